"""Per-(rank, step) time attribution: exclusive parts that sum exactly to the step time, plus overlap.

Which lanes count. A rank with GPU work (any GPU-lane row that is not an annotation) is attributed on its GPU
lanes: kernels, memcpy, memset and ``cuda_sync`` markers of all its streams. A rank without GPU work (CPU/gloo
runs) is attributed on its CPU threads: communication is the comm ops (``record_param_comms``, ``c10d::*``,
``gloo:*`` / ``nccl:*`` / ``sl:comm:*`` annotations) and compute the other CPU ops. On one CPU thread a comm op
nests inside framework ops, so per thread the comm time is removed from that thread's compute first; across
threads (e.g. backward thread computing while the main thread waits) the priority below applies as on GPUs.

Step windows, first source that exists:

1. ``ProfilerStep#N`` annotations of the analysed lane kind (GPU user annotations on a GPU rank; several per
   step are joined to their hull);
2. on a GPU rank, the GPU work's own ``step`` (the reader gives a kernel the step of its launch): step N runs
   from the first start of its work to the first start of step N+1's work (the last step: to its last end), so
   the GPU-side step includes the idle before the next step's first kernel and never overlaps its neighbour;
3. CPU ``ProfilerStep#N`` annotations (a CPU rank, or a GPU rank whose work carries no step);
4. one window ``[first work start, last work end)`` with step -1.

Time outside every window is not attributed.

The partition. Inside a window every ns is given to the first label, in this priority order, whose interval
set covers it::

    compute > all_reduce > all_gather > reduce_scatter > all_to_all > broadcast > barrier > other_comm
            > memcpy_h2d > memcpy_d2h > memcpy_d2d > memset > bubble > p2p_send > p2p_recv > sync > idle

so ``compute`` is all time with any compute running, each comm column is that collective's *exposed* time, and
``idle`` is the rest. ``bubble`` is pipeline time (``sl:pp:batch`` windows minus ``F``/``B``/``W`` action spans,
see ``bubbles``); it ranks above p2p because a pipeline recv kernel spinning for its peer is bubble, not
transfer. The columns of ``EXCLUSIVE_COLUMNS`` sum to ``step_ns`` exactly in integer ns (asserted).

Alongside: ``overlapped_<comm>`` = time(comm_c ∩ compute); ``comm_ns`` = time(∪ comm) and
``overlap_ratio`` = time(compute ∩ ∪comm) / time(∪comm) (HTA's definition; NaN without communication);
``pageable_memcpy_ns`` = time with an H2D/D2H copy from/to pageable host memory running (the slow, blocking
kind of offload traffic; ``memory_kind == "Pageable"``).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pandas as pd

import shardline.profiling.annotations as contract
from shardline.profiling import intervals as iv
from shardline.profiling.bubbles import bubble_set
from shardline.profiling.classify import Lane, classify_events, match_names, match_table
from shardline.profiling.errors import AttributionError, TraceWarning
from shardline.profiling.schema import (
    COMM_CATEGORIES,
    category_texts,
    check_events,
    codes_or_end,
    per_category_table,
    step_numbers,
)

LABELS = ("compute", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier",
          "other_comm", "memcpy_h2d", "memcpy_d2h", "memcpy_d2d", "memset", "bubble", "p2p_send", "p2p_recv",
          "sync", "idle")
#: Exclusive columns of ``breakdown`` (exposed time for the comm categories), summing to ``step_ns``.
EXCLUSIVE_COLUMNS = LABELS
OVERLAP_COLUMNS = tuple(f"overlapped_{c}" for c in COMM_CATEGORIES)

# Source categories that mark spans rather than work (Kineto current and 2021 legacy, Nsight NVTX).
ANNOTATION_CATS = frozenset({"user_annotation", "gpu_user_annotation", "python_function", "Trace", "ac2g",
                             "fwdbwd", "overhead", "cuda_runtime", "cuda_driver", "Runtime", "python", "nvtx",
                             "cpu_instant_event", "async", "flow"})
_ANNOTATION_NAME_RE = r"^(ProfilerStep#\d+|sl:pp:|nccl:|gloo:|ucc:|mpi:|sl:comm:)"
_CPU_OP_CATS = frozenset({"cpu_op", "Operator", "user_annotation"})
_PP_PREFIX = f"{contract.PREFIX}:pp:"  # the pattern bubbles selects its rows with


def breakdown(traceset_or_events, *, layout=None) -> pd.DataFrame:
    """One row per (rank, step): the exclusive partition of the step time and the overlap columns.

    Accepts a ``TraceSet`` (uses ``.events``) or an events table; an unclassified table (all ``category``
    empty) is classified first. See the module docstring for lanes, windows and the priority order.
    """
    events = checked_events(traceset_or_events, caller="breakdown", layout=layout)
    # The columns are read once for the whole table (views), then taken per rank.
    table = _Rows.of(events)
    rows = [_rank_breakdown(events, table.take(sel), rank, sel) for rank, sel in _rank_selections(events)]
    rows = [r for r in rows if r is not None]
    if not rows:
        # An execution trace, a memory timeline or an init-only NCCL log loads fine but holds no timed work:
        # the user gets the (empty) table with a warning rather than an exception.
        warnings.warn("nothing to attribute: the events table has no work events on any rank",
                      TraceWarning, stacklevel=2)
        return empty_breakdown()
    # One frame from the joined columns (every rank has the same ones); a frame per rank and a concat would
    # cost about a millisecond per rank.
    return pd.DataFrame({column: np.concatenate([r[column] for r in rows]) for column in rows[0]})


def checked_events(traceset_or_events, *, caller: str, layout=None) -> pd.DataFrame:
    """The events table of a TraceSet or DataFrame, schema-checked (bad input raises ``AttributionError``),
    classified when it is not yet (every ``category`` empty) or when a ``layout`` for the dims is given."""
    events = getattr(traceset_or_events, "events", traceset_or_events)
    if not isinstance(events, pd.DataFrame):
        raise AttributionError(f"{caller} expects a TraceSet or an events DataFrame, got {type(events).__name__}")
    try:
        check_events(events)
    except ValueError as exc:
        raise AttributionError(f"{caller}: {exc}") from None
    negative = events["dur_ns"] < 0
    if negative.any():
        names = events.loc[negative, "name"].astype(str).unique()[:5].tolist()
        raise AttributionError(f"{caller}: {int(negative.sum())} events have a negative duration (e.g. {names})")
    if layout is not None or (len(events) and is_in(events["category"], ("",)).all()):
        events = classify_events(events, layout=layout)
    return events


def empty_breakdown() -> pd.DataFrame:
    """A zero-row breakdown with every column ``breakdown`` returns."""
    columns = ["rank", "step", "lanes", "start_ns", "end_ns", "step_ns", *LABELS, *OVERLAP_COLUMNS, "comm_ns",
               "pageable_memcpy_ns"]
    frame = pd.DataFrame({c: np.empty(0, dtype=np.int64) for c in columns})
    frame["lanes"] = frame["lanes"].astype(str)
    frame["overlap_ratio"] = np.empty(0, dtype=float)
    return frame


def is_in(column: pd.Series, values) -> np.ndarray:
    """Boolean mask: is each value of a categorical column (as text) in ``values``; computed on the
    categories and broadcast through the codes, never on a string per row. A missing value is in nothing."""
    return in_table(column, values)[codes_or_end(column)]


def in_table(column: pd.Series, values) -> np.ndarray:
    """``is_in`` per category (one extra trailing False for a missing value), to index with codes."""
    wanted = frozenset(values)
    return per_category_table(column, ("is_in", wanted),
                              lambda texts: np.array([t in wanted for t in texts] + [False], dtype=bool))


def _rank_selections(events: pd.DataFrame):
    """``(rank, rows)`` in rank order, ``rows`` a slice when the table is grouped by rank (as ``load`` builds
    it), else the row positions of that rank in table order (made one rank at a time)."""
    rank = events["rank"].to_numpy()
    if len(rank) and (rank[1:] >= rank[:-1]).all():
        ranks, first = np.unique(rank, return_index=True)
        yield from ((int(r), slice(lo, hi)) for r, lo, hi in zip(ranks, first, [*first[1:], len(rank)]))
        return
    for r in np.unique(rank):
        yield int(r), np.flatnonzero(rank == r)


class _Tables:
    """Per-category lookup tables of one events table (computed once, indexed with each row's codes)."""

    def __init__(self, events: pd.DataFrame) -> None:
        name, cat, category = events["name"], events["cat"], events["category"]
        self.lane_gpu = in_table(events["lane"], (Lane.GPU.value,))
        self.lane_cpu = in_table(events["lane"], (Lane.CPU.value,))
        # Annotations by source category or by name: never GPU work.
        self.annotation_cat = in_table(cat, ANNOTATION_CATS)
        self.annotation_name = match_table(name, _ANNOTATION_NAME_RE)
        self.step_marker = match_table(name, r"^(ProfilerStep#\d+|sl:pp:)")
        self.cpu_op_cat = in_table(cat, ("cpu_op", "Operator"))
        self.comm_op_cat = in_table(cat, _CPU_OP_CATS)
        self.comm = in_table(category, COMM_CATEGORIES)
        self.copy = in_table(category, ("memcpy_h2d", "memcpy_d2h"))
        self.pageable = in_table(events["memory_kind"], ("Pageable",))
        self.pipeline = match_table(name, _PP_PREFIX)  # the pattern bubbles selects its rows with
        self.step_no = per_category_table(name, ("step_no",), _step_table)
        self.step_marked = self.step_no >= 0
        self.code_of = {text: i for i, text in enumerate(category_texts(category.cat.categories))}


class _Lookup:
    """A per-row array of ``_Rows``: the ``_Tables`` entry of the same name indexed with the rows' codes of
    ``column``; computed on first use, then kept on the rows."""

    def __init__(self, column: str) -> None:
        self.column = column

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, rows, owner=None):
        if rows is None:
            return self
        value = getattr(rows.tables, self.name)[rows.columns[self.column]]
        rows.__dict__[self.name] = value  # an instance attribute now shadows this (non-data) descriptor
        return value


