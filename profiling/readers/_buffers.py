"""A trace file's bytes, and the steps of reading a Kineto trace that run without the GIL.

Kept apart from the Kineto reader (which imports msgspec and builds its decoders: ~5 ms) and light to import,
so that ``load``'s prefetch thread reads, gunzips and scans the first trace while the main thread is still
importing the reader. ``SHARDLINE_KINETO_NATIVE=0`` turns the native scanner (``_kscan``, optional at build
time) off.
"""

from __future__ import annotations

import gzip
import mmap
import os
import zlib
from pathlib import Path
from typing import NamedTuple

from shardline.profiling.errors import TraceFormatError

try:
    from shardline.profiling.readers import _kscan
except ImportError:  # built without a C compiler: the ordinary paths read every trace
    _kscan = None

NATIVE_ENABLED = os.environ.get("SHARDLINE_KINETO_NATIVE", "1") not in ("0", "false", "no", "off")
#: Documents up to this size are read whole by the native scanner; bigger ones go in bounded chunks.
NATIVE_MAX_BYTES = 64 << 20
#: Plain files at least this big are memory-mapped and their pages released as they are decoded.
MAP_MIN_BYTES = 32 << 20
#: The output buffer a gzip's size trailer may ask for, at most, per compressed byte (a damaged trailer
#: could claim 4 GiB; JSON traces compress ~10-30x, so a bigger real file only grows its buffer as it goes).
_MAX_RATIO = 256


def native_available() -> bool:
    return _kscan is not None and NATIVE_ENABLED


def native_reads(data) -> bool:
    """Whether the native scanner reads this buffer (a whole document in memory, not too big)."""
    return native_available() and not isinstance(data, mmap.mmap) and len(data) <= NATIVE_MAX_BYTES


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
    size = min(int.from_bytes(data[-4:], "little"), _MAX_RATIO * len(data))
    try:
        inflate = zlib.decompressobj(wbits=31)  # 31: a gzip member, checked against its CRC and size
        head = inflate.decompress(data, 1)
        out = head + inflate.flush(max(size - len(head), 1))
    except zlib.error:
        return gzip.decompress(data)
    if not inflate.eof or inflate.unused_data.lstrip(b"\x00"):
        return gzip.decompress(data)
    return out


def trace_buffer(path: Path) -> bytes | mmap.mmap:
    """The trace's bytes: a read-only memory map for big plain files (its pages can be released as they are
    decoded, so the file never has to sit in memory whole), else the bytes, gunzipped when gzip."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            magic = handle.read(2)
            if magic != b"\x1f\x8b" and size >= MAP_MIN_BYTES:
                return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise TraceFormatError(f"{path}: cannot read file ({exc})") from exc
    return read_bytes(path)


def worth_prefetching(path: Path) -> bool:
    """Whether reading this file ahead pays: the native scanner will read it whole (a plain file below the
    memory-map size, or a gzip whose size trailer says at most ``NATIVE_MAX_BYTES``). A bigger trace is
    decoded in bounded chunks, and holding it whole ahead of its turn would only add its size to the peak."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            if handle.read(2) != b"\x1f\x8b":
                return size < MAP_MIN_BYTES
            if size < 18:
                return True
            handle.seek(-4, os.SEEK_END)
            return int.from_bytes(handle.read(4), "little") <= NATIVE_MAX_BYTES
    except OSError:
        return True  # the read itself reports the problem, naming the file


class Prefetched(NamedTuple):
    """The first steps of reading a Kineto trace, done ahead of ``read_kineto`` (``load``'s prefetch thread)."""

    data: bytes | mmap.mmap  # trace_buffer(path)
    scanned: dict | None  # native_scan(data); None where the scanner does not read the document


def prefetch(path: Path) -> Prefetched:
    """Read the file's bytes (gunzipped) and run the native scanner over them: the parts of reading a trace
    that run without the GIL."""
    data = trace_buffer(path)
    return Prefetched(data, native_scan(data) if native_reads(data) else None)


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
