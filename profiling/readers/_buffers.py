"""A trace file's bytes, and the steps of reading a Kineto trace that run without the GIL.

Kept apart from the Kineto reader (which imports msgspec and builds its decoders) and light to import,
so that ``load``'s prefetch thread reads, gunzips and scans the first trace while the main thread is still
importing the reader. Whether a file is mapped, read ahead or scanned natively is the plan's (``_plan``).
"""

from __future__ import annotations

import gzip
import io
import json
import mmap
import sys
import zlib
from pathlib import Path
from typing import NamedTuple

from ..base.errors import TraceFormatError
from . import _plan

try:
    from . import _kscan
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
    """The file's bytes, gunzipped in memory when gzip. Our error, one line naming the file: a damaged,
    truncated or oversized gzip (``_plan.gzip_limit``), and a ``.gz`` that is neither gzip nor JSON."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read file ({exc})") from exc
    if data[:2] != b"\x1f\x8b":
        check_not_mislabelled(path, data)
        return data
    limit = _plan.gzip_limit(len(data))
    try:
        return gunzip(data, limit=limit)
    except InflatedTooLarge:
        raise TraceFormatError(f"{path}: refused as a decompression bomb: {len(data)} gzip bytes inflate to more "
                               f"than {limit} ({_limit_reason(len(data), limit)})") from None
    except EOFError:
        raise TraceFormatError(f"{path}: truncated gzip: its {len(data)} bytes end before the end of the "
                               "compressed stream (the file was cut short)") from None
    except (gzip.BadGzipFile, zlib.error, OSError) as exc:
        raise TraceFormatError(f"{path}: corrupt gzip ({exc})") from None


def _limit_reason(compressed: int, limit: int) -> str:
    """Which limit of ``_plan.gzip_limit`` refused the file, and how to raise it."""
    ratio, cap = _plan.gzip_settings()
    if limit == cap and cap < max(_plan.GZIP_FREE_BYTES, ratio * compressed):
        return "the cap; SHARDLINE_GZIP_MAX_BYTES raises it"
    return f"{ratio}x its size, where real traces compress 5-30x; SHARDLINE_GZIP_MAX_RATIO raises it"


#: Leading bytes of formats a ``.gz`` trace is sometimes mistaken for.
_OTHER_MAGIC = ((b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"PK\x03\x04", "zip"),
                (b"\x04\x22\x4d\x18", "lz4"))


def check_not_mislabelled(path: Path, data) -> None:
    """Raise our error for a file named ``.gz`` whose bytes are neither gzip nor JSON (a plain JSON trace
    under a ``.gz`` name is read as JSON); an empty one is left to the reader to say so."""
    if not path.name.lower().endswith(".gz"):
        return
    head = bytes(data[:64])
    text = head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
    if not text or text[:1] in (b"{", b"["):
        return
    kind = next((name for magic, name in _OTHER_MAGIC if head.startswith(magic)), None)
    if kind is None and len(head) > 1 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0:
        kind = "zlib"
    what = f"{kind}-compressed" if kind else "not JSON either"
    raise TraceFormatError(f"{path}: not gzip: named .gz but starts with {head[:8]!r}, not the gzip magic "
                           f"b'\\x1f\\x8b' ({what})")


class InflatedTooLarge(ValueError):
    """A gzip inflates past the limit ``gunzip`` was given."""


#: Bytes inflated per step where a gzip's members are counted (``_check_members``).
_PIECE = 8 << 20


def gunzip(data: bytes, *, limit: int | None = None) -> bytes:
    """``gzip.decompress(data)``, refusing (:class:`InflatedTooLarge`) a gzip that inflates to more than
    ``limit`` bytes (``_plan.gzip_limit`` of the data's size when None) while holding at most that many.

    A whole single member whose size trailer is within the limit is inflated in one zlib call without the GIL
    (``gzip.decompress`` parses the header in Python and inflates into a buffer grown block by block, taking
    the GIL back between blocks: in a thread next to busy Python code each of those waits up to the switch
    interval), stopped one byte past the trailer's size, so a trailer that lies costs at most that. Anything
    else (several members, damage, a truncated stream, a trailer that lies or is past the limit) is first
    inflated and counted a piece at a time, nothing kept (``_check_members``: the errors of
    ``gzip.decompress``, or the refusal), and only then by ``gzip.decompress``, whose result is the reference.
    """
    if limit is None:
        limit = _plan.gzip_limit(len(data))
    if len(data) >= 18:
        size = int.from_bytes(data[-4:], "little")
        if size <= limit:
            inflate = zlib.decompressobj(wbits=31)  # 31: a gzip member, checked against its CRC and size
            try:
                out = inflate.decompress(data, size + 1)
            except zlib.error:
                out = None
            if out is not None and inflate.eof and not inflate.unused_data.lstrip(b"\x00"):
                return out
            del out
    _check_members(data, limit)
    return gzip.decompress(data)


def _check_members(data: bytes, limit: int) -> None:
    """Raise what ``gzip.decompress(data)`` raises (its own header parser, then the same checks in the same
    order), or :class:`InflatedTooLarge` once more than ``limit`` bytes came out; memory: one piece."""
    total = 0
    rest = data
    while True:
        head = io.BytesIO(rest)
        if gzip._read_gzip_header(head) is None:  # the reference's own parser: its errors, its leniency
            return
        inflate = zlib.decompressobj(wbits=-zlib.MAX_WBITS)
        pending, crc, size = memoryview(rest)[head.tell():], 0, 0
        while not inflate.eof:
            piece = inflate.decompress(pending, min(_PIECE, limit + 1 - total - size))
            size += len(piece)
            if total + size > limit:
                raise InflatedTooLarge(f"more than {limit} bytes")
            pending = inflate.unconsumed_tail
            if not piece and not pending:
                break  # the input ended before the member did
            crc = zlib.crc32(piece, crc)
        if not inflate.eof or len(inflate.unused_data) < 8:
            raise EOFError("Compressed file ended before the end-of-stream marker was reached")
        if crc != int.from_bytes(inflate.unused_data[:4], "little"):
            raise gzip.BadGzipFile("CRC check failed")
        if size & 0xFFFFFFFF != int.from_bytes(inflate.unused_data[4:8], "little"):
            raise gzip.BadGzipFile("Incorrect length of data produced")
        total += size
        rest = inflate.unused_data[8:].lstrip(b"\x00")


def trace_buffer(path: Path, *, mapped: bool | None = None) -> bytes | mmap.mmap:
    """The trace's bytes: a read-only memory map where the plan maps the file (big plain files: their pages
    are released as they are decoded, so the file never sits in memory whole), else the bytes, gunzipped
    when gzip. ``mapped``: the caller's plan already decided."""
    if mapped is None:
        mapped = _plan.plan(path).mapped
    if mapped:
        try:
            with open(path, "rb") as handle:
                buffer = None if handle.read(2) == b"\x1f\x8b" else \
                    mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise TraceFormatError(f"{path}: cannot read file ({exc})") from exc
        if buffer is not None:
            check_not_mislabelled(path, buffer)
            return buffer
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


def too_deep(path: Path) -> TraceFormatError:
    """The error for a document nested past what the JSON decoders take (they recurse per level, up to the
    interpreter's recursion limit): a trace's events nest a few levels."""
    return TraceFormatError(f"{path}: JSON nested too deep to decode (arrays or objects more than about "
                            f"{sys.getrecursionlimit()} levels deep; a trace nests a few)")


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
