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
(``p2p.match_p2p``; for one rank's trace an estimate from message size and link bandwidth) and, in a matched
pipeline, the stage's fill and drain up to the schedule's share (``idle.pipeline_bubble``). It ranks above p2p
because a pipeline recv kernel spinning for its peer is bubble, not transfer. The columns of
``EXCLUSIVE_COLUMNS`` sum to ``step_ns`` exactly in integer ns (asserted).

``idle`` is split by cause into ``idle_host_bound``, ``idle_sync``, ``idle_dataloader``, ``idle_dependency`` and
``idle_other`` (``idle.IDLE_CAUSES``, rules in ``attribution.idle``), which sum to ``idle`` exactly, so
with the other exclusive columns to the step; ``EXCLUSIVE_COLUMNS`` keeps the one ``idle``.

Alongside: ``overlapped_<comm>`` = time(comm_c ∩ compute); ``comm_ns`` = time(∪ comm) and
``overlap_ratio`` = time(compute ∩ ∪comm) / time(∪comm) (HTA's definition; NaN without communication);
``pageable_memcpy_ns`` = time with an H2D/D2H copy from/to pageable host memory running (the slow, blocking
kind of offload traffic; ``memory_kind == "Pageable"``).

One object per trace set. ``attribute(traceset)`` takes the trace set's one ``table.survey.Survey`` (the events
table checked and, when it is not yet, classified once, with the layout the trace set was loaded with or the one
given; each rank's work rows and lane kind, step windows and pipeline annotation rows) and returns the one
:class:`Attribution` over it, so every later call gets the same object. It computes, on first use and then
keeps, each rank's bubble set (``matching.pipelines``), label sets and the breakdown. Every analysis (``comm_by_dim``,
``collectives``, ``bubbles``) and every output (reports, TensorBoard, the merged trace, the ``StepProfiler``
callback, the CLI) reads these; none derives them again from the raw table.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np
import pandas as pd

from ..base import intervals as iv
from ..base.errors import TraceWarning
from ..base.schema import COMM_CATEGORIES
from ..matching.matched import Matching, matching_of
from ..matching.pipelines import rank_pipelines
from ..table.partition import (
    EXCLUSIVE_COLUMNS,
    LABELS,
    OVERLAP_COLUMNS,
    partition,
    partition_columns,
    segment_owners,
)
from ..table.rows import WORK_COLUMNS, in_table, is_in, label_sets
from ..table.survey import RankSurvey, Survey, surveyed
from .idle import IDLE_CAUSES, IdleRows, idle_causes, pipeline_bubble

T = TypeVar("T")

__all__ = ["EXCLUSIVE_COLUMNS", "LABELS", "OVERLAP_COLUMNS", "Attribution", "RankAttribution", "attribute",
           "breakdown", "comm_by_dim", "empty_breakdown", "in_table", "is_in", "partition", "partition_columns",
           "per_rank_work", "segment_owners"]

_NOTHING = "nothing to attribute: the events table has no work events on any rank"


def attribute(source, *, layout: Mapping[str, int] | None = None, caller: str = "attribute") -> Attribution:
    """The :class:`Attribution` of ``source`` (a ``TraceSet``, an events table, an ``Attribution`` or its
    ``Survey``): the one over ``table.survey.surveyed(source, layout=layout, caller=caller)`` (see there for
    ``layout``, the classification and the errors), so a trace set has one per layout."""
    survey = surveyed(source, layout=layout, caller=caller)
    return survey.attribution if survey.attribution is not None else Attribution(survey)


class Attribution:
    """One trace set's survey (``survey``, a ``table.survey.Survey``), its matching (``matching``, a
    ``matching.matched.Matching``) and everything attribution derives from them (see the module docstring).
    Build it with :func:`attribute`; ``events`` is the classified table (not to be modified), ``layout`` the
    dims it was classified with (or None).

    ``ranks``: every rank of the table, in rank order (a :class:`RankAttribution` each); ``working``: those
    with work to attribute. ``metadata``: the trace set's metadata (``TraceSet.metadata``; empty for a table).
    ``breakdown``: the per-(rank, step) partition, computed on first use and kept. ``matching``: the survey's
    own, or one given (``scale``: ``Matching(pipelines=...)``, the bubbles measured elsewhere, whose warnings
    were given there). ``idle_rows``: what the idle-cause rules read, built once. :meth:`derived`: an analysis
    above this floor computed once per attribution.
    """

    def __init__(self, survey: Survey, *, matching: Matching | None = None) -> None:
        self.survey = survey
        if survey.attribution is None and matching is None:
            survey.attribution = self
        self.matching = matching_of(survey, caller="Attribution")[1] if matching is None else matching
        self._derived: dict = {}

    # The survey's fields, read through (one object per trace set either way).
    events = property(lambda self: self.survey.events)
    layout = property(lambda self: self.survey.layout)
    files = property(lambda self: self.survey.files)
    metadata = property(lambda self: self.survey.metadata)
    timings = property(lambda self: self.survey.timings)
    contexts = property(lambda self: self.survey.contexts)

    def __repr__(self) -> str:
        return f"Attribution({len(self.events)} events, ranks={[r.rank for r in self.ranks]}, layout={self.layout})"

    @functools.cached_property
    def ranks(self) -> tuple[RankAttribution, ...]:
        return tuple(RankAttribution(rank, pipelines=self._pipelines, attribution=self) for rank in self.survey.ranks)

    def _pipelines(self):
        """``pipelines.rank_pipelines`` of this attribution's matching: what each rank's bubble set is taken
        from."""
        return rank_pipelines(self)[0]

    @property
    def working(self) -> tuple[RankAttribution, ...]:
        return tuple(r for r in self.ranks if r.has_work)

    def rank(self, rank: int) -> RankAttribution:
        self.survey.rank(rank)  # AttributionError naming the ranks there are
        return next(r for r in self.ranks if r.rank == rank)

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

    @functools.cached_property
    def idle_rows(self) -> IdleRows:
        """The columns the idle-cause rules read (``idle.IdleRows``), built once."""
        return IdleRows(self.events)

    def derived(self, analysis: Callable[..., T], *args, **inputs) -> T:
        """``analysis(self, *args, **inputs)`` computed the first time ``analysis`` is asked for with these
        ``args`` (hashable; ``inputs`` are passed but do not tell one result from another), the kept value
        afterwards: an analysis of a floor above (critical path, what-if context, report sections), which this
        one cannot name, kept once per attribution so every output of a trace set shows the same."""
        key = (analysis, *args)
        if key not in self._derived:
            self._derived[key] = analysis(self, *args, **inputs)
        return self._derived[key]


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
    notes += rank_pipelines(attribution)[1]  # the p2p pipeline inference's warnings (given ones: none here)
    if not rows:
        # An execution trace, a memory timeline or an init-only NCCL log loads fine but holds no timed work:
        # the user gets the (empty) table with a warning rather than an exception.
        return empty_breakdown(), (_NOTHING,)
    # One frame from the joined columns (every rank has the same ones); a frame per rank and a concat would
    # pay pandas' per-frame overhead once per rank.
    return pd.DataFrame({column: np.concatenate([r[column] for r in rows]) for column in rows[0]}), notes


class RankAttribution:
    """One rank of an :class:`Attribution`: its survey (``survey``, a ``table.survey.RankSurvey``, whose fields
    -- ``rank``, ``lanes``, ``work()``, ``windows``, ``attributed_windows``, ``window_bounds``, ``window_note``,
    ``pipeline``, ``pp_rows`` ... -- it reads through) and what the breakdown adds: the bubble set, the label
    sets and the partition, computed on first use and kept.
    """

    def __init__(self, survey: RankSurvey, *, pipelines=None, attribution=None) -> None:
        self.survey = survey
        self._pipelines = pipelines
        self._attribution = attribution

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "survey":
            raise AttributeError(name)
        return getattr(self.survey, name)

    def __repr__(self) -> str:
        return repr(self.survey).replace("RankSurvey(", "RankAttribution(", 1)

    @functools.cached_property
    def bubble(self) -> iv.IntervalSet:
        """The pipeline bubble set of the method ``pipelines.rank_pipelines`` measures this rank with (``sl:pp``
        annotations, torch.distributed.pipelining's names, or its receive waits and, in a matched pipeline, its
        fill and drain: ``idle.pipeline_bubble``); empty without a pipeline."""
        measured = self._pipelines().get(self.rank) if self._pipelines is not None else None
        if measured is None:
            return iv.EMPTY
        return measured.bubble if self._attribution is None else pipeline_bubble(self._attribution, self, measured)

    @functools.cached_property
    def label_sets(self) -> dict[str, iv.IntervalSet]:
        """Interval set of every non-idle label (before the priority partition), plus ``pageable_memcpy``."""
        work = self.survey.table.take(self.work_positions, WORK_COLUMNS)
        return label_sets(work, self.lanes, bubble=self.bubble)

    def partition_columns(self) -> dict[str, np.ndarray]:
        """The breakdown columns of this rank (``partition.partition_columns`` of its sets and windows); keeps
        the idle set the partition leaves (``idle_set``)."""
        steps, starts, ends = self.window_bounds
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

    columns = ["rank", "step", "lanes", "start_ns", "end_ns", "step_ns", *LABELS, *OVERLAP_COLUMNS, "comm_ns",
               "pageable_memcpy_ns", *IDLE_CAUSES]
    frame = pd.DataFrame({c: np.empty(0, dtype=np.int64) for c in columns})
    frame["lanes"] = frame["lanes"].astype(str)
    frame["overlap_ratio"] = np.empty(0, dtype=float)
    return frame


def per_rank_work(source, keep, *, columns, categories=None, caller: str = "report_sections"):
    """``keep(work)`` of each rank's attributed work rows (only ``columns``; only ``categories`` when given),
    concatenated: one rank's rows are materialised at a time, so a large trace set costs its events table plus
    one rank, never a second copy of everything."""

    frames = [keep(rank.work(columns, categories=categories))
              for rank in attribute(source, caller=caller).working]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else None
