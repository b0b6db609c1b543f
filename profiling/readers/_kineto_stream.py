"""The plan's ``STREAM`` path: the events array of a trace (memory-mapped when big and plain) is cut into chunks
at event boundaries and each chunk is decoded, turned into columns and its file pages released before the
next one, so memory holds one chunk of text and its structs at a time, never the whole file.

Boundaries: a chunk ends at a ``}`` followed by ``,`` and ``{`` (whitespace allowed), found by a regular
expression near the target size. Such a pattern can also occur inside a string literal; cutting there leaves
an unterminated string, so the chunk fails to decode and the whole file is read by the plan's next path
instead (correct, only slower). The metadata keys are read from the text before ``"traceEvents"`` and from
the tail after the array (current Kineto writes ``baseTimeNanoseconds`` there). Anything unexpected returns
None and the plan's next path reads the file (the last one also handles damaged files).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import re
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from ._kineto_columns import Decoded
from ._plan import DecodePath

_BOUNDARY = re.compile(rb"\}[ \t\r\n]*,[ \t\r\n]*\{")  # JSON whitespace only
_DECODE_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_DECODE_RAWS = msgspec.json.Decoder(list[msgspec.Raw])
#: How far into the file the ``traceEvents`` key may start, and how much tail may follow the array.
_HEAD_LIMIT = 64 << 20
_TAIL_LIMIT = 1 << 20


class Fallback(Exception):
    """The file does not have the regular shape this path needs."""


def release_pages(buffer: mmap.mmap, upto: int) -> None:
    """Drop the mapped (clean, file-backed) pages before ``upto``; the kernel re-reads them if touched."""
    upto -= upto % mmap.PAGESIZE
    if upto > 0 and hasattr(mmap, "MADV_DONTNEED"):
        buffer.madvise(mmap.MADV_DONTNEED, 0, upto)


def stream_mapped(path: Path, buffer: mmap.mmap, *, chunk_bytes: int, decode_events: Callable,
                  decode_batch: Callable, to_columns: Callable, warnings: list[str]) -> Decoded | None:
    """The top-level keys (raw JSON) and column batches of a mapped trace, or None to read it another way
    (an in-memory buffer is cut the same way, unmapped: a forced ``STREAM`` plan on a gzip file).

    ``decode_events(text)`` decodes a chunk (a JSON array) into structs in one call; when it refuses the chunk,
    ``decode_batch(path, raws, warnings)`` decodes its raw event slices one by one,
    salvaging what it can. ``to_columns(structs)`` turns the structs into a column batch.
    """
    noted = len(warnings)
    try:
        top, start, close = _bounds(buffer)
        batches = read_chunks(path, buffer, start, close, chunk_bytes=chunk_bytes, decode_events=decode_events,
                              decode_batch=decode_batch, to_columns=to_columns, warnings=warnings)
        return Decoded(top, batches, DecodePath.STREAM)
    except Fallback:
        del warnings[noted:]  # the whole-file read will say the same again
        if isinstance(buffer, mmap.mmap):
            release_pages(buffer, len(buffer))
        return None


def read_chunks(path: Path, buffer, start: int, close: int, *, chunk_bytes: int, decode_events: Callable,
                decode_batch: Callable, to_columns: Callable, warnings: list[str]) -> list:
    """Column batches of the events text ``buffer[start:close]`` (between the array's brackets), one chunk
    at a time; raises ``Fallback`` when the chunks cannot be cut at event boundaries."""
    batches = []
    mapped = isinstance(buffer, mmap.mmap)
    with memoryview(buffer) as view:
        for chunk_start, chunk_end in _chunks(buffer, start, close, chunk_bytes):
            with view[chunk_start:chunk_end] as events_text:
                text = _bracketed(events_text)
            if mapped:
                release_pages(buffer, chunk_end)
            batches.append(to_columns(_decode_chunk(path, text, decode_events, decode_batch, warnings)))
            del text
            trim_heap()
    return batches


class PageReleaser:
    """Drops the pages of a mapped trace that lie wholly before a decoded event (they are clean file pages:
    the kernel re-reads them if touched again). A no-op for in-memory buffers."""

    def __init__(self, buffer) -> None:
        self.map = buffer if isinstance(buffer, mmap.mmap) else None
        self.base = np.frombuffer(buffer, dtype=np.uint8).ctypes.data if self.map is not None else 0
        self.done = 0

    def release(self, upto=None) -> None:
        if self.map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        end = len(self.map) if upto is None else np.frombuffer(upto, dtype=np.uint8).ctypes.data - self.base
        if not 0 <= end <= len(self.map):
            return  # a slice of another buffer (a repaired copy of the document): nothing of the map to drop
        end -= end % mmap.PAGESIZE
        if end > self.done:
            self.map.madvise(mmap.MADV_DONTNEED, 0, end)
            self.done = end if upto is not None else 0


def _load_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_MALLOC_TRIM = _load_trim() if sys.platform.startswith("linux") else None


def trim_heap() -> None:
    """Hand the heap memory freed by a decoded chunk back to the OS (glibc ``malloc_trim``).

    Each chunk allocates and frees its structs and temporary arrays; glibc keeps freed heap pages
    (its mmap threshold grows after the first big free, so later arrays land on the heap too), and without
    this the process would carry that garbage as resident memory for the rest of the read. No-op elsewhere.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _bracketed(events_text: memoryview) -> bytearray:
    """``[`` + the text + ``]`` in one new buffer (one copy of the chunk, not three)."""
    text = bytearray(len(events_text) + 2)
    text[0], text[-1] = ord("["), ord("]")
    text[1:-1] = events_text
    return text


def _decode_chunk(path: Path, text: bytearray | bytes, decode_events: Callable, decode_batch: Callable,
                  warnings: list[str]) -> list:
    try:
        return decode_events(text)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        pass  # some event is damaged or mistyped: split the chunk into events and salvage them one by one
    try:
        raws = _DECODE_RAWS.decode(text)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        from ._kineto_msgspec import non_finite_as_null  # lazy: msgspec's paths load only for a repair

        repaired = non_finite_as_null(path, text, warnings)  # bare NaN/Infinity: read as null, as whole reads do
        if repaired is None:
            raise Fallback(str(exc)) from exc
        return _decode_chunk(path, repaired, decode_events, decode_batch, warnings)
    return decode_batch(path, raws, warnings)


def _bounds(buffer) -> tuple[dict, int, int]:
    """Top-level metadata (head and tail keys) and the byte range of the events array's contents."""
    key = buffer.find(b'"traceEvents"', 0, _HEAD_LIMIT)
    if key < 0 or buffer[:key].lstrip()[:1] != b"{":
        raise Fallback("no traceEvents key near the start")
    bracket = buffer.find(b"[", key, key + 4096)
    if bracket < 0 or buffer[key + len(b'"traceEvents"'):bracket].strip() != b":":
        raise Fallback("traceEvents is not followed by an array")
    head = buffer[:key].rstrip().rstrip(b",").rstrip()
    try:
        top = _DECODE_TOP.decode(head + b"}") if head != b"{" else {}
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise Fallback("unreadable metadata before traceEvents") from exc
    tail_from = max(bracket, len(buffer) - _TAIL_LIMIT)
    tail = buffer[tail_from:]
    close = tail.rfind(b"]")
    while close >= 0:
        rest = tail[close + 1:].strip()
        if rest == b"}":
            return top, bracket + 1, _array_end(buffer, bracket, tail_from + close, top)
        if rest.startswith(b","):
            try:
                top.update(_DECODE_TOP.decode(b"{" + rest[1:]))
                return top, bracket + 1, _array_end(buffer, bracket, tail_from + close, top)
            except (msgspec.DecodeError, UnicodeDecodeError):
                pass
        close = tail.rfind(b"]", 0, close)
    raise Fallback("no end of the events array")


def _array_end(buffer, bracket: int, close: int, top: dict) -> int:
    """The events array's ``]``: ``close`` when only whitespace lies between it and the last event's ``}``;
    else, where that gap opens with a ``]``, the array ended there and ``close`` closed a later key's array
    (``"INFO": [...]``, which Kineto writes after the events): its keys are read into ``top`` too, so
    none (``baseTimeNanoseconds``...) is lost. Anything else is left to ``_last_brace`` to refuse."""
    end = buffer.rfind(b"}", bracket, close)
    gap = bytes(buffer[end + 1:close]).lstrip() if end >= 0 else b""
    if not gap.startswith(b"]"):
        return close
    rest = bytes(buffer[end + 1:]).lstrip()[1:].lstrip()
    if not rest.startswith(b","):
        raise Fallback("no end of the events array")
    try:
        top.update(_DECODE_TOP.decode(b"{" + rest[1:]))
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise Fallback("unreadable metadata after the events array") from exc
    return end + 1 + bytes(buffer[end + 1:close]).index(b"]")


def _chunks(buffer, start: int, close: int, chunk: int):
    """``(begin, end)`` byte ranges of whole events, about ``chunk`` bytes each, covering ``[start, close)``."""
    while start < close:
        match = _BOUNDARY.search(buffer, start + chunk, close) if close - start > chunk * 3 // 2 else None
        if match is None:
            yield start, _last_brace(buffer, start, close)
            return
        yield start, match.start() + 1
        start = match.end() - 1


def _last_brace(buffer, start: int, close: int) -> int:
    end = buffer.rfind(b"}", start, close)
    if end < 0:
        raise Fallback("events array without an object")
    # Anything between the last object and the close: an element that is no object, or the array's end then
    # other keys (``_bounds`` took a later ``]`` for the close: a key's array value, as in ``"x": [1]}``, whose
    # keys, and the metadata before them, would be lost). The whole-document read judges it.
    if bytes(buffer[end + 1:close]).strip():
        raise Fallback("the events array does not end with an object")
    return end + 1
