"""``diff_breakdowns(before, after)``: what changed per category and per rank between two runs' breakdowns.

Both runs rarely profile the same step numbers, so each rank is compared on its *mean step*: for a rank with
n profiled steps, column c's mean is ``total_c / n``. Means are apportioned to integer ns by the largest
remainder: every column gets ``floor(total_c / n)``, and the units still missing to reach the rounded mean
step time ``round(total_step / n)`` go to the columns with the largest remainders. So every mean is within
1 ns of the exact one and the exclusive columns of a mean step still sum to its step time exactly, which makes
the explanation exact in integers::

    sum over EXCLUSIVE_COLUMNS of delta_c  ==  delta_step        (delta = after - before, ns)

The row ``rank == ALL_RANKS`` (-1) compares the mean (rank, step) row of all compared ranks, by the same rule.

Which ranks are compared: the pairs given (``pairs``: before's rank A with after's rank B, e.g. ``--rank 3:1``),
else every rank present in both runs; two single-rank runs compare their one rank whatever its number (a rank
recorded as 3 in one trace and 1 in the other is one process profiled twice). A table row's ``rank`` is the
before rank and ``rank_after`` the after rank; every pairing across numbers is said in ``DiffResult.notes``, as
are the ranks left out.

Bases. ``share_of_delta`` = delta_c / delta_step is given only where the steps compare and the step moved by
at least ``SHARE_MIN_FRACTION`` of the before step: a share of a near-zero delta (thousands of percent) says
nothing; ``delta_of_step`` = delta_c / before step is the base that holds wherever steps compare. A run with
no step markers (``ProfilerStep``; its one window is the whole capture, step -1) has no step to compare: its
rows are kept, flagged ``comparable = False``, with neither percentage, and a note says why.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..attribution.core import EXCLUSIVE_COLUMNS
from ..base.errors import AttributionError

ALL_RANKS = -1
#: ``share_of_delta`` is given only where the step moved by at least this fraction of the before step.
SHARE_MIN_FRACTION = 0.01
#: The step number of a window that is a whole capture, not a marked step (``attribution.core``).
UNMARKED_STEP = -1


@dataclass(frozen=True)
class DiffResult:
    """``table``: one row per (rank, column) with rank_after, before_ns, after_ns, delta_ns (ints),
    share_of_delta and delta_of_step (NaN where no sensible base: see the module doc), steps_before /
    steps_after and comparable; ``column`` is an exclusive column or ``"step"``. ``notes``: what was paired
    across rank numbers, left out, or is not comparable."""

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


def parse_pairs(texts) -> tuple[tuple[int, int], ...]:
    """``["3:1", "0:0"]`` (or one ``"3:1,0:0"``) -> ``((3, 1), (0, 0))``: before's rank, after's rank."""
    pairs = []
    for text in texts or ():
        for part in str(text).split(","):
            before, sep, after = part.strip().partition(":")
            try:
                pair = (int(before), int(after))
            except ValueError:
                pair = None
            if not sep or pair is None or min(pair) < 0:
                raise AttributionError(f"diff: rank pair {part.strip()!r} is not BEFORE:AFTER with two ranks >= 0 "
                                       "(e.g. 3:1)")
            pairs.append(pair)
    return tuple(pairs)


def _paired(ranks_b: set[int], ranks_a: set[int], pairs) -> tuple[list[tuple[int, int]], list[str]]:
    """The (before rank, after rank) pairs to compare and the notes saying how they were chosen."""
    notes = []
    if pairs:
        pairs = [(int(b), int(a)) for b, a in pairs]
        for side, ranks, wanted in (("before", ranks_b, [b for b, _ in pairs]), ("after", ranks_a,
                                                                                  [a for _, a in pairs])):
            missing = sorted(set(wanted) - ranks)
            if missing:
                raise AttributionError(f"diff: rank {missing[0]} is not in the {side} run (its ranks: "
                                       f"{sorted(ranks)})")
            twice = sorted(r for r in set(wanted) if wanted.count(r) > 1)
            if twice:
                raise AttributionError(f"diff: the {side} run's rank {twice[0]} is paired twice")
        crossed = [(b, a) for b, a in pairs if b != a]
        if crossed:
            notes.append("ranks paired as asked: " + ", ".join(f"before {b} with after {a}" for b, a in crossed))
        left = (ranks_b - {b for b, _ in pairs}, ranks_a - {a for _, a in pairs})
    elif len(ranks_b) == 1 and len(ranks_a) == 1 and ranks_b != ranks_a:
        (b,), (a,) = ranks_b, ranks_a
        pairs = [(b, a)]
        notes.append(f"single-rank runs compared whatever their rank numbers: before's rank {b} with after's "
                     f"rank {a}")
        left = (set(), set())
    else:
        pairs = [(r, r) for r in sorted(ranks_b & ranks_a)]
        left = (ranks_b - ranks_a, ranks_a - ranks_b)
    if left[0] or left[1]:
        notes.append(f"ranks only before: {sorted(left[0])}; only after: {sorted(left[1])} (left out)")
    if not pairs:
        raise AttributionError(f"diff: no rank in both runs (before {sorted(ranks_b)}, after {sorted(ranks_a)}); "
                               "pair ranks explicitly (--rank BEFORE:AFTER)")
    return pairs, notes


def _unmarked(bd: pd.DataFrame, ranks: list[int]) -> list[int]:
    """The ranks among ``ranks`` whose breakdown has no marked step (only the whole-capture window)."""
    if "step" not in bd:
        return []
    marked = bd[bd["step"] != UNMARKED_STEP]["rank"]
    return [r for r in ranks if r not in set(marked.astype(int))]


def diff_breakdowns(before: pd.DataFrame, after: pd.DataFrame, *, pairs=None) -> DiffResult:
    """Per compared rank and per exclusive column: the mean-step time before, after and the delta (see the
    module doc). ``pairs``: (before rank, after rank) pairs to compare, instead of the ranks both runs have."""
    for name, bd in (("before", before), ("after", after)):
        missing = [c for c in ("rank", "step_ns", *EXCLUSIVE_COLUMNS) if c not in bd]
        if missing:
            raise AttributionError(f"diff: the {name} breakdown lacks columns {missing}")
        if bd.empty:
            raise AttributionError(f"diff: the {name} run has nothing attributed (no work events)")
    ranks_b, ranks_a = set(before["rank"].astype(int)), set(after["rank"].astype(int))
    pairs, notes = _paired(ranks_b, ranks_a, pairs)
    used_b, used_a = [b for b, _ in pairs], [a for _, a in pairs]
    mb, ma = _means(before, used_b), _means(after, used_a)
    unmarked_b, unmarked_a = set(_unmarked(before, used_b)), set(_unmarked(after, used_a))
    sides = [f"the {side} run's rank(s) {sorted(ranks)}" for side, ranks in (("before", unmarked_b),
                                                                             ("after", unmarked_a)) if ranks]
    if sides:
        notes.append(f"no step markers (ProfilerStep) in {' and '.join(sides)}: a 'step' there is the whole "
                     "capture, so those rows are not comparable step for step; their times are shown, without "
                     "percentages")
    columns = [*EXCLUSIVE_COLUMNS, "step"]
    frames = []
    for b_rank, a_rank in [*pairs, (ALL_RANKS, ALL_RANKS)]:
        (cb, sb, nb), (ca, sa, na) = mb[b_rank], ma[a_rank]
        b = np.append(cb, sb)
        a = np.append(ca, sa)
        delta = a - b
        if b_rank == ALL_RANKS:
            comparable = not (unmarked_b or unmarked_a)
        else:
            comparable = b_rank not in unmarked_b and a_rank not in unmarked_a
        step_delta = int(delta[-1])
        # The share of the step's delta, only where the step moved beyond the noise floor and steps compare.
        shares = delta / step_delta if comparable and sb > 0 and abs(step_delta) >= SHARE_MIN_FRACTION * sb \
            else np.full(len(delta), np.nan)
        frames.append(pd.DataFrame({"rank": b_rank, "rank_after": a_rank, "column": columns, "before_ns": b,
                                    "after_ns": a, "delta_ns": delta, "steps_before": nb, "steps_after": na,
                                    "share_of_delta": shares,
                                    "delta_of_step": delta / sb if comparable and sb > 0
                                    else np.full(len(delta), np.nan),
                                    "comparable": comparable}))
    return DiffResult(table=pd.concat(frames, ignore_index=True), notes=tuple(notes))


def explain(result: DiffResult, *, rank: int = ALL_RANKS, top: int = 5) -> str:
    """One line: the mean step time before -> after and the columns that moved most (ms)."""
    rows = result.table[result.table["rank"] == rank].set_index("column")
    step = rows.loc["step"]
    parts = rows.drop(index="step")
    parts = parts[parts["delta_ns"] != 0]
    parts = parts.loc[parts["delta_ns"].abs().sort_values(ascending=False, kind="stable").index]
    moved = ", ".join(f"{c} {d / 1e6:+.3f}" for c, d in parts["delta_ns"].head(top).items()) or "nothing moved"
    after = int(step["rank_after"]) if "rank_after" in step else rank
    who = "all ranks" if rank == ALL_RANKS else f"rank {rank}" if after == rank else f"rank {rank} -> {after}"
    what = "mean step" if bool(step.get("comparable", True)) else "whole capture (no step markers: not comparable)"
    return (f"{who}: {what} {step.before_ns / 1e6:.3f} ms -> {step.after_ns / 1e6:.3f} ms "
            f"({step.delta_ns / 1e6:+.3f} ms): {moved}")
