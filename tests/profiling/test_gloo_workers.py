"""Collectives of real gloo CPU traces: posted on one thread, run on the process group's worker thread.

torch 2.13's ProcessGroupGloo records a collective twice: the dispatcher op (``c10d::allreduce_``, microseconds,
on the calling thread) and ``gloo:all_reduce`` (the whole run, on one of the group's worker threads), and neither
carries a process group (no ``record_param_comms``). Each call is one call: the run, with its post's group where
the post has one. Real traces from forked gloo ranks under ``torch.profiler`` (CPU activities), checked against the
raw JSON's own spans; a hand-built table checks the pairing rule where executions run out of post order.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")

WORLD = 4
STEPS, TP_CALLS = 2, 3  # the multi-group job: per step 3 all-reduces on the tp pair, then 1 on the dp pair


def _ddp(rank, folder):
    """Data parallel over the world group (DDP's bucketed all-reduces, posted from backward)."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)),
                                    bucket_cap_mb=0.05)  # several buckets: several all-reduces per step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 64)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step()  # warm-up outside the profile
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
    prof.export_chrome_trace(str(folder / f"rank{rank}.pt.trace.json"))


def _groups(rank, folder):
    """Two tp pairs ({0,1}, {2,3}) and two dp pairs ({0,2}, {1,3}), with Megatron's group descriptions; rank 3
    computes before each tp call, so its tp peer waits."""
    import torch.distributed as dist

    pairs = {"tp": ([0, 1], [2, 3]), "dp": ([0, 2], [1, 3])}
    made = {dim: [dist.new_group(r, group_desc="TENSOR_MODEL_PARALLEL_GROUP" if dim == "tp" else
                                 "DATA_PARALLEL_GROUP") for r in ranks] for dim, ranks in pairs.items()}
    tp = made["tp"][0 if rank < 2 else 1]
    dp = made["dp"][rank % 2]
    x = torch.ones(1000)
    dist.all_reduce(x, group=tp)
    dist.all_reduce(x, group=dp)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            for _ in range(TP_CALLS):
                if rank == 3:
                    torch.randn(200, 200) @ torch.randn(200, 200)
                dist.all_reduce(x, group=tp)
            dist.all_reduce(x, group=dp)
    prof.export_chrome_trace(str(folder / f"rank{rank}.pt.trace.json"))


