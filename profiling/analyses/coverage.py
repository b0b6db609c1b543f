"""Communication coverage: the communication the classification rules do not know (comm ops that launched
no comm kernel, kernels no rule names), grouped by name with the ranks and counts (a section of
``report_sections``, and the ``comm_coverage`` finding's source)."""

from __future__ import annotations

import enum

import numpy as np
import pandas as pd

from ..attribution.core import attribute
from ..base.schema import COMM_CATEGORIES, category_texts, codes_or_end
from ..table.linking import launch_rows, launching_op
from ..table.names import match_table


class Finding(str, enum.Enum):
    """What ``comm_coverage`` reports; the value is the text every report shows."""

    OP_WITHOUT_KERNEL = "communication op with no communication kernel"
    KERNEL_WITHOUT_OP = "communication kernel with no communication op"


COVERAGE_COLUMNS = ("finding", "name", "category", "ranks", "count", "launched")
#: CPU-only backends: their ops launch no GPU kernel by design.
_HOST_BACKENDS = r"^(gloo|mpi|ucc):"


def comm_coverage_frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(COVERAGE_COLUMNS)).astype({"count": np.int64})


def comm_coverage(source) -> pd.DataFrame:
    """How the next unknown communication library shows itself: per (finding, name), on ranks whose trace
    records kernel launches (CPU rows with a correlation id) and GPU rows --

    - ``communication op with no communication kernel``: a CPU communication op (``c10d::*``, ``nccl:*``,
      ``record_param_comms``, ``sl:comm:*``; not the host-only ``gloo:*``/``mpi:*``/``ucc:*``) inside whose
      span GPU work but no communication kernel was launched (kernel.correlation == launch.correlation, launch
      inside the op on the same thread) and that is no communication kernel's op (``linking.launching_op``:
      by its launch or its External id). ``launched``: the kernels those ops did launch (most frequent first,
      three at most) -- the names a new ``CommRule`` should match;
    - ``communication kernel with no communication op``: a GPU communication kernel that has no
      ``launching_op`` among those ops: its launch lies in none, and no op's External id names it (DeepEP and
      symmetric-memory kernels run so).

    Columns: finding, name, category, ranks (comma-separated), count (occurrences over those ranks), launched.
    Vectorised over the events table; one small loop per (rank, thread) holding communication ops."""

    events = source if isinstance(source, pd.DataFrame) else attribute(source, caller="comm_coverage").events
    if not len(events):
        return comm_coverage_frame([])
    return _coverage(events)


def _coverage(ev: pd.DataFrame) -> pd.DataFrame:

    cat_codes = codes_or_end(ev["category"])
    cat_texts = np.array([*category_texts(ev["category"].cat.categories), ""], dtype=object)
    comm = np.isin(cat_texts, list(COMM_CATEGORIES))[cat_codes]
    cpu = (ev["lane"] == "cpu").to_numpy()
    gpu = (ev["lane"] == "gpu").to_numpy()
    rank, stream = ev["rank"].to_numpy(), ev["stream"].to_numpy()
    corr = ev["correlation"].to_numpy()
    start = ev["start_ns"].to_numpy()
    end = start + ev["dur_ns"].to_numpy()
    ranks = np.intersect1d(np.unique(rank[cpu & (corr >= 0)]), np.unique(rank[gpu]))
    if not len(ranks):
        return comm_coverage_frame([])
    considered = np.isin(rank, ranks)
    name_codes = codes_or_end(ev["name"])
    ops = np.flatnonzero(cpu & comm & considered & ~match_table(ev["name"], _HOST_BACKENDS)[name_codes])
    kernels = np.flatnonzero(gpu & considered & (corr >= 0))
    launch = launch_rows(ev, kernels)
    kernels, launch = kernels[launch >= 0], launch[launch >= 0]
    is_comm_kernel = comm[kernels]
    comm_rows = np.flatnonzero(gpu & comm & considered)
    op_of = launching_op(ev, ops=ops, rows=comm_rows)  # each communication kernel's op, -1 for none
    covered_ops, has_gpu_work, inside = _launches_inside(ops, launch, rank=rank, stream=stream, start=start, end=end,
                                           comm_launch=is_comm_kernel)
    # An op that launched no GPU work at all (work.wait()'s record_param_comms, a coalesced send whose kernel the
    # group end launches) is not evidence of a kernel nobody recognises.
    uncovered = ops[has_gpu_work & ~(covered_ops | np.isin(ops, op_of))]
    texts = np.array([*category_texts(ev["name"].cat.categories), ""], dtype=object)
    labels = dict(rank=rank, name_codes=name_codes, texts=texts, categories=cat_texts[cat_codes])
    rows = _op_rows(uncovered, kernels, launch, inside, **labels)
    # The reverse: comm kernels (with a launch) that are no op's.
    comm_k = kernels[is_comm_kernel]
    orphans = comm_k[op_of[np.searchsorted(comm_rows, comm_k)] < 0]
    rows += _grouped(orphans, Finding.KERNEL_WITHOUT_OP, launched={}, **labels)
    return comm_coverage_frame(rows)


