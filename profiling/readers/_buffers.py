"""A trace file's bytes, and the steps of reading a Kineto trace that run without the GIL.

Kept apart from the Kineto reader (which imports msgspec and builds its decoders) and light to import,
so that ``load``'s prefetch thread reads, gunzips and scans the first trace while the main thread is still
importing the reader. Whether a file is mapped, read ahead or scanned natively is the plan's (``_plan``).
"""

from __future__ import annotations

import gzip
import json
import mmap
import zlib
from pathlib import Path
from typing import NamedTuple

from shardline.profiling.errors import TraceFormatError
from shardline.profiling.readers import _plan

try:
    from shardline.profiling.readers import _kscan
except ImportError:  # built without a C compiler: the other paths read every trace
    _kscan = None


def native_available() -> bool:
    """Whether the native scanner is built and not switched off (``SHARDLINE_KINETO_NATIVE=0``), now."""
    return _kscan is not None and _plan.native_on()


def native_scan(data) -> dict | None:
    """The scanner's raw output for a whole document in memory (``_kscan.scan``), or None when the scanner
    is unavailable or refuses the document. Its events pass holds no GIL."""
    return _kscan.scan(data) if native_available() else None


def read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped in memory when gzip; a corrupt or truncated gzip is our error."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read file ({exc})") from exc
    if data[:2] != b"\x1f\x8b":
        return data
    try:
        return gunzip(data)
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as exc:
        raise TraceFormatError(f"{path}: corrupt or truncated gzip ({exc})") from exc


def gunzip(data: bytes) -> bytes:
    """``gzip.decompress(data)``, mostly in one zlib call without the GIL.

    ``gzip.decompress`` parses the header in Python and inflates into a buffer grown block by block, taking
    the GIL back between blocks: in a thread next to busy Python code each of those waits up to the switch
    interval. Here the first call reads the header (and at most one byte); ``flush`` then inflates the rest
    into a buffer sized from the size trailer, in one go. Anything but one whole member (several members,
    damage, a truncated stream) is handed to ``gzip.decompress``, whose result and errors are the reference.
    """
    if len(data) < 18:
        return gzip.decompress(data)
    size = min(int.from_bytes(data[-4:], "little"), _plan.GZIP_MAX_RATIO * len(data))
    try:
        inflate = zlib.decompressobj(wbits=31)  # 31: a gzip member, checked against its CRC and size
        head = inflate.decompress(data, 1)
        out = head + inflate.flush(max(size - len(head), 1))
    except zlib.error:
        return gzip.decompress(data)
    if not inflate.eof or inflate.unused_data.lstrip(b"\x00"):
        return gzip.decompress(data)
    return out


def trace_buffer(path: Path, *, mapped: bool | None = None) -> bytes | mmap.mmap:
    """The trace's bytes: a read-only memory map where the plan maps the file (big plain files: their pages
    are released as they are decoded, so the file never sits in memory whole), else the bytes, gunzipped
    when gzip. ``mapped``: the caller's plan already decided."""
    if mapped is None:
        mapped = _plan.plan(path).mapped
    if mapped:
        try:
            with open(path, "rb") as handle:
                if handle.read(2) != b"\x1f\x8b":
                    return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise TraceFormatError(f"{path}: cannot read file ({exc})") from exc
    return read_bytes(path)


def worth_prefetching(path: Path) -> bool:
    """Whether reading this file ahead pays (the plan's ``prefetch``: a document read whole)."""
    return _plan.plan(path).prefetch


class Prefetched(NamedTuple):
    """The first steps of reading a Kineto trace, done ahead of ``read_kineto`` (``load``'s prefetch thread)."""

    data: bytes | mmap.mmap  # trace_buffer(path)
    scanned: dict | None  # native_scan(data); None where the plan does not start with the scanner
    plan: _plan.ReadPlan | None = None  # the plan for data


def prefetch(path: Path, *, mapped: bool | None = None, op_args: bool = False) -> Prefetched:
    """Read the file's bytes (gunzipped) and run the native scanner over them: the parts of reading a trace
    that run without the GIL. ``mapped``: the caller's plan for the file already decided (``load`` planned
    it to see whether it is worth prefetching), so this thread does not plan it from the file again.
    ``op_args``: the read keeps the op args (its plan has no native scan to run ahead)."""
    data = trace_buffer(path, mapped=mapped)
    chosen = _plan.plan(path, data=data, op_args=op_args)
    first = chosen.paths[0] if chosen.paths else None
    return Prefetched(data, native_scan(data) if first is _plan.DecodePath.NATIVE else None, chosen)


def utf8_repaired(data) -> bytes | None:
    """``data`` with every invalid UTF-8 sequence replaced by U+FFFD (encoded), or None when it is valid.

    Python's codec decides, never a JSON decoder's error: msgspec raised ``UnicodeDecodeError`` for invalid
    UTF-8 in a decoded string up to 0.22 and raises ``msgspec.DecodeError`` ("Invalid UTF-8 encoded string")
    from 0.23 on, so neither its error class nor its text is a contract to build on.
    """
    raw = bytes(data)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace").encode("utf-8")
    return None


NOT_JSON = object()


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def json_value(raw):
    """One small raw JSON value (a top-level key's, a string literal), decoded by the standard library (msgspec
    is imported only by the paths that need it: ``msgspec_paths``) with msgspec's strictness: NaN and
    Infinity, invalid UTF-8 and lone surrogates are no JSON. ``NOT_JSON`` when it does not decode."""
    raw = bytes(raw)
    try:
        # Decoded as UTF-8 first: given bytes, ``json.loads`` would guess UTF-16/32 from NUL bytes and pass
        # UTF-8-encoded surrogates.
        value = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return NOT_JSON
    if b"\\u" in raw and not _encodable(value):  # only a \\u escape makes a lone surrogate (UTF-8 was checked)
        return NOT_JSON
    return value


def _encodable(value) -> bool:
    """Whether every text in the decoded value is valid Unicode (no lone surrogate from a ``\\ud800`` escape)."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_encodable(k) and _encodable(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_encodable(v) for v in value)
    return True
