"""Exact decimal-text -> integer conversion, vectorised over many numbers at once.

Kineto writes times as microseconds with up to three (sometimes more) decimals, e.g. ``1712195495519695.8``.
Such a number has 17 significant digits, more than a float64 holds, so parsing it as a float and multiplying
by 1000 silently moves events by up to a few hundred ns. We parse the text instead: each number becomes one
fixed-width row of bytes, and the digits are combined column by column with numpy (no Python loop per event).
"""

from __future__ import annotations

import numpy as np

#: Widest number text we accept; longer text (or an exponent form) is parsed one by one in Python.
_WIDTH = 32
#: Largest power of ten used as a digit weight: 10**18 still fits int64.
_MAX_EXP = 18
_POW10 = np.array([10**k for k in range(_MAX_EXP + 1)], dtype=np.int64)
_INT64_MAX = np.iinfo(np.int64).max


def _fast(texts: np.ndarray, scale_digits: int) -> np.ndarray | None:
    """The common case (plain ``[-]digits[.digits]`` that fits) with numpy's C string kernels; None otherwise."""
    if texts.dtype.itemsize > _WIDTH or (np.strings.find(texts, b"e") >= 0).any() or \
            (np.strings.find(texts, b"E") >= 0).any():
        return None
    if not (np.strings.find(texts, b".") >= 0).any():
        # Integers only (e.g. µs times without fractions): one C-level conversion.
        try:
            values = texts.astype(np.int64)
        except (ValueError, OverflowError, TypeError):
            return None
        limit = _INT64_MAX // 10**scale_digits
        if len(values) and (values.max() > limit or values.min() < -limit or (np.strings.str_len(texts) == 0).any()):
            return None
        return values * 10**scale_digits
    try:
        negative = np.strings.startswith(texts, b"-")
        head, _, tail = np.strings.partition(texts, b".")
        whole = np.abs(head.astype(np.int64))
        # One digit beyond the scale decides the rounding; the rest cannot change it (half away from zero).
        digits = np.strings.ljust(tail, scale_digits + 1, b"0").astype(f"S{scale_digits + 1}").astype(np.int64)
    except (ValueError, OverflowError, TypeError):
        return None
    if len(whole) and (whole.max() > _INT64_MAX // 10**scale_digits - 1 or (np.strings.str_len(head) == 0).any()
                       or (digits < 0).any()):
        return None
    values = whole * 10**scale_digits + digits // 10 + (digits % 10 >= 5)
    return np.where(negative, -values, values)


def decimal_texts_to_scaled(texts: np.ndarray, *, scale_digits: int) -> tuple[np.ndarray, np.ndarray]:
    """Convert decimal number texts to integers ``round(value * 10**scale_digits)``, exactly.

    ``texts`` is a numpy ``S`` (bytes) array, one number text per element (JSON number syntax: optional sign,
    digits, optional fraction, optional exponent). Digits beyond ``scale_digits`` decimals are rounded half
    away from zero from the first dropped digit. Returns ``(values, bad)``: int64 values and a boolean mask of
    elements that are not a number or do not fit int64 (their value is 0; the caller decides what to do).
    """
    texts = np.asarray(texts)
    if texts.dtype.kind != "S":
        texts = texts.astype(f"S{_WIDTH}")
    fast = _fast(texts, scale_digits)
    if fast is not None:
        return fast, np.zeros(len(texts), dtype=bool)
    n = len(texts)
    originals = texts
    overlong = np.zeros(n, dtype=bool)
    if texts.dtype.itemsize > _WIDTH:
        # A fixed-width grid as wide as the longest text could be huge; long texts take the slow path.
        overlong = np.strings.str_len(texts) > _WIDTH
        texts = np.where(overlong, b"0", texts).astype(f"S{_WIDTH}")
    values = np.zeros(n, dtype=np.int64)
    bad = np.zeros(n, dtype=bool)
    if n == 0:
        return values, bad
    width = texts.dtype.itemsize
    grid = np.frombuffer(np.ascontiguousarray(texts).tobytes(), dtype=np.uint8).reshape(n, width)
    negative = grid[:, 0] == ord("-")
    is_digit = (grid >= ord("0")) & (grid <= ord("9"))
    is_dot = grid == ord(".")
    is_pad = grid == 0
    # Anything but digits, one dot, a leading minus and trailing padding goes to the slow exact path.
    odd = ~(is_digit | is_dot | is_pad)
    odd[:, 0] &= ~negative
    slow = odd.any(axis=1) | (is_dot.sum(axis=1) > 1) | ~is_digit.any(axis=1) | overlong
    columns = np.arange(width)
    length = np.where(is_pad.any(axis=1), is_pad.argmax(axis=1), width)
    dot = np.where(is_dot.any(axis=1), is_dot.argmax(axis=1), length)
    # Exponent of 10 (in output units) carried by the digit in each column.
    exponent = np.where(columns[None, :] < dot[:, None], dot[:, None] - 1 - columns[None, :],
                        dot[:, None] - columns[None, :]) + scale_digits
    digits = np.where(is_digit, grid.astype(np.int64) - ord("0"), 0)
    too_big = (is_digit & (digits > 0) & (exponent > _MAX_EXP)).any(axis=1)
    weights = _POW10[np.clip(exponent, 0, _MAX_EXP)]
    kept = is_digit & (exponent >= 0)
    # Sum with overflow detection: the int part fits when it has at most 18 significant output digits, and
    # the 19-digit case is checked against int64 after the sum in unsigned arithmetic.
    total = np.where(kept, digits * weights, 0).astype(np.uint64).sum(axis=1)
    first_dropped = (is_digit & (exponent == -1))
    round_up = np.where(first_dropped, digits, 0).max(axis=1) >= 5
    total = total + round_up.astype(np.uint64)
    too_big |= total > np.uint64(_INT64_MAX)
    values = np.where(too_big | slow, 0, total.astype(np.int64))
    values = np.where(negative, -values, values)
    bad = too_big & ~slow
    for i in np.flatnonzero(slow):
        value = _exact_one(originals[i] if overlong[i] else texts[i], scale_digits=scale_digits)
        if value is None:
            bad[i] = True
        else:
            values[i] = value
    return values, bad


def _exact_one(text: bytes, *, scale_digits: int) -> int | None:
    """The slow exact path for one number text (exponent forms, odd widths); None if not an int64 number."""
    from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

    try:
        number = Decimal(bytes(text).decode("ascii").strip())
    except (InvalidOperation, UnicodeDecodeError, ValueError):
        return None
    if not number.is_finite():
        return None
    scaled = int((number.scaleb(scale_digits)).to_integral_value(rounding=ROUND_HALF_UP))
    if not -_INT64_MAX - 1 <= scaled <= _INT64_MAX:
        return None
    return scaled
