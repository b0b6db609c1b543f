"""The priority partition of step windows over label interval sets (the arithmetic of ``attribution``).

Inside a window every ns goes to the first label of ``LABELS`` whose interval set covers it, ``idle`` when none
does; the exclusive columns therefore sum to the window length exactly, in integer ns. See ``attribution`` for
where the sets and windows come from.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..base import intervals as iv
from ..base.errors import AttributionError
from ..base.schema import COMM_CATEGORIES

LABELS = ("compute", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier",
          "other_comm", "memcpy_h2d", "memcpy_d2h", "memcpy_d2d", "memset", "bubble", "p2p_send", "p2p_recv",
          "sync", "idle")
#: Exclusive columns of ``breakdown`` (exposed time for the comm categories), summing to ``step_ns``.
EXCLUSIVE_COLUMNS = LABELS
OVERLAP_COLUMNS = tuple(f"overlapped_{c}" for c in COMM_CATEGORIES)


def partition(sets: dict[str, iv.IntervalSet], *, win_start: np.ndarray, win_end: np.ndarray,
              leading: dict[str, np.ndarray] | None = None) -> pd.DataFrame:
    """Exclusive partition of each window by ``LABELS`` priority, + overlap (see ``partition_columns``)."""
    return pd.DataFrame(partition_columns(sets, win_start=win_start, win_end=win_end, leading=leading))


def partition_columns(sets: dict[str, iv.IntervalSet], *, win_start: np.ndarray, win_end: np.ndarray,
                      leading: dict[str, np.ndarray] | None = None,
                      idle_out: list | None = None) -> dict[str, np.ndarray]:
    """Exclusive partition of each window ``[win_start[k], win_end[k])`` by ``LABELS`` priority, + overlap.

    Elementary segments lie between consecutive endpoints of all sets and windows, so each segment is wholly
    inside or outside every set; it goes to the first covering label (idle if none). Per-label prefix sums
    over segments give any window's total as a difference of two prefix values, exactly, in int64.
    ``idle_out``: a list to which the idle set is appended -- the segments no label covers, over the hull of
    the windows and the sets (what ``idle`` totals per window), so nobody has to union the sets again.
    """
    win_start = np.asarray(win_start, np.int64)
    win_end = np.asarray(win_end, np.int64)
    if (win_end < win_start).any():
        raise AttributionError(f"step windows with end before start: {list(zip(win_start, win_end))[:5]}")
    points = iv.distinct(np.concatenate([win_start, win_end] + [a for s in sets.values() for a in s]), scratch=True)
    length = np.diff(points)
    lo = np.searchsorted(points, win_start)
    hi = np.searchsorted(points, win_end)

    def totals(mask: np.ndarray) -> np.ndarray:
        """Per-window length of the segments in ``mask``: a prefix sum over just them, read at each window's
        bounds, exactly in int64 (memory: the masked segments, not a row-sized array per column)."""
        segments = np.flatnonzero(mask)
        prefix = np.zeros(len(segments) + 1, dtype=np.int64)
        np.cumsum(length[segments], out=prefix[1:])
        return prefix[np.searchsorted(segments, hi)] - prefix[np.searchsorted(segments, lo)]

    covered: dict[str, np.ndarray] = {}
    owner = segment_owners(sets, points, keep=covered)
    out: dict[str, np.ndarray] = {**(leading or {}), "start_ns": win_start, "end_ns": win_end,
                                  "step_ns": win_end - win_start}
    for k, label in enumerate(LABELS):
        out[label] = totals(owner == k)
    if idle_out is not None:
        idle = np.flatnonzero(owner == len(LABELS) - 1)
        idle_out.append(iv.union(points[idle], points[idle + 1]))
    parts = np.sum([out[label] for label in LABELS], axis=0)
    if not np.array_equal(parts, out["step_ns"]):  # the partition covers each window once, by construction
        raise AssertionError(f"attribution parts {parts} do not sum to step times {out['step_ns']}")
    nothing = np.zeros(len(length), dtype=bool)
    compute = covered.get("compute", nothing)
    any_comm = nothing.copy()
    for comm in COMM_CATEGORIES:
        c = covered.get(comm, nothing)
        out[f"overlapped_{comm}"] = totals(c & compute)
        any_comm |= c
    out["comm_ns"] = totals(any_comm)
    for extra in sorted(set(sets) - set(LABELS)):  # reported alongside, outside the partition
        out[f"{extra}_ns"] = totals(_segments_covered(sets[extra], points))
    overlapped = totals(any_comm & compute)
    with np.errstate(invalid="ignore", divide="ignore"):
        out["overlap_ratio"] = np.where(out["comm_ns"] > 0, overlapped / np.maximum(out["comm_ns"], 1), np.nan)
    return out


def segment_owners(sets: dict[str, iv.IntervalSet], points: np.ndarray, *,
                   keep: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """Index into ``LABELS`` of each segment ``[points[j], points[j+1])``: the first label in priority order
    whose set covers it, idle (the last) when none does. ``points`` must hold every endpoint of the sets.
    ``keep``: filled with the cover masks of compute and the comm labels (the overlap columns need them)."""
    owner = np.full(len(points) - 1, len(LABELS) - 1, dtype=np.int8)
    for k in range(len(LABELS) - 2, -1, -1):  # lowest priority first, so the highest one is written last
        label = LABELS[k]
        if label in sets:
            cover = _segments_covered(sets[label], points)
            owner[cover] = k
            if keep is not None and (label in COMM_CATEGORIES or label == "compute"):
                keep[label] = cover
    return owner


def _segments_covered(a: iv.IntervalSet, points: np.ndarray) -> np.ndarray:
    """For each segment ``[points[j], points[j+1])``: is it inside the canonical set ``a``, whose endpoints are
    all among ``points``. +1 at each start, -1 at each end, summed: a byte per segment, no int64 temporaries
    (a canonical set's intervals are disjoint and never touch, so no point is both a start and an end)."""
    marks = np.zeros(len(points), dtype=np.int8)
    marks[np.searchsorted(points, a[0])] = 1
    marks[np.searchsorted(points, a[1])] = -1
    return np.cumsum(marks[:-1], dtype=np.int8).view(bool)