def _mixed(rank, folder):
    """The world group only: reduce_scatter_tensor (gloo runs it as one all-reduce), the list reduce_scatter (one
    all-reduce per rank), all_gather_into_tensor, three async all-reduces in flight, and a send/recv pair per
    two ranks (gloo runs those inline; an irecv's gloo:recv outlasts its op)."""
    import torch.distributed as dist

    x = torch.ones(WORLD * 256)
    out = torch.empty(256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.reduce_scatter_tensor(out, x)
        dist.reduce_scatter(out, list(x.chunk(WORLD)))
        dist.all_gather_into_tensor(x, out)
        works = [dist.all_reduce(torch.ones(512), async_op=True) for _ in range(3)]
        for work in works:
            work.wait()
        if rank % 2 == 0:
            dist.send(out, rank + 1)
        else:
            dist.irecv(out, rank - 1).wait()
    prof.export_chrome_trace(str(folder / f"rank{rank}.pt.trace.json"))


def _all(rank, world, ddp_folder, groups_folder, mixed_folder):
    torch.set_num_threads(1)
    _ddp(rank, ddp_folder)
    _groups(rank, groups_folder)
    _mixed(rank, mixed_folder)
    return rank


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from shardline.plugins.testing import run_ranks

    made = [tmp_path_factory.mktemp(name) for name in ("ddp", "groups", "mixed")]
    assert run_ranks(_all, WORLD, *made, timeout=240) == list(range(WORLD))
    return made


def _raw(folder, rank, prefix):
    """The raw trace's spans of one rank whose name starts with ``prefix``: (thread, start µs, duration µs), by
    start."""
    doc = json.loads((folder / f"rank{rank}.pt.trace.json").read_text())
    return sorted(((e["tid"], e["ts"], e["dur"]) for e in doc["traceEvents"]
                   if e.get("ph") == "X" and e.get("name", "").startswith(prefix)), key=lambda t: t[1])


def test_each_ddp_all_reduce_is_one_call_the_workers_run(folders):
    """One call per collective (DDP's bucket all-reduces and its buffer broadcasts), not two, lasting what the
    worker's gloo:* run lasted, and matched over the four ranks of the world group."""
    from shardline.profiling.matching.collectives import comm_calls, match_collectives
    from shardline.profiling.table.load import load

    ddp, _, _ = folders
    traces = load(ddp)
    calls = comm_calls(traces)
    for rank in range(WORLD):
        runs, posts = _raw(ddp, rank, "gloo:"), _raw(ddp, rank, "c10d::")
        assert len(runs) == len(posts) >= 4, (rank, len(runs), len(posts))  # 2 steps x >= 2 buckets
        assert len(_raw(ddp, rank, "gloo:all_reduce")) >= 4
        assert {tid for tid, _, _ in runs}.isdisjoint({tid for tid, _, _ in posts})  # run on other threads
        mine = calls[calls["rank"] == rank].sort_values("start_ns")
        assert len(mine) == len(runs), (rank, len(mine), len(runs))
        np.testing.assert_allclose(mine["dur_ns"].to_numpy() / 1e3, [d for _, _, d in runs], atol=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one group per rank: nothing to warn about
        matched = match_collectives(traces)
    assert len(matched) == len(calls)
    assert (matched["members"] == WORLD).all()
    assert set(matched["category"]) == {"all_reduce", "broadcast"}
    # an instance's runs end together (the all-reduce completes on every rank): one host, one clock
    spread = matched.groupby("instance")["end_ns"].agg(lambda e: e.max() - e.min())
    assert (spread < 50_000_000).all(), spread.max()


def test_calls_on_several_anonymous_groups_are_counted_once_and_named_in_a_warning(folders):
    """Per rank 2 x (3 + 1) calls, not twice that; and since gloo records no group, matching them by order in one
    group mixes the tp and dp pairs' calls: a TraceWarning names the rank's groups from its pg_config."""
    from shardline.profiling.base.errors import TraceWarning
    from shardline.profiling.matching.collectives import comm_calls, match_collectives
    from shardline.profiling.table.load import load

    _, groups, _ = folders
    traces = load(groups)
    calls = comm_calls(traces)
    assert calls.groupby("rank").size().to_dict() == {r: STEPS * (TP_CALLS + 1) for r in range(WORLD)}
    assert (calls["group"] == "").all()  # the trace holds no group: none is invented
    with pytest.warns(TraceWarning, match=r"rank0\.pt\.trace\.json: rank 0's collective calls carry no process "
                                          r"group.*3 groups \(default_pg \[0, 1, 2, 3\], TENSOR_MODEL_PARALLEL_GROUP"
                                          r" \[0, 1\], DATA_PARALLEL_GROUP \[0, 2\]\)"):
        match_collectives(traces)


def test_reduce_scatters_sends_and_async_calls_count_once_each(folders):
    """Every collective posted (every c10d op but the sends and receives) is one call: gloo's all-reduce runs that
    carry out a reduce-scatter are reduce-scatter calls -- the list form's further runs are not calls of their own
    -- and a receive whose gloo:recv outlasts its op is one receive in the bandwidth table, not two."""
    from shardline.profiling.matching.bandwidth import collective_bandwidth
    from shardline.profiling.matching.collectives import comm_calls, match_collectives
    from shardline.profiling.table.load import load

    *_, mixed = folders
    traces = load(mixed)
    calls = comm_calls(traces)
    for rank in range(WORLD):
        posts = _raw(mixed, rank, "c10d::")
        doc = json.loads((mixed / f"rank{rank}.pt.trace.json").read_text())
        names = [e["name"] for e in doc["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("c10d::")]
        collectives = [n for n in names if n not in ("c10d::send", "c10d::recv_")]
        mine = calls[calls["rank"] == rank]
        assert len(posts) == len(names)
        assert len(mine) == len(collectives) == 6, (rank, mine["category"].tolist(), collectives)
        assert mine["category"].value_counts().to_dict() == {"all_reduce": 3, "reduce_scatter": 2, "all_gather": 1}
        # the list reduce_scatter's WORLD all-reduce runs are all in the raw trace, one of them is its call
        assert len(_raw(mixed, rank, "gloo:all_reduce")) == 3 + 1 + WORLD
    from shardline.profiling.base.errors import TraceWarning

    with pytest.warns(TraceWarning, match="carry no process group"):  # the tp/dp groups made before are listed
        matched = match_collectives(traces)
    assert (matched["members"] == WORLD).all()
    p2p = collective_bandwidth(traces)
    p2p = p2p[p2p["category"].isin(["p2p_send", "p2p_recv"])]
    assert p2p.groupby("rank").size().to_dict() == {r: 1 for r in range(WORLD)}


def test_an_nccl_call_is_no_gloo_runs_post():
    """A GPU rank with an NCCL group and a gloo side group: the NCCL op (it launched the all-gather kernel) is a
    complete call, so the gloo run on its worker thread pairs with the gloo group's own post, not with the older
    NCCL op, and takes none of the NCCL group's fields."""
    from shardline.profiling.table.classify import classify_events

    rows = [dict(lane="cpu", stream=1, name="c10d::_allgather_base_", cat="cpu_op", start_ns=10, dur_ns=20),
            dict(lane="cpu", stream=1, name="record_param_comms", cat="cpu_op", start_ns=11, dur_ns=5,
                 collective="_allgather_base", pg_name="nccl_world", pg_ranks="[0, 1]", pg_size=2, seq=7),
            dict(lane="cpu", stream=1, name="cudaLaunchKernel", cat="cuda_runtime", start_ns=13, dur_ns=2,
                 correlation=5),
            dict(lane="gpu", stream=7, name="ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                 cat="kernel", start_ns=40, dur_ns=100, correlation=5),
            dict(lane="cpu", stream=1, name="c10d::allgather_", cat="cpu_op", start_ns=50, dur_ns=3),
            dict(lane="cpu", stream=21, name="gloo:all_gather", cat="user_annotation", start_ns=55, dur_ns=30)]
    from shardline.profiling.base.schema import conform

    events = classify_events(conform(pd.DataFrame([dict(rank=0, source="kineto", **r) for r in rows])))
    run = events[events["name"] == "gloo:all_gather"].iloc[0]
    kernel = events[events["lane"] == "gpu"].iloc[0]
    assert (str(run["pg_name"]), int(run["seq"])) == ("", -1)
    assert (str(kernel["pg_name"]), int(kernel["seq"])) == ("nccl_world", 7)


def test_a_group_without_description_is_named_by_its_number():
    from shardline.profiling.matching.collectives import _group_label

    assert _group_label({"pg_name": "3", "pg_desc": "undefined", "ranks": [0, 1]}) == "group 3"
    assert _group_label({"pg_name": "1", "pg_desc": "TENSOR_MODEL_PARALLEL_GROUP"}) == "TENSOR_MODEL_PARALLEL_GROUP"


def _cpu(rows):
    from shardline.profiling.base.schema import conform

    return conform(pd.DataFrame([dict(rank=0, lane="cpu", source="kineto", **r) for r in rows]))


def test_worker_spans_take_their_posts_group_in_queue_order_by_thread():
    """Two process groups, each with its own worker thread (11: group A, 12: group B), posts on thread 1 in the
    order A0, B0, A1, B1; group A's worker is still busy with A0 when B0 is posted, so B0 runs first (at 25,
    before A1's post), and A1 runs after B0 started. Each run takes its own post's group and seq, and the posts
    drop out of the calls."""
    from shardline.profiling.matching.collectives import _cpu_calls
    from shardline.profiling.table.classify import classify_events

    def post(start, group, seq):
        return [dict(stream=1, name="c10d::allreduce_", cat="cpu_op", start_ns=start, dur_ns=5),
                dict(stream=1, name="record_param_comms", cat="cpu_op", start_ns=start + 1, dur_ns=3,
                     collective="allreduce", pg_name=group, pg_ranks="[0, 1]", pg_size=2, seq=seq)]

    def run(thread, start, dur):
        return [dict(stream=thread, name="gloo:all_reduce", cat="user_annotation", start_ns=start, dur_ns=dur)]

    rows = (post(10, "A", 0) + run(11, 12, 40) + post(20, "B", 0) + run(12, 25, 10) + post(30, "A", 1)
            + post(40, "B", 1) + run(12, 42, 10) + run(11, 55, 10))
    events = classify_events(_cpu(rows))
    runs = events[events["name"] == "gloo:all_reduce"].sort_values("start_ns")
    assert runs[["start_ns", "pg_name", "seq"]].values.tolist() == [[12, "A", 0], [25, "B", 0], [42, "B", 1],
                                                                    [55, "A", 1]]
    calls = _cpu_calls(events[events["category"] == "all_reduce"][
        ["rank", "category", "pg_name", "pg_ranks", "dim", "seq", "stream", "start_ns", "dur_ns", "name"]])
    assert calls["name"].astype(str).tolist() == ["gloo:all_reduce"] * 4


def test_an_inline_span_inside_its_op_stays_one_call():
    """gloo's span nested in its op on the same thread (as a send runs, or an older torch recorded all) is not
    a worker run: the op is the call, as before."""
    from shardline.profiling.matching.collectives import _cpu_calls
    from shardline.profiling.table.classify import classify_events

    rows = [dict(stream=1, name="c10d::allreduce_", cat="cpu_op", start_ns=10, dur_ns=100),
            dict(stream=1, name="gloo:all_reduce", cat="user_annotation", start_ns=12, dur_ns=90)]
    events = classify_events(_cpu(rows))
    calls = _cpu_calls(events[["rank", "category", "pg_name", "pg_ranks", "dim", "seq", "stream", "start_ns",
                               "dur_ns", "name"]])
    assert calls["name"].astype(str).tolist() == ["c10d::allreduce_"]


def test_terminal_report_shows_the_warning_and_a_straggler_without_nan(folders, capsys):
    """``shardline profile report`` in the terminal: the analyses' warnings go to stderr (the table format used to
    drop them), and no finding says "nan" (the straggler's peers have no compute: their collectives ran on gloo's
    worker threads)."""
    from shardline.profiling.present.cli import main

    _, groups, _ = folders
    assert main(["profile", "report", str(groups)]) == 0
    out, err = capsys.readouterr()
    assert "shardline profile report: warning: " in err and "carry no process group" in err
    assert err.count("carry no process group") == 1, err  # once: not again as a Python warning
    findings = [line for line in out.splitlines() if line.startswith("  ") and ". " in line[:6]]
    assert findings and not any("nan" in line for line in findings), findings
    # which rank is named is not asserted: with the groups mixed (the warning), the order matching decides it
    assert sum("is last in" in line for line in findings) <= 1