class _Rows:
    """The columns attribution reads, as numpy arrays: views of an events table's columns (category codes for
    the categoricals), taken per rank and per work selection. Row masks come from the per-category tables
    as they are needed, so nothing per row is computed for the whole table at once (its memory stays that
    of one rank's rows)."""

    def __init__(self, columns: dict[str, np.ndarray], tables: _Tables) -> None:
        self.columns = columns
        self.tables = tables
        self.__dict__.update(columns)

    @classmethod
    def of(cls, events: pd.DataFrame) -> _Rows:
        columns = {"start": events["start_ns"].to_numpy(), "dur": events["dur_ns"].to_numpy(),
                   "step": events["step"].to_numpy(), "stream": events["stream"].to_numpy()}
        columns.update((key, codes_or_end(events[key])) for key in ("lane", "cat", "name", "category",
                                                                     "memory_kind"))
        return cls(columns, _Tables(events))

    def take(self, selection, columns=None) -> _Rows:
        """These rows at ``selection`` (a slice, positions or a boolean mask); ``columns``: only these."""
        return _Rows({key: values[selection] for key, values in self.columns.items()
                      if columns is None or key in columns}, self.tables)

    @functools.cached_property
    def end(self) -> np.ndarray:
        return self.start + self.dur

    lane_gpu = _Lookup("lane")
    lane_cpu = _Lookup("lane")
    comm = _Lookup("category")
    step_marked = _Lookup("name")
    pipeline = _Lookup("name")

    @functools.cached_property
    def pageable(self) -> np.ndarray:
        return self.tables.copy[self.category] & self.tables.pageable[self.memory_kind]

    def work(self) -> tuple[np.ndarray, str]:
        """Mask of the rows attributed for one rank and the lane kind used (``Lane.GPU`` or ``Lane.CPU``)."""
        t = self.tables
        gpu = self.lane_gpu & ~t.annotation_cat[self.cat] & ~t.annotation_name[self.name]
        if gpu.any():
            return gpu, Lane.GPU.value
        # CPU ops are work; among annotations only communication ones (gloo:* / nccl:* / sl:comm:*) are.
        cpu = self.lane_cpu & ~t.step_marker[self.name] & (
            t.cpu_op_cat[self.cat] | (self.comm & t.comm_op_cat[self.cat]))
        return cpu, Lane.CPU.value


