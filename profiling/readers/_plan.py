"""Which way the Kineto reader decodes a trace: every threshold and override in one place, one function.

Four decode paths give the same columns (``_kineto_columns.Columns``) for any trace they accept, and differ
only in speed and memory:

- ``NATIVE``: the C scanner (``_kscan``) reads a whole in-memory document in one pass, no object per event.
- ``STREAM``: the events array is cut into chunks at event boundaries and msgspec decodes one chunk at a
  time; a memory-mapped plain file has each chunk's pages released, so it never sits in memory whole.
- ``ONE_CALL``: msgspec decodes a small events array into typed structs in one call.
- ``SLICES``: msgspec splits the array into one raw slice per event and decodes them in batches; the only
  path that salvages damage (the events before it, with a warning). It never refuses, so it is always last.

A fifth, Arrow's JSON reader parsing chunks straight into columns, was dropped: it won on no input of the
benchmark, with or without the scanner (``bench/results/bench_reader_paths.md``). Arrow still casts the
time texts msgspec leaves raw (``_kineto_columns._arrow_times_ns``), unless ``SHARDLINE_KINETO_ARROW=0``.

:func:`plan` orders the paths for one trace. A path that cannot read a document exactly refuses it and the
next one in the plan reads it (the fallbacks keep the results identical); a *forced* plan (the ``force``
argument, or ``SHARDLINE_KINETO_PATH``) holds one path and a refusal raises :class:`PathRefused` instead, so
the tests and the benchmark know which path produced what. Environment variables are read when a plan is
made, never at import: ``SHARDLINE_KINETO_NATIVE=0`` leaves the scanner out. A read that keeps the op args
(``op_args=True``: the ``schema.OP_ARG_COLUMNS``) leaves it out too: the scanner reads the schema's fields only.

How far a gzip may inflate is here too (``gzip_limit``: a ratio to its compressed size above a floor, and an
absolute cap, ``SHARDLINE_GZIP_MAX_RATIO`` / ``SHARDLINE_GZIP_MAX_BYTES``, read when a file is read): past it,
the read is refused as a decompression bomb before the inflated bytes are held (``_buffers.gunzip``).

Light to import (no msgspec, no Arrow): ``load``'s prefetch thread plans before the reader is imported.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import re
import sys
from enum import Enum
from pathlib import Path

from ..base.errors import ProfilingError


class _Log:
    """``logging.getLogger("shardline.profiling.readers")``, imported on first use: a process that never imported
    ``logging`` has configured no handler, so there is nothing to log to, and importing it is a noticeable
    share of a fresh small read."""

    name = "shardline.profiling.readers"

    def debug(self, message: str, *args) -> None:
        logging = sys.modules.get("logging")
        if logging is not None:
            logging.getLogger(self.name).debug(message, *args)


log = _Log()

#: A document up to this size (in memory) is read whole by the native scanner: its columns are built
#: whole (its peak memory a few times the document's, below the msgspec way's); bigger ones go in chunks.
NATIVE_MAX_BYTES = 64 << 20
#: Plain files at least this big are memory-mapped and streamed (their pages released as they are decoded).
MAP_MIN_BYTES = 32 << 20
#: An events array up to this size is decoded by msgspec in one call (its structs are a few MB at most).
ONE_CALL_MAX_BYTES = 4 << 20
#: Bytes of event text per chunk (the STREAM path).
CHUNK_BYTES = 24 << 20
#: Events decoded per msgspec batch: big enough to amortise the per-batch cost, small enough to bound memory.
BATCH_EVENTS = 200_000
#: A gzip may inflate to at most this many bytes per compressed byte (``SHARDLINE_GZIP_MAX_RATIO``), beyond
#: ``GZIP_FREE_BYTES``: the real traces of the corpus compress 5-30x, deflate's ceiling is ~1032x (a bomb).
GZIP_MAX_RATIO = 256
#: Inflated sizes up to this pass whatever the ratio (a small file of repeated events harms nothing).
GZIP_FREE_BYTES = 64 << 20
#: No gzip inflates past this (``SHARDLINE_GZIP_MAX_BYTES``): the inflated document is held in memory whole.
GZIP_MAX_BYTES = 16 << 30

_OFF = ("0", "false", "no", "off")


class DecodePath(str, Enum):
    NATIVE = "native"
    STREAM = "stream"
    ONE_CALL = "one_call"
    SLICES = "slices"


class PathRefused(Exception):
    """A forced path could not read the document (or one of its chunks) exactly."""


class ReadPlan:
    """The decode paths to try, in order, and the settings they run with (an immutable value).

    A plain class, not a dataclass: building a frozen dataclass costs time at import, and this module is
    imported inside a fresh small read's critical path (``load`` imports it before its prefetch thread starts).
    """

    __slots__ = ("paths", "mapped", "arrow", "strict", "chunk_bytes", "batch_events", "reason", "prefetch",
                 "op_args")

    paths: tuple[DecodePath, ...]
    #: read the file through a memory map (``STREAM``), not into memory
    mapped: bool
    #: Arrow may cast the time texts msgspec leaves raw (else numpy parses them: the same ns)
    arrow: bool
    #: a refusal raises ``PathRefused`` (a forced plan) instead of handing the document on
    strict: bool
    #: the thresholds below, as this module had them when the plan was made (tests may change them)
    chunk_bytes: int
    batch_events: int
    reason: str
    #: reading the file ahead of its turn pays (``load``'s prefetch): a document read whole, at most
    #: ``NATIVE_MAX_BYTES``; a bigger one is decoded in bounded chunks, and holding it early only adds to the peak
    prefetch: bool
    #: the decode keeps the op args (``schema.OP_ARG_COLUMNS``); never on the native path
    op_args: bool

    def __init__(self, paths: tuple[DecodePath, ...], *, mapped: bool, arrow: bool, strict: bool = False,
                 chunk_bytes: int = -1, batch_events: int = -1, reason: str = "", prefetch: bool = False,
                 op_args: bool = False):
        values = (tuple(paths), mapped, arrow, strict, CHUNK_BYTES if chunk_bytes < 0 else chunk_bytes,
                  BATCH_EVENTS if batch_events < 0 else batch_events, reason, prefetch, bool(op_args))
        for name, value in zip(self.__slots__, values):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"ReadPlan is immutable: cannot set {name}")

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other) -> bool:
        return self._values() == other._values() if type(other) is ReadPlan else NotImplemented

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return "ReadPlan(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__) + ")"

    def refused(self, path: Path, what: DecodePath, why: str) -> None:
        """Note a refusal; raises ``PathRefused`` in a forced plan."""
        if self.strict:
            raise PathRefused(f"{path}: the forced {what.value} path refused it ({why})")
        log.debug("%s: %s path refused it (%s); handing it on", path, what.value, why)


def native_built() -> bool:
    return _installed("shardline.profiling.readers._kscan")


def arrow_installed() -> bool:
    return _installed("pyarrow")


_INSTALLED: dict[str, bool] = {}


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, looked up once per process: the lookup stats a folder, and in
    ``load``'s prefetch thread every such call gives up the GIL and waits to get it back from the busy reader."""
    found = _INSTALLED.get(module)
    if found is None:
        found = _INSTALLED[module] = importlib.util.find_spec(module) is not None
    return found


