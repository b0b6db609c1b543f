"""CRC-32 (zlib's, the reflected polynomial ``0xEDB88320``) of a piece and of each of its fixed-size chunks.

A large piece's manifest entry carries one CRC per ``chunk`` bytes besides the piece's own, so that a reader that
needs only some rows of the piece (another layout's part of it) reads and checks only the chunks holding them. The
writer computes each chunk's CRC once and derives the piece's from them (:func:`combine`): no second pass over
the bytes.

:func:`combine` uses ``crc(A + B) = crc(A) * x^(8 |B|) + crc(B)`` over GF(2) modulo the CRC polynomial (the
pre- and post-inversion of zlib's CRC cancel in that sum). Polynomials are 32-bit words in the reflected order of
the CRC itself: bit 31 is ``x^0``.
"""

from __future__ import annotations

import functools
import zlib

_POLY = 0xEDB88320
_ONE = 1 << 31  # x^0


def _times(a: int, b: int) -> int:
    """``a(x) * b(x)`` modulo the CRC polynomial."""
    product = 0
    bit = _ONE
    while bit and a:
        if a & bit:
            product ^= b
            a ^= bit
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1  # b *= x
        bit >>= 1
    return product


@functools.lru_cache(maxsize=64)
def _shift(nbytes: int) -> int:
    """``x^(8 nbytes)`` modulo the CRC polynomial (square and multiply)."""
    result, power = _ONE, _ONE >> 8  # x^0, x^8
    while nbytes:
        if nbytes & 1:
            result = _times(result, power)
        power = _times(power, power)
        nbytes >>= 1
    return result


def combine(first: int, second: int, second_bytes: int) -> int:
    """The CRC-32 of ``A + B`` from ``first = crc32(A)``, ``second = crc32(B)`` and ``len(B)``."""
    return _times(_shift(second_bytes), first) ^ second


def chunked(data, chunk: int) -> tuple[int, list[int]]:
    """``(CRC-32 of data, [CRC-32 of each chunk-byte slice of data])``; the last slice may be shorter."""
    parts = [zlib.crc32(data[i:i + chunk]) for i in range(0, len(data), chunk)]
    whole = 0
    for i, value in enumerate(parts):
        whole = combine(whole, value, min(chunk, len(data) - i * chunk))
    return whole, parts


__all__ = ["chunked", "combine"]
