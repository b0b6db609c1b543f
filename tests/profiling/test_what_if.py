"""What-if predictions against ground truth: the generator's own trace of the changed world (another transfer
time, no straggler, another micro-batch count or schedule), the path rows the generator lays out, the idle
causes it states, or a published closed form -- never the code's own output."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest

from shardline.profiling.analyses.what_if import Keep, Method, Scenario, ScenarioError, ScenarioKind
from shardline.profiling.present.cli import main
from shardline.profiling.present.scenarios import what_if
from shardline.profiling.table.load import load


def _step(table: pd.DataFrame, scenario: str, step: int = 0) -> pd.Series:
    rows = table[(table["scenario"] == scenario) & (table["rank"] == -1) & (table["step"] == step)]
    assert len(rows) == 1, table
    return rows.iloc[0]


def _ranks(table: pd.DataFrame, scenario: str, step: int = 0) -> dict[int, int]:
    rows = table[(table["scenario"] == scenario) & (table["rank"] >= 0) & (table["step"] == step)]
    return dict(zip(rows["rank"].tolist(), rows["predicted_ns"].tolist()))


# --- scenarios as values -------------------------------------------------------------------------------------

def test_scenario_text_round_trips():
    for text in ("overlap", "overlap:category=all_reduce+p2p,dim=tp", "comm_faster:k=2", "comm_faster:k=1.5,dim=dp",
                 "no_straggler", "no_straggler:rank=7", "no_host_bound", "pipeline:m=16",
                 "pipeline:v=2", "pipeline:schedule=gpipe", "pipeline:m=8,keep=batch"):
        assert str(Scenario.parse(text)) == text
    scenario = Scenario.parse("comm_faster:k=3,category=p2p")
    assert scenario.kind is ScenarioKind.COMM_FASTER and scenario.k == 3.0
    assert scenario.selected() == ("p2p_send", "p2p_recv")
    assert Scenario.parse("pipeline:m=8,keep=batch").keep is Keep.BATCH


@pytest.mark.parametrize("text, words", [
    ("faster", ["unknown scenario 'faster'", "comm_faster"]),
    ("comm_faster:k=0,category=allreduce", ["k=0.0", "category=['allreduce']"]),
    ("no_straggler:rank=x", ["rank='x'"]),
    ("overlap:k=2,speed=3", ["unknown keys ['k', 'speed']", "['category', 'dim']"]),
    ("pipeline:m=0,schedule=zb", ["m=0", "schedule='zb'"]),
    ("pipeline:m=8,m=4", ["repeated keys ['m']"]),
    ("pipeline:keep=all", ["keep='all'"]),
])
def test_a_bad_scenario_names_every_offending_value(text, words):
    with pytest.raises(ScenarioError) as info:
        Scenario.parse(text)
    for word in words:
        assert word in str(info.value), info.value


# --- perfect overlap -------------------------------------------------------------------------------------------

def test_overlap_removes_exactly_the_exposed_communication_on_the_path(synth):
    # Truth: the generator's path rows; each rank's work is its compute (nothing else but communication).
    offsets = [0, 40, -25, 7]
    rows, truth = synth.straggler_all_reduce(world=4, straggler=2, compute=1000, extra=600, transfer=200,
                                             offsets=offsets)
    table = what_if(synth.to_frame(rows), "overlap")
    comm_on_path = sum(end - start for _, label, start, end in truth["path"] if label != "compute")
    row = _step(table, "overlap")
    assert (row["measured_ns"], row["predicted_ns"], row["method"]) == (truth["end"], truth["end"] - comm_on_path,
                                                                        Method.REPLAY.value)
    assert _ranks(table, "overlap") == {0: 1000, 1: 1000, 2: 1600, 3: 1000}
    assert set(table.loc[table["rank"] >= 0, "method"]) == {Method.BOUND.value}

    rows, truth = synth.zero3_step(world=3, slow=1)
    table = what_if(synth.to_frame(rows), "overlap")
    transfers = sum(end - start for _, label, start, end in truth["path"] if label.endswith("transfer"))
    assert _step(table, "overlap")["predicted_ns"] == truth["end"] - transfers == 4200
    assert _ranks(table, "overlap") == {0: 3 * 1000, 1: 3 * 1400, 2: 3 * 1000}  # three layers of compute each


def test_overlap_keeps_the_waits_on_the_path(synth):
    # A pipeline seen through p2p: with every transfer hidden the path is its compute alone, the textbook
    # 1F1B makespan (m + p - 1)(f + b) (the closing all-reduce is communication too).
    p, m, f, b = 3, 6, 1000, 2000
    rows, _ = synth.spinning_pipeline(p, m, f=f, b=b, steps=1)
    row = _step(what_if(synth.to_frame(rows), "overlap"), "overlap")
    assert row["predicted_ns"] == (m + p - 1) * (f + b)


def test_overlap_of_a_pipeline_whose_p2p_is_all_waiting(synth):
    # The generator's p2p is instantaneous: its receive kernels spin over the waits for the previous stage
    # (bubble), so hiding communication under compute saves nothing.
    rows, truth = synth.one_f_one_b(4, 4)
    for scenario in ("overlap", "comm_faster:k=8"):
        row = _step(what_if(synth.to_frame(rows), scenario), scenario)
        assert row["predicted_ns"] == row["measured_ns"] == truth["makespan"]


# --- faster communication ----------------------------------------------------------------------------------------

def test_comm_two_times_faster_halves_the_transfer_on_the_path(synth):
    rows, _ = synth.straggler_all_reduce(transfer=200, offsets=[0, 5, -7, 11])
    _, faster = synth.straggler_all_reduce(transfer=100, offsets=[0, 5, -7, 11])  # the world it predicts
    table = what_if(synth.to_frame(rows), "comm_faster:k=2")
    assert _step(table, "comm_faster:k=2")["predicted_ns"] == faster["end"] == 1700
    assert set(_ranks(table, "comm_faster:k=2").values()) == {faster["end"]}  # waits stay: only transfer shrinks

    rows, _ = synth.zero3_step()
    _, faster = synth.zero3_step(gather=50, prefetch=150, scatter=75)
    table = what_if(synth.to_frame(rows), ["comm_faster:k=2", "comm_faster:k=2,category=all_gather"])
    assert _step(table, "comm_faster:k=2")["predicted_ns"] == faster["end"]
    assert set(_ranks(table, "comm_faster:k=2").values()) == {faster["end"]}
    _, gathers_only = synth.zero3_step(gather=50, prefetch=150)
    assert _step(table, "comm_faster:k=2,category=all_gather")["predicted_ns"] == gathers_only["end"]


def test_comm_faster_by_dim_after_a_full_load(synth, tmp_path):
    # Loaded from Kineto files, so the classifier gives the mesh_dp group its dim (dp).
    rows, _ = synth.zero3_step(scatter=200, offsets=[0, 40, -25])
    synth.write_kineto(rows, tmp_path)
    _, faster = synth.zero3_step(gather=25, prefetch=75, scatter=50)
    table = what_if(load(tmp_path), ["comm_faster:k=4,dim=dp", "comm_faster:k=4,dim=tp"])
    assert _step(table, "comm_faster:k=4,dim=dp")["predicted_ns"] == faster["end"]
    row = _step(table, "comm_faster:k=4,dim=tp")
    assert row["predicted_ns"] == row["measured_ns"]  # no tp communication here


# --- no straggler ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("straggler", [2, 0])
def test_without_the_straggler_the_step_is_the_other_ranks(synth, straggler):
    offsets = [0, 30, -12, 9]
    rows, _ = synth.straggler_all_reduce(straggler=straggler, extra=600, offsets=offsets)
    _, on_time = synth.straggler_all_reduce(straggler=straggler, extra=0, offsets=offsets)
    for text in ("no_straggler", f"no_straggler:rank={straggler}"):  # the named rank, or the measured one
        table = what_if(synth.to_frame(rows), text)
        row = _step(table, text)
        assert row["predicted_ns"] == on_time["end"] == 1200
        assert f"straggler rank {straggler}" in row["note"]
        assert set(_ranks(table, text).values()) == {on_time["end"]}


def test_without_the_zero3_straggler(synth):
    # The slow rank's late all-gather made the others wait, then its own longer layers did: both go.
    rows, _ = synth.zero3_step(slow=1, compute=1000, slow_compute=1400)
    _, on_time = synth.zero3_step(slow=1, compute=1000, slow_compute=1000)
    table = what_if(synth.to_frame(rows), "no_straggler:rank=1")
    assert _step(table, "no_straggler:rank=1")["predicted_ns"] == on_time["end"] == 3350
    assert _ranks(table, "no_straggler:rank=1") == {0: 3350, 1: 3350, 2: 3350}


def test_no_straggler_needs_collectives_or_a_rank(synth):
    rows, _ = synth.idle_causes_steps()
    with pytest.raises(ScenarioError, match="give rank=R"):
        what_if(synth.to_frame(rows), "no_straggler")
    with pytest.raises(ScenarioError, match="rank 5 has no work"):
        what_if(synth.to_frame(rows), "no_straggler:rank=5")


# --- no host-bound idle ---------------------------------------------------------------------------------------

def test_no_host_bound_removes_exactly_the_host_bound_idle_on_the_path(synth):
    rows, truth = synth.idle_causes_steps()
    table = what_if(synth.to_frame(rows), "no_host_bound")
    for step, host_bound in zip(truth["step"], truth["idle_host_bound"]):
        assert _step(table, "no_host_bound", step)["predicted_ns"] == 500 - host_bound
        assert _ranks(table, "no_host_bound", step) == {0: 500 - host_bound}


@pytest.mark.parametrize("busy", [0, 1])
def test_a_rank_computing_through_the_step_keeps_it(synth, busy):
    # One rank computes through both steps, the other is the idle-causes rank; they never talk, so the step
    # ends when the busy one ends, whatever the other's host does. busy=0: the path is the busy rank's (the
    # documented tie: the lowest rank), the idle off the path saves nothing; busy=1: the path is the idle
    # rank's, and its replay (500 - host-bound) is floored at the busy rank's own work.
    idle = 1 - busy
    rows, truth = synth.idle_causes_steps(rank=idle)
    t0 = 1_000_000
    for step in (1, 2):
        lo = t0 + 500 * (step - 1)
        # Uncategorised like the generator's own rows: the whole table is classified once.
        rows += [synth.gpu_event(busy, "compute", lo, 500), synth.annotation(busy, f"ProfilerStep#{step}", lo, 500)]
    table = what_if(synth.to_frame(rows), "no_host_bound")
    for step, host_bound in zip(truth["step"], truth["idle_host_bound"]):
        assert _step(table, "no_host_bound", step)["predicted_ns"] == 500
        assert _ranks(table, "no_host_bound", step) == {busy: 500, idle: 500 - host_bound}


# --- pipelines ------------------------------------------------------------------------------------------------

def _within(predicted: int, truth: int, share: float = 0.05) -> bool:
    """The pipeline what-if's contract (issue 20): within 5% of the generator's own step. The timing model
    here is the generators', so it is in fact exact; 5% leaves room for a model that is not."""
    return abs(predicted - truth) <= share * truth


