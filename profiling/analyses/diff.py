"""``diff_breakdowns(before, after)``: what changed per category and per rank between two runs' breakdowns.

Both runs rarely profile the same step numbers, so each rank is compared on its *mean step*: for a rank with
n profiled steps, column c's mean is ``total_c / n``. Means are apportioned to integer ns by the largest
remainder: every column gets ``floor(total_c / n)``, and the units still missing to reach the rounded mean
step time ``round(total_step / n)`` go to the columns with the largest remainders. So every mean is within
1 ns of the exact one and the exclusive columns of a mean step still sum to its step time exactly, which makes
the explanation exact in integers::

    sum over EXCLUSIVE_COLUMNS of delta_c  ==  delta_step        (delta = after - before, ns)

The row ``rank == ALL_RANKS`` (-1) compares the mean (rank, step) row of all ranks present in both runs, by the
same rule. Ranks present in only one run are left out and named in ``DiffResult.notes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..attribution.core import EXCLUSIVE_COLUMNS
from ..base.errors import AttributionError

ALL_RANKS = -1


@dataclass(frozen=True)
class DiffResult:
    """``table``: one row per (rank, column) with before_ns, after_ns, delta_ns (ints), share_of_delta, plus
    steps_before / steps_after; ``column`` is an exclusive column or ``"step"``. ``notes``: what was left out."""

    table: pd.DataFrame
    notes: tuple[str, ...] = ()


def apportioned_mean(totals: np.ndarray, *, step_total: int, n: int) -> np.ndarray:
    """Integer means of ``totals / n`` (ints summing to ``step_total``) that sum to ``round(step_total / n)``,
    each within 1 of the exact mean (largest-remainder apportionment, ties to the earlier column)."""
    totals = np.asarray(totals, dtype=np.int64)
    if n <= 0:
        raise AttributionError(f"cannot average over {n} steps")
    floor, rem = np.divmod(totals, n)
    target = (2 * int(step_total) + n) // (2 * n)  # round half up, in integers
    missing = target - int(floor.sum())
    out = floor.copy()
    if missing > 0:
        order = np.argsort(-rem, kind="stable")
        out[order[:missing]] += 1
    return out


def _means(bd: pd.DataFrame, ranks: list[int]) -> dict[int, tuple[np.ndarray, int, int]]:
    """rank -> (apportioned column means, mean step, step count); ALL_RANKS over all rows of ``ranks``."""
    out = {}
    for rank, rows in [(r, bd[bd["rank"] == r]) for r in ranks] + [(ALL_RANKS, bd[bd["rank"].isin(ranks)])]:
        totals = rows[list(EXCLUSIVE_COLUMNS)].sum().to_numpy(dtype=np.int64)
        step_total = int(rows["step_ns"].sum())
        means = apportioned_mean(totals, step_total=step_total, n=len(rows))
        out[rank] = (means, int(means.sum()), len(rows))
    return out


def diff_breakdowns(before: pd.DataFrame, after: pd.DataFrame) -> DiffResult:
    """Per rank and per exclusive column: the mean-step time before, after and the delta (see the module doc)."""
    for name, bd in (("before", before), ("after", after)):
        missing = [c for c in ("rank", "step_ns", *EXCLUSIVE_COLUMNS) if c not in bd]
        if missing:
            raise AttributionError(f"diff: the {name} breakdown lacks columns {missing}")
        if bd.empty:
            raise AttributionError(f"diff: the {name} run has nothing attributed (no work events)")
    ranks_b, ranks_a = set(before["rank"].astype(int)), set(after["rank"].astype(int))
    common = sorted(ranks_b & ranks_a)
    notes = []
    if ranks_b ^ ranks_a:
        notes.append(f"ranks only before: {sorted(ranks_b - ranks_a)}; only after: {sorted(ranks_a - ranks_b)} "
                     "(left out)")
    if not common:
        raise AttributionError(f"diff: no rank in both runs (before {sorted(ranks_b)}, after {sorted(ranks_a)})")
    mb, ma = _means(before, common), _means(after, common)
    columns = [*EXCLUSIVE_COLUMNS, "step"]
    frames = []
    for rank in [*common, ALL_RANKS]:
        (cb, sb, nb), (ca, sa, na) = mb[rank], ma[rank]
        b = np.append(cb, sb)
        a = np.append(ca, sa)
        delta = a - b
        frames.append(pd.DataFrame({"rank": rank, "column": columns, "before_ns": b, "after_ns": a,
                                    "delta_ns": delta, "steps_before": nb, "steps_after": na}))
    table = pd.concat(frames, ignore_index=True)
    step_delta = table["rank"].map(table[table["column"] == "step"].set_index("rank")["delta_ns"])
    table["share_of_delta"] = table["delta_ns"] / step_delta.where(step_delta != 0)
    return DiffResult(table=table, notes=tuple(notes))


def explain(result: DiffResult, *, rank: int = ALL_RANKS, top: int = 5) -> str:
    """One line: the mean step time before -> after and the columns that moved most (ms)."""
    rows = result.table[result.table["rank"] == rank].set_index("column")
    step = rows.loc["step"]
    parts = rows.drop(index="step")
    parts = parts[parts["delta_ns"] != 0]
    parts = parts.loc[parts["delta_ns"].abs().sort_values(ascending=False, kind="stable").index]
    moved = ", ".join(f"{c} {d / 1e6:+.3f}" for c, d in parts["delta_ns"].head(top).items()) or "nothing moved"
    who = "all ranks" if rank == ALL_RANKS else f"rank {rank}"
    return (f"{who}: mean step {step.before_ns / 1e6:.3f} ms -> {step.after_ns / 1e6:.3f} ms "
            f"({step.delta_ns / 1e6:+.3f} ms): {moved}")
