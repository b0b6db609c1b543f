"""The per-rank survey's row work: which rows of the events table are work and on which lanes, the step
windows, and the label interval sets (the rules are in ``attribution.core``'s docstring); ``survey`` keeps
them per rank.

Everything runs on numpy arrays: views of the table's columns, category codes for the categoricals, and
per-category lookup tables (``schema.per_category_table``) indexed with the codes, so nothing is computed
per row as a string.
"""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd

import shardline.job.annotations as contract

from ..base import intervals as iv
from ..base.schema import (
    COMM_CATEGORIES,
    category_texts,
    codes_or_end,
    per_category_table,
    step_numbers,
)
from .kinds import Lane
from .names import match_table
from .partition import LABELS

# Source categories that mark spans rather than work (Kineto current and 2021 legacy, Nsight NVTX).
ANNOTATION_CATS = frozenset({"user_annotation", "gpu_user_annotation", "python_function", "Trace", "ac2g",
                             "fwdbwd", "overhead", "cuda_runtime", "cuda_driver", "Runtime", "python", "nvtx",
                             "cpu_instant_event", "async", "flow"})
_ANNOTATION_NAME_RE = r"^(ProfilerStep#\d+|sl:pp:|nccl:|gloo:|ucc:|mpi:|sl:comm:)"
_CPU_OP_CATS = frozenset({"cpu_op", "Operator", "user_annotation"})
PP_PREFIX = f"{contract.PREFIX}:pp:"  # the pattern bubbles selects its rows with


def is_in(column: pd.Series, values) -> np.ndarray:
    """Boolean mask: is each value of a categorical column (as text) in ``values``; computed on the
    categories and broadcast through the codes, never on a string per row. A missing value is in nothing."""
    return in_table(column, values)[codes_or_end(column)]


def in_table(column: pd.Series, values) -> np.ndarray:
    """``is_in`` per category (one extra trailing False for a missing value), to index with codes."""
    wanted = frozenset(values)
    return per_category_table(column, ("is_in", wanted),
                              lambda texts: np.array([t in wanted for t in texts] + [False], dtype=bool))


def rank_selections(events: pd.DataFrame):
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
        self.pipeline = match_table(name, PP_PREFIX)  # the pattern bubbles selects its rows with
        self.step_no = per_category_table(name, ("step_no",), _step_table)
        self.step_marked = self.step_no >= 0
        self.code_of = {text: i for i, text in enumerate(category_texts(category.cat.categories))}