def _groups(rows: np.ndarray, *, rank, stream):
    """(rank, thread) -> rows there, for ``rows``."""
    if not len(rows):
        return {}
    keys = pd.MultiIndex.from_arrays([rank[rows], stream[rows]])
    codes, uniques = pd.factorize(keys)
    order = np.argsort(codes, kind="stable")
    bounds = np.searchsorted(codes[order], np.arange(len(uniques) + 1))
    return {tuple(uniques[i]): rows[order[bounds[i]:bounds[i + 1]]] for i in range(len(uniques))}


def _launches_inside(ops, launch, *, rank, stream, start, end, comm_launch):
    """Per op: was a communication kernel launched inside it, was any GPU work; and per (rank, thread) the
    [lo, hi) range of the launches (sorted by start) inside each op, as (ops, launches, lo, hi), to name them."""
    covered = np.zeros(len(ops), dtype=bool)
    launched = np.zeros(len(ops), dtype=bool)
    inside = {}
    op_groups = _groups(ops, rank=rank, stream=stream)
    launch_pos = _groups(np.arange(len(launch)), rank=rank[launch], stream=stream[launch])
    for key, group in op_groups.items():
        mine = launch_pos.get(key)
        if mine is None:
            continue
        mine = mine[np.argsort(start[launch[mine]], kind="stable")]
        t = start[launch[mine]]
        lo = np.searchsorted(t, start[group], side="left")
        hi = np.searchsorted(t, end[group], side="right")
        comm_count = np.concatenate([[0], np.cumsum(comm_launch[mine])])
        idx = np.searchsorted(ops, group)  # ops ascend (flatnonzero)
        covered[idx] = comm_count[hi] > comm_count[lo]
        launched[idx] = hi > lo
        inside[key] = (group, mine, lo, hi)
    return covered, launched, inside


def _op_rows(uncovered, kernels, launch, inside, *, rank, name_codes, texts, categories) -> list[dict]:
    """Rows for ops without a communication kernel, with the kernels they did launch."""
    if not len(uncovered):
        return []
    flagged = np.zeros(len(name_codes), dtype=bool)
    flagged[uncovered] = True
    op_names, kernel_names = [], []
    for group, mine, lo, hi in inside.values():
        keep = flagged[group]
        if not keep.any():
            continue
        lo, hi, group = lo[keep], hi[keep], group[keep]
        counts = hi - lo
        if not counts.sum():
            continue
        # every (op, launch inside it) pair, without a loop over ops
        offsets = np.repeat(lo - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        picked = mine[np.arange(counts.sum()) + offsets]
        op_names.append(name_codes[np.repeat(group, counts)])
        kernel_names.append(name_codes[kernels[picked]])
    launched: dict[str, str] = {}
    if op_names:
        pairs = pd.DataFrame({"op": np.concatenate(op_names), "kernel": np.concatenate(kernel_names)})
        counted = pairs.value_counts().reset_index(name="n").sort_values(["op", "n", "kernel"],
                                                                         ascending=[True, False, True])
        for op, part in counted.groupby("op", sort=False):
            launched[texts[op]] = "; ".join(f"{texts[k]} ×{n}" for k, n in zip(part["kernel"][:3], part["n"][:3]))
    return _grouped(uncovered, Finding.OP_WITHOUT_KERNEL, launched=launched, rank=rank, name_codes=name_codes,
                    texts=texts, categories=categories)


def _grouped(rows, finding: Finding, *, launched: dict, rank, name_codes, texts, categories) -> list[dict]:
    if not len(rows):
        return []
    frame = pd.DataFrame({"name": texts[name_codes[rows]], "category": categories[rows], "rank": rank[rows]})
    out = []
    for (name, category), part in frame.groupby(["name", "category"], sort=True):
        out.append(dict(finding=finding.value, name=name, category=category,
                        ranks=",".join(str(int(r)) for r in sorted(set(part["rank"].tolist()))),
                        count=len(part), launched=launched.get(name, "")))
    return out


def coverage_note(coverage: pd.DataFrame) -> str:
    """One line for the reports (and the terminal) summarising ``comm_coverage``."""
    if coverage.empty:
        return ("every communication op launched a communication kernel and every communication kernel has its "
                "op (or the trace records no kernel launches)")
    counts = coverage.groupby("finding")["count"].sum()
    parts = [f"{int(counts[f.value])} × {f.value}" for f in Finding if f.value in counts.index]
    return ("; ".join(parts) + ": a kernel no rule knows shows up here -- name it with a CommRule "
            "(--rules FILE)")
