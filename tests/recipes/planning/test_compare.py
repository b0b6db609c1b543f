"""``compare``: a synthetic 4-rank profile laid out by hand (so every measured mean is known exactly) against
``predict_stages``, its report formats and its errors; and the real 8-rank DLRM trace set for structure.

Tolerances: the measured column is integer ns and compared exactly; the predicted column is the prediction's
own float, compared with ``==`` (one rank's value is copied, not recomputed); the all-ranks prediction is a
mean of floats, compared at rel 1e-12.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from shardline.profiling.table.partition import EXCLUSIVE_COLUMNS, OVERLAP_COLUMNS
from shardline.recipes.planning.catalog import PlanError, load_catalog
from shardline.recipes.planning.compare import ALL_RANKS, COLUMNS, Kind, compare
from shardline.recipes.planning.layout import PlanLayout
from shardline.recipes.planning.models import packaged
from shardline.recipes.planning.steptime import predict_stages

# The profiler tests' synthetic-trace helpers (Kineto rows and writer), loaded by path as their conftest does.
_SPEC = importlib.util.spec_from_file_location(
    "shardline_synthetic_traces_planning", Path(__file__).parents[2] / "profiling" / "synthetic_traces.py")
synth = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(synth)

MODEL = packaged("gpt2-125m")
CLUSTER = load_catalog().cluster("dgx-h100")
SEQ = 1024
LAYOUT = PlanLayout(pp=2, dp=2, micro_batches=4)  # world 4: ranks 0, 1 on pipeline rank 0; 2, 3 on 1
T0 = 1_000_000
STEPS = (1, 2, 3)
STEP_NS = 1000

# Rank r, step k, window [t, t + 1000) with t = T0 + 1000 (k - 1), laid out as:
#   compute    [t, t + 400 + 100k)
#   all_reduce [t + 300 + 100k, t + 500 + 100k)          100 ns under compute, 100 exposed
#   p2p_send   [t + 500 + 100k, t + 550 + 100k + 50r)    50 (r + 1) exposed
#   idle: the rest, 500 - 100k - 50 (r + 1)               (rank 3, step 3: none)
# Means over steps 1, 2, 3, worked out on paper (compute 500/600/700; idle rank 0: 350/250/150 ...):
MEANS = {0: dict(compute=600, all_reduce=100, p2p_send=50, idle=250, overlapped_all_reduce=100),
         1: dict(compute=600, all_reduce=100, p2p_send=100, idle=200, overlapped_all_reduce=100),
         2: dict(compute=600, all_reduce=100, p2p_send=150, idle=150, overlapped_all_reduce=100),
         3: dict(compute=600, all_reduce=100, p2p_send=200, idle=100, overlapped_all_reduce=100)}
# Over all 12 (rank, step) rows: p2p (50 + 100 + 150 + 200) / 4, idle (250 + 200 + 150 + 100) / 4.
ALL_MEANS = dict(compute=600, all_reduce=100, p2p_send=125, idle=175, overlapped_all_reduce=100)
# warmup=1 leaves steps 2 and 3: compute (600 + 700) / 2; idle rank 0 (250 + 150) / 2, ...
MEANS_AFTER_WARMUP = {r: dict(compute=650, all_reduce=100, p2p_send=50 * (r + 1), idle=200 - 50 * r,
                              overlapped_all_reduce=100) for r in range(4)}


def _rows(world_ranks=range(4)) -> list[dict]:
    rows = []
    for r in world_ranks:
        for k in STEPS:
            t = T0 + STEP_NS * (k - 1)
            for category, start, dur in (("compute", 0, 400 + 100 * k), ("all_reduce", 300 + 100 * k, 200),
                                         ("p2p_send", 500 + 100 * k, 50 * (r + 1))):
                rows.append(synth.gpu_event(r, category, t + start, dur))
            rows.append(synth.annotation(r, f"ProfilerStep#{k}", t, STEP_NS))
    return rows


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("compare") / "run"
    synth.write_kineto(_rows(), folder, world=4)
    return folder


def _measured(comparison, rank: int) -> dict[str, int]:
    rows = comparison.rows(rank)
    return {c: int(v) for c, v in rows["measured_ns"].items()}


def _expected(means: dict[str, int]) -> dict[str, int]:
    out = {c: 0 for c in (*EXCLUSIVE_COLUMNS, *OVERLAP_COLUMNS)}
    out.update(means)
    out["step"] = STEP_NS
    return out


def test_measured_column_is_the_hand_laid_timeline(profile):
    c = compare(profile, MODEL, LAYOUT, CLUSTER, seq_len=SEQ)
    assert list(c.table.columns) == list(COLUMNS)
    assert c.steps == {r: STEPS for r in range(4)}
    for rank, means in MEANS.items():
        assert _measured(c, rank) == _expected(means), rank
    assert _measured(c, ALL_RANKS) == _expected(ALL_MEANS)
    assert (c.table["measured_s"] == c.table["measured_ns"] / 1e9).all()
    assert set(c.table["steps"]) == {3} | {12}  # 3 steps per rank; 12 (rank, step) rows in the all-ranks mean


def test_warmup_leaves_out_the_first_steps(profile):
    c = compare(profile, MODEL, LAYOUT, CLUSTER, seq_len=SEQ, warmup=1)
    assert c.steps == {r: (2, 3) for r in range(4)}
    for rank, means in MEANS_AFTER_WARMUP.items():
        assert _measured(c, rank) == _expected(means), rank


def test_predicted_column_is_predict_stages(profile):
    c = compare(profile, MODEL, LAYOUT, CLUSTER, seq_len=SEQ, tp_overlap=True)  # predict kwargs pass through
    stages = predict_stages(MODEL, LAYOUT, CLUSTER, seq_len=SEQ, tp_overlap=True)
    assert c.predictions == tuple(stages)
    for rank in range(4):
        rows = c.rows(rank)
        pp_rank = rank // 2
        assert set(rows["pp_rank"]) == {pp_rank}
        stage = stages[pp_rank]
        expected = {**stage.time_s, **stage.overlapped_s, "step": stage.step_s}
        assert rows["predicted_s"].to_dict() == expected, rank  # copied, so equal exactly
    everyone = c.rows(ALL_RANKS)["predicted_s"]
    first, last = ({**s.time_s, **s.overlapped_s} for s in stages)
    for column in (*EXCLUSIVE_COLUMNS, *OVERLAP_COLUMNS):  # two ranks on each pipeline rank: the plain mean
        assert math.isclose(everyone[column], (first[column] + last[column]) / 2, rel_tol=1e-12), column
    assert math.isclose(everyone["step"], (stages[0].step_s + stages[1].step_s) / 2, rel_tol=1e-12)


def test_error_kinds_and_partition(profile):
    c = compare(profile, MODEL, LAYOUT, CLUSTER, seq_len=SEQ)
    t = c.table
    measured = t["measured_s"] != 0
    assert ((t.loc[measured, "error"] - (t.loc[measured, "predicted_s"] - t.loc[measured, "measured_s"])
             / t.loc[measured, "measured_s"]).abs() < 1e-12).all()
    assert t.loc[~measured, "error"].isna().all()
    for rank, rows in t.groupby("rank"):
        by_kind = rows.groupby("kind")["measured_ns"].sum()
        assert by_kind[Kind.EXCLUSIVE.value] == by_kind[Kind.STEP.value], rank  # the parts sum to the step
        parts = rows[rows["kind"] == Kind.EXCLUSIVE.value]
        step = rows[rows["kind"] == Kind.STEP.value]
        assert math.isclose(parts["predicted_s"].sum(), float(step["predicted_s"].iloc[0]), rel_tol=1e-9)


@pytest.mark.parametrize(("layout", "pp_ranks"), [
    (PlanLayout(pp=2, dp=2), [0, 0, 1, 1]),
    (PlanLayout(tp=2, pp=2), [0, 0, 1, 1]),
    (PlanLayout(pp=4), [0, 1, 2, 3]),
    (PlanLayout(dp=4), [0, 0, 0, 0]),
])
def test_each_rank_meets_its_pipeline_rank(profile, layout, pp_ranks):
    c = compare(profile, MODEL, layout, CLUSTER, seq_len=SEQ)
    per_rank = c.table[c.table["rank"] != ALL_RANKS].groupby("rank")["pp_rank"].unique()
    assert [list(v) for v in per_rank] == [[p] for p in pp_ranks]


def test_summary_step_then_largest_gaps(profile):
    c = compare(profile, MODEL, LAYOUT, CLUSTER, seq_len=SEQ)
    lines = c.summary()
    everyone = c.rows(ALL_RANKS)
    parts = everyone[everyone["kind"] == Kind.EXCLUSIVE.value]
    gaps = (parts["predicted_s"] - parts["measured_s"]).abs()
    gaps = gaps[gaps > 0].sort_values(ascending=False, kind="stable")
    assert [line.split(":")[0] for line in lines] == ["step", *gaps.index[:3]]
    assert "measured 1 µs" in lines[0]  # the mean step is 1000 ns
    error = everyone.loc["step", "error"]
    assert lines[0].endswith(f"(error {100 * error:+.0f}%)")


def test_report_formats(profile, tmp_path):
    c = compare(profile, MODEL, LAYOUT, CLUSTER, seq_len=SEQ)
    md = c.to_markdown()
    assert md.startswith("# shardline plan --compare")
    assert "| rank | pp_rank | category | predicted_ms | measured_ms | error_% |" in md
    assert "ranks 0-3: steps 1, 2, 3" in md
    assert all(f"- {line}" in md for line in c.summary())
    assert "| 3 | 1 | p2p_send |" in md and "| 0.000200 |" in md  # rank 3's 200 ns, exact ms
    assert "| 0 | 0 | memset |" not in md  # a category zero on both sides everywhere is not shown

    doc = json.loads(c.to_json())
    assert doc["layout"]["pp"] == 2 and doc["steps"]["0"] == list(STEPS) and doc["summary"] == c.summary()
    rows = pd.DataFrame(doc["rows"])
    assert len(rows) == len(c.table) and (rows["measured_ns"] == c.table["measured_ns"]).all()
    assert rows["error"].isna().equals(c.table["error"].isna())

    c.to_csv(tmp_path / "compare.csv")
    back = pd.read_csv(tmp_path / "compare.csv", dtype={"predicted_s": str})
    assert list(back.columns) == list(COLUMNS)
    assert (back["measured_ns"] == c.table["measured_ns"]).all()
    # Written as repr (shortest round-trip text), so Python's float() of it gives each value back exactly.
    assert [float(v) for v in back["predicted_s"]] == c.table["predicted_s"].tolist()
    c.to_parquet(tmp_path / "compare.parquet")
    assert pd.read_parquet(tmp_path / "compare.parquet").equals(c.table)

    text = c.to_text()
    assert text.startswith("profile: ") and c.summary()[0] in text and "predicted_ms" in text

    page = c.to_html()
    assert page.startswith("<!DOCTYPE html>") and '<table id="compare-table-1">' in page
    assert "<th>measured_ms</th>" in page and "http" not in page


def test_ranks_missing_from_a_larger_world_are_named(tmp_path):
    synth.write_kineto(_rows(range(2)), tmp_path / "half", world=4)  # only ranks 0 and 1 were traced
    c = compare(tmp_path / "half", MODEL, LAYOUT, CLUSTER, seq_len=SEQ)
    assert sorted(c.steps) == [0, 1]
    assert any("ranks [2, 3]" in note for note in c.notes)
    assert _measured(c, 1) == _expected(MEANS[1])


def test_world_mismatch_names_both_numbers(profile):
    with pytest.raises(PlanError, match=r"world size 4 but the layout has world 8"):
        compare(profile, MODEL, PlanLayout(pp=2, dp=4), CLUSTER, seq_len=SEQ)


def test_empty_and_missing_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlanError, match="no trace, log or export found"):
        compare(tmp_path / "empty", MODEL, LAYOUT, CLUSTER, seq_len=SEQ)
    with pytest.raises(PlanError, match="no such file or folder"):
        compare(tmp_path / "absent", MODEL, LAYOUT, CLUSTER, seq_len=SEQ)


def test_no_steps_left(profile, tmp_path):
    with pytest.raises(PlanError, match=r"warmup=3, ranks \[0, 1, 2, 3\] keep no measured step"):
        compare(profile, MODEL, LAYOUT, CLUSTER, seq_len=SEQ, warmup=3)
    with pytest.raises(PlanError, match="warmup=-1"):
        compare(profile, MODEL, LAYOUT, CLUSTER, seq_len=SEQ, warmup=-1)
    # Step markers but no work on any rank: nothing to compare.
    synth.write_kineto([synth.annotation(r, "ProfilerStep#1", T0, STEP_NS) for r in range(4)], tmp_path / "idle",
                       world=4)
    with pytest.raises(PlanError, match="no rank has work"):
        compare(tmp_path / "idle", MODEL, LAYOUT, CLUSTER, seq_len=SEQ)


def test_real_dlrm_trace_set(traces_dir):
    """param's DLRM run: 8 ranks (``distributedInfo.world_size`` 8, PROVENANCE: rank r/8), one profiled step
    each, data-parallel (no pg_config names another dim): compared as dp=8."""
    from shardline.profiling.attribution.core import breakdown
    from shardline.profiling.table.load import load

    folder = traces_dir / "param" / "dlrm_kineto"
    layout = PlanLayout(dp=8)
    c = compare(folder, MODEL, layout, CLUSTER, seq_len=SEQ)
    assert sorted(c.steps) == list(range(8))
    bd = breakdown(load(folder))
    stage = predict_stages(MODEL, layout, CLUSTER, seq_len=SEQ)[0]
    for rank, rows in c.table.groupby("rank"):
        rows = rows.set_index("category")
        parts = rows[rows["kind"] == Kind.EXCLUSIVE.value]
        assert parts["measured_ns"].sum() == rows.loc["step", "measured_ns"], rank
        assert set(rows["pp_rank"]) == {ALL_RANKS if rank == ALL_RANKS else 0}
        assert rows["predicted_s"].to_dict() == {**stage.time_s, **stage.overlapped_s, "step": stage.step_s}
        if rank != ALL_RANKS:  # one step per rank: its measured row is the profiler's breakdown row
            mine = bd[bd["rank"] == rank]
            assert rows.loc["step", "steps"] == len(mine) == len(c.steps[rank])
            if len(mine) == 1:
                assert rows.loc[list(EXCLUSIVE_COLUMNS), "measured_ns"].tolist() == \
                    mine[list(EXCLUSIVE_COLUMNS)].iloc[0].tolist()
    assert c.summary()[0].startswith("step: predicted ")
