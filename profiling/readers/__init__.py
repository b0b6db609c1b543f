"""Readers: one module per input format, each turning a file into rows of the events table.

Every reader returns a :class:`ReadResult`: schema-conformant rows (``source`` names the reader), the metadata
it found per rank, and the warnings it raised about parts it could not read. ``sniff`` says which reader a
file needs, from its name and first bytes; :func:`shardline.profiling.load` is the public entry point.
"""

from __future__ import annotations

import gzip
import re
import zlib
from enum import Enum
from pathlib import Path

import pandas as pd


class Format(str, Enum):
    """Input formats ``load`` recognises."""

    KINETO = "kineto"
    NCCL_LOG = "nccl_log"
    NSYS = "nsys"
    FLIGHT_RECORDER = "flight_recorder"
    NCCL_PROFILER = "nccl_profiler"


class ReadResult:
    """What one reader produced from one file.

    ``events``: the schema-conformant rows. A reader that builds them as columns may hand those instead
    (``columns``: the schema's columns in its order and dtypes, numpy arrays and categoricals): the frame is then
    built on first use of ``events``, and ``load`` joins the columns of many files without a frame per file
    (building one and reading its columns back out is pandas' per-frame overhead, paid per file).
    """

    __slots__ = ("_events", "columns", "metadata", "warnings", "skipped")

    def __init__(self, events: pd.DataFrame | None = None, metadata: dict[int, dict] | None = None,
                 warnings: list[str] | None = None, skipped: str | None = None, *,
                 columns: dict | None = None) -> None:
        if events is None and columns is None:
            raise TypeError("ReadResult needs events or columns")
        self._events = events
        self.columns = columns
        #: rank -> metadata dict (``distributedInfo``, ``baseTimeNanoseconds``, ``deviceProperties`` ...).
        self.metadata = {} if metadata is None else metadata
        self.warnings = [] if warnings is None else warnings
        #: what the file is, when it holds no events (e.g. an execution trace); None otherwise.
        self.skipped = skipped

    @property
    def events(self) -> pd.DataFrame:
        if self._events is None and self.columns is not None:
            self._events = pd.DataFrame(self.columns, copy=False)
        return self._events

    @events.setter
    def events(self, value) -> None:
        self._events, self.columns = value, None

    @property
    def n_events(self) -> int:
        """The number of event rows (without building the frame)."""
        if self._events is None and self.columns is not None:
            return len(next(iter(self.columns.values()))) if self.columns else 0
        return len(self._events)

    def __repr__(self) -> str:
        return (f"ReadResult({self.n_events} events, ranks={sorted(self.metadata)}, {len(self.warnings)} warnings"
                + (f", skipped={self.skipped!r})" if self.skipped else ")"))


class Damage(str):
    """A reader's warning that a file's JSON is cut short or corrupt from some point on, so the events after
    it are lost; ``cause`` says which in a few words (``load`` names it where the loss leaves no rank)."""

    def __new__(cls, text: str, cause: str = "") -> Damage:
        note = super().__new__(cls, text)
        note.cause = cause or text
        return note

    def __getnewargs__(self) -> tuple[str, str]:  # pickled with its cause (a reader worker's result)
        return str(self), self.cause


def truncation(text) -> str | None:
    """``"truncated JSON (...)"`` where a JSON document's ``text`` stops with brackets left open (it does not end
    with one that closes, and opens more than it closes), else None: told from its bytes, never from a
    decoder's error text (trailing bytes after a whole document, or damage inside it, are not truncation)."""
    if bytes(text[-64:]).rstrip(b" \t\r\n")[-1:] in (b"}", b"]"):
        return None
    if text.count(b"{") + text.count(b"[") <= text.count(b"}") + text.count(b"]"):
        return None
    return f"truncated JSON (it ends at byte {len(text)}, before the document closes)"


_SQLITE_MAGIC = b"SQLite format 3\x00"
_NCCL_LINE = re.compile(rb"NCCL (INFO|WARN)|NCCL version")
_TEXT_SUFFIXES = (".log", ".txt", ".out", ".err")
_JSON_SUFFIXES = (".json", ".json.gz", ".gz")


def peek(path: Path, size: int = 4096) -> bytes:
    """The first ``size`` bytes of a file, gunzipped when it is gzip; ``b""`` when that fails."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(size)
        if head[:2] == b"\x1f\x8b":
            with gzip.open(path, "rb") as handle:
                head = handle.read(size)
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error):
        return b""
    return head


def sniff(path: Path) -> Format | None:
    """Which reader a file needs, from its content first and its name second; None for anything else.

    Kineto JSON and the flight-recorder JSON dump are told apart by their keys; an NCCL profiler-plugin dump
    is a JSON-like array of ``"cat": "GROUP_API"``-style events; a text file is an NCCL log when it holds
    NCCL lines.
    """
    name = path.name.lower()
    head = peek(path)
    if head.startswith(_SQLITE_MAGIC) or name.endswith((".sqlite", ".sqlite3")):
        return Format.NSYS
    stripped = head.lstrip()
    opens_json = stripped[:1] in (b"{", b"[")
    if name.endswith(_TEXT_SUFFIXES) or not opens_json:
        if _NCCL_LINE.search(head):
            return Format.NCCL_LOG
        if stripped[:1] == b"[" and (b"GROUP_API" in head or b"KERNEL_LAUNCH" in head or b"P2P_API" in head):
            return Format.NCCL_PROFILER
        if not opens_json:
            # Unreadable or empty content with a JSON name is still meant as a trace: let its reader say why.
            return Format.KINETO if name.endswith(_JSON_SUFFIXES) else None
        return None
    if stripped[:1] == b"[":
        if b"GROUP_API" in head or b"KERNEL_LAUNCH" in head or b"COLL" in head and b"CommHash" in head:
            return Format.NCCL_PROFILER
        return Format.KINETO if name.endswith(_JSON_SUFFIXES) else None
    if b'"pg_config"' in head and b'"entries"' in head or b'"pg_status"' in head:
        return Format.FLIGHT_RECORDER
    if name.endswith(_JSON_SUFFIXES) or name.endswith(".raw.gz"):
        return Format.KINETO
    return None