class _Lookup:
    """A per-row array of ``Rows``: the ``_Tables`` entry of the same name indexed with the rows' codes of
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


class Rows:
    """The columns attribution reads, as numpy arrays: views of an events table's columns (category codes for
    the categoricals), taken per rank and per work selection. Row masks come from the per-category tables
    as they are needed, so nothing per row is computed for the whole table at once (its memory stays that
    of one rank's rows)."""

    def __init__(self, columns: dict[str, np.ndarray], tables: _Tables) -> None:
        self.columns = columns
        self.tables = tables
        self.__dict__.update(columns)

    @classmethod
    def of(cls, events: pd.DataFrame) -> Rows:
        columns = {"start": events["start_ns"].to_numpy(), "dur": events["dur_ns"].to_numpy(),
                   "step": events["step"].to_numpy(), "stream": events["stream"].to_numpy(),
                   "correlation": events["correlation"].to_numpy()}
        columns.update((key, codes_or_end(events[key])) for key in ("lane", "cat", "name", "category",
                                                                     "memory_kind"))
        return cls(columns, _Tables(events))

    def take(self, selection, columns=None) -> Rows:
        """These rows at ``selection`` (a slice, positions or a boolean mask); ``columns``: only these."""
        return Rows({key: values[selection] for key, values in self.columns.items()
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
        gpu = self.work_on(Lane.GPU.value)
        if gpu.any():
            return gpu, Lane.GPU.value
        return self.work_on(Lane.CPU.value), Lane.CPU.value

    def work_on(self, lanes: str) -> np.ndarray:
        """Mask of the rows that are work on that lane kind: GPU rows but annotations; on the CPU, ops and the
        communication annotations (gloo:* / nccl:* / sl:comm:*)."""
        t = self.tables
        if lanes == Lane.GPU.value:
            return self.lane_gpu & ~t.annotation_cat[self.cat] & ~t.annotation_name[self.name]
        return (self.lane_cpu & ~t.step_marker[self.name]
                & (t.cpu_op_cat[self.cat] | (self.comm & t.comm_op_cat[self.cat])))


#: What the work rows' label sets and windows read.
WORK_COLUMNS = ("start", "dur", "step", "stream", "category", "memory_kind")


def _step_table(texts: list[str]) -> np.ndarray:
    """``schema.step_numbers`` per category, one extra -1 for a missing value."""
    return np.append(step_numbers(texts), -1)


_NO_WINDOWS = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))


def rank_windows(rows: Rows, *, lanes: str, work: Rows) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray],
                                                                  str | None]:
    """(step, start, end) of one rank's windows, sorted by step (see the module docstring), and the note to
    warn with when the GPU step annotations failed ``check_gpu_steps`` and were replaced (else None).
    ``work`` needs ``start``, ``dur``, ``step`` and ``correlation``."""
    marked = rows.step_marked
    gpu, cpu = Lane.GPU.value, Lane.CPU.value
    for lane_kind in ((lanes, cpu) if lanes == gpu else (cpu,)):
        if lane_kind == cpu and lanes == gpu:
            from_work = _gpu_work_steps(work.step, work.start, work.end)
            if len(from_work[0]):
                return from_work, None
        sel = marked & (rows.lane_gpu if lane_kind == gpu else rows.lane_cpu)
        if sel.any():
            # Several markers of one step (e.g. one per stream) are joined to their hull.
            windows = _hulls(rows.tables.step_no[rows.name[sel]], rows.start[sel], rows.start[sel] + rows.dur[sel])
            if lane_kind == gpu:
                return check_gpu_steps(windows, rows, work)
            return windows, None
    return _NO_WINDOWS, None


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


def launched_steps(rows: Rows, work: Rows) -> np.ndarray:
    """Per work row: the step of the CPU call that launched it (the CPU-lane row with its correlation id, in a
    CPU ``ProfilerStep#N``; the first such row of an id), else -1. Unlike the reader's ``step`` this never
    falls back to a GPU-side window, so it can judge those windows."""
    out = np.full(len(work.start), -1, dtype=np.int64)
    launch = rows.lane_cpu & (rows.correlation >= 0) & (rows.step >= 0)
    if not launch.any() or not len(out):
        return out
    ids, first = np.unique(rows.correlation[launch], return_index=True)
    steps = rows.step[launch][first]
    slot = np.minimum(np.searchsorted(ids, work.correlation), len(ids) - 1)
    hit = (work.correlation >= 0) & (ids[slot] == work.correlation)
    out[hit] = steps[slot[hit]]
    return out


def check_gpu_steps(annotated, rows: Rows, work: Rows):
    """The GPU-side ``ProfilerStep#N`` windows ``annotated``, checked against the kernels each CPU step launched
    (``launched_steps``); ``(windows, None)`` when they hold, else the derived windows and a note saying why.

    Kineto builds a GPU step annotation from the GPU work its CPU step launched, so a healthy one spans that
    work. ROCm traces break this: stubs (microseconds for a step of milliseconds), steps out of order, steps
    missing. Per step N with launched work L_N = [first start, last end) of that work, and annotation A_N:

    - *stub*: |A_N| < |L_N| / 2;
    - *out of order*: A_N starts before A_(N-1) (steps both annotated and launched, ascending);
    - *out of place*: not a stub, but A_N leaves more than a tenth of L_N uncovered (a healthy annotation
      covers all of it; the tenth absorbs µs rounding);
    - *missing*: L_N exists, A_N does not.

    If any step fails, every window of the rank is L_N (one consistent source; steps that launched nothing get
    none). Without launched work (no correlation ids, no CPU steps) nothing can be checked or derived and the
    annotations stay.
    """
    launched = launched_steps(rows, work)
    on = launched >= 0
    if not on.any():
        return annotated, None
    derived = _hulls(launched[on], work.start[on], work.end[on])
    cpu = rows.step_marked & rows.lane_cpu
    cpu_steps = _hulls(rows.tables.step_no[rows.name[cpu]], rows.start[cpu], rows.end[cpu])
    failures = _gpu_step_failures(annotated, derived, cpu_steps)
    if not failures:
        return annotated, None
    return derived, (f"GPU step annotations are {'; '.join(failures)}; steps derived from the kernels each CPU "
                     f"step launched (first start to last end)")


