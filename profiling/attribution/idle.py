"""Idle, decomposed: why each idle ns of the breakdown was idle, and how late the host launched GPU work.

The idle set of a rank is what the breakdown's ``idle`` column totals: the time covered by none of the
partition's labels (``attribution.RankAttribution.label_sets``), here over the hull of the rank's attributed
windows and its work, so that a window's share of it is exactly that window's ``idle``. It splits into
:data:`IDLE_CAUSES`, disjoint sets whose per-window totals sum to the window's ``idle`` in integer ns
(asserted), and hence, with the other exclusive columns, to the step.

GPU ranks. The idle set is a sequence of gaps ``[a, b)`` (its maximal intervals: no stream of the rank runs
anything). Each gap is judged by the *next work*: the first GPU work row of the rank (kernel, copy, memset,
communication; not a ``sync`` marker) starting at or after ``b``, the one with the earliest launch among
those starting together. Its launch call is the CPU row of the rank with the same ``correlation`` whose name
is a launch API (:data:`LAUNCH_PATTERN`: ``cudaLaunchKernel``, ``cuLaunchKernelEx``, ``hipLaunchKernel``,
``cudaMemcpyAsync``, ``cudaMemsetAsync``, ``cudaGraphLaunch``, ... with any ``_vNNNN`` suffix; the earliest
such row of an id). A gap is

- *host-late* when that launch call had not returned when the gap began (``launch end > a``: it started after
  the GPU ran dry, or was still running then): the work that ran next had not been handed over yet (a call
  still running at ``a`` is the case ``launch <= a`` of the launch latency below). All of ``[a, b)`` is the
  host's, not only the part after
  the launch started: ``[a, launch)`` is the host not yet calling, and ``[launch, b)`` is the launch's own
  latency (the call and the submission), which is exposed only because nothing was queued behind the last
  work; both disappear together when the host runs far enough ahead (earlier launches, fewer launches, CUDA
  graphs), and the counterfactual "had it been launched before the GPU ran dry" removes the whole gap;
- *queued* when the launch call returned at or before ``a``: the work was already on its stream. It is
  *dependency* when a cross-stream wait was enqueued in front of it -- a ``cudaStreamWaitEvent`` /
  ``hipStreamWaitEvent`` / ``cuStreamWaitEvent`` call or a ``Stream Wait Event`` row (:data:`WAIT_PATTERN`)
  started after the launch of the previous work on the same stream and no later than this launch (a
  ``Stream Wait Event`` row names its stream and counts for that stream only; a runtime call names none and
  counts for any stream, unless a ``Stream Wait Event`` row with its correlation id names it). Otherwise it is
  *held*: nothing on the GPU side says why the queued work did not run. A held gap whose next work belongs to
  a whole graph (its launch call is a ``cudaGraphLaunch`` / ``hipGraphLaunch`` / ``cuGraphLaunch``,
  :data:`GRAPH_LAUNCH_PATTERN`) is judged as host-late: the graph was put on the stream long before, and with no
  stream of the rank running anything its node waited on something the host had not yet submitted (an event
  recorded outside the graph, a host node). Of any other held gap, the part from its start while the host was
  already blocked when the GPU ran dry (the blocking interval of ``S`` or ``D`` below holds the gap's start,
  up to where it ends) is the host's; the rest is launch latency or GPU-side scheduling and goes to other;
- *unknown* when the next work has no launch call in the trace (no correlation ids, no runtime rows) or
  there is no next work (idle at the end of the rank's work).

Host state. ``S``: the union, over all CPU threads of the rank, of the spans in which the host was blocked in
a synchronisation (:data:`SYNC_PATTERN`): ``cuda/hip{Stream,Device,Event}Synchronize``,
``cu{Stream,Ctx,Event}Synchronize``, the blocking ``cudaMemcpy`` / ``hipMemcpy`` / ``hipMemcpyWithStream``,
Kineto's ``cuda_sync`` rows ``Stream Sync`` / ``Event Sync`` / ``Context Sync`` (except those whose
correlation id is a non-blocking ``cuda/hip{Event,Stream}Query``, which Kineto also reports as ``Event Sync``),
and a blocking ``.item()`` (``aten::item``, ``aten::_local_scalar_dense``), and the launch call
(``cudaMemcpyAsync``, ...) of a copy whose GPU row moves pageable host memory (``memory_kind`` ``Pageable``): the
call stages the data through a bounce buffer and returns when the copy is done, so the host is blocked in it.
``D``: the spans of data loading
(:data:`DATALOADER_PATTERN`): torch's ``enumerate(DataLoader)#<Iter>.__next__`` and Lightning's fetch spans
``[_TrainingEpochLoop].train_dataloader_next``, ``[_EvaluationLoop].val_next`` / ``test_next``,
``[_PredictionLoop].predict_next`` (also the 1.x loop names without the underscore).

Precedence, per idle ns (the first that applies)::

    idle_dependency  in a queued gap with a cross-stream wait in front of its next work
    idle_sync        in a host-late or unknown gap, while the host was in S; in a held gap, from its start
                     while the host was still in the S interval it was in when the gap began
    idle_dataloader  the same for D (and not in S)
    idle_host_bound  in a host-late gap (the host was doing anything else: Python, CPU ops, launch calls)
    idle_other       the rest: held gaps the host was not blocked at, unknown gaps outside S and D

Launch evidence comes first because it says whether the host could have mattered at all: in a queued gap behind a
cross-stream wait the GPU held the work and the host's state is irrelevant; a held gap is the host's only where the
host was blocked from before the GPU ran dry (a synchronise that starts later, inside the gap, waits on work the
GPU already holds: a consequence, not the cause). Inside host-side gaps the host's state is read per ns, innermost
first: a synchronisation is a leaf call (often inside a data-loading span, e.g. a loader that calls ``.item()``),
data loading an outer span, and host-bound the remainder. So ``idle_sync`` is the GPU idle while the host waited (a
``.item()`` returning after its copy, a synchronise that drained the queue), not the Python the host ran after it
returned, which is host-bound.

CPU ranks (lanes ``cpu``): no launches, so no gaps to judge: ``idle_dataloader`` = idle ∩ D (the main thread
waiting for a loader's worker processes shows as idle inside ``__next__``) and ``idle_other`` the rest; the
other columns are 0.

Pipeline fill and drain, before all of the above (:func:`pipeline_bubble`, which the breakdown's ``bubble`` set
is made of). On a rank measured from receives matched with their sends in a pipeline
(``matching.pipelines.P2PPipeline``), the receive waits are bubble, and so is, per step window ``[lo, hi)``, the
stage's *fill* and *drain*: the idle of ``[lo, first pipeline message start)`` and ``[last pipeline message
end, hi)`` (a later stage idles before its first input, and after its last gradient leaves while the stages
upstream still drain). Order, per idle ns of those two regions (judged on the idle set the receive waits
leave, with the gap rules above):

    1. idle_sync, idle_dataloader, idle_host_bound   a host-blocking cause the rules above find stays idle
    2. bubble                                        the rest, up to the schedule's own share: the window's
                                                     bubble (waits included) reaches at most
                                                     ``floor(ideal_fraction x (hi - lo))`` (the closed form of
                                                     ``shardline.job.pipeline.theory``); fill and drain give
                                                     their parts nearest the pipeline's messages first, in
                                                     proportion to their sizes
    3. idle_dependency, idle_other                   what is left (the remainder still idle)

A queued gap's cross-stream wait (dependency) is no host cause: a stage's first forward queued behind the
receive of its input is exactly the fill. Taking part of a gap as bubble leaves the rest of it judged as
before (same next work, same launch, a later start only where the gap was queued), so the idle causes of the
breakdown split the remaining idle by the same rules.

Launch statistics (:func:`launch_stats`, per rank with work, over all its work rows): ``launches`` counts the
GPU work rows with a launch call, and ``launch_delay_*`` describe ``work start - launch call start`` (median,
90th percentile by linear interpolation, max; NaN / -1 without launches). ``kernels`` counts the GPU work
rows of a compute or communication category (not copies, memsets or sync markers) and ``short_kernels`` those
shorter than :data:`SHORT_KERNEL_NS` (10 µs); ``short_kernel_share`` = time(∪ short kernels) / ``busy_ns``,
time(∪ GPU work): the fraction of the GPU's busy time in which a short kernel runs (NaN without GPU work).
GPU-lane ``sync`` markers (``Stream Wait Event`` rows) are neither launches nor busy time.

Culprits (:func:`idle_culprits`): each piece of ``idle_sync``, ``idle_dataloader`` and ``idle_host_bound`` named by
the host call that blocked (the innermost blocking row over it; none for host-bound), the op around that call
(the outermost ``cpu_op`` inside the annotation) and the innermost ``user_annotation`` (``## sparse_data_dist ##``
-> ``aten::to`` -> ``cudaMemcpyAsync``), with its ns per step; :func:`pageable_idle` is the part of ``idle_sync``
under pageable copies' launch calls, what pinning those buffers gives back.

Integration: :func:`idle_causes` gives the columns of one rank aligned with its ``attributed_windows`` (the
rows of ``partition_columns``) and, given the partition's ``idle`` column, asserts the sum against it;
:func:`idle_sets` the cause interval sets themselves (for timelines); ``analyses.idle.idle_breakdown`` and
``analyses.idle.launch_stats`` the tables for a trace set. Everything is numpy over the rank's rows (per-category name
tables, sorted searches, interval-set arithmetic), no Python loop per event.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ..base import intervals as iv
from ..base.schema import COMM_CATEGORIES, codes_or_end, per_category_table
from ..table.kinds import Lane
from ..table.partition import LABELS
from ..table.rows import WORK_COLUMNS, in_table, label_sets, rank_selections

__all__ = ["CULPRIT_COLUMNS", "DATALOADER_PATTERN", "GRAPH_LAUNCH_PATTERN", "IDLE_CAUSES", "LAUNCH_PATTERN",
           "LAUNCH_STATS_COLUMNS", "NAMED_CAUSES", "SHORT_KERNEL_NS", "SYNC_PATTERN", "WAIT_PATTERN", "IdleRows",
           "empty_culprits", "idle_causes", "idle_culprits", "idle_sets", "pageable_idle", "pageable_launches",
           "pipeline_bubble", "rank_launch_stats"]

#: The idle columns, summing to ``idle`` per (rank, step); precedence in the module docstring.
IDLE_CAUSES = ("idle_host_bound", "idle_sync", "idle_dataloader", "idle_dependency", "idle_other")
#: A kernel shorter than this is short (launch overhead dominates it).
SHORT_KERNEL_NS = 10_000

_V = r"(?:_v\d+)?"
#: Runtime / driver calls that put work on a GPU stream (the launch of the row with their correlation id).
LAUNCH_PATTERN = rf"^(?:cuda|cu|hip)\w*(?:Launch|Memcpy|Memset)\w*?{_V}$"
#: The launch of a whole CUDA / HIP graph: its nodes run in the graph's own order, not when it was launched.
GRAPH_LAUNCH_PATTERN = rf"^(?:cuda|cu|hip)GraphLaunch\w*?{_V}$"
#: Host calls and spans blocked until the GPU caught up.
SYNC_PATTERN = (rf"^(?:(?:cuda|hip)(?:Stream|Device|Event|Thread)Synchronize|cu(?:Stream|Ctx|Event)Synchronize|"
                rf"cudaMemcpy|hipMemcpy|hipMemcpyWithStream){_V}$|^(?:Stream Sync|Event Sync|Context Sync)$|"
                r"^aten::(?:item|_local_scalar_dense)\b")
#: Non-blocking queries Kineto also reports as ``Event Sync`` rows (same correlation id).
_QUERY_PATTERN = rf"^(?:cuda|hip|cu)(?:Event|Stream)Query{_V}$"
#: A stream told to wait for an event recorded on another stream.
WAIT_PATTERN = rf"^(?:(?:cuda|hip|cu)StreamWaitEvent{_V}|Stream Wait Event)$"
_WAIT_ROW_PATTERN = r"^Stream Wait Event$"  # the kind that names the waiting stream
#: Data-loading spans: torch's DataLoader iterator, Lightning's fetch spans (2.x ``_Loop`` and 1.x names).
DATALOADER_PATTERN = (r"^enumerate\(DataLoader\)#\w+\.__next__$|"
                      r"^\[_?\w*Loop\]\.(?:train_dataloader|val|test|predict)_next$")

LAUNCH_STATS_COLUMNS = ("rank", "lanes", "launches", "launch_delay_median_ns", "launch_delay_p90_ns",
                        "launch_delay_max_ns", "kernels", "short_kernels", "short_kernel_ns", "busy_ns",
                        "short_kernel_share")
_KERNEL_CATEGORIES = ("compute", *COMM_CATEGORIES)
_PARTITION_LABELS = tuple(label for label in LABELS if label != "idle")
_NONE = np.iinfo(np.int64).max  # "no launch" in a launch-start array
#: Kineto's ``cat`` of the spans that name a host op's context: annotations (``record_function``), and ops.
_ANNOTATION_CATS = ("user_annotation",)
_OP_CATS = ("cpu_op",)


class IdleRows:
    """The columns and per-category name tables the decomposition reads, for the whole events table (built
    once per attribution and kept on it: ``Attribution.idle_rows``), and what it derives per rank, kept
    here: ``hosts`` (rank -> its launch, sync and wait rows) and ``sets`` (rank -> ``idle_sets``)."""

    def __init__(self, events: pd.DataFrame) -> None:
        self.start = events["start_ns"].to_numpy()
        self.dur = events["dur_ns"].to_numpy()
        self.stream = events["stream"].to_numpy()
        self.correlation = events["correlation"].to_numpy()
        self.name = codes_or_end(events["name"])
        self.lane = codes_or_end(events["lane"])
        self.category = codes_or_end(events["category"])
        self.cpu = in_table(events["lane"], (Lane.CPU.value,))
        self.kernel = in_table(events["category"], _KERNEL_CATEGORIES)
        self.sync_category = in_table(events["category"], ("sync",))
        self.memory_kind = codes_or_end(events["memory_kind"])
        self.pageable = in_table(events["memory_kind"], ("Pageable",))
        self.cat = codes_or_end(events["cat"])
        self.annotation = in_table(events["cat"], _ANNOTATION_CATS)
        self.cpu_op = in_table(events["cat"], _OP_CATS)
        self.names = events["name"]
        # One byte per name category: which of the patterns it matches (bit flags). Only the names that can
        # match one (their first characters say so) meet the patterns: a trace holds few of them.
        self.flags = per_category_table(events["name"], ("idle.flags",), _name_flags)
        self.selections = dict(rank_selections(events))
        self.hosts: dict[int, _Host] = {}
        self.sets: dict[int, dict[str, iv.IntervalSet]] = {}
        #: rank -> the sets of :data:`NAMED_CAUSES` the breakdown's ``idle_causes`` computed (what
        #: ``idle_culprits`` names; small next to the idle set, which the breakdown does not keep).
        self.named: dict[int, dict[str, iv.IntervalSet]] = {}


_LAUNCH, _SYNC, _QUERY, _WAIT, _WAIT_ROW, _DATALOADER, _GRAPH = (1 << bit for bit in range(7))
#: Every pattern above starts with one of these (a cheap filter before the regular expressions).
_PREFIXES = ("cu", "hip", "Stream ", "Event ", "Context ", "aten::item", "aten::_local_scalar_dense",
             "enumerate(DataLoader)", "[")


_FLAG_PATTERNS = [re.compile(p).match for p in (LAUNCH_PATTERN, SYNC_PATTERN, _QUERY_PATTERN, WAIT_PATTERN,
                                                _WAIT_ROW_PATTERN, DATALOADER_PATTERN, GRAPH_LAUNCH_PATTERN)]


def _name_flags(texts) -> np.ndarray:
    """Bit flags of each name (and a trailing 0 for a missing one): which of the patterns it matches."""
    flags = np.zeros(len(texts) + 1, dtype=np.uint8)
    for position, text in enumerate(texts):  # one iteration per distinct name
        if text.startswith(_PREFIXES):
            flags[position] = sum(1 << bit for bit, match in enumerate(_FLAG_PATTERNS) if match(text))
    return flags


def _table(attribution) -> IdleRows:
    return attribution.idle_rows


def _host(attribution, rank) -> _Host:
    table = _table(attribution)
    if rank.rank not in table.hosts:
        table.hosts[rank.rank] = _Host(table, table.selections[rank.rank])
    return table.hosts[rank.rank]


class _Host:
    """What one rank's rows say about its host: the launch start of each correlation id, the sync and data-
    loading sets, the stream-wait markers."""

    def __init__(self, table: IdleRows, selection) -> None:
        flags = table.flags[table.name[selection]]
        start, end = table.start[selection], table.start[selection] + table.dur[selection]
        corr, cpu = table.correlation[selection], table.cpu[table.lane[selection]]
        launch = cpu & ((flags & _LAUNCH) > 0) & (corr >= 0)
        ids, starts, ends, graph = corr[launch], start[launch], end[launch], (flags[launch] & _GRAPH) > 0
        order = np.lexsort((starts, ids))  # by id, then start: the first row of an id is its earliest
        ids, starts, ends, graph = ids[order], starts[order], ends[order], graph[order]
        first = np.flatnonzero(np.diff(ids, prepend=ids[:1] - 1))
        self.ids, self.launch_start, self.graph = ids[first], starts[first], graph[first]
        self.launch_end = ends[first]
        sync = np.flatnonzero((flags & _SYNC) > 0)
        queries = corr[((flags & _QUERY) > 0) & (corr >= 0)]
        sync = sync[~((corr[sync] >= 0) & np.isin(corr[sync], queries))]  # a query's "Event Sync" waited for nothing
        # A launch call whose GPU row copies from or to pageable host memory: it stages through a bounce
        # buffer and returns only when the copy is done, so the host is blocked in it like in a synchronise.
        gpu_pageable = ~cpu & table.pageable[table.memory_kind[selection]] & (corr >= 0)
        copies = np.flatnonzero(launch & np.isin(corr, np.unique(corr[gpu_pageable])))
        self.pageable = iv.union(start[copies], end[copies])
        self.sync = iv.merge(iv.union(start[sync], end[sync]), self.pageable)
        self.copies = copies
        self.blocking = np.concatenate([sync, copies])  # rows (positions in the selection) that block the host
        self.selection = selection
        loading = (flags & _DATALOADER) > 0
        self.dataloader = iv.union(start[loading], end[loading])
        self.loading = np.flatnonzero(loading)
        rows = (flags & _WAIT_ROW) > 0  # "Stream Wait Event": names the stream that waits
        calls = np.flatnonzero(((flags & _WAIT) > 0) & ~rows)
        named = corr[rows & (corr >= 0)]
        calls = calls[~((corr[calls] >= 0) & np.isin(corr[calls], named))]  # its row names the stream
        self.wait_any = np.sort(start[calls])
        self.wait_stream, self.wait_start = _sorted_by_stream(table.stream[selection][rows], start[rows])

    def launches(self, correlation: np.ndarray, *, graph: bool = False, end: bool = False) -> np.ndarray:
        """Launch-call start of each correlation id, ``_NONE`` where the rank has no launch call for it;
        ``end``: the call's end instead; ``graph``: whether that call launched a whole graph (False where there
        is none)."""
        out = np.full(len(correlation), False if graph else _NONE, dtype=bool if graph else np.int64)
        if not len(self.ids):
            return out
        slot = np.minimum(np.searchsorted(self.ids, correlation), len(self.ids) - 1)
        hit = (correlation >= 0) & (self.ids[slot] == correlation)
        out[hit] = (self.graph if graph else self.launch_end if end else self.launch_start)[slot[hit]]
        return out

    def waits_between(self, stream: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Per query: is there a stream-wait marker for ``stream`` (or for any stream) started in ``(lo, hi]``."""
        found = _count_in(self.wait_any, lo, hi) > 0
        for s in np.intersect1d(np.unique(stream), self.wait_stream):  # a handful of streams
            mine = stream == s
            lo_at, hi_at = np.searchsorted(self.wait_stream, s, "left"), np.searchsorted(self.wait_stream, s, "right")
            found[mine] |= _count_in(self.wait_start[lo_at:hi_at], lo[mine], hi[mine]) > 0
        return found


