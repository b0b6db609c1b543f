"""The per-rank survey under ``attribution``: which rows of the events table are work and on which lanes, the
step windows, and the label interval sets (the rules are in ``attribution``'s docstring).

Everything runs on numpy arrays: views of the table's columns, category codes for the categoricals, and
per-category lookup tables (``schema.per_category_table``) indexed with the codes, so nothing is computed
per row as a string.
"""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd

import shardline.profiling.annotations as contract
from shardline.profiling import intervals as iv
from shardline.profiling.classify import Lane, match_table
from shardline.profiling.partition import LABELS
from shardline.profiling.schema import (
    COMM_CATEGORIES,
    category_texts,
    codes_or_end,
    per_category_table,
    step_numbers,
)

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
                   "step": events["step"].to_numpy(), "stream": events["stream"].to_numpy()}
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
        t = self.tables
        gpu = self.lane_gpu & ~t.annotation_cat[self.cat] & ~t.annotation_name[self.name]
        if gpu.any():
            return gpu, Lane.GPU.value
        # CPU ops are work; among annotations only communication ones (gloo:* / nccl:* / sl:comm:*) are.
        cpu = self.lane_cpu & ~t.step_marker[self.name] & (
            t.cpu_op_cat[self.cat] | (self.comm & t.comm_op_cat[self.cat]))
        return cpu, Lane.CPU.value


#: What the work rows' label sets and windows read.
WORK_COLUMNS = ("start", "dur", "step", "stream", "category", "memory_kind")


def _step_table(texts: list[str]) -> np.ndarray:
    """``schema.step_numbers`` per category, one extra -1 for a missing value."""
    return np.append(step_numbers(texts), -1)


_NO_WINDOWS = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))


def rank_windows(rows: Rows, *, lanes: str, work: Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step, start, end) of one rank's windows, sorted by step (see the module docstring)."""
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


