"""The job generator (``job_traces.write_job``) against the real profiler: its traces load like torch's, and the
analyses recover the job's structure (ranks, steps, process groups, the pipeline) and its ground truth."""

from __future__ import annotations

import gzip
import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from shardline.profiling.base.errors import TraceWarning

_SPEC = importlib.util.spec_from_file_location("shardline_tests_job_traces", Path(__file__).with_name("job_traces.py"))
job_traces = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(job_traces)

COMM = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p_send", "p2p_recv")
DIM_OF_DESC = {"TENSOR_MODEL_PARALLEL_GROUP": "tp", "DATA_PARALLEL_GROUP": "dp", "PIPELINE_MODEL_PARALLEL_GROUP": "pp"}


def _load(folder: Path):
    from shardline.profiling import load

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traceset = load(folder)
    return traceset, [str(w.message) for w in caught if issubclass(w.category, TraceWarning)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The tiny default job (tp=2, pp=2, dp=2, 2 steps of 4 micro-batches), written and loaded once."""
    folder = tmp_path_factory.mktemp("job")
    truth = job_traces.write_job(folder)
    traceset, notes = _load(folder)
    return folder, truth, traceset, notes


def test_every_rank_loads_as_written(job):
    folder, truth, traceset, notes = job
    world = truth["world"]
    assert world == 8 and notes == []
    assert traceset.ranks == tuple(range(world))
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"rank{r}.pt.trace.json.gz" for r in range(world))
    rows = traceset.events.groupby("rank").size()
    assert rows.tolist() == truth["rows"]  # every complete event read, nothing more
    gpu = traceset.events[traceset.events["lane"].astype(str) == "gpu"]
    assert gpu[gpu["cat"].astype(str) != "gpu_user_annotation"].groupby("rank").size().tolist() == truth["kernels"]

    doc = json.loads(gzip.open(truth["files"][3]).read())
    assert doc["distributedInfo"]["rank"] == 3 and doc["distributedInfo"]["world_size"] == world
    assert doc["distributedInfo"]["backend"] == "nccl" and doc["schemaVersion"] == 1
    assert doc["deviceProperties"][3]["name"] == job_traces.DEVICE_NAME
    assert isinstance(doc["baseTimeNanoseconds"], int) and list(doc)[-1] == "baseTimeNanoseconds"
    assert len(doc["traceEvents"]) == truth["events"][3]
    # Activities in time order (Kineto's metadata, Trace span and instants close the array).
    activity = [e for e in doc["traceEvents"] if e["ph"] in ("X", "s", "f") and e.get("cat") != "Trace"]
    ts = [float(e["ts"]) for e in activity]
    assert ts == sorted(ts)
    steps = [e for e in activity if e["name"].startswith("ProfilerStep#")]
    assert [(e["name"], e["cat"]) for e in steps] == [("ProfilerStep#2", "user_annotation"),
                                                      ("ProfilerStep#2", "gpu_user_annotation"),
                                                      ("ProfilerStep#3", "user_annotation"),
                                                      ("ProfilerStep#3", "gpu_user_annotation")]


def test_breakdown_sees_compute_tp_p2p_and_the_bubble(job):
    from shardline.profiling import attribute, breakdown
    from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS
    from shardline.profiling.matching.pipelines import BubbleMethod, rank_pipelines

    _, truth, traceset, _ = job
    table = breakdown(traceset)
    assert sorted(zip(table["rank"], table["step"])) == [(r, s) for r in range(truth["world"]) for s in truth["steps"]]
    assert (table[list(EXCLUSIVE_COLUMNS)].sum(axis=1) == table["step_ns"]).all()
    for column in ("compute", "all_reduce", "reduce_scatter", "all_gather", "p2p_send", "p2p_recv", "bubble"):
        assert (table[column] > 0).all(), column
    assert (table["compute"] > 0.4 * table["step_ns"]).all()
    pipelines, notes = rank_pipelines(attribute(traceset))
    assert notes == ()
    assert {r: p.method for r, p in pipelines.items()} == dict.fromkeys(range(truth["world"]), BubbleMethod.P2P_MATCHED)


def test_collectives_match_across_every_group_member_by_seq(job):
    from shardline.profiling.matching.collectives import match_collectives

    _, truth, traceset, _ = job
    matched = match_collectives(traceset)
    groups = truth["groups"]
    assert (matched["members"] == matched["group"].map(lambda g: len(groups[g]["ranks"]))).all()
    used = {name: info for name, info in groups.items() if info["collectives"]}
    descs = {info["desc"] for info in used.values()}
    assert descs == {"TENSOR_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP", "MODEL_PARALLEL_GROUP"}
    assert set(matched["group"]) == set(used)
    for name, info in used.items():
        mine = matched[matched["group"] == name]
        calls = sum(info["collectives"].values())
        # Every member made every call, and the Seq numbers (one counter per group) run without a gap.
        assert sorted(mine["rank"].unique().tolist()) == info["ranks"]
        for _, seqs in mine.groupby("rank")["instance"]:
            assert sorted(seqs.tolist()) == list(range(info["seq0"], info["seq0"] + calls))


def test_dims_from_the_megatron_group_descriptions(job):
    _, truth, traceset, _ = job
    ev = traceset.events
    comm = ev[ev["category"].astype(str).isin(COMM)]
    desc, dim = comm["pg_desc"].astype(str), comm["dim"].astype(str)
    for text, want in DIM_OF_DESC.items():
        assert (dim[desc == text] == want).all() and (desc == text).any(), text
    kernels = comm[(comm["lane"].astype(str) == "gpu") & (comm["cat"].astype(str) == "kernel")]
    p2p = kernels["category"].astype(str).isin(("p2p_send", "p2p_recv"))
    assert (kernels.loc[p2p, "dim"].astype(str) == "pp").all() and p2p.any()
    assert set(kernels.loc[p2p, "name"].astype(str)) == {job_traces.SEND_RECV}
    tp_kernels = kernels[kernels["pg_desc"].astype(str) == "TENSOR_MODEL_PARALLEL_GROUP"]
    assert set(tp_kernels["category"].astype(str)) == {"all_reduce", "broadcast"}
    dp_kernels = kernels[kernels["dim"].astype(str) == "dp"]
    assert set(dp_kernels["category"].astype(str)) == {"reduce_scatter", "all_gather"}
    # Megatron's MODEL_PARALLEL_GROUP is tp x pp: our grid's combined "mp" axis.
    assert set(kernels.loc[kernels["pg_desc"].astype(str) == "MODEL_PARALLEL_GROUP", "dim"].astype(str)) == {"mp"}


def test_bubble_is_the_receive_wait_on_one_clock(tmp_path):
    """Without clock skew the breakdown's bubble is exactly the time the receives spun before their send."""
    from shardline.profiling import breakdown

    truth = job_traces.write_job(tmp_path, clock_skew_ns=0, seed=1)
    traceset, notes = _load(tmp_path)
    assert notes == []
    table = breakdown(traceset)
    for row in table.itertuples(index=False):
        assert row.bubble == truth["recv_wait_ns"][truth["steps"].index(row.step), row.rank] > 0


def test_clock_offsets_recovered_on_every_rank(job):
    # Exactly, to the ns, on every rank: also those that share no group with rank 0 (aligned through the ranks
    # they do share one with), with absolute ns times (~1.7e18: a float would round them to 256 ns).
    from shardline.profiling.matching.collectives import match_collectives

    _, truth, traceset, _ = job
    got = match_collectives(traceset).groupby("rank")["offset_ns"].first()
    want = np.array(truth["clock_offset_ns"]) - truth["clock_offset_ns"][0]
    assert got.tolist() == want.tolist()


def test_files_sized_by_mb_per_rank(tmp_path):
    truth = job_traces.write_job(tmp_path, mb_per_rank=2, gzip_files=False)
    sizes = [p.stat().st_size for p in truth["files"]]
    assert sizes == truth["bytes"]
    assert all(1.6e6 <= size <= 2.4e6 for size in sizes), sizes
    assert len(truth["steps"]) > 2  # more steps than the default


def test_thirty_two_ranks_generate_and_load(tmp_path):
    truth = job_traces.write_job(tmp_path, tp=2, pp=4, dp=4, steps=1, micro_batches=4)
    traceset, notes = _load(tmp_path)
    assert traceset.ranks == tuple(range(32)) and notes == []
    assert truth["pipelines"][0] == [0, 2, 4, 6]


@pytest.mark.parametrize("layout, seed", [(dict(tp=1, pp=4, dp=2), 4), (dict(tp=2, pp=4, dp=1), 2),
                                          (dict(tp=2, pp=2, dp=2), 6)])
def test_the_straggler_of_a_pipelined_job_is_its_slow_rank_not_the_first_stage(tmp_path, layout, seed):
    """The job's slow rank (15% slower compute) is named on every step; the grad-norm all-reduce over
    MODEL_PARALLEL_GROUP (tp x pp: every stage), where the last stage waits out the first stage's cool-down, is
    left out of the count as a group across stages, by its ranks or (no pipeline ranks traced) by its dim."""
    from shardline.profiling.attribution.core import attribute
    from shardline.profiling.matching.collectives import match_collectives, pipeline_stages, stragglers

    truth = job_traces.write_job(tmp_path, seed=seed, **layout)
    tp, pp, dp = layout["tp"], layout["pp"], layout["dp"]
    first_stage = {job_traces.rank_of(d, 0, t, tp=tp, pp=pp) for d in range(dp) for t in range(tp)}
    assert truth["straggler"] not in first_stage  # else the test could not tell the two apart
    traceset, _ = _load(tmp_path)
    events = attribute(traceset).events
    stages = pipeline_stages(events)
    assert stages == {job_traces.rank_of(d, s, t, tp=tp, pp=pp): s
                      for d in range(dp) for s in range(pp) for t in range(tp)}

    matched = match_collectives(traceset)
    crossing = set(matched.loc[matched["cross_stage"], "group"])
    descs = set(events.loc[events["pg_name"].astype(str).isin(crossing), "pg_desc"].astype(str))
    assert descs == {"MODEL_PARALLEL_GROUP"}
    steps = len(truth["steps"])
    assert stragglers(matched)["straggler_rank"].tolist() == [truth["straggler"]] * steps
    if pp == 4:  # counted, the cool-down names a first-stage rank on every step: what this guards against
        assert set(stragglers(matched.drop(columns="cross_stage"))["straggler_rank"]) <= first_stage

    # No pipeline group's ranks and no peers (the pipeline is seen only by its groups' sizes): in this pipelined
    # job the groups of dims pp / mp / embed / world cross stages
    blind = events.copy()
    pp_rows = blind["dim"].astype(str) == "pp"
    blind["pg_ranks"] = blind["pg_ranks"].where(~pp_rows, "")
    blind["peer"] = blind["peer"].where(~pp_rows, -1)
    assert pipeline_stages(blind) == {}
    again = match_collectives(blind)
    assert set(again.loc[again["cross_stage"], "group"]) == crossing
    assert stragglers(again)["straggler_rank"].tolist() == [truth["straggler"]] * steps


@pytest.mark.parametrize("layout, seed", [(dict(tp=1, pp=4, dp=2), 4), (dict(tp=2, pp=2, dp=2), 6),
                                          (dict(tp=2, pp=1, dp=4), 3)])
def test_no_straggler_predicts_the_same_job_without_its_slow_rank(tmp_path, monkeypatch, layout, seed):
    """``what_if(no_straggler)`` against the truth: the same job (same seed, same jitter) written again with the
    slow rank at full speed. The straggler's stretches of the path are cut to its stage's peers (another stage
    does other work in the same span: compared with every rank, the cut was 0 on a pipelined job). Within 1.5%
    of the true step (measured: 0.2-1.1%); the finding names the slowdown against the stage's other ranks."""
    from shardline.profiling import load
    from shardline.profiling.present.report_sections import findings
    from shardline.profiling.present.scenarios import what_if

    def steps(folder):
        table = what_if(load(folder), "no_straggler")
        whole = table[table["rank"] == -1].sort_values("step")
        return whole["measured_ns"].to_numpy(float), whole["predicted_ns"].to_numpy(float)

    slowdown = job_traces.STRAGGLER_SLOWDOWN
    truth = job_traces.write_job(tmp_path / "slow", seed=seed, **layout)
    measured, predicted = steps(tmp_path / "slow")
    monkeypatch.setattr(job_traces, "STRAGGLER_SLOWDOWN", 1.0)
    job_traces.write_job(tmp_path / "even", seed=seed, **layout)
    without, _ = steps(tmp_path / "even")
    assert (measured - without > 0.05 * without).all()  # the slow rank costs the job >5%: there is a saving to find
    assert np.abs(predicted - without).max() <= 0.015 * without.min(), (measured, predicted, without)

    text = findings(load(tmp_path / "slow")).set_index("rule").loc["straggler", "text"]
    assert text.startswith(f"rank {truth['straggler']} is last")
    if layout["pp"] > 1:
        share = float(text.split("its compute is ")[1].split("%")[0]) / 100
        assert "the median of its pipeline stage's other ranks" in text
        assert abs(share - (slowdown - 1)) < 0.02, text


def test_a_cpu_only_view_matches_each_call_in_its_own_group(job):
    """The job as a CPU-only profile would show it (no kernels: ``activities=[CPU]``): a rank's calls are matched
    by the outermost op, ``c10d::allreduce_`` and friends, which carry no group; each takes the group, seq and
    dim of the ``record_param_comms`` inside it, so every instance is one call per member of one real group
    (before, every group's calls fell into one anonymous group matched by order)."""
    from shardline.profiling.attribution.core import attribute
    from shardline.profiling.matching.collectives import match_collectives

    folder, truth, traceset, _ = job
    events = traceset.events
    cpu = events[events["lane"].astype(str) != "gpu"].reset_index(drop=True)
    classified = attribute(cpu).events
    c10d = classified[classified["name"].astype(str).str.startswith("c10d::")]
    assert len(c10d) and set(c10d["dim"].astype(str)) == {"tp", "dp", "pp", "mp"}
    assert (c10d["pg_name"].astype(str) != "").all()
    collective = ~c10d["category"].astype(str).str.startswith("p2p")
    assert collective.any() and (c10d.loc[collective, "seq"] >= 0).all()  # the seq they are matched by

    matched = match_collectives(cpu)
    members = classified.drop_duplicates("pg_name").set_index(classified.drop_duplicates("pg_name")["pg_name"]
                                                             .astype(str))["pg_ranks"].astype(str)
    assert set(matched["group"]) <= set(members.index) and "" not in set(matched["group"])
    for (group, _, _), part in matched.groupby(["group", "category", "instance"]):
        assert sorted(part["rank"]) == [int(r) for r in members[group].strip("[]").split(",")], group


def test_an_outer_op_takes_only_the_record_of_its_own_collective():
    """``c10d::allreduce_`` holding first another call's record (an all-gather on a helper group), then its own:
    it takes its own group and seq, not the first nested record's; a c10d op with only another call inside keeps
    no group."""
    import pandas as pd

    from shardline.profiling.base.schema import conform
    from shardline.profiling.table.classify import classify_events

    def op(name, start, dur, **args):
        return {"rank": 0, "lane": "cpu", "device": -1, "stream": 11, "name": name, "cat": "cpu_op",
                "start_ns": start, "dur_ns": dur, **args}

    helper = dict(collective="allgather", pg_name="9", pg_desc="HELPER", pg_ranks="[0, 1]", pg_size=2, seq=7)
    own = dict(collective="allreduce", pg_name="0", pg_desc="TENSOR_MODEL_PARALLEL_GROUP", pg_ranks="[0, 1]",
               pg_size=2, seq=3)
    rows = [op("c10d::allreduce_", 0, 100), op("record_param_comms", 5, 10, **helper),
            op("record_param_comms", 20, 70, **own),
            op("c10d::allreduce_", 200, 100), op("record_param_comms", 205, 10, **helper)]
    out = classify_events(conform(pd.DataFrame(rows)))
    first, second = out.iloc[0], out.iloc[3]
    assert (str(first["pg_name"]), int(first["seq"]), str(first["dim"])) == ("0", 3, "tp")
    assert str(second["pg_name"]) == "" and int(second["seq"]) == -1


def test_a_job_of_one_stage_has_no_group_across_stages_and_its_finding_says_so(tmp_path):
    """pp=1: Megatron's MODEL_PARALLEL_GROUP is the tp group (dim mp) and crosses nothing; every group counts."""
    from shardline.profiling.matching.collectives import match_collectives, stragglers
    from shardline.profiling.present.report_sections import findings

    truth = job_traces.write_job(tmp_path, seed=3, tp=2, pp=1, dp=4)
    traceset, _ = _load(tmp_path)
    matched = match_collectives(traceset)
    assert not matched["cross_stage"].any() and "mp" in set(matched["dim"])
    assert stragglers(matched)["straggler_rank"].tolist() == [truth["straggler"]] * len(truth["steps"])
    text = findings(traceset).set_index("rule").loc["straggler", "text"]
    assert "pipeline stage" not in text and "above the median" in text


@pytest.mark.parametrize("hide", ["descriptions", "world"])
def test_the_pipelined_straggler_without_group_descriptions_or_with_a_world_group(tmp_path, hide):
    """Older traces name no group (no ``pg_desc``: every dim unknown): the stages come from the sends' and
    receives' peers. A pipelined job whose cross-stage group is the world (a loss all-reduce on default_pg) and
    whose pipeline ranks are not known: the world group crosses stages by its dim."""
    import pandas as pd

    from shardline.profiling.attribution.core import attribute
    from shardline.profiling.matching.collectives import match_collectives, pipeline_stages, stragglers

    truth = job_traces.write_job(tmp_path, seed=4, tp=1, pp=4, dp=2)
    traceset, _ = _load(tmp_path)
    if hide == "descriptions":
        table = traceset.events.copy()
        for column in ("pg_desc", "category", "dim"):  # unclassified again, without descriptions
            table[column] = pd.Categorical([""] * len(table))
        assert set(attribute(table).events["dim"].astype(str)) <= {"", "unknown"}
        assert pipeline_stages(table) == {job_traces.rank_of(d, s, 0, tp=1, pp=4): s
                                          for d in range(2) for s in range(4)}
    else:
        table = attribute(traceset).events.copy()
        dims = table["dim"].astype(str)
        pp_rows = (dims == "pp").to_numpy()
        table["pg_ranks"] = table["pg_ranks"].where(~pp_rows, "")
        table["peer"] = table["peer"].where(~pp_rows, -1)
        table["dim"] = pd.Categorical(dims.replace({"mp": "world"}))
        assert pipeline_stages(table) == {}
    matched = match_collectives(table)
    assert matched["cross_stage"].any()
    assert stragglers(matched)["straggler_rank"].tolist() == [truth["straggler"]] * len(truth["steps"])