def test_pipeline_other_m_from_annotations(synth, tmp_path):
    rows, _ = synth.one_f_one_b(4, 4)
    synth.write_kineto(rows, tmp_path)
    _, truth = synth.one_f_one_b(4, 8)
    table = what_if(load(tmp_path), "pipeline:m=8")
    row = _step(table, "pipeline:m=8")
    assert row["method"] == Method.SIMULATION.value and "micro-batch size kept" in row["note"]
    assert _within(row["predicted_ns"], truth["makespan"])
    assert all(_within(v, truth["makespan"]) for v in _ranks(table, "pipeline:m=8").values())


@pytest.mark.parametrize("p, m, new", [(4, 4, 8), (3, 6, 3), (3, 6, 12)])
def test_pipeline_other_m_from_p2p_alone(synth, p, m, new):
    # No annotations: F, B and the transfer come from the spinning send/recv kernels and the compute between.
    rows, _ = synth.spinning_pipeline(p, m, offsets=[0, 300, -200, 50][:p])
    _, truth = synth.spinning_pipeline(p, new)
    table = what_if(synth.to_frame(rows), f"pipeline:m={new}")
    for step in (0, 1):
        expected = truth["step_end"][step] - truth["step_start"][step]
        assert _within(_step(table, f"pipeline:m={new}", step)["predicted_ns"], expected)


