"""Bubbles of torch.distributed.pipelining traces, read through ``pipeline_adapters``.

Real traces: ``PipelineStage`` on 2 forked gloo ranks under ``torch.profiler`` (CPU activities), one Chrome trace
per rank. torch 2.13's ``ScheduleGPipe`` records ``Forward i`` / ``Backward i``; ``ScheduleInterleaved1F1B`` with
one stage per rank runs the 1F1B order through the runtime that records ``PP:{stage}{action}{microbatch}``, with
two stages per rank (r, r+p) the interleaved order; ``ScheduleDualPipeV`` (stages r and 2p-1-r) adds the
overlapped ``PP:(aFi;bBj)OVERLAP_F_B`` spans; ``Schedule1F1B`` records no span at all (its schedules.py code has
no ``record_function``), so it is measured from its send/recv alone (``p2p``). A synthetic frame with the exact
names checks the adapter's arithmetic to the ns.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")

WORLD, M = 2, 4


def _run_profiled(rank, world, folder, schedule, m):
    import torch.distributed.pipelining as pipelining
    from torch import nn

    torch.manual_seed(0)
    cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
           "interleaved": pipelining.ScheduleInterleaved1F1B, "interleaved_v2": pipelining.ScheduleInterleaved1F1B,
           "dualpipev": pipelining.ScheduleDualPipeV}[schedule]
    loss = lambda o, t: ((o - t) ** 2).mean()  # noqa: E731
    if schedule in ("interleaved_v2", "dualpipev"):  # two stages per rank: r and r+p, or the V's r and 2p-1-r
        index = [rank, rank + world] if schedule == "interleaved_v2" else [rank, 2 * world - 1 - rank]
        stages = [pipelining.PipelineStage(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), i, 2 * world,
                                           torch.device("cpu")) for i in index]
        sched = cls(stages, m, loss_fn=loss)
    else:
        stage = pipelining.PipelineStage(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), rank, world,
                                         torch.device("cpu"))
        sched = cls([stage] if schedule == "interleaved" else stage, m, loss_fn=loss)
    x, target = torch.randn(8 * m, 64), torch.zeros(8 * m, 64)

    def step():
        if schedule == "dualpipev":  # the V: rank 0 holds the first and the last stage
            sched.step(x, target=target, losses=[]) if rank == 0 else sched.step()
        else:
            sched.step(x) if rank == 0 else sched.step(target=target, losses=[])

    step()  # warm-up outside the profile (first-call allocations, gloo pairs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    prof.export_chrome_trace(str(folder / f"rank{rank}.pt.trace.json"))
    return rank


SCHEDULES = ("gpipe", "interleaved", "1f1b", "interleaved_v2", "dualpipev")


def _run_all(rank, world, folders, m):
    """Every schedule on one process group (one fork and gloo rendezvous for all), one trace each."""
    for schedule, folder in zip(SCHEDULES, folders):
        _run_profiled(rank, world, folder, schedule, m)
    return rank


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    from shardline.plugins.testing import run_ranks
    from shardline.profiling.table.load import load

    folders = [tmp_path_factory.mktemp(schedule) for schedule in SCHEDULES]
    assert run_ranks(_run_all, WORLD, folders, M, timeout=180) == [0, 1]
    return {schedule: load(folder) for schedule, folder in zip(SCHEDULES, folders)}


@pytest.mark.parametrize(("schedule", "name"), [("gpipe", "gpipe"), ("interleaved", "1f1b")])
def test_real_torch_pipelining_trace_gives_measured_bubbles(traces, schedule, name):
    from shardline.profiling.analyses.bubbles import pipeline_bubbles
    from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, breakdown
    from shardline.profiling.matching.pipelines import BubbleMethod

    traceset = traces[schedule]
    table = breakdown(traceset)
    # The profiler's invariant: the exclusive parts partition every step exactly (integer ns).
    assert (table[list(EXCLUSIVE_COLUMNS)].sum(axis=1) == table["step_ns"]).all()

    bubbles = pipeline_bubbles(traceset).set_index("rank")
    assert sorted(bubbles.index) == [0, 1]
    assert (bubbles["method"] == BubbleMethod.TORCH_PIPELINING.value).all()
    assert bubbles.loc[[0, 1], "stage"].tolist() == [0, 1]
    assert (bubbles["p"] == WORLD).all() and (bubbles["m"] == M).all() and (bubbles["m_seen"] == M).all()
    assert (bubbles["v"] == 1).all() and (bubbles["schedule"] == name).all()
    assert (bubbles["ideal_fraction"] == (WORLD - 1) / (M + WORLD - 1)).all()
    phases = bubbles[["warmup_ns", "steady_ns", "cooldown_ns"]].sum(axis=1)
    assert (phases == bubbles["bubble_ns"]).all()  # exact: integer ns, each in one phase
    assert ((bubbles["bubble_ns"] > 0) & (bubbles["bubble_ns"] < bubbles["batch_ns"])).all()
    # The last stage waits for its first activation, the first stage for its first gradient.
    assert bubbles.loc[WORLD - 1, "warmup_ns"] > 0
    assert bubbles.loc[0, "warmup_ns"] > 0
    # Each batch window lies inside its rank's attributed window, so the bubble never exceeds the step.
    steps = table.set_index("rank")["step_ns"]
    assert (bubbles["batch_ns"] <= steps.loc[bubbles.index]).all()


@pytest.mark.parametrize(("schedule", "name", "ideal"), [
    ("interleaved_v2", "interleaved", (WORLD - 1) / (2 * M + WORLD - 1)), ("dualpipev", "dualpipev", np.nan)])
def test_real_two_stages_per_rank(traces, schedule, name, ideal):
    """ScheduleInterleaved1F1B with stages r and r+p, ScheduleDualPipeV with r and 2p-1-r (whose overlapped
    ``PP:(aFi;bBj)OVERLAP_F_B`` spans carry a forward and a backward): v=2, every micro-batch seen."""
    from shardline.profiling.analyses.bubbles import pipeline_bubbles
    from shardline.profiling.attribution.core import breakdown
    from shardline.profiling.matching.pipelines import BubbleMethod

    traceset = traces[schedule]
    bubbles = pipeline_bubbles(traceset).set_index("rank")
    assert (bubbles["method"] == BubbleMethod.TORCH_PIPELINING.value).all()
    assert (bubbles["v"] == 2).all() and (bubbles["m"] == M).all() and (bubbles["m_seen"] == M).all()
    assert (bubbles["schedule"] == name).all() and (bubbles["p"] == WORLD).all()
    assert np.allclose(bubbles["ideal_fraction"], ideal, equal_nan=True)
    assert (bubbles[["warmup_ns", "steady_ns", "cooldown_ns"]].sum(axis=1) == bubbles["bubble_ns"]).all()
    # The breakdown's bubble column is this bubble set, less what a label above it covers (compute ops).
    table = breakdown(traceset).set_index("rank")
    assert ((table["bubble"] > 0) & (table["bubble"] <= bubbles["bubble_ns"])).all()


def test_schedule_1f1b_records_no_spans_and_is_measured_from_its_send_recv(traces):
    """Schedule1F1B records no span: its gloo send/recv rows alone give the pipeline (two ranks, no peer
    recorded: each one's peer is the other, the first stage opens with a send) and the bubble."""
    from shardline.profiling.analyses.bubbles import pipeline_bubbles
    from shardline.profiling.attribution.core import attribute, breakdown
    from shardline.profiling.matching.p2p import match_p2p, pipelines_of
    from shardline.profiling.matching.pipelines import BubbleMethod
    from shardline.profiling.table.partition import partition_columns

    traceset = traces["1f1b"]
    bubbles = pipeline_bubbles(traceset).set_index("rank")
    assert (bubbles["method"] == BubbleMethod.P2P_MATCHED.value).all()
    assert bubbles.loc[[0, 1], "stage"].tolist() == [0, 1]
    assert (bubbles["p"] == WORLD).all() and (bubbles["m"] == M).all() and (bubbles["v"] == 1).all()
    assert (bubbles["schedule"] == "1f1b").all()
    assert [p.ranks for p in pipelines_of(traceset)] == [(0, 1)]
    matched = match_p2p(traceset)
    receives = matched[matched["kind"] == "recv"]
    assert len(receives) == WORLD * M and (receives["method"] == "matched").all()
    # One host clock: a receive completes only after its matched send started.
    assert (receives["send_start_ns"] <= receives["end_ns"]).all()
    table = breakdown(traceset).set_index("rank")
    assert (table["bubble"] == bubbles["bubble_ns"]).all() and (table["bubble"] >= 0).all()
    # Stage 0 waits for its first gradient, which needs stage 1's first forward and backward: in the receive
    # (bubble), or, when gloo's send of the activation before it blocked until stage 1 took it, in that send
    # (a send's wait for its receiver is back-pressure and stays p2p_send). Which one is up to the run.
    assert table.loc[0, "bubble"] + table.loc[0, "p2p_send"] > 0
    # The split only moves receive time from p2p to bubble: partitioned without the bubble set, the same
    # windows give the same compute, collectives and idle, and bubble + p2p equals their p2p.
    for rank in attribute(traceset).working:
        sets = dict(rank.label_sets, bubble=(np.empty(0, np.int64), np.empty(0, np.int64)))
        windows = rank.attributed_windows
        plain = partition_columns(sets, win_start=windows["start_ns"], win_end=windows["end_ns"])
        row = table.loc[rank.rank]
        assert plain["compute"][0] == row["compute"] and plain["idle"][0] == row["idle"]
        assert plain["p2p_send"][0] + plain["p2p_recv"][0] == row["bubble"] + row["p2p_send"] + row["p2p_recv"]


def _frame(rows):
    events = pd.DataFrame(rows, columns=["name", "cat", "category", "start_ns", "dur_ns"])
    return events.assign(rank=1, lane="cpu", pg_size=-1)


def test_runtime_names_exact_ground_truth():
    """Stage 1 of a 2-stage 1F1B run, m=2, laid out by hand (ns). RECV_F posts a receive whose gloo lifetime
    ends at 150 (F0 waits 100..150) and at 480 (F1 waits 400..480) -- that prefetched receive overlaps B0's
    compute and is not B0's wait; RECV_B1's completes at 540, before B1 starts (no wait); the blocking send op
    nested in B0 is p2p, not compute, and the async ``gloo:send`` lifetime is never subtracted."""
    from shardline.profiling.analyses.bubbles import _batch_row
    from shardline.profiling.matching.pipeline_adapters import torch_pipelining_rows

    events = _frame([
        ("PP:1RECV_F0", "user_annotation", "compute", 90, 10),
        ("c10d::recv_", "cpu_op", "p2p_recv", 92, 5),
        ("gloo:recv", "user_annotation", "p2p_recv", 95, 55),   # done at 150
        ("PP:1F0", "user_annotation", "compute", 100, 150),      # compute 150..250
        ("PP:1RECV_F1", "user_annotation", "compute", 250, 10),
        ("gloo:recv", "user_annotation", "p2p_recv", 255, 225),  # done at 480; overlaps B0: not B0's wait
        ("PP:1B0", "user_annotation", "compute", 260, 140),      # compute 260..400 minus the send 300..320
        ("c10d::send", "cpu_op", "p2p_send", 300, 20),
        ("gloo:send", "user_annotation", "p2p_send", 310, 500),  # async lifetime: never subtracted
        ("PP:1F1", "user_annotation", "compute", 400, 130),      # compute 480..530
        ("PP:1RECV_B1", "user_annotation", "compute", 530, 5),
        ("gloo:recv", "user_annotation", "p2p_recv", 531, 9),    # done at 540
        ("PP:1B1", "user_annotation", "compute", 600, 100),      # compute 600..700 (recv done before)
        ("PP:1REDUCE_GRAD", "user_annotation", "compute", 700, 20),
    ])
    batches, actions = torch_pipelining_rows(events, "cpu", p_default=2)
    assert batches[["start_ns", "end_ns", "p", "m", "v", "schedule"]].values.tolist() == [
        [90, 720, 2, 2, 1, "1f1b"]]
    assert actions[["start_ns", "end_ns", "action", "stage", "microbatch"]].values.tolist() == [
        [150, 250, "F", 1, 0], [260, 300, "B", 1, 0], [320, 400, "B", 1, 0], [480, 530, "F", 1, 1],
        [600, 700, "B", 1, 1]]
    row = _batch_row(1, batch=next(batches.itertuples(index=False)), actions=actions)
    compute = 100 + 40 + 80 + 50 + 100
    assert row["batch_ns"] == 630 and row["bubble_ns"] == 630 - compute
    # warm-up [90, 260): 90..150 + 250..260; steady [260, 530): 300..320 + 400..480; cool-down [530, 720).
    assert (row["warmup_ns"], row["steady_ns"], row["cooldown_ns"]) == (70, 100, 70 + 20)
    assert row["stage"] == 1 and row["m_seen"] == 2


def test_single_stage_names_exact_ground_truth_and_batch_split():
    """GPipe's ``Forward i`` / ``Backward i`` include their receive; two batches split where micro-batch 0
    repeats; the stage comes from ``stage_default`` (the names carry none)."""
    from shardline.profiling.matching.pipeline_adapters import torch_pipelining_rows

    rows = []
    for t0 in (0, 1000):
        rows += [("Forward 0", "user_annotation", "compute", t0, 100),
                 ("c10d::recv_", "cpu_op", "p2p_recv", t0 + 1, 40),          # wait until t0+41
                 ("gloo:recv", "user_annotation", "p2p_recv", t0 + 41, 9),   # done at t0+50
                 ("Forward 1", "user_annotation", "compute", t0 + 100, 100),
                 ("c10d::recv_", "cpu_op", "p2p_recv", t0 + 101, 9),         # done at t0+110
                 ("Backward 0", "user_annotation", "compute", t0 + 300, 100),
                 ("Backward 1", "user_annotation", "compute", t0 + 400, 100)]
    batches, actions = torch_pipelining_rows(_frame(rows), "cpu", p_default=2, stage_default=1)
    assert batches[["start_ns", "end_ns", "m", "schedule"]].values.tolist() == [
        [0, 500, 2, "gpipe"], [1000, 1500, 2, "gpipe"]]
    first = actions[actions["end_ns"] <= 500]
    assert first[["start_ns", "end_ns", "action", "stage"]].values.tolist() == [
        [50, 100, "F", 1], [110, 200, "F", 1], [300, 400, "B", 1], [400, 500, "B", 1]]
    assert np.array_equal(actions["start_ns"].to_numpy()[4:] - 1000, first["start_ns"].to_numpy())


def test_trace_without_third_party_names_is_unchanged():
    from shardline.profiling.matching.pipeline_adapters import has_torch_pipelining, torch_pipelining_rows

    events = _frame([("aten::mm", "cpu_op", "compute", 0, 10), ("Forwarding", "user_annotation", "compute", 0, 5)])
    assert not has_torch_pipelining(events)
    batches, actions = torch_pipelining_rows(events, "cpu")
    assert batches.empty and actions.empty