def _switch(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in _OFF


def native_on() -> bool:
    """The scanner is built and ``SHARDLINE_KINETO_NATIVE`` does not switch it off (read now)."""
    return native_built() and _switch("SHARDLINE_KINETO_NATIVE")


def arrow_on() -> bool:
    """pyarrow is installed and ``SHARDLINE_KINETO_ARROW`` does not switch it off (read now)."""
    return arrow_installed() and _switch("SHARDLINE_KINETO_ARROW")


def gzip_limit(compressed: int) -> int:
    """The most bytes a gzip of ``compressed`` bytes may inflate to: ``GZIP_MAX_RATIO`` per compressed byte
    (at least ``GZIP_FREE_BYTES``), never past ``GZIP_MAX_BYTES``; each overridden by its environment
    variable, read now (``gzip_settings``)."""
    ratio, cap = gzip_settings()
    return min(cap, max(GZIP_FREE_BYTES, ratio * compressed))


def gzip_settings() -> tuple[int, int]:
    """``(ratio, cap)``: ``SHARDLINE_GZIP_MAX_RATIO`` and ``SHARDLINE_GZIP_MAX_BYTES`` (read now), else the
    defaults; a bad value is our error, naming it."""
    return (_env_size("SHARDLINE_GZIP_MAX_RATIO", GZIP_MAX_RATIO),
            _env_size("SHARDLINE_GZIP_MAX_BYTES", GZIP_MAX_BYTES))


_SIZE = re.compile(r"(\d+)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)


def _env_size(name: str, default: int) -> int:
    """A whole number from the environment, with an optional binary unit (``16G``, ``512MiB``)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    match = _SIZE.fullmatch(text) if text.isascii() else None
    if match is None:

        raise ProfilingError(f"{name}={text!r}: not a whole number with an optional K/M/G/T unit (e.g. 16G)")
    return int(match.group(1)) << (10 * " KMGT".index(match.group(2).upper() or " "))


def plan(path: Path, *, data=None, force: DecodePath | str | None = None, op_args: bool = False) -> ReadPlan:
    """The plan for reading ``path``: from its size and kind on disk (``data`` None: whether to map it),
    or from the buffer already read (``data``: bytes or a memory map); ``op_args``: the read keeps the op args.

    Rules, in order: a forced path (``force``, else ``SHARDLINE_KINETO_PATH``) is the whole plan; a plain
    file of at least ``MAP_MIN_BYTES`` is mapped and streamed; an in-memory document of at most
    ``NATIVE_MAX_BYTES`` goes to the native scanner first (where built and not switched off, and the op args
    are not asked for); then msgspec in one call up to ``ONE_CALL_MAX_BYTES``, else in chunks (``STREAM``);
    ``SLICES`` last, always.
    """
    force = force or os.environ.get("SHARDLINE_KINETO_PATH") or None
    native, arrow = native_on(), arrow_on()
    size, gzip, mapped = _measure(path, data)
    whole = not gzip or size <= NATIVE_MAX_BYTES
    if force is not None:
        chosen = _forced(DecodePath(force), size=size, gzip=gzip, data=data, arrow=arrow, op_args=op_args)
    elif mapped if data is not None else not gzip and size >= MAP_MIN_BYTES:
        chosen = ReadPlan((DecodePath.STREAM, DecodePath.SLICES), mapped=True, arrow=arrow, op_args=op_args,
                          reason=f"a plain file of {size} bytes >= {MAP_MIN_BYTES}: mapped and streamed")
    else:
        paths, why = [], []
        if native and size <= NATIVE_MAX_BYTES and not op_args:
            paths.append(DecodePath.NATIVE)
            why.append(f"{size} bytes <= {NATIVE_MAX_BYTES}: native scanner first")
        elif op_args:
            why.append("op args asked for: not the native scanner (it reads the schema's fields only)")
        elif size <= NATIVE_MAX_BYTES:
            why.append("native scanner " + ("switched off" if native_built() else "not built"))
        if size <= ONE_CALL_MAX_BYTES:
            paths.append(DecodePath.ONE_CALL)
            why.append(f"msgspec in one call up to {ONE_CALL_MAX_BYTES}")
        else:
            paths.append(DecodePath.STREAM)
            why.append(f"msgspec chunks above {ONE_CALL_MAX_BYTES}")
        paths.append(DecodePath.SLICES)
        chosen = ReadPlan(tuple(paths), mapped=False, arrow=arrow, prefetch=whole, reason="; ".join(why),
                          op_args=op_args)
    log.debug("%s: plan %s (%s)", path, "/".join(p.value for p in chosen.paths), chosen.reason)
    return chosen


def _forced(path: DecodePath, *, size: int, gzip: bool, data, arrow: bool, op_args: bool) -> ReadPlan:
    """A one-path plan that raises where the path refuses (STREAM maps a plain file whatever its size)."""
    if path is DecodePath.NATIVE and not native_built():
        raise PathRefused("the native scanner was not built")
    if path is DecodePath.NATIVE and op_args:
        raise PathRefused("the native scanner does not read the op args")
    mapped = path is DecodePath.STREAM and not gzip if data is None else isinstance(data, mmap.mmap)
    return ReadPlan((path,), mapped=mapped, arrow=arrow, strict=True, reason=f"forced ({size} bytes)",
                    op_args=op_args)


def _measure(path: Path, data) -> tuple[int, bool, bool]:
    """``(document bytes, gzip on disk, mapped)``: of the buffer when given, else from the file (a gzip's
    size trailer; an unreadable file plans as small: its read says why)."""
    if data is not None:
        return len(data), False, isinstance(data, mmap.mmap)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            if handle.read(2) != b"\x1f\x8b":
                return size, False, False
            if size < 18:
                return 0, True, False
            handle.seek(-4, os.SEEK_END)
            return int.from_bytes(handle.read(4), "little"), True, False
    except OSError:
        return 0, False, False