def test_pipeline_other_schedule(synth):
    rows, _ = synth.spinning_pipeline(4, 4, schedule="1f1b", steps=1)
    _, truth = synth.spinning_pipeline(4, 4, schedule="gpipe", steps=1)
    row = _step(what_if(synth.to_frame(rows), "pipeline:schedule=gpipe"), "pipeline:schedule=gpipe")
    assert _within(row["predicted_ns"], truth["step_end"][0])
    rows, _ = synth.spinning_pipeline(4, 8, schedule="gpipe", steps=1)
    _, truth = synth.spinning_pipeline(4, 8, schedule="1f1b", steps=1)
    row = _step(what_if(synth.to_frame(rows), "pipeline:schedule=1f1b"), "pipeline:schedule=1f1b")
    assert _within(row["predicted_ns"], truth["step_end"][0])


def test_pipeline_interleaved_matches_the_closed_form(synth):
    # Narayanan et al. (2021): interleaving v chunks cuts 1F1B's bubble to (p - 1)(t_f + t_b) / v, so the
    # step is m (t_f + t_b) + (p - 1)(t_f + t_b) / v (equal F and B: the closed form holds exactly).
    p, m, f, b, v = 4, 4, 100, 100, 2
    rows, truth = synth.one_f_one_b(p, m, f=f, b=b)
    row = _step(what_if(synth.to_frame(rows), f"pipeline:v={v}"), f"pipeline:v={v}")
    assert row["measured_ns"] == truth["makespan"]
    assert _within(row["predicted_ns"], m * (f + b) + (p - 1) * (f + b) // v)


def test_pipeline_keep_the_global_batch(synth):
    # Twice the micro-batches at half the size: the generator's m=8 trace with F and B halved.
    rows, _ = synth.one_f_one_b(4, 4, f=200, b=400)
    _, truth = synth.one_f_one_b(4, 8, f=100, b=200)
    row = _step(what_if(synth.to_frame(rows), "pipeline:m=8,keep=batch"), "pipeline:m=8,keep=batch")
    assert _within(row["predicted_ns"], truth["makespan"]) and "global batch kept" in row["note"]


def test_pipeline_needs_a_pipeline_and_a_buildable_schedule(synth):
    rows, _ = synth.straggler_all_reduce()
    with pytest.raises(ScenarioError, match="no pipeline"):
        what_if(synth.to_frame(rows), "pipeline:m=8")
    rows, _ = synth.one_f_one_b(4, 4)
    with pytest.raises(ScenarioError, match="multiple of"):
        what_if(synth.to_frame(rows), "pipeline:v=2,m=6")  # interleaving needs m % p == 0
    with pytest.raises(ScenarioError, match="needs schedule=interleaved"):
        what_if(synth.to_frame(rows), "pipeline:v=2,schedule=gpipe")


# --- the table and the command line -----------------------------------------------------------------------------

def test_every_row_states_its_method_and_the_columns(synth):
    rows, _ = synth.straggler_all_reduce()
    table = what_if(synth.to_frame(rows), ["overlap", "comm_faster:k=2", "no_straggler", "no_host_bound"])
    assert list(table.columns) == ["step", "rank", "scenario", "method", "measured_ns", "predicted_ns", "saved_ns",
                                   "note"]
    assert set(table["method"]) <= {m.value for m in Method}
    assert np.array_equal(table["saved_ns"], table["measured_ns"] - table["predicted_ns"])
    assert (table.groupby("scenario")["rank"].apply(lambda r: (r == -1).sum()) == 1).all()


def test_cli_whatif(synth, tmp_path, capsys):
    rows, _ = synth.straggler_all_reduce(transfer=200)
    _, faster = synth.straggler_all_reduce(transfer=100)
    synth.write_kineto(rows, tmp_path / "run")
    assert main(["profile", "whatif", str(tmp_path / "run"), "--scenario", "comm_faster:k=2", "--scenario",
                 "overlap", "--format", "csv"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)
    assert _step(table, "comm_faster:k=2")["predicted_ns"] == faster["end"]
    assert main(["profile", "whatif", str(tmp_path / "run"), "--scenario", "no_straggler"]) == 0
    out = capsys.readouterr().out
    assert "critical-path replay" in out and "straggler rank 2" in out
    assert main(["profile", "whatif", str(tmp_path / "run"), "--scenario", "comm_faster:k=-1"]) == 2
    assert "k=-1.0" in capsys.readouterr().err
