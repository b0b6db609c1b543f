"""Interval-set arithmetic on integer-ns half-open intervals ``[start, end)``, vectorised with numpy.

An interval set is a pair ``(starts, ends)`` of int64 arrays, sorted, disjoint and non-touching (the canonical
form ``union`` returns). Empty intervals (``end <= start``) are dropped everywhere. The binary set operations
take their two operands positionally, like the operators they stand for (``a \\ b``, ``a ∩ b``).
"""

from __future__ import annotations

import numpy as np

IntervalSet = tuple[np.ndarray, np.ndarray]

EMPTY: IntervalSet = (np.empty(0, np.int64), np.empty(0, np.int64))


def union(starts, ends) -> IntervalSet:
    """Canonical union of arbitrary intervals: sort by start, then a new run begins where a start exceeds the
    running maximum of all previous ends (``np.maximum.accumulate``)."""
    s = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    keep = e > s
    s, e = s[keep], e[keep]
    if not len(s):
        return EMPTY
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new_run = np.empty(len(s), dtype=bool)
    new_run[0] = True
    new_run[1:] = s[1:] > reach[:-1]
    run_id = np.cumsum(new_run) - 1
    run_end = np.zeros(run_id[-1] + 1, dtype=np.int64)
    np.maximum.at(run_end, run_id, e)
    return s[new_run], run_end


def distinct(values: np.ndarray, *, scratch: bool = False) -> np.ndarray:
    """The sorted distinct values of an int64 array: ``np.unique`` by one sort (numpy 2's hash-based unique
    is slower on these endpoint arrays). ``scratch``: ``values`` is the caller's own
    temporary and may be sorted in place (no copy)."""
    ordered = np.asarray(values, dtype=np.int64)
    if scratch and ordered is values:
        ordered.sort()
    else:
        ordered = np.sort(ordered)
    if len(ordered) < 2:
        return ordered
    first = np.empty(len(ordered), dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return ordered[first]


def total(a: IntervalSet) -> int:
    """Length of a canonical set (sum of its intervals)."""
    return int((a[1] - a[0]).sum())


def covers(a: IntervalSet, points) -> np.ndarray:
    """For each point t: is t inside some ``[start, end)`` of the canonical set ``a``."""
    points = np.asarray(points, dtype=np.int64)
    if not len(a[0]):
        return np.zeros(len(points), dtype=bool)
    idx = np.searchsorted(a[0], points, side="right") - 1
    return (idx >= 0) & (a[1][np.clip(idx, 0, None)] > points)


def _combine(a: IntervalSet, b: IntervalSet, keep_fn) -> IntervalSet:
    """Elementary segments between all endpoints, kept where ``keep_fn(in_a, in_b)``, merged back."""
    points = distinct(np.concatenate([a[0], a[1], b[0], b[1]]))
    if len(points) < 2:
        return EMPTY
    seg_s, seg_e = points[:-1], points[1:]
    keep = keep_fn(covers(a, seg_s), covers(b, seg_s))
    return union(seg_s[keep], seg_e[keep])


def subtract(a: IntervalSet, b: IntervalSet) -> IntervalSet:
    """``a \\ b`` of canonical sets."""
    return _combine(a, b, lambda x, y: x & ~y)


def intersect(a: IntervalSet, b: IntervalSet) -> IntervalSet:
    """``a ∩ b`` of canonical sets."""
    return _combine(a, b, lambda x, y: x & y)


def merge(*sets: IntervalSet) -> IntervalSet:
    """Union of several canonical sets."""
    if not sets:
        return EMPTY
    return union(np.concatenate([s[0] for s in sets]), np.concatenate([s[1] for s in sets]))


def window_totals(a: IntervalSet, *, lo, hi) -> np.ndarray:
    """Length of ``a ∩ [lo[k], hi[k])`` for every window k, as F(hi) - F(lo) with F(t) = |a ∩ (-inf, t)|."""
    lo = np.asarray(lo, dtype=np.int64)
    hi = np.asarray(hi, dtype=np.int64)
    if not len(a[0]):
        return np.zeros(len(lo), dtype=np.int64)
    before = np.concatenate([[0], np.cumsum(a[1] - a[0])])  # total length of the intervals before index i

    def measure_below(t: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(a[0], t, side="right") - 1
        safe = np.clip(idx, 0, None)
        partial = np.clip(t - a[0][safe], 0, a[1][safe] - a[0][safe])
        return np.where(idx >= 0, before[safe] + partial, 0)

    return measure_below(hi) - measure_below(lo)