#: What the work rows' label sets and windows read.
_WORK_COLUMNS = ("start", "dur", "step", "stream", "category", "memory_kind")


def _step_table(texts: list[str]) -> np.ndarray:
    """``schema.step_numbers`` per category, one extra -1 for a missing value."""
    return np.append(step_numbers(texts), -1)


_NO_WINDOWS = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))


def work_rows(events: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows attributed for one rank and the lane kind used (``Lane.GPU`` or ``Lane.CPU``)."""
    mask, lanes = _Rows.of(events).work()
    return events[mask], lanes


def step_windows(events: pd.DataFrame, *, lanes: str, work: pd.DataFrame | None = None,
                 whole: bool = False) -> pd.DataFrame:
    """Columns step, start_ns, end_ns for one rank (see the module docstring), sorted by step. ``whole``: a
    rank whose work has no windows gets one, ``[first work start, last work end)`` with step -1 (the window
    ``breakdown`` attributes then)."""
    rows = _Rows.of(events)
    work_of = rows.take(rows.work()[0]) if work is None else _Rows.of(work)
    steps, starts, ends = (_windows_or_whole if whole else _windows)(rows, lanes=lanes, work=work_of)
    return pd.DataFrame({"step": steps, "start_ns": starts, "end_ns": ends})


def _windows_or_whole(rows: _Rows, *, lanes: str, work: _Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    steps, starts, ends = _windows(rows, lanes=lanes, work=work)
    if len(steps) or not len(work.start):
        return steps, starts, ends
    return np.array([-1], dtype=np.int64), np.array([work.start.min()]), np.array([work.end.max()])


def _windows(rows: _Rows, *, lanes: str, work: _Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step, start, end) of one rank's windows, sorted by step: ``step_windows`` on the arrays."""
    marked = rows.step_marked
    gpu, cpu = Lane.GPU.value, Lane.CPU.value
    for lane_kind in ((lanes, cpu) if lanes == gpu else (cpu,)):
        if lane_kind == cpu and lanes == gpu:
            from_work = _gpu_work_steps(work.step, work.start, work.end)
            if len(from_work[0]):
                return from_work
        sel = marked & (rows.lane_gpu if lane_kind == gpu else rows.lane_cpu)
        if sel.any():
            # Several markers of one step (e.g. one per stream) are joined to their hull.
            return _hulls(rows.tables.step_no[rows.name[sel]], rows.start[sel], rows.start[sel] + rows.dur[sel])
    return _NO_WINDOWS


def _hulls(step: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct step (ascending): the first start and the last end."""
    order = np.argsort(step, kind="stable")
    steps, first = np.unique(step[order], return_index=True)
    return (steps.astype(np.int64), np.minimum.reduceat(start[order], first).astype(np.int64),
            np.maximum.reduceat(end[order], first).astype(np.int64))


def _gpu_work_steps(step: np.ndarray, start: np.ndarray, end: np.ndarray):
    """Windows from the ``step`` of GPU work: [first start of N, first start of N+1), last: to its last end."""
    stepped = step >= 0
    if not stepped.any():
        return _NO_WINDOWS
    steps, starts, last_ends = _hulls(step[stepped], start[stepped], end[stepped])
    last_end = int(last_ends[-1])
    # The next step's first start closes a step; a non-increasing start (out-of-order work) gives an empty window.
    ends = np.append(np.maximum(starts[1:], starts[:-1]), max(last_end, int(starts[-1])))
    return steps, starts, ends


def label_sets(events: pd.DataFrame, work: pd.DataFrame, lanes: str) -> dict[str, iv.IntervalSet]:
    """Interval set of every non-idle label for one rank (before the priority partition)."""
    pipeline = match_names(events["name"], _PP_PREFIX)
    return _label_sets(_Rows.of(work), lanes, pipeline=events[pipeline] if pipeline.any() else None)


def _label_sets(work: _Rows, lanes: str, *, pipeline: pd.DataFrame | None) -> dict[str, iv.IntervalSet]:
    """``label_sets`` on the arrays of the work rows; ``pipeline``: the rank's pipeline annotation rows, in
    order (only they matter to bubbles), or None when it has none."""
    start, end = work.start, work.end
    sets: dict[str, iv.IntervalSet] = {}
    if lanes == Lane.CPU.value:
        # Per thread, comm time leaves the thread's compute (comm ops nest inside framework ops).
        compute_parts = []
        for thread in np.unique(work.stream):
            on = work.stream == thread
            comm, busy = on & work.comm, on & ~work.comm
            compute_parts.append(iv.subtract(iv.union(start[busy], end[busy]), iv.union(start[comm], end[comm])))
        sets["compute"] = iv.merge(*compute_parts)
    for label in LABELS:
        if label in ("idle", "bubble") or (label == "compute" and lanes == Lane.CPU.value):
            continue
        on = work.category == work.tables.code_of.get(label, -1)
        sets[label] = iv.union(start[on], end[on]) if on.any() else iv.EMPTY
    sets["bubble"] = bubble_set(pipeline, lanes=lanes) if pipeline is not None else iv.EMPTY
    # Not a partition label: time with a copy from/to pageable host memory running (a PCIe offload smell).
    sets["pageable_memcpy"] = iv.union(start[work.pageable], end[work.pageable])
    return sets


def _rank_breakdown(events: pd.DataFrame, rows: _Rows, rank: int, selection) -> dict[str, np.ndarray] | None:
    mask, lanes = rows.work()
    if not mask.any():
        return None
    work = rows.take(mask, _WORK_COLUMNS)
    steps, win_start, win_end = _windows_or_whole(rows, lanes=lanes, work=work)
    pipeline = None
    if rows.pipeline.any():  # the rank's pipeline annotation rows, in table order
        at = np.flatnonzero(rows.pipeline)
        pipeline = events.iloc[at + selection.start if isinstance(selection, slice) else selection[at]]
    sets = _label_sets(work, lanes, pipeline=pipeline)
    leading = {"rank": np.full(len(steps), rank, dtype=np.int64), "step": steps,
               "lanes": np.full(len(steps), lanes, dtype=object)}
    return partition_columns(sets, win_start=win_start, win_end=win_end, leading=leading)


def partition(sets: dict[str, iv.IntervalSet], *, win_start: np.ndarray, win_end: np.ndarray,
              leading: dict[str, np.ndarray] | None = None) -> pd.DataFrame:
    """Exclusive partition of each window by ``LABELS`` priority, + overlap (see ``partition_columns``)."""
    return pd.DataFrame(partition_columns(sets, win_start=win_start, win_end=win_end, leading=leading))


def partition_columns(sets: dict[str, iv.IntervalSet], *, win_start: np.ndarray, win_end: np.ndarray,
                      leading: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Exclusive partition of each window ``[win_start[k], win_end[k])`` by ``LABELS`` priority, + overlap.

    Elementary segments lie between consecutive endpoints of all sets and windows, so each segment is wholly
    inside or outside every set; it goes to the first covering label (idle if none). Per-label prefix sums
    over segments give any window's total as a difference of two prefix values, exactly, in int64.
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


def comm_by_dim(traceset_or_events, *, layout=None) -> pd.DataFrame:
    """One row per (rank, step, dim) with communication: ``comm_ns`` = time(∪ comm of that dim),
    ``exposed_ns`` = time(that \\ compute), ``overlapped_ns`` = time(that ∩ compute).

    Dims are not a partition of each other (a TP all-reduce may run under a DP reduce-scatter), so the
    per-dim exposed times can sum to more than the exposed comm columns of ``breakdown``.
    """
    events = checked_events(traceset_or_events, caller="comm_by_dim", layout=layout)
    frames = []
    for rank, grp in events.groupby("rank", observed=True, sort=True):
        work, lanes = work_rows(grp)
        if work.empty:
            continue
        windows = step_windows(grp, lanes=lanes, work=work, whole=True)
        compute = label_sets(grp, work, lanes)["compute"]
        comm = work[work["category"].astype(str).isin(COMM_CATEGORIES)]
        lo, hi = windows["start_ns"].to_numpy(), windows["end_ns"].to_numpy()
        for dim, rows in comm.groupby(comm["dim"].astype(str), sort=True):  # a handful of dims per rank
            dim_set = iv.union(rows["start_ns"], rows["start_ns"] + rows["dur_ns"])
            frames.append(pd.DataFrame({
                "rank": int(rank), "step": windows["step"].to_numpy(), "dim": dim,
                "comm_ns": iv.window_totals(dim_set, lo=lo, hi=hi),
                "exposed_ns": iv.window_totals(iv.subtract(dim_set, compute), lo=lo, hi=hi),
                "overlapped_ns": iv.window_totals(iv.intersect(dim_set, compute), lo=lo, hi=hi)}))
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in (("rank", "int64"), ("step", "int64"),
                             ("dim", "str"), ("comm_ns", "int64"), ("exposed_ns", "int64"),
                             ("overlapped_ns", "int64"))})
    out = pd.concat(frames, ignore_index=True)
    return out[out["comm_ns"] > 0].reset_index(drop=True)
