"""Cross-rank matching: synthetic skewed collectives with exact truth, and the real 8-rank DLRM set."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from shardline.profiling.base.errors import AttributionError, TraceWarning
from shardline.profiling.matching.collectives import (
    ClockAlignment,
    clock_offsets,
    match_collectives,
    stragglers,
    wait_transfer,
)


def _arrivals(seed: int, n_coll: int, world: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (np.arange(n_coll)[:, None] * 100_000 + rng.integers(0, 5_000, size=(n_coll, world))).astype(np.int64)


@pytest.mark.parametrize("use_seq", [True, False])
def test_skewed_clocks_are_aligned_and_wait_transfer_recovered_exactly(synth, use_seq):
    arrivals = _arrivals(1, 6, 4)
    transfer = np.array([700, 800, 900, 1_000, 1_100, 1_200])
    offsets = np.array([0, 12_345, -7_000, 250_000])
    rows, truth = synth.skewed_collectives(arrivals, transfer=transfer, offsets=offsets)
    if not use_seq:
        rows = [{k: v for k, v in r.items() if k != "seq"} for r in rows]
    matched = match_collectives(synth.to_frame(rows))
    for r in range(4):
        mine = matched[matched["rank"] == r].sort_values("instance")
        assert mine["wait_ns"].tolist() == truth["wait"][:, r].tolist()
        assert mine["transfer_ns"].tolist() == transfer.tolist()
        assert (mine["offset_ns"] == truth["offset"][r]).all()
    last = matched[matched["is_last"]].sort_values("instance")["rank"].tolist()
    assert last == truth["straggler"].tolist()
    skew = clock_offsets(matched)
    assert skew["offset_ns"].tolist() == truth["offset"].tolist()
    assert (skew["residual_skew_max_ns"] == 0).all()


def test_without_alignment_skew_shows_up_as_wait(synth):
    arrivals = np.zeros((2, 2), dtype=np.int64)
    rows, _ = synth.skewed_collectives(arrivals, transfer=np.array([100, 100]), offsets=np.array([0, 40]))
    matched = match_collectives(synth.to_frame(rows), clock=ClockAlignment.NONE)
    # Both arrive together in truth; rank 1's clock is 40 ns ahead, so rank 0 seems to wait 40 ns.
    assert matched.groupby("rank")["wait_ns"].sum().tolist() == [80, 0]


def test_straggler_is_the_rank_that_caused_most_waiting(synth):
    arrivals = np.array([[0, 0, 900], [0, 50, 0], [0, 0, 700]], dtype=np.int64) + \
        np.arange(3)[:, None] * 10_000
    rows, _ = synth.skewed_collectives(arrivals, transfer=np.array([10, 10, 10]),
                                     offsets=np.zeros(3, dtype=np.int64))
    table = stragglers(match_collectives(synth.to_frame(rows), clock=ClockAlignment.NONE))
    assert table[["straggler_rank", "caused_wait_ns", "times_last"]].values.tolist() == [[2, 3200, 2]]


def test_a_straggler_costs_the_time_others_waited_not_the_sum_over_calls_in_flight(synth):
    """Two all-reduces in flight together on rank 0 (two groups, two streams), both waiting [0, 500) for rank 1:
    rank 1 cost rank 0 500 ns, not 1000 (the wait of each, summed), and a third, later wait adds its own 100."""
    rows = []
    for group, stream in (("A", 20), ("B", 21)):
        for rank, arrive in ((0, 0), (1, 500)):
            rows.append(dict(synth.gpu_event(rank, "all_reduce", arrive, 700 - arrive, stream=stream), pg_name=group,
                             pg_ranks="[0, 1]", pg_size=2, seq=0, category="all_reduce"))
    for rank, arrive in ((0, 800), (1, 900)):
        rows.append(dict(synth.gpu_event(rank, "all_reduce", arrive, 1000 - arrive, stream=20), pg_name="A",
                         pg_ranks="[0, 1]", pg_size=2, seq=1, category="all_reduce"))
    rows += [synth.annotation(rank, "ProfilerStep#0", 0, 1000) for rank in (0, 1)]
    table = stragglers(match_collectives(synth.to_frame(rows), clock=ClockAlignment.NONE))
    assert table[["straggler_rank", "caused_wait_ns", "times_last"]].values.tolist() == [[1, 600, 3]]


def test_uneven_call_counts_warn_and_match_the_common_prefix(synth):
    rows, _ = synth.skewed_collectives(_arrivals(2, 3, 2), transfer=np.array([5, 5, 5]),
                                      offsets=np.zeros(2, dtype=np.int64))
    rows = [{k: v for k, v in r.items() if k != "seq"} for r in rows][:-1]  # rank 1 lost its last call
    with pytest.warns(TraceWarning, match="different numbers of calls"):
        matched = match_collectives(synth.to_frame(rows), clock=ClockAlignment.NONE)
    assert sorted(matched["instance"].unique()) == [0, 1]


def test_no_communication_is_our_error(synth):
    frame = synth.to_frame([dict(synth.gpu_event(0, "compute", 0, 10), category="compute")])
    with pytest.raises(AttributionError, match="no communication"):
        match_collectives(frame)


def _raw_all_to_all(folder):
    """Independent of the library: the SendRecv kernels (DLRM's all-to-all) per rank, straight from JSON."""
    starts, durs = {}, {}
    for path in sorted(folder.glob("*.json.gz")):
        doc = json.loads(gzip.open(path).read())
        rank = doc["distributedInfo"]["rank"]
        kernels = sorted((e["ts"], e["dur"]) for e in doc["traceEvents"]
                         if e.get("cat") == "kernel" and "SendRecv" in e["name"])
        starts[rank] = np.array([k[0] for k in kernels])
        durs[rank] = np.array([k[1] for k in kernels])
    return np.array([starts[r] for r in sorted(starts)]), np.array([durs[r] for r in sorted(durs)])


def test_dlrm_all_to_all_ranks_1_and_3_mostly_wait_and_straggler_is_named(traces_dir):
    from shardline.profiling.table.load import load

    folder = traces_dir / "param" / "dlrm_kineto"
    matched = match_collectives(load(folder))
    split = wait_transfer(matched).set_index(["rank", "category"])
    a2a = split.xs("all_to_all", level="category")
    assert (a2a["calls"] == 5).all()
    assert a2a.loc[1, "wait_fraction"] > 0.9 and a2a.loc[3, "wait_fraction"] > 0.9
    assert set(a2a["wait_ns"].nlargest(2).index) == {1, 3}

    # The reference, from the raw JSON (µs): wait = last start - own start, within each call's duration.
    starts, durs = _raw_all_to_all(folder)
    raw_wait = np.minimum(starts.max(axis=0) - starts, durs).sum(axis=1)
    assert set(np.argsort(raw_wait)[-2:]) == {1, 3}
    assert raw_wait[1] / durs[1].sum() > 0.9 and raw_wait[3] / durs[3].sum() > 0.9
    # Ours, with clocks aligned by at most a few µs, agrees with the raw waits to within that alignment.
    offsets = clock_offsets(matched).set_index("rank")["offset_ns"]
    assert (offsets.abs() < 5_000).all()
    tolerance_ns = 5 * 2 * 5_000  # five calls, each wait moved by at most two offsets
    assert np.abs(a2a["wait_ns"].to_numpy() - raw_wait * 1_000).max() <= tolerance_ns

    raw_last = np.bincount(starts.argmax(axis=0), minlength=8)
    (row,) = stragglers(matched).itertuples(index=False)
    assert row.straggler_rank == 7 == raw_last.argmax()


def test_cpu_gloo_calls_use_the_outermost_op_per_thread():
    import pandas as pd

    from shardline.profiling.base.schema import conform

    rows = []
    for rank, arrive in ((0, 100), (1, 160)):  # rank 1 arrives 60 ns late; both finish at 300
        rows += [dict(rank=rank, lane="cpu", stream=1, name="aten::mm", cat="cpu_op", start_ns=0, dur_ns=arrive),
                 dict(rank=rank, lane="cpu", stream=1, name="c10d::allreduce_", cat="cpu_op", start_ns=arrive,
                      dur_ns=300 - arrive),
                 dict(rank=rank, lane="cpu", stream=1, name="record_param_comms", cat="cpu_op",
                      start_ns=arrive + 1, dur_ns=290 - arrive, collective="allreduce", seq=0),
                 dict(rank=rank, lane="cpu", stream=1, name="gloo:all_reduce", cat="user_annotation",
                      start_ns=arrive + 2, dur_ns=280 - arrive)]
    matched = match_collectives(conform(pd.DataFrame(rows)), clock=ClockAlignment.NONE)
    assert matched[["rank", "start_ns", "wait_ns", "transfer_ns", "is_last"]].values.tolist() == [
        [0, 100, 60, 140, False], [1, 160, 0, 140, True]]


def test_point_to_point_calls_are_not_matched_as_collectives(synth):
    rows, _ = synth.skewed_collectives(_arrivals(3, 2, 2), transfer=np.array([5, 5]),
                                       offsets=np.zeros(2, dtype=np.int64))
    p2p = [dict(synth.gpu_event(0, "p2p_send", 900_000, 50), category="p2p_send"),
           dict(synth.gpu_event(1, "p2p_recv", 900_010, 40), category="p2p_recv")]
    matched = match_collectives(synth.to_frame(rows + p2p))
    assert set(matched["category"]) == {"all_reduce"} and len(matched) == 4
