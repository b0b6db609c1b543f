"""Per-(rank, step) time attribution: exclusive parts that sum exactly to the step time, plus overlap.

Which lanes count. A rank with GPU work (any GPU-lane row that is not an annotation) is attributed on its GPU
lanes: kernels, memcpy, memset and ``cuda_sync`` markers of all its streams. A rank without GPU work (CPU/gloo
runs) is attributed on its CPU threads: communication is the comm ops (``record_param_comms``, ``c10d::*``,
``gloo:*`` / ``nccl:*`` / ``sl:comm:*`` annotations) and compute the other CPU ops. On one CPU thread a comm op
nests inside framework ops, so per thread the comm time is removed from that thread's compute first; across
threads (e.g. backward thread computing while the main thread waits) the priority below applies as on GPUs.

Step windows, first source that exists:

1. ``ProfilerStep#N`` annotations of the analysed lane kind (GPU user annotations on a GPU rank; several per
   step are joined to their hull). GPU-side ones are checked first against the GPU work each CPU step
   launched (by correlation id; ``survey.check_gpu_steps``): ROCm traces hold stubs (microseconds for a step
   of milliseconds), steps out of order and steps missing. Where they fail, every window of the rank is
   instead ``[first start, last end)`` of the work its CPU step launched (what Kineto's GPU annotation is
   when healthy), and the breakdown warns once per rank (a ``TraceWarning`` naming the file and the failure);
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
``idle`` is the rest. ``bubble`` is pipeline time, measured per rank by the first method that applies (see
``bubbles.rank_pipelines``): shardline's ``sl:pp:batch`` windows minus its ``F``/``B``/``W`` action spans;
torch.distributed.pipelining's ``PP:*`` / ``Forward i`` spans net of their receive waits; else, on a trace with
nothing but send/recv, the part of each receive spent before the matched send started on its peer
(``p2p.match_p2p``; for one rank's trace an estimate from message size and link bandwidth). It ranks above p2p
because a pipeline recv kernel spinning for its peer is bubble, not transfer. The columns of
``EXCLUSIVE_COLUMNS`` sum to ``step_ns`` exactly in integer ns (asserted).

``idle`` is split by cause into ``idle_host_bound``, ``idle_sync``, ``idle_dataloader``, ``idle_dependency`` and
``idle_other`` (``idle.IDLE_CAUSES``, rules in ``shardline.profiling.idle``), which sum to ``idle`` exactly, so
with the other exclusive columns to the step; ``EXCLUSIVE_COLUMNS`` keeps the one ``idle``.

Alongside: ``overlapped_<comm>`` = time(comm_c ∩ compute); ``comm_ns`` = time(∪ comm) and
``overlap_ratio`` = time(compute ∩ ∪comm) / time(∪comm) (HTA's definition; NaN without communication);
``pageable_memcpy_ns`` = time with an H2D/D2H copy from/to pageable host memory running (the slow, blocking
kind of offload traffic; ``memory_kind == "Pageable"``).

One object per trace set. ``attribute(traceset)`` checks and (when it is not yet) classifies the events table
once, with the layout the trace set was loaded with (``load(path, layout=...)``) or the one given, and returns
an :class:`Attribution` kept on the trace set, so every later call gets the same object. It surveys each rank
once (the work rows and their lane kind, the step windows, the pipeline annotation rows) and computes, on first
use and then keeps, each rank's label sets and the breakdown. Every analysis (``comm_by_dim``,
``collectives``, ``bubbles``) and every output (reports, TensorBoard, the merged trace, the ``StepProfiler``
callback, the CLI) reads these; none derives them again from the raw table.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Mapping

import numpy as np
import pandas as pd

from shardline.profiling import intervals as iv
from shardline.profiling.bubbles import pp_rows, rank_pipelines
from shardline.profiling.classify import assign_dims, check_layout, classify_events
from shardline.profiling.errors import AttributionError, TraceWarning
from shardline.profiling.idle import idle_causes
from shardline.profiling.partition import (
    EXCLUSIVE_COLUMNS,
    LABELS,
    OVERLAP_COLUMNS,
    partition,
    partition_columns,
    segment_owners,
)
from shardline.profiling.schema import COMM_CATEGORIES, check_events, codes_or_end
from shardline.profiling.survey import (
    WORK_COLUMNS,
    Rows,
    in_table,
    is_in,
    label_sets,
    rank_selections,
    rank_windows,
)

__all__ = ["EXCLUSIVE_COLUMNS", "LABELS", "OVERLAP_COLUMNS", "Attribution", "RankAttribution", "attribute",
           "breakdown", "comm_by_dim", "empty_breakdown", "in_table", "is_in", "partition", "partition_columns",
           "segment_owners"]

_NOTHING = "nothing to attribute: the events table has no work events on any rank"


def attribute(source, *, layout: Mapping[str, int] | None = None, caller: str = "attribute") -> Attribution:
    """The :class:`Attribution` of ``source`` (a ``TraceSet``, an events table, or an ``Attribution``).

    ``layout`` (``dict(tp=, cp=, dp=, pp=)``) names the parallel dims of groups whose description does not;
    without it the layout the trace set was loaded with applies. A trace set keeps one attribution per layout,
    so asking again costs nothing. The table is classified once when it is not yet (every ``category``
    empty); a classified table given another layout has only its ``dim`` column derived again. A bad table
    raises ``AttributionError`` naming ``caller``, a bad layout ``ClassificationError`` naming its entries.
    """
    if layout is not None:
        check_layout(layout)  # ClassificationError naming the bad entries
    if isinstance(source, Attribution):
        if layout is None or _layout_key(layout) == _layout_key(source.layout):
            return source
        source = source.events
    events = getattr(source, "events", source)
    if not isinstance(events, pd.DataFrame):
        raise AttributionError(f"{caller} expects a TraceSet or an events DataFrame, got {type(events).__name__}")
    loaded_with = getattr(source, "layout", None)
    chosen = loaded_with if layout is None else layout
    cache = getattr(source, "attributions", None)
    key = _layout_key(chosen)
    if cache is not None and key in cache:
        return cache[key]
    _check(events, caller=caller)
    if len(events) and is_in(events["category"], ("",)).all():
        events = classify_events(events, layout=chosen)
    elif _layout_key(chosen) != _layout_key(loaded_with):
        events = assign_dims(events, layout=chosen)
    attribution = Attribution(events, layout=chosen, files=_files_of(source),
                              metadata=getattr(source, "metadata", None))
    if cache is not None:
        cache[key] = attribution
    return attribution


def _files_of(source) -> dict[int, str]:
    """Rank -> the name(s) of the file(s) its rows came from (a ``TraceSet``'s ``files``), for warnings."""
    names: dict[int, list[str]] = {}
    for path, ranks in (getattr(source, "files", None) or {}).items():
        for rank in ranks:
            names.setdefault(int(rank), []).append(str(path))
    return {rank: ", ".join(sorted(paths)) for rank, paths in names.items()}


def _layout_key(layout: Mapping[str, int] | None):
    return None if layout is None else tuple(sorted((str(k), int(v)) for k, v in layout.items()))


def _check(events: pd.DataFrame, *, caller: str) -> None:
    try:
        check_events(events)
    except ValueError as exc:
        raise AttributionError(f"{caller}: {exc}") from None
    negative = events["dur_ns"] < 0
    if negative.any():
        names = events.loc[negative, "name"].astype(str).unique()[:5].tolist()
        raise AttributionError(f"{caller}: {int(negative.sum())} events have a negative duration (e.g. {names})")


class Attribution:
    """One trace set's events, classified, and everything attribution derives from them (see the module
    docstring). Build it with :func:`attribute`; ``events`` is the classified table (not to be modified),
    ``layout`` the dims it was classified with (or None).

    ``ranks``: every rank of the table, in rank order (a :class:`RankAttribution` each); ``working``: those
    with work to attribute. ``metadata``: the trace set's metadata (``TraceSet.metadata``; empty for a table).
    ``breakdown``: the per-(rank, step) partition, computed on first use and kept.
    """

    def __init__(self, events: pd.DataFrame, *, layout: Mapping[str, int] | None = None,
                 files: Mapping[int, str] | None = None, metadata: Mapping | None = None,
                 pipelines: Mapping | None = None, contexts: Mapping | None = None) -> None:
        self.events = events
        # Measured elsewhere (``scale``: a worker's own annotations, or the driver's matching across ranks):
        # rank -> ``bubbles.RankPipeline``, used instead of ``rank_pipelines`` for the bubble sets.
        self.given_pipelines = None if pipelines is None else dict(pipelines)
        # rank -> ``scale.RankContext``: lanes and windows from the rank's whole trace, for a table that holds
        # only some of its rows (``scale``'s compact rows).
        self.contexts = dict(contexts or {})
        self.layout = None if layout is None else dict(layout)
        self.files = dict(files or {})
        self.metadata = dict(metadata or {})  # the trace set's per-rank metadata (device names, layout ...)
        self.timings: dict[str, float] = {}  # seconds some analyses took (``idle_causes``; reports add theirs)
        self._memo: dict = {}

    def __repr__(self) -> str:
        return f"Attribution({len(self.events)} events, ranks={[r.rank for r in self.ranks]}, layout={self.layout})"

    @functools.cached_property
    def ranks(self) -> tuple[RankAttribution, ...]:
        # The table's columns read once (views and category codes), shared by the ranks.
        table = Rows.of(self.events)
        return tuple(RankAttribution(self.events, table, rank=rank, selection=selection,
                                     source=self.files.get(rank, f"rank {rank}"), pipelines=self._pipelines,
                                     context=self.contexts.get(rank))
                     for rank, selection in rank_selections(self.events))

    def _pipelines(self):
        """``bubbles.rank_pipelines`` of this attribution (what each rank's bubble set is taken from), or the
        pipelines it was given."""
        return self.given_pipelines if self.given_pipelines is not None else rank_pipelines(self)[0]

    @property
    def working(self) -> tuple[RankAttribution, ...]:
        return tuple(r for r in self.ranks if r.has_work)

    def rank(self, rank: int) -> RankAttribution:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise AttributionError(f"rank {rank} is not in this trace set (ranks {[r.rank for r in self.ranks]})")

    @functools.cached_property
    def _breakdown(self) -> tuple[pd.DataFrame, tuple[str, ...]]:
        return _compute_breakdown(self)

    @property
    def breakdown(self) -> pd.DataFrame:
        """The breakdown (see ``breakdown``); its warnings (an empty one; a rank whose GPU step annotations
        were replaced) are issued on every read, so a reader sees them under its own warning filters however
        often it was computed before. Not to be modified."""
        table, notes = self._breakdown
        for note in notes:
            warnings.warn(note, TraceWarning, stacklevel=2)
        return table

    def cached(self, key, compute):
        """``compute()`` the first time ``key`` is asked for, the kept result afterwards (for the analyses an
        output shows, e.g. ``report_sections``)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]


def _compute_breakdown(attribution: Attribution) -> tuple[pd.DataFrame, tuple[str, ...]]:
    """The breakdown of every rank with work, and the warnings to issue (the one computation of it)."""
    rows = []
    spent = 0.0
    for rank in attribution.working:
        columns = rank.partition_columns()
        started = time.perf_counter()
        columns.update(idle_causes(attribution, rank, idle=columns["idle"]))  # asserted to sum to idle
        rank.__dict__.pop("idle_set", None)  # gap-sized: not kept once counted (``idle_set`` partitions again)
        spent += time.perf_counter() - started
        rows.append(columns)
    attribution.timings["idle_causes"] = spent
    notes = tuple(rank.window_note for rank in attribution.working if rank.window_note)
    if attribution.given_pipelines is None:  # given: measured, and warned about, where they were
        notes += rank_pipelines(attribution)[1]  # the p2p pipeline inference's warnings
    if not rows:
        # An execution trace, a memory timeline or an init-only NCCL log loads fine but holds no timed work:
        # the user gets the (empty) table with a warning rather than an exception.
        return empty_breakdown(), (_NOTHING,)
    # One frame from the joined columns (every rank has the same ones); a frame per rank and a concat would
    # pay pandas' per-frame overhead once per rank.
    return pd.DataFrame({column: np.concatenate([r[column] for r in rows]) for column in rows[0]}), notes


class RankAttribution:
    """One rank of an :class:`Attribution`, surveyed once: its lane kind, its work rows (as positions in the
    events table, in table order), its step windows and its pipeline annotation rows. The label sets, the
    pipeline rows and the bubble set are computed on first use and kept.

    ``lanes``: ``Lane.GPU``/``Lane.CPU`` value (a rank without work: ``cpu``). ``windows``: the windows its
    markers (or its GPU work's steps) give, possibly none; ``attributed_windows``: the windows ``breakdown``
    partitions (``windows``, else ``[first work start, last work end)`` with step -1). ``window_note``: why
    the GPU step annotations were replaced by windows from the launched work (naming ``source``), or None.
    """

    def __init__(self, events: pd.DataFrame, table: Rows, *, rank: int, selection, source: str = "",
                 pipelines=None, context=None) -> None:
        self._events = events
        self._pipelines = pipelines
        self._table = table
        self.rank = rank
        rows = table.take(selection)
        if context is None:
            mask, self.lanes = rows.work()
        else:  # the rank's whole trace said (``scale.RankContext``): its rows here are a part of it
            self.lanes = context.lanes
            mask = rows.work_on(self.lanes)
        self.work_positions = _positions(selection, mask)
        self.pipeline_positions = _positions(selection, rows.pipeline)
        if context is not None:
            self.has_work = bool(context.has_work)
            self._windows, self._attributed = context.windows, context.attributed
            self.window_note = context.window_note
            return
        self.has_work = bool(len(self.work_positions))
        work = rows.take(mask, ("start", "dur", "step", "correlation"))
        self._windows, note = rank_windows(rows, lanes=self.lanes, work=work)
        self.window_note = None if note is None else f"{source or f'rank {rank}'}: {note}"
        if len(self._windows[0]) or not self.has_work:
            self._attributed = self._windows
        else:
            self._attributed = (np.array([-1], dtype=np.int64), np.array([work.start.min()]),
                                np.array([work.end.max()]))

    def __repr__(self) -> str:
        return (f"RankAttribution(rank={self.rank}, lanes={self.lanes!r}, work rows={len(self.work_positions)}, "
                f"windows={len(self._attributed[0])})")

    def work(self, columns=None, *, categories=None) -> pd.DataFrame:
        """The rank's attributed work rows (all columns, or ``columns``), in table order; ``categories``: only
        the rows of these categories."""
        positions = self.work_positions
        if categories is not None:
            category = self._events["category"]
            positions = positions[in_table(category, categories)[codes_or_end(category)[positions]]]
        if columns is None:
            return self._events.iloc[positions]
        return self._events.iloc[positions, [self._events.columns.get_loc(c) for c in columns]]

    @functools.cached_property
    def windows(self) -> pd.DataFrame:
        steps, starts, ends = self._windows
        return pd.DataFrame({"step": steps, "start_ns": starts, "end_ns": ends})

    @functools.cached_property
    def attributed_windows(self) -> pd.DataFrame:
        steps, starts, ends = self._attributed
        return pd.DataFrame({"step": steps, "start_ns": starts, "end_ns": ends})

    @property
    def window_bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(step, start_ns, end_ns)`` of ``attributed_windows`` as arrays (not to be modified)."""
        return self._attributed

    @property
    def pipeline(self) -> pd.DataFrame:
        """The rank's ``sl:pp:*`` annotation rows, in table order."""
        return self._events.iloc[self.pipeline_positions]

    @functools.cached_property
    def pp_rows(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """``bubbles.pp_rows`` of the rank: (batches, actions) on the lanes it is attributed on."""
        return pp_rows(self.pipeline, self.lanes)

    @functools.cached_property
    def bubble(self) -> iv.IntervalSet:
        """The pipeline bubble set of the method ``bubbles.rank_pipelines`` measures this rank with (``sl:pp``
        annotations, torch.distributed.pipelining's names, or its receive waits); empty without a pipeline."""
        measured = self._pipelines().get(self.rank) if self._pipelines is not None else None
        return iv.EMPTY if measured is None else measured.bubble

    @functools.cached_property
    def label_sets(self) -> dict[str, iv.IntervalSet]:
        """Interval set of every non-idle label (before the priority partition), plus ``pageable_memcpy``."""
        work = self._table.take(self.work_positions, WORK_COLUMNS)
        return label_sets(work, self.lanes, bubble=self.bubble)

    def partition_columns(self) -> dict[str, np.ndarray]:
        """The breakdown columns of this rank (``partition.partition_columns`` of its sets and windows); keeps
        the idle set the partition leaves (``idle_set``)."""
        steps, starts, ends = self._attributed
        leading = {"rank": np.full(len(steps), self.rank, dtype=np.int64), "step": steps,
                   "lanes": np.full(len(steps), self.lanes, dtype=object)}
        idle: list = []
        columns = partition_columns(self.label_sets, win_start=starts, win_end=ends, leading=leading, idle_out=idle)
        self.__dict__["idle_set"] = idle[0]
        return columns

    @functools.cached_property
    def idle_set(self) -> iv.IntervalSet:
        """The time no label covers, over the hull of the attributed windows and the work: what the
        breakdown's ``idle`` totals per window (``idle`` splits it by cause)."""
        self.partition_columns()
        return self.__dict__["idle_set"]


def _positions(selection, mask: np.ndarray) -> np.ndarray:
    """Table positions of the rows ``mask`` picks among those of ``selection`` (a slice or positions)."""
    if isinstance(selection, slice):
        return np.flatnonzero(mask) + selection.start
    return selection[mask]


def breakdown(source, *, layout: Mapping[str, int] | None = None) -> pd.DataFrame:
    """One row per (rank, step): the exclusive partition of the step time and the overlap columns.

    ``source``: a ``TraceSet``, an events table (an unclassified one, all ``category`` empty, is classified
    first) or an ``Attribution``; ``layout`` as for ``attribute``. The table is computed once per trace set
    (``Attribution.breakdown``); this returns a copy of it. See the module docstring for lanes, windows and the
    priority order.
    """
    return attribute(source, layout=layout, caller="breakdown").breakdown.copy()


def comm_by_dim(source, *, layout: Mapping[str, int] | None = None) -> pd.DataFrame:
    """One row per (rank, step, dim) with communication: ``comm_ns`` = time(∪ comm of that dim),
    ``exposed_ns`` = time(that \\ compute), ``overlapped_ns`` = time(that ∩ compute).

    Dims are not a partition of each other (a TP all-reduce may run under a DP reduce-scatter), so the
    per-dim exposed times can sum to more than the exposed comm columns of ``breakdown``.
    """
    attribution = attribute(source, layout=layout, caller="comm_by_dim")
    frames = []
    for rank in attribution.working:
        windows = rank.attributed_windows
        compute = rank.label_sets["compute"]
        comm = rank.work(["dim", "start_ns", "dur_ns"], categories=COMM_CATEGORIES)
        lo, hi = windows["start_ns"].to_numpy(), windows["end_ns"].to_numpy()
        for dim, rows in comm.groupby(comm["dim"].astype(str), sort=True):  # a handful of dims per rank
            dim_set = iv.union(rows["start_ns"], rows["start_ns"] + rows["dur_ns"])
            frames.append(pd.DataFrame({
                "rank": rank.rank, "step": windows["step"].to_numpy(), "dim": dim,
                "comm_ns": iv.window_totals(dim_set, lo=lo, hi=hi),
                "exposed_ns": iv.window_totals(iv.subtract(dim_set, compute), lo=lo, hi=hi),
                "overlapped_ns": iv.window_totals(iv.intersect(dim_set, compute), lo=lo, hi=hi)}))
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in (("rank", "int64"), ("step", "int64"),
                             ("dim", "str"), ("comm_ns", "int64"), ("exposed_ns", "int64"),
                             ("overlapped_ns", "int64"))})
    out = pd.concat(frames, ignore_index=True)
    return out[out["comm_ns"] > 0].reset_index(drop=True)


def empty_breakdown() -> pd.DataFrame:
    """A zero-row breakdown with every column ``breakdown`` returns."""
    from shardline.profiling.idle import IDLE_CAUSES

    columns = ["rank", "step", "lanes", "start_ns", "end_ns", "step_ns", *LABELS, *OVERLAP_COLUMNS, "comm_ns",
               "pageable_memcpy_ns", *IDLE_CAUSES]
    frame = pd.DataFrame({c: np.empty(0, dtype=np.int64) for c in columns})
    frame["lanes"] = frame["lanes"].astype(str)
    frame["overlap_ratio"] = np.empty(0, dtype=float)
    return frame
