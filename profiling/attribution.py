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

import re
import warnings

import numpy as np
import pandas as pd

import shardline.profiling.annotations as contract
from shardline.profiling import intervals as iv
from shardline.profiling.bubbles import bubble_set
from shardline.profiling.classify import Lane, classify_events, match_names
from shardline.profiling.errors import AttributionError, TraceWarning
from shardline.profiling.schema import (
    COMM_CATEGORIES,
    category_texts,
    check_events,
    codes_or_end,
    per_category_table,
)

LABELS = ("compute", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier",
          "other_comm", "memcpy_h2d", "memcpy_d2h", "memcpy_d2d", "memset", "bubble", "p2p_send", "p2p_recv",
          "sync", "idle")
#: Exclusive columns of ``breakdown`` (exposed time for the comm categories), summing to ``step_ns``.
EXCLUSIVE_COLUMNS = LABELS
OVERLAP_COLUMNS = tuple(f"overlapped_{c}" for c in COMM_CATEGORIES)

STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
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
    rows = [_rank_breakdown(grp) for _, grp in per_rank(events, _USED_COLUMNS)]
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
    wanted = frozenset(values)
    table = per_category_table(column, ("is_in", wanted),
                               lambda texts: np.array([t in wanted for t in texts] + [False], dtype=bool))
    return table[codes_or_end(column)]


#: The columns attribution reads; the per-rank copies hold only these.
_USED_COLUMNS = ("rank", "lane", "stream", "name", "cat", "category", "dim", "start_ns", "dur_ns", "step",
                 "memory_kind")


def per_rank(events: pd.DataFrame, columns=None):
    """``(rank, rows of that rank)`` in rank order, like ``groupby("rank")``, but copying one rank at a time
    and, when ``columns`` is given, only those columns."""
    rank = events["rank"].to_numpy()
    keep = list(events.columns) if columns is None else [c for c in events.columns if c in columns]
    if len(rank) and (rank[1:] >= rank[:-1]).all():
        # Rows already grouped by rank in order (as ``load`` builds the table): slices, no per-rank copy.
        table = events[keep]
        ranks, first = np.unique(rank, return_index=True)
        for r, lo, hi in zip(ranks, first, [*first[1:], len(rank)]):
            yield r, table.iloc[lo:hi]
        return
    for r in np.unique(rank):
        yield r, events.loc[rank == r, keep]


