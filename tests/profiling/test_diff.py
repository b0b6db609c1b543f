"""`profile diff`: per rank and category, mean-step deltas that sum exactly to the step-time delta."""

from __future__ import annotations

import copy
import io
import math
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.profiling.analyses.diff import ALL_RANKS, apportioned_mean, diff_breakdowns, explain
from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, breakdown
from shardline.profiling.base.errors import AttributionError
from shardline.profiling.present.cli import main


def _sums_exactly(table: pd.DataFrame) -> None:
    for rank, rows in table.groupby("rank"):
        parts = rows[rows["column"] != "step"]
        step = rows[rows["column"] == "step"].iloc[0]
        assert int(parts["delta_ns"].sum()) == int(step["delta_ns"]), rank
        assert int(parts["before_ns"].sum()) == int(step["before_ns"])
        assert int(parts["after_ns"].sum()) == int(step["after_ns"])


def _frame(synth, rows):
    return breakdown(synth.to_frame(rows))


def test_removed_copy_becomes_idle(synth):
    """zero_tp_offload minus its 40 ns D2H copy: the 650 ns step is unchanged, d2h -40, idle +40."""
    before_rows = [r for rank in (0, 1) for r in synth.zero_tp_offload(rank=rank)[0]]
    after_rows = [r for r in before_rows if r.get("category") != "memcpy_d2h"]
    result = diff_breakdowns(_frame(synth, before_rows), _frame(synth, after_rows))
    _sums_exactly(result.table)
    delta = result.table.set_index(["rank", "column"])["delta_ns"]
    for rank in (0, 1, ALL_RANKS):
        assert delta[(rank, "memcpy_d2h")] == -40 and delta[(rank, "idle")] == 40 and delta[(rank, "step")] == 0
        assert (delta.loc[rank].drop(["memcpy_d2h", "idle"]) == 0).all()


def test_longer_step_and_slower_all_reduce(synth):
    """The step annotation 50 ns longer and the TP all-reduce 30 ns longer (it was exposed and stays so)."""
    before_rows, _ = synth.zero_tp_offload()
    after_rows = copy.deepcopy(before_rows)
    for row in after_rows:
        if row["name"].startswith("ProfilerStep"):
            row["dur_ns"] += 50
        if row.get("category") in ("memcpy_h2d", "reduce_scatter", "memcpy_d2h", "compute") and \
                row["start_ns"] - 1_000_000 >= 340:
            row["start_ns"] += 30  # everything after the all-reduce shifts by 30
        if row.get("category") == "all_reduce":
            row["dur_ns"] += 30
    result = diff_breakdowns(_frame(synth, before_rows), _frame(synth, after_rows))
    _sums_exactly(result.table)
    delta = result.table[result.table["rank"] == 0].set_index("column")["delta_ns"]
    assert delta["step"] == 50 and delta["all_reduce"] == 30 and delta["idle"] == 20
    assert explain(result).startswith("all ranks: mean step 0.001 ms -> 0.001 ms (+0.000 ms): all_reduce")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10**12), min_size=len(EXCLUSIVE_COLUMNS),
                         max_size=len(EXCLUSIVE_COLUMNS)), min_size=1, max_size=7))
def test_apportioned_means_sum_and_stay_within_one_ns(steps):
    totals = np.array(steps, dtype=np.int64).sum(axis=0)
    step_total = int(totals.sum())
    n = len(steps)
    means = apportioned_mean(totals, step_total=step_total, n=n)
    assert int(means.sum()) == math.floor(Fraction(step_total, n) + Fraction(1, 2))  # ties: half up
    assert all(abs(Fraction(int(m)) - Fraction(int(t), n)) < 1 for m, t in zip(means, totals))


def _random_breakdown(rng, *, ranks, steps) -> pd.DataFrame:
    parts = rng.integers(0, 10**9, size=(len(ranks) * steps, len(EXCLUSIVE_COLUMNS)))
    frame = pd.DataFrame(parts, columns=list(EXCLUSIVE_COLUMNS))
    frame.insert(0, "rank", np.repeat(ranks, steps))
    frame.insert(1, "step", np.tile(np.arange(steps), len(ranks)))
    frame["step_ns"] = frame[list(EXCLUSIVE_COLUMNS)].sum(axis=1)
    return frame


@pytest.mark.parametrize("seed", range(5))
def test_different_step_counts_and_ranks_still_sum_exactly(seed):
    rng = np.random.default_rng(seed)
    before = _random_breakdown(rng, ranks=[0, 1, 2], steps=3)
    after = _random_breakdown(rng, ranks=[0, 1, 3], steps=7)
    result = diff_breakdowns(before, after)
    _sums_exactly(result.table)
    assert sorted(set(result.table["rank"])) == [ALL_RANKS, 0, 1]
    assert result.notes == ("ranks only before: [2]; only after: [3] (left out)",)
    row = result.table[(result.table["rank"] == 0) & (result.table["column"] == "compute")].iloc[0]
    exact = Fraction(int(after[after["rank"] == 0]["compute"].sum()), 7) - Fraction(
        int(before[before["rank"] == 0]["compute"].sum()), 3)
    assert abs(Fraction(int(row["delta_ns"])) - exact) < 2  # each mean within 1 ns


def test_no_common_rank_or_empty_run_is_refused():
    rng = np.random.default_rng(0)
    # Two single-rank runs compare whatever their rank numbers (issue 50 §4): disjoint multi-rank runs are refused.
    with pytest.raises(AttributionError, match="no rank in both runs"):
        diff_breakdowns(_random_breakdown(rng, ranks=[0, 1], steps=1),
                        _random_breakdown(rng, ranks=[2, 3], steps=1))
    with pytest.raises(AttributionError, match="before run has nothing attributed"):
        diff_breakdowns(_random_breakdown(rng, ranks=[0], steps=1).iloc[:0], _random_breakdown(rng, ranks=[0],
                                                                                                   steps=1))


def test_cli_diff_on_corpus_traces(traces_dir, capsys):
    """HTA's trace_compare pair (one rank, two steps each) through the command line, csv and table."""
    base, test = traces_dir / "hta" / "trace_compare" / "base", traces_dir / "hta" / "trace_compare" / "test"
    assert main(["profile", "diff", str(base), str(test), "--format", "csv"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out))
    _sums_exactly(table)
    from shardline.profiling.table.load import load

    want = diff_breakdowns(breakdown(load(base)), breakdown(load(test))).table
    assert table["delta_ns"].tolist() == want["delta_ns"].tolist()
    assert main(["profile", "diff", str(base), str(test)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("all ranks: mean step")


def test_cli_diff_markdown_and_errors(traces_dir, tmp_path, capsys):
    base = traces_dir / "hta" / "trace_compare" / "base"
    out = tmp_path / "d.md"
    assert main(["profile", "diff", str(base), str(base), "--format", "md", "-o", str(out)]) == 0
    text = out.read_text()
    assert "(+0.000 ms): nothing moved" in text and "| rank | column |" in text
    assert main(["profile", "diff", str(base), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardline profile diff: error:") and "missing" in err