def _sorted_by_stream(stream: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((start, stream))
    return stream[order], start[order]


def _count_in(sorted_points: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """How many of ``sorted_points`` lie in ``(lo, hi]``, per query."""
    return np.searchsorted(sorted_points, hi, "right") - np.searchsorted(sorted_points, lo, "right")


def pipeline_bubble(attribution, rank, measured) -> iv.IntervalSet:
    """The bubble set of ``rank`` measured by ``measured`` (its ``matching.matched.RankPipeline``): its own
    ``bubble`` and, on a rank measured from matched p2p with ``steps``, the fill and drain of each step up to the
    schedule's share, after the host-blocking idle causes (module docstring)."""
    steps = getattr(measured, "steps", None)
    if steps is None or steps.empty:
        return measured.bubble
    table = _table(attribution)
    work = rank.work_positions
    sets = label_sets(rank.survey.table.take(work, WORK_COLUMNS), rank.lanes, bubble=measured.bubble)
    labelled = [sets[label] for label in LABELS if label in sets]
    step_no, lo, hi = rank.window_bounds
    points = np.concatenate([lo, hi, *[a for pair in labelled for a in pair]])
    if not len(points):
        return measured.bubble
    hull = iv.union([points.min()], [points.max()])
    before = iv.subtract(hull, iv.merge(*labelled))  # the idle set the receive waits leave
    host = _host(attribution, rank)
    if rank.lanes == Lane.GPU.value:
        causes = _gpu_causes(before, table, work, host)
        blocked = iv.merge(causes["idle_sync"], causes["idle_dataloader"], causes["idle_host_bound"])
    else:
        blocked = iv.intersect(before, host.dataloader)
    free = iv.subtract(before, blocked)
    higher = iv.merge(*[sets[label] for label in LABELS[:LABELS.index("bubble")] if label in sets])
    counted = iv.window_totals(iv.subtract(measured.bubble, higher), lo=lo, hi=hi)
    at = {int(s): k for k, s in enumerate(step_no.tolist())}
    pieces = [measured.bubble]
    for row in steps.itertuples(index=False):  # one iteration per step
        k = at.get(int(row.step))
        if k is None or not np.isfinite(row.ideal_fraction):
            continue
        a, b = int(lo[k]), int(hi[k])
        budget = int(np.floor(row.ideal_fraction * (b - a))) - int(counted[k])
        if budget <= 0:
            continue
        fill = iv.intersect(free, iv.union([a], [max(a, min(int(row.start_ns), b))]))
        drain = iv.intersect(free, iv.union([min(b, max(int(row.end_ns), a))], [b]))
        pieces += _nearest(fill, drain, budget)
    return iv.merge(*pieces)


def _nearest(fill: iv.IntervalSet, drain: iv.IntervalSet, budget: int) -> list[iv.IntervalSet]:
    """At most ``budget`` ns of ``fill`` and ``drain``: all of both when they fit, else each its share of the
    budget in proportion to its size, the fill's latest ns and the drain's earliest (nearest the messages)."""
    size_fill, size_drain = iv.total(fill), iv.total(drain)
    if size_fill + size_drain <= budget:
        return [fill, drain]
    keep_fill = budget * size_fill // (size_fill + size_drain)
    return [_last_ns(fill, keep_fill), _first_ns(drain, budget - keep_fill)]


def _first_ns(a: iv.IntervalSet, n: int) -> iv.IntervalSet:
    """The earliest ``n`` ns of ``a``."""
    starts, ends = a
    before = np.cumsum(ends - starts) - (ends - starts)  # ns of ``a`` before each interval
    keep = before < n
    return starts[keep], np.minimum(ends[keep], starts[keep] + (n - before[keep]))


def _last_ns(a: iv.IntervalSet, n: int) -> iv.IntervalSet:
    """The latest ``n`` ns of ``a``."""
    starts, ends = a
    after = iv.total(a) - np.cumsum(ends - starts)  # ns of ``a`` after each interval
    keep = after < n
    return np.maximum(starts[keep], ends[keep] - (n - after[keep])), ends[keep]


def idle_sets(attribution, rank) -> dict[str, iv.IntervalSet]:
    """The idle set of ``rank`` (key ``idle``) and its cause sets (keys :data:`IDLE_CAUSES`), disjoint, their
    union the idle set; over the hull of the rank's attributed windows and work (see the module docstring).
    Computed once per rank and kept on the attribution."""
    kept = _table(attribution).sets
    if rank.rank not in kept:
        kept[rank.rank] = _idle_sets(attribution, rank)
    return kept[rank.rank]


def _idle_sets(attribution, rank, *, other: bool = True) -> dict[str, iv.IntervalSet]:
    table = _table(attribution)
    work = rank.work_positions
    if not len(work) and not len(rank.window_bounds[0]):
        return {"idle": iv.EMPTY, **{cause: iv.EMPTY for cause in IDLE_CAUSES}}
    idle = rank.idle_set  # the partition's own idle segments, over the hull of the windows and the work
    host = _host(attribution, rank)
    sets = {cause: iv.EMPTY for cause in IDLE_CAUSES}
    if rank.lanes == Lane.GPU.value:
        sets.update(_gpu_causes(idle, table, work, host))
    else:
        sets["idle_dataloader"] = iv.intersect(idle, host.dataloader)
    if other:  # the rest of the idle set (idle_causes takes its total as the difference instead)
        sets["idle_other"] = iv.subtract(idle, iv.merge(*(sets[c] for c in IDLE_CAUSES if c != "idle_other")))
    return {"idle": idle, **sets}


def _gpu_causes(idle: iv.IntervalSet, table: IdleRows, work: np.ndarray, host: _Host) -> dict[str, iv.IntervalSet]:
    """The cause sets of a GPU rank's idle gaps but ``idle_other`` (the rest, taken by the caller)."""
    gap_start, gap_end = idle
    if not len(host.ids):  # no launch call in the trace: every gap is unknown (judged by the host state alone)
        sync = iv.intersect(idle, host.sync)
        return {"idle_dependency": iv.EMPTY, "idle_sync": sync,
                "idle_dataloader": iv.subtract(iv.intersect(idle, host.dataloader), sync), "idle_host_bound": iv.EMPTY}
    candidates = work[~table.sync_category[table.category[work]]]
    start = table.start[candidates]
    launch = host.launches(table.correlation[candidates])
    order = np.lexsort((launch, start))  # by start; among equal starts the earliest launch first
    start, launch, candidates = start[order], launch[order], candidates[order]
    nxt = np.searchsorted(start, gap_end, "left")
    has_next = nxt < len(start)
    nxt = np.minimum(nxt, max(len(start) - 1, 0))
    next_launch = launch[nxt] if len(start) else np.full(len(gap_end), _NONE, dtype=np.int64)
    known = has_next & (next_launch != _NONE)
    # Late: the launch call had not returned when the GPU ran dry (it began after, or was still running).
    next_end = host.launches(table.correlation[candidates], end=True)[nxt] if len(start) else next_launch
    late = known & (next_end > gap_start)
    queued = np.flatnonzero(known & ~late)
    dependency = np.zeros(len(gap_start), dtype=bool)
    if len(queued):
        stream = table.stream[candidates]
        previous = _previous_launch_on_stream(stream, launch)
        k = nxt[queued]
        dependency[queued] = host.waits_between(stream[k], previous[k], launch[k])
    held = known & ~late & ~dependency  # queued, and nothing on the GPU side says why it did not run
    if held.any():
        # A graph's node queued long ago, every stream of the rank idle: it waited on something the host had
        # not yet submitted (an event recorded outside the graph, a host node), so the host's state decides.
        in_graph = held & host.launches(table.correlation[candidates], graph=True)[nxt]
        held &= ~in_graph
        late |= in_graph
    host_side = (gap_start[late | ~known], gap_end[late | ~known])
    held_gaps = (gap_start[held], gap_end[held])
    sync = (iv.merge(iv.intersect(host_side, host.sync), _blocked_from_start(held_gaps, host.sync))
            if len(host.sync[0]) else iv.EMPTY)
    loading = (iv.subtract(iv.merge(iv.intersect(host_side, host.dataloader),
                                    _blocked_from_start(held_gaps, host.dataloader)), sync)
               if len(host.dataloader[0]) else iv.EMPTY)
    late_gaps = (gap_start[late], gap_end[late])
    blocked = iv.merge(sync, loading)
    return {"idle_dependency": (gap_start[dependency], gap_end[dependency]), "idle_sync": sync,
            "idle_dataloader": loading,
            "idle_host_bound": iv.subtract(late_gaps, blocked) if len(blocked[0]) else late_gaps}


def _blocked_from_start(gaps: iv.IntervalSet, blocked: iv.IntervalSet) -> iv.IntervalSet:
    """Of each gap ``[a, b)``, ``[a, min(b, e))`` where the interval ``[s, e)`` of ``blocked`` (a union: disjoint,
    sorted) holds ``a`` (``s <= a < e``): the host was already blocked when the GPU ran dry, until it returned."""
    a, b = gaps
    starts, ends = blocked
    if not len(a) or not len(starts):
        return iv.EMPTY
    k = np.searchsorted(starts, a, "right") - 1
    hit = k >= 0
    hit[hit] = ends[k[hit]] > a[hit]
    return a[hit], np.minimum(b[hit], ends[k[hit]])


def _previous_launch_on_stream(stream: np.ndarray, launch: np.ndarray) -> np.ndarray:
    """Per row: the launch start of the previous launched row on its stream (launch order), else int64 min."""
    out = np.full(len(stream), np.iinfo(np.int64).min, dtype=np.int64)
    known = np.flatnonzero(launch != _NONE)
    order = known[np.lexsort((launch[known], stream[known]))]
    same = stream[order][1:] == stream[order][:-1]
    out[order[1:][same]] = launch[order][:-1][same]
    return out


def idle_causes(attribution, rank, *,
                idle: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per attributed window of ``rank`` (the rows of ``rank.partition_columns()``, in that order): the ns of
    each cause of :data:`IDLE_CAUSES` (int64). Their sum is the window's idle, checked against ``idle`` (the
    partition's ``idle`` column of this rank) when given: ``AssertionError`` if not equal."""
    _, lo, hi = rank.window_bounds  # the arrays of ``attributed_windows``, without building its frame
    sets = _idle_sets(attribution, rank, other=False)  # not kept whole: the breakdown needs only the totals
    _table(attribution).named[rank.rank] = {cause: sets[cause] for cause in NAMED_CAUSES}  # for idle_culprits
    zero = np.zeros(len(lo), dtype=np.int64)
    out = {cause: iv.window_totals(sets[cause], lo=lo, hi=hi) if len(sets[cause][0]) else zero
           for cause in IDLE_CAUSES if cause != "idle_other"}
    measured = iv.window_totals(sets["idle"], lo=lo, hi=hi)
    # The causes are disjoint subsets of the idle set (by construction), so the rest of it is other.
    out["idle_other"] = measured - np.sum(list(out.values()), axis=0, dtype=np.int64)
    total = measured if idle is None else np.asarray(idle, dtype=np.int64)
    parts = np.sum([out[cause] for cause in IDLE_CAUSES], axis=0, dtype=np.int64)
    if not np.array_equal(parts, total) or (out["idle_other"] < 0).any():
        raise AssertionError(f"rank {rank.rank}: idle causes {parts.tolist()[:5]} do not sum to idle "
                             f"{total.tolist()[:5]}")
    return out


def rank_launch_stats(attribution, rank) -> tuple:
    """One row of ``analyses.idle.launch_stats`` (``LAUNCH_STATS_COLUMNS``): ``rank``'s launch delays and
    short kernels."""
    if rank.lanes != Lane.GPU.value:
        return rank.rank, rank.lanes, 0, np.nan, np.nan, -1, 0, 0, 0, 0, np.nan
    table = _table(attribution)
    work = rank.work_positions
    work = work[~table.sync_category[table.category[work]]]  # sync markers: neither launched nor busy
    start, end = table.start[work], table.start[work] + table.dur[work]
    launch = _host(attribution, rank).launches(table.correlation[work])
    launched = launch != _NONE
    delay = start[launched] - launch[launched]
    if len(delay):
        median, p90 = np.percentile(delay, [50, 90])
        longest = int(delay.max())
    else:
        median, p90, longest = np.nan, np.nan, -1
    kernel = table.kernel[table.category[work]]
    short = kernel & (end - start < SHORT_KERNEL_NS)
    busy = iv.total(iv.union(start, end))
    short_ns = iv.total(iv.union(start[short], end[short]))
    return (rank.rank, rank.lanes, int(launched.sum()), float(median), float(p90), longest, int(kernel.sum()),
            int(short.sum()), short_ns, busy, short_ns / busy if busy else np.nan)


#: The idle causes a host call explains, in the order their culprits are named (``idle_culprits``).
NAMED_CAUSES = ("idle_sync", "idle_dataloader", "idle_host_bound")
CULPRIT_COLUMNS = ("rank", "step", "cause", "call", "op", "annotation", "thread", "pageable", "idle_ns", "gaps")
_STEP_MARK = "ProfilerStep#"


def idle_culprits(attribution, rank) -> pd.DataFrame:
    """The host calls behind ``rank``'s host-blocked idle: per (step, cause of :data:`NAMED_CAUSES`, call, op,
    annotation) the ns of that cause's set (``idle_sets``) in the step window, and in how many pieces (``gaps``);
    columns :data:`CULPRIT_COLUMNS`. Each piece (a maximal interval of the cause's set inside a window) is named
    at its midpoint, on one host thread:

    - ``call``: for ``idle_sync`` the innermost blocking row covering it (a synchronise, ``.item()``, a
      pageable copy's launch call: ``pageable`` True), for ``idle_dataloader`` the data-loading span; for
      ``idle_host_bound`` empty (the host was not blocked, it was busy), its thread the one that launched most;
    - ``annotation``: the innermost ``user_annotation`` of that thread covering it (not ``ProfilerStep#``, not
      the call itself: a data-loading span is one);
    - ``op``: the outermost ``cpu_op`` of that thread covering it (and the call) that starts inside the
      annotation: what the code called (``aten::to`` around the ``cudaMemcpyAsync`` of a pageable copy).

    "" where no row says. A CPU rank has only ``idle_dataloader`` pieces to name. Reads the cause sets the
    breakdown kept (``IdleRows.named``) rather than partitioning the rank again."""
    sets = {cause: cause_set(attribution, rank, cause) for cause in NAMED_CAUSES}
    step_no, lo, hi = rank.window_bounds
    if not len(lo):
        return _culprit_frame([])
    table, host = _table(attribution), _host(attribution, rank)
    sel = host.selection
    start = table.start[sel]
    end = start + table.dur[sel]
    cpu = table.cpu[table.lane[sel]]
    thread = table.stream[sel]
    names = np.asarray(table.names.cat.categories, dtype=object)
    name = np.append(names, "")[table.name[sel]]
    cat = table.cat[sel]
    step_mark = np.array([str(n).startswith(_STEP_MARK) for n in names] + [False])[table.name[sel]]
    annotations = np.flatnonzero(cpu & table.annotation[cat] & ~step_mark)
    ops = np.flatnonzero(cpu & table.cpu_op[cat])
    launching = np.flatnonzero(cpu & ((table.flags[table.name[sel]] & _LAUNCH) > 0))
    busiest = int(pd.Series(thread[launching]).mode().iloc[0]) if len(launching) else None
    parts = []
    for cause in NAMED_CAUSES:
        if not len(sets[cause][0]):
            continue
        calls = {"idle_sync": host.blocking, "idle_dataloader": host.loading}.get(cause, np.empty(0, np.int64))
        for k in range(len(lo)):  # one iteration per step window
            a, b = iv.intersect(sets[cause], iv.union([lo[k]], [hi[k]]))
            if not len(a):
                continue
            near = {kind: found[(start[found] < b[-1]) & (end[found] > a[0])]  # what can cover a piece here
                    for kind, found in (("calls", calls), ("notes", annotations), ("ops", ops))}
            mid = (a + b) // 2
            call = _pick(near["calls"], start, end, mid, mid + 1, inner=True)
            named = call >= 0
            fallback = busiest if cause == "idle_host_bound" and busiest is not None else _NO_THREAD
            on = np.where(named, thread[np.maximum(call, 0)], fallback)
            note, op = np.full(len(a), -1, np.int64), np.full(len(a), -1, np.int64)
            for t in np.unique(on[on != _NO_THREAD]).tolist():  # a handful of threads
                q = on == t
                note[q] = _pick(near["notes"][thread[near["notes"]] == t], start, end, mid[q], mid[q] + 1,
                                inner=True, exclude=call[q])
                floor = np.where(note[q] >= 0, start[np.maximum(note[q], 0)], np.iinfo(np.int64).min)
                lo_at = np.where(named[q], start[np.maximum(call[q], 0)], mid[q])
                hi_at = np.where(named[q], end[np.maximum(call[q], 0)], mid[q] + 1)
                op[q] = _pick(near["ops"][thread[near["ops"]] == t], start, end, lo_at, hi_at, inner=False,
                              floor=floor)
            parts.append(pd.DataFrame({
                "rank": rank.rank, "step": int(step_no[k]), "cause": cause, "call": _names(name, call),
                "op": _names(name, op), "annotation": _names(name, note), "thread": np.where(on == _NO_THREAD, -1, on),
                "pageable": named & np.isin(call, host.copies), "idle_ns": b - a}))
    return _culprit_frame(pd.concat(parts, ignore_index=True) if parts else [])


_NO_THREAD = np.iinfo(np.int64).min
_CHUNK = 1024  # queries per block of the cover matrix (queries x candidate rows)


def _names(name: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return np.where(rows >= 0, name[np.maximum(rows, 0)], "") if len(name) else np.full(len(rows), "", object)


def _pick(candidates: np.ndarray, start: np.ndarray, end: np.ndarray, lo_q: np.ndarray, hi_q: np.ndarray, *,
          inner: bool, floor: np.ndarray | None = None, exclude: np.ndarray | None = None) -> np.ndarray:
    """Per query ``i``: the row of ``candidates`` covering ``[lo_q[i], hi_q[i])`` (starting at or after
    ``floor[i]``, not ``exclude[i]``): ``inner``, the one starting last (the shortest among those), else the one
    starting first (the longest among those); -1 where none does."""
    out = np.full(len(lo_q), -1, dtype=np.int64)
    if not len(candidates) or not len(lo_q):
        return out
    s, e = start[candidates][None, :], end[candidates][None, :]
    d = e - s
    low, high = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    for c in range(0, len(lo_q), _CHUNK):  # blocks of queries: bounded memory
        at = slice(c, c + _CHUNK)
        cover = (s <= lo_q[at, None]) & (e >= hi_q[at, None])
        if floor is not None:
            cover &= s >= floor[at, None]
        if exclude is not None:
            cover &= candidates[None, :] != exclude[at, None]
        if inner:
            best = np.where(cover, s, low).max(axis=1)
            pick = np.where(cover & (s == best[:, None]), d, high).argmin(axis=1)
        else:
            best = np.where(cover, s, high).min(axis=1)
            pick = np.where(cover & (s == best[:, None]), d, low).argmax(axis=1)
        out[at] = np.where(cover.any(axis=1), candidates[pick], -1)
    return out


def empty_culprits() -> pd.DataFrame:
    """A zero-row table of :data:`CULPRIT_COLUMNS`."""
    return _culprit_frame([])


def _culprit_frame(rows) -> pd.DataFrame:
    """Culprit pieces (a frame, or a list of rows) summed per (rank, step, cause, call, op, annotation)."""
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows, columns=[c for c in CULPRIT_COLUMNS
                                                                                    if c != "gaps"])
    frame = frame.astype({"rank": np.int64, "step": np.int64, "thread": np.int64, "pageable": bool,
                          "idle_ns": np.int64})
    keys = [c for c in CULPRIT_COLUMNS if c not in ("idle_ns", "gaps")]
    grouped = frame.groupby(keys, sort=False, dropna=False)["idle_ns"].agg(["sum", "size"]).reset_index()
    grouped = grouped.rename(columns={"sum": "idle_ns", "size": "gaps"}).astype({"idle_ns": np.int64, "gaps": np.int64})
    return grouped.sort_values(["rank", "step", "idle_ns"], ascending=[True, True, False],
                               kind="stable").reset_index(drop=True)[list(CULPRIT_COLUMNS)]


def cause_set(attribution, rank, cause: str) -> iv.IntervalSet:
    """``rank``'s idle set of ``cause`` (a key of :data:`IDLE_CAUSES`): for :data:`NAMED_CAUSES` the one the
    breakdown kept, without partitioning the rank again; else from :func:`idle_sets`."""
    named = _table(attribution).named.get(rank.rank)
    if named is not None and cause in named:
        return named[cause]
    return idle_sets(attribution, rank)[cause]


def pageable_idle(attribution, rank) -> iv.IntervalSet:
    """The part of ``rank``'s ``idle_sync`` set while its host was blocked in the launch call of a copy from or to
    pageable host memory: the GPU idle those copies cost (what pinning the buffers would give back)."""
    sync = cause_set(attribution, rank, "idle_sync")
    return iv.intersect(sync, _host(attribution, rank).pageable) if len(sync[0]) else iv.EMPTY


def pageable_launches(attribution, rank) -> int:
    """How many launch calls of ``rank`` put a copy from or to pageable memory on the GPU (0 where the trace has
    no runtime rows for them: then whether the host was blocked is not in the trace)."""
    return int(len(_host(attribution, rank).copies))