def work_rows(events: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows attributed for one rank and the lane kind used (``Lane.GPU`` or ``Lane.CPU``)."""
    named_annotation = match_names(events["name"], _ANNOTATION_NAME_RE)
    lane_gpu = (events["lane"] == Lane.GPU.value).to_numpy()
    gpu = lane_gpu & ~is_in(events["cat"], ANNOTATION_CATS) & ~named_annotation
    if gpu.any():
        return events[gpu], Lane.GPU.value
    is_comm = is_in(events["category"], COMM_CATEGORIES)
    step_marker = match_names(events["name"], r"^(ProfilerStep#\d+|sl:pp:)")
    # CPU ops are work; among annotations only communication ones (gloo:* / nccl:* / sl:comm:*) are.
    cpu = (events["lane"] == Lane.CPU.value).to_numpy() & ~step_marker & (
        is_in(events["cat"], ["cpu_op", "Operator"]) | (is_comm & is_in(events["cat"], _CPU_OP_CATS)))
    return events[cpu], Lane.CPU.value


def step_windows(events: pd.DataFrame, *, lanes: str, work: pd.DataFrame | None = None) -> pd.DataFrame:
    """Columns step, start_ns, end_ns for one rank (see the module docstring), sorted by step."""
    marked = match_names(events["name"], STEP_RE.pattern)
    gpu, cpu = Lane.GPU.value, Lane.CPU.value
    for lane_kind in ((lanes, cpu) if lanes == gpu else (cpu,)):
        if lane_kind == cpu and lanes == gpu:
            from_work = _gpu_work_steps(work_rows(events)[0] if work is None else work)
            if len(from_work):
                return from_work
        sel = marked & (events["lane"] == lane_kind).to_numpy()
        if sel.any():
            sub = events[sel]
            steps = sub["name"].astype(str).str.extract(STEP_RE, expand=False)  # only the step markers
            frame = pd.DataFrame({"step": steps.astype(np.int64).to_numpy(),
                                  "start_ns": sub["start_ns"].to_numpy(),
                                  "end_ns": (sub["start_ns"] + sub["dur_ns"]).to_numpy()})
            return frame.groupby("step", as_index=False).agg(start_ns=("start_ns", "min"),
                                                             end_ns=("end_ns", "max"))
    return pd.DataFrame({"step": np.empty(0, np.int64), "start_ns": np.empty(0, np.int64),
                         "end_ns": np.empty(0, np.int64)})


def _gpu_work_steps(work: pd.DataFrame) -> pd.DataFrame:
    """Windows from the ``step`` of GPU work: [first start of N, first start of N+1), last: to its last end."""
    step = work["step"].to_numpy()
    stepped = step >= 0
    if not stepped.any():
        return pd.DataFrame({"step": np.empty(0, np.int64), "start_ns": np.empty(0, np.int64),
                             "end_ns": np.empty(0, np.int64)})
    start = work["start_ns"].to_numpy()[stepped]
    end = start + work["dur_ns"].to_numpy()[stepped]
    step = step[stepped]
    order = np.argsort(step, kind="stable")
    steps, first = np.unique(step[order], return_index=True)
    starts = np.minimum.reduceat(start[order], first)
    last_end = int(np.maximum.reduceat(end[order], first)[-1])
    # The next step's first start closes a step; a non-increasing start (out-of-order work) gives an empty window.
    ends = np.append(np.maximum(starts[1:], starts[:-1]), max(last_end, int(starts[-1])))
    return pd.DataFrame({"step": steps.astype(np.int64), "start_ns": starts.astype(np.int64), "end_ns": ends})


def label_sets(events: pd.DataFrame, work: pd.DataFrame, lanes: str) -> dict[str, iv.IntervalSet]:
    """Interval set of every non-idle label for one rank (before the priority partition)."""
    start = work["start_ns"].to_numpy()
    end = start + work["dur_ns"].to_numpy()
    category = work["category"]
    sets: dict[str, iv.IntervalSet] = {}
    if lanes == Lane.CPU.value:
        # Per thread, comm time leaves the thread's compute (comm ops nest inside framework ops).
        stream = work["stream"].to_numpy()
        compute_parts = []
        comm = is_in(category, COMM_CATEGORIES)
        for thread in np.unique(stream):
            on = stream == thread
            comm_t = iv.union(start[on & comm], end[on & comm])
            busy_t = iv.union(start[on & ~comm], end[on & ~comm])
            compute_parts.append(iv.subtract(busy_t, comm_t))
        sets["compute"] = iv.merge(*compute_parts)
    codes = codes_or_end(category)
    code_of = {text: i for i, text in enumerate(category_texts(category.cat.categories))}
    for label in LABELS:
        if label in ("idle", "bubble") or (label == "compute" and lanes == Lane.CPU.value):
            continue
        on = codes == code_of.get(label, -1)
        sets[label] = iv.union(start[on], end[on]) if on.any() else iv.EMPTY
    # Only the pipeline annotations matter to bubbles: hand over just those rows (in order), not the rank.
    pipeline = match_names(events["name"], _PP_PREFIX)
    sets["bubble"] = bubble_set(events[pipeline], lanes=lanes) if pipeline.any() else iv.EMPTY
    # Not a partition label: time with a copy from/to pageable host memory running (a PCIe offload smell).
    pageable = is_in(category, ("memcpy_h2d", "memcpy_d2h")) & is_in(work["memory_kind"], ("Pageable",))
    sets["pageable_memcpy"] = iv.union(start[pageable], end[pageable])
    return sets


def _rank_breakdown(events: pd.DataFrame) -> dict[str, np.ndarray] | None:
    work, lanes = work_rows(events)
    if work.empty:
        return None
    windows = step_windows(events, lanes=lanes, work=work)
    if windows.empty:
        first = int(work["start_ns"].min())
        last = int((work["start_ns"] + work["dur_ns"]).max())
        windows = pd.DataFrame({"step": [-1], "start_ns": [first], "end_ns": [last]})
    sets = label_sets(events, work, lanes)
    steps = windows["step"].to_numpy().astype(np.int64)
    leading = {"rank": np.full(len(steps), int(events["rank"].iloc[0]), dtype=np.int64), "step": steps,
               "lanes": np.full(len(steps), lanes, dtype=object)}
    return partition_columns(sets, win_start=windows["start_ns"].to_numpy(), win_end=windows["end_ns"].to_numpy(),
                             leading=leading)


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
    points = np.unique(np.concatenate([win_start, win_end] + [a for s in sets.values() for a in s]))
    seg_s, seg_e = points[:-1], points[1:]
    length = seg_e - seg_s
    lo = np.searchsorted(points, win_start)
    hi = np.searchsorted(points, win_end)
    covered = {label: iv.covers(s, seg_s) for label, s in sets.items()}
    free = np.ones(len(seg_s), dtype=bool)
    out: dict[str, np.ndarray] = {**(leading or {}), "start_ns": win_start, "end_ns": win_end,
                                  "step_ns": win_end - win_start}

    def window_sums(mask: np.ndarray) -> np.ndarray:
        prefix = np.concatenate([[0], np.cumsum(np.where(mask, length, 0))])
        return prefix[hi] - prefix[lo]

    for label in LABELS:
        mask = free if label == "idle" else (free & covered.get(label, np.zeros_like(free)))
        out[label] = window_sums(mask)
        free &= ~mask
    parts = np.sum([out[label] for label in LABELS], axis=0)
    if not np.array_equal(parts, out["step_ns"]):  # the partition covers each window once, by construction
        raise AssertionError(f"attribution parts {parts} do not sum to step times {out['step_ns']}")
    compute = covered["compute"]
    any_comm = np.zeros(len(seg_s), dtype=bool)
    for comm in COMM_CATEGORIES:
        c = covered.get(comm, np.zeros_like(free))
        out[f"overlapped_{comm}"] = window_sums(c & compute)
        any_comm |= c
    out["comm_ns"] = window_sums(any_comm)
    for extra in sorted(set(sets) - set(LABELS)):  # reported alongside, outside the partition
        out[f"{extra}_ns"] = window_sums(covered[extra])
    overlapped = window_sums(any_comm & compute)
    with np.errstate(invalid="ignore", divide="ignore"):
        out["overlap_ratio"] = np.where(out["comm_ns"] > 0, overlapped / np.maximum(out["comm_ns"], 1), np.nan)
    return out


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
        windows = step_windows(grp, lanes=lanes, work=work)
        if windows.empty:
            windows = pd.DataFrame({"step": [-1], "start_ns": [int(work["start_ns"].min())],
                                    "end_ns": [int((work["start_ns"] + work["dur_ns"]).max())]})
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
