"""Arrow's exact decimal cast of µs time texts, for the msgspec paths of the Kineto reader.

msgspec leaves ``ts``/``dur`` as raw number texts (a double in between would lose the ns of a 17-digit
absolute µs time); ``_kineto_columns._arrow_times_ns`` joins a batch's texts into one Arrow string array and
casts it to ``decimal(38, 3)`` here: the unscaled integer is the time in ns, exactly. Where Arrow refuses (a
fourth decimal, a text that is no number, beyond int64 ns) numpy's text parser (``_numtext``) reads them.

(Arrow's JSON reader also used to parse whole chunks of events into columns: that decode path won on no
input of ``bench/bench_reader_paths.py`` and was dropped; see ``_plan``.)
"""

from __future__ import annotations

import numpy as np

try:
    import pyarrow as pa
    import pyarrow.compute as pc
except ImportError:  # pragma: no cover - pyarrow is a dependency; numpy parses the times without it
    pa = None

if pa is not None:
    #: µs with 3 decimals, parsed exactly from the number text: the unscaled integer is the time in ns.
    _DECIMAL = pa.decimal128(38, 3)


def available() -> bool:
    """pyarrow is importable."""
    return pa is not None


def cast_decimal(texts):
    """Number texts (an Arrow string array) as decimal(38, 3), exactly; raises ``ArrowInvalid`` for a text
    that is not a number or has more than 3 decimals."""
    return pc.cast(texts, _DECIMAL)


def exact_ns(column) -> np.ndarray | None:
    """int64 ns of a µs time column read as decimal(38, 3): its unscaled integer, exactly; 0 where null;
    None when a value is beyond int64 ns (more than 3 decimals already made the cast refuse)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(column) == 0:
        return np.zeros(0, dtype=np.int64)
    words = np.frombuffer(column.buffers()[1], dtype=np.int64, count=2 * (len(column) + column.offset))
    low, high = words[2 * column.offset::2], words[2 * column.offset + 1::2]
    if column.null_count:
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        low, high = np.where(valid, low, 0), np.where(valid, high, 0)
    # The 128-bit value must fit int64; int64's minimum is refused too, as the numpy text parser counts
    # magnitudes beyond int64's maximum out of range.
    if (high != (low >> 63)).any() or (low == np.iinfo(np.int64).min).any():
        return None
    return low.copy()
