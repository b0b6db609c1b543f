"""The checksums of a checkpoint: a CRC of each piece, of each fixed-size chunk of a large piece, of each file.

Two CRCs, named in the manifest's ``checksum`` field (:data:`ALGORITHMS`):

- ``"crc32c"`` (what a save writes): CRC-32C, the Castagnoli polynomial (reflected ``0x82F63B78``; iSCSI,
  ext4 and Btrfs metadata, SCTP). The ``crc32c`` package computes it with the CPU's CRC instruction (SSE 4.2,
  ARMv8), several times faster than zlib's table-driven CRC-32, and releases the GIL from its version 2.6 on,
  so the CRC thread runs beside the reads.
- ``"crc32"``: zlib's CRC-32 (reflected ``0xEDB88320``), what checkpoints written before the field existed hold
  (a manifest without ``checksum``); they read as before.

A large piece's manifest entry carries one CRC per ``chunk`` bytes besides the piece's own, so that a reader that
needs only some rows of the piece (another layout's part of it) reads and checks only the chunks holding them. The
writer computes each chunk's CRC once and derives the piece's from them (:meth:`Checksum.combine`): no second
pass over the bytes.

:meth:`Checksum.combine` uses ``crc(A + B) = crc(A) * x^(8 |B|) + crc(B)`` over GF(2) modulo the CRC's
polynomial (the pre- and post-inversion both CRCs use cancel in that sum). Polynomials are 32-bit words in the
reflected order of the CRC itself: bit 31 is ``x^0``.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from shardline.plugins.errors import CheckpointError

_ONE = 1 << 31  # x^0


try:
    from crc32c import crc32c as _hardware_crc32c
except ImportError:  # a dependency of shardline; only a broken install lacks it
    _hardware_crc32c = None


_MISSING = "CRC-32C checksums need the 'crc32c' package, which is not installed (pip install 'crc32c>=2.6')"


def _crc32c(data, value: int = 0) -> int:
    if _hardware_crc32c is None:  # readers and writers say where first (Checksum.require)
        raise CheckpointError(_MISSING)
    return _hardware_crc32c(data, value)


@dataclass(frozen=True)
class Checksum:
    """One CRC: ``of(data, value=0)`` extends ``value`` (the CRC of what came before) by ``data``."""

    name: str
    of: Callable[..., int]
    poly: int

    def _times(self, a: int, b: int) -> int:
        """``a(x) * b(x)`` modulo the polynomial."""
        product, bit = 0, _ONE
        while bit and a:
            if a & bit:
                product ^= b
                a ^= bit
            b = (b >> 1) ^ self.poly if b & 1 else b >> 1  # b *= x
            bit >>= 1
        return product

    @functools.lru_cache(maxsize=64)  # noqa: B019 - two instances, kept for the process's life
    def _shift(self, nbytes: int) -> int:
        """``x^(8 nbytes)`` modulo the polynomial (square and multiply)."""
        result, power = _ONE, _ONE >> 8  # x^0, x^8
        while nbytes:
            if nbytes & 1:
                result = self._times(result, power)
            power = self._times(power, power)
            nbytes >>= 1
        return result

    def require(self, where) -> None:
        """CheckpointError naming ``where`` when this CRC cannot be computed here (CRC-32C without its package)."""
        if self.of is _crc32c and _hardware_crc32c is None:
            raise CheckpointError(f"{where}: {_MISSING}")

    def direct(self) -> Callable[..., int]:
        """:attr:`of` without its check that the CRC can be computed here (for a caller that ran
        :meth:`require`: one call less per piece)."""
        return _hardware_crc32c if self.of is _crc32c and _hardware_crc32c is not None else self.of

    def combine(self, first: int, second: int, second_bytes: int) -> int:
        """The CRC of ``A + B`` from ``first = crc(A)``, ``second = crc(B)`` and ``len(B)``."""
        return self._times(self._shift(second_bytes), first) ^ second

    def chunked(self, data, chunk: int) -> tuple[int, list[int]]:
        """``(CRC of data, [CRC of each chunk-byte slice of data])``; the last slice may be shorter."""
        parts = [self.of(data[i:i + chunk]) for i in range(0, len(data), chunk)]
        whole = 0
        for i, value in enumerate(parts):
            whole = self.combine(whole, value, min(chunk, len(data) - i * chunk))
        return whole, parts


ALGORITHMS = {"crc32c": Checksum("crc32c", _crc32c, 0x82F63B78), "crc32": Checksum("crc32", zlib.crc32, 0xEDB88320)}
#: What a save writes.
WRITTEN = ALGORITHMS["crc32c"]
#: What a manifest without a ``checksum`` field holds.
LEGACY = ALGORITHMS["crc32"]


def algorithm(name, where) -> Checksum:
    """The :class:`Checksum` a manifest names (``where``: the manifest, for the message)."""
    found = ALGORITHMS.get(name) if isinstance(name, str) else None
    if found is None:
        raise CheckpointError(f"{where}: checksum {name!r} is not one this shardline reads ({sorted(ALGORITHMS)})")
    return found


__all__ = ["ALGORITHMS", "Checksum", "LEGACY", "WRITTEN", "algorithm"]