def _gpu_step_failures(annotated, derived, cpu_steps) -> list[str]:
    """What of ``check_gpu_steps``'s rules fails, one phrase per kind, naming the first failing step."""
    a_step, a_start, a_end = annotated
    l_step, l_start, l_end = derived
    common, ai, li = np.intersect1d(a_step, l_step, assume_unique=True, return_indices=True)
    a_lo, a_hi, l_lo, l_hi = a_start[ai], a_end[ai], l_start[li], l_end[li]
    a_dur, l_dur = a_hi - a_lo, l_hi - l_lo
    covered = np.maximum(np.minimum(a_hi, l_hi) - np.maximum(a_lo, l_lo), 0)
    stub = 2 * a_dur < l_dur
    backwards = np.append(False, a_lo[1:] < a_lo[:-1])
    misplaced = ~stub & (10 * covered < 9 * l_dur)
    missing = np.setdiff1d(l_step, a_step, assume_unique=True)
    n = len(l_step)
    failures = []
    if stub.any():
        i = int(np.argmax(stub))
        c = np.searchsorted(cpu_steps[0], common[i])
        on_cpu = (f"{_span(cpu_steps[2][c] - cpu_steps[1][c])} on the CPU, its kernels span {_span(l_dur[i])}"
                  if c < len(cpu_steps[0]) and cpu_steps[0][c] == common[i] else f"its kernels span {_span(l_dur[i])}")
        failures.append(f"stubs ({int(stub.sum())} of {n} steps): step {common[i]} is {_span(a_dur[i])} on the "
                        f"GPU but {on_cpu}")
    if (backwards | misplaced).any():
        count = f"({int((backwards | misplaced).sum())} of {n} steps)"
        if backwards.any():
            i = int(np.argmax(backwards))
            failures.append(f"out of order {count}: step {common[i]} starts {_span(a_lo[i - 1] - a_lo[i])} "
                            f"before step {common[i - 1]} on the GPU")
        else:
            i = int(np.argmax(misplaced))
            failures.append(f"out of place {count}: step {common[i]} covers "
                            f"{100 * covered[i] / l_dur[i]:.0f}% of the span of its kernels on the GPU")
    if len(missing):
        shown = ", ".join(str(s) for s in missing[:5]) + (", ..." if len(missing) > 5 else "")
        failures.append(f"missing ({len(missing)} of {n} steps): step{'s' * (len(missing) > 1)} {shown}")
    return failures


def _span(ns) -> str:
    """A duration in ns as text with 3 significant digits and a unit (``8 µs``, ``41.2 ms``)."""
    ns = int(ns)
    for scale, unit in ((1_000_000_000, "s"), (1_000_000, "ms"), (1_000, "µs")):
        if abs(ns) >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns} ns"


def label_sets(work: Rows, lanes: str, *, bubble: iv.IntervalSet) -> dict[str, iv.IntervalSet]:
    """Interval set of every non-idle label of one rank (before the priority partition), from the arrays of
    its work rows; ``bubble``: the rank's pipeline bubble set."""
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
    sets["bubble"] = bubble
    # Not a partition label: time with a copy from/to pageable host memory running (a PCIe offload smell).
    sets["pageable_memcpy"] = iv.union(start[work.pageable], end[work.pageable])
    return sets


def step_of(start: np.ndarray, windows) -> np.ndarray:
    """The step whose window ``[start_ns, end_ns)`` holds each start time (-1 outside every window)."""
    step = np.full(len(start), -1, dtype=np.int64)
    if len(windows):
        order = np.argsort(windows["start_ns"].to_numpy())
        ws = windows["start_ns"].to_numpy()[order]
        idx = np.searchsorted(ws, start, side="right") - 1
        inside = (idx >= 0) & (start < windows["end_ns"].to_numpy()[order][np.clip(idx, 0, None)])
        step[inside] = windows["step"].to_numpy()[order][idx[inside]]
    return step
