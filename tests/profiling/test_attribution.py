"""breakdown(): exact ns partitions against hand-worked timelines and a brute-force raster reference."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, breakdown, comm_by_dim, partition
from shardline.profiling.base import intervals as iv
from shardline.profiling.base.errors import AttributionError, TraceWarning
from shardline.profiling.base.schema import conform


def _row(table: pd.DataFrame, rank: int = 0) -> pd.Series:
    (row,) = [r for _, r in table.iterrows() if r["rank"] == rank]
    return row


def test_hand_laid_zero_tp_offload_step_is_recovered_to_the_ns(synth):
    rows, truth = synth.zero_tp_offload()
    row = _row(breakdown(synth.to_frame(rows)))
    assert row["step"] == 3 and row["lanes"] == "gpu"
    for key, value in truth.items():
        if key != "overlap_ratio_num":
            assert row[key] == value, key
    assert row[list(EXCLUSIVE_COLUMNS)].sum() == row["step_ns"] == 650
    assert row["overlap_ratio"] == pytest.approx(truth["overlap_ratio_num"] / truth["comm_ns"], abs=0)


def test_unclassified_table_is_classified_first(synth):
    rows, truth = synth.zero_tp_offload()
    bare = [{k: v for k, v in r.items() if k != "category"} for r in rows]
    row = _row(breakdown(synth.to_frame(bare)))
    # The all_gather / reduce_scatter kernels are NCCL 2.19+ ncclDevKernel_* names, the h2d a memcpy.
    assert (row["all_gather"], row["reduce_scatter"], row["memcpy_h2d"], row["compute"]) == (50, 60, 60, 350)


def test_trace_without_steps_is_one_window_from_first_to_last_event(synth):
    rows = [dict(synth.gpu_event(0, "compute", 10, 5), category="compute"),
            dict(synth.gpu_event(0, "all_reduce", 30, 10), category="all_reduce")]
    row = _row(breakdown(synth.to_frame(rows)))
    assert (row["step"], row["start_ns"], row["end_ns"]) == (-1, 10, 40)
    assert (row["compute"], row["all_reduce"], row["idle"]) == (5, 10, 15)
    assert row["overlap_ratio"] == 0.0


def test_cpu_only_gloo_rank_counts_comm_ops_inside_framework_ops():
    # Thread 1: optimizer.step [0,100) holds c10d::allreduce_ [20,60) > record_param_comms > gloo:all_reduce.
    # Thread 2 (backward): an op [50,80) running while thread 1 is in the all-reduce -> 10 ns overlapped.
    rows = [dict(rank=0, lane="cpu", stream=1, name="ProfilerStep#5", cat="user_annotation", start_ns=0,
                 dur_ns=120),
            dict(rank=0, lane="cpu", stream=1, name="Optimizer.step#SGD.step", cat="cpu_op", start_ns=0,
                 dur_ns=100),
            dict(rank=0, lane="cpu", stream=1, name="c10d::allreduce_", cat="cpu_op", start_ns=20, dur_ns=40),
            dict(rank=0, lane="cpu", stream=1, name="record_param_comms", cat="cpu_op", start_ns=21,
                 dur_ns=38, collective="allreduce"),
            dict(rank=0, lane="cpu", stream=1, name="gloo:all_reduce", cat="user_annotation", start_ns=22,
                 dur_ns=30),
            dict(rank=0, lane="cpu", stream=2, name="autograd::engine::evaluate_function: MmBackward0",
                 cat="cpu_op", start_ns=50, dur_ns=30)]
    row = _row(breakdown(conform(pd.DataFrame(rows))))
    assert (row["step"], row["lanes"], row["step_ns"]) == (5, "cpu", 120)
    # compute: [0,20) + [60,100) on thread 1, [50,80) on thread 2 -> [0,20) u [50,100) = 70.
    assert (row["compute"], row["all_reduce"], row["overlapped_all_reduce"], row["idle"]) == (70, 30, 10, 20)
    assert row["overlap_ratio"] == pytest.approx(10 / 40, abs=0)


def test_two_steps_and_two_ranks_partition_separately(synth):
    a, _ = synth.zero_tp_offload(rank=0, t0=0)
    b, _ = synth.zero_tp_offload(rank=1, t0=5_000)
    extra = [dict(synth.gpu_event(0, "compute", 700, 30), category="compute"),
             synth.annotation(0, "ProfilerStep#4", 650, 100)]
    table = breakdown(synth.to_frame(a + b + extra))
    assert list(zip(table["rank"], table["step"])) == [(0, 3), (0, 4), (1, 3)]
    assert table.loc[1, ["compute", "idle", "step_ns"]].tolist() == [30, 70, 100]
    assert (table[list(EXCLUSIVE_COLUMNS)].sum(axis=1) == table["step_ns"]).all()


def test_bad_input_raises_our_errors(synth):
    with pytest.raises(AttributionError, match="TraceSet or an events DataFrame"):
        breakdown([1, 2, 3])
    only_annotations = synth.to_frame([synth.annotation(0, "ProfilerStep#1", 0, 10)])
    with pytest.warns(TraceWarning, match="nothing to attribute"):
        empty = breakdown(only_annotations)
    assert empty.empty and set(EXCLUSIVE_COLUMNS) <= set(empty.columns) and "overlap_ratio" in empty
    with pytest.raises(AttributionError, match="end before start"):
        partition({"compute": iv.EMPTY}, win_start=np.array([10]), win_end=np.array([5]))


_spans = st.lists(st.tuples(st.sampled_from(["compute", "all_reduce", "all_gather", "p2p_recv", "memcpy_h2d",
                                             "memcpy_d2h", "memset", "sync", "reduce_scatter"]),
                            st.integers(0, 400), st.integers(0, 120)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(spans=_spans, window=st.tuples(st.integers(0, 200), st.integers(200, 600)),
       bubble=st.lists(st.tuples(st.integers(0, 500), st.integers(1, 80)), max_size=4))
def test_partition_equals_brute_force_raster(synth, spans, window, bubble):
    rows = [dict(rank=0, category=c, start_ns=s, dur_ns=d) for c, s, d in spans]
    bubble_spans = [(s, s + d) for s, d in bubble]
    sets = {}
    for label in {r["category"] for r in rows}:
        mine = [r for r in rows if r["category"] == label]
        sets[label] = iv.union([r["start_ns"] for r in mine], [r["start_ns"] + r["dur_ns"] for r in mine])
    sets.setdefault("compute", iv.EMPTY)
    sets["bubble"] = iv.union([s for s, _ in bubble_spans], [e for _, e in bubble_spans])
    got = partition(sets, win_start=np.array([window[0]]), win_end=np.array([window[1]])).iloc[0]
    want = synth.raster_partition(rows, rank=0, window=window, bubble=bubble_spans)
    assert {k: int(got[k]) for k in want} == want
    comm = [r for r in rows if r["category"] in ("all_reduce", "all_gather", "p2p_recv", "reduce_scatter")]
    assert got["comm_ns"] == synth.raster_partition(
        [dict(r, category="compute") for r in comm], rank=0, window=window)["compute"]


def test_pageable_copies_are_flagged_alongside_the_partition(synth):
    rows = [dict(synth.gpu_event(0, "memcpy_h2d", 0, 40), category="memcpy_h2d", memory_kind="Pageable",
                 name="Memcpy HtoD (Pageable -> Device)"),
            dict(synth.gpu_event(0, "memcpy_h2d", 30, 40), category="memcpy_h2d", memory_kind="Pinned"),
            dict(synth.gpu_event(0, "memcpy_d2h", 100, 10), category="memcpy_d2h", memory_kind="Pageable")]
    row = _row(breakdown(synth.to_frame(rows)))
    assert (row["memcpy_h2d"], row["memcpy_d2h"], row["idle"], row["pageable_memcpy_ns"]) == (70, 10, 30, 50)


def test_comm_by_dim_splits_exposed_and_overlapped_per_parallel_dimension(synth):
    rows, _ = synth.zero_tp_offload()
    desc = {"all_gather": "sl:dp", "reduce_scatter": "sl:dp", "all_reduce": "sl:tp"}
    rows = [dict(r, pg_desc=desc[r.get("category")]) if r.get("category") in desc else r for r in rows]
    bare = [{k: v for k, v in r.items() if k != "category"} for r in rows]  # classified (with dims) inside
    table = comm_by_dim(synth.to_frame(bare)).set_index("dim")
    # dp: all_gather [80,180) + reduce_scatter [480,560), compute as in zero_tp_offload's docstring.
    assert table.loc["dp", ["comm_ns", "exposed_ns", "overlapped_ns"]].tolist() == [180, 110, 70]
    assert table.loc["tp", ["comm_ns", "exposed_ns", "overlapped_ns"]].tolist() == [40, 40, 0]
    assert (table["step"] == 3).all()


@settings(max_examples=40, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 60)), max_size=12),
       windows=st.lists(st.tuples(st.integers(0, 350), st.integers(0, 120)), min_size=1, max_size=5))
def test_window_totals_equal_a_ns_count(spans, windows):
    a = iv.union([s for s, _ in spans], [s + d for s, d in spans])
    painted = np.zeros(500, dtype=bool)
    for s, d in spans:
        painted[s:s + d] = True
    lo = np.array([w for w, _ in windows])
    hi = lo + np.array([d for _, d in windows])
    assert iv.window_totals(a, lo=lo, hi=hi).tolist() == [int(painted[x:y].sum()) for x, y in zip(lo, hi)]


def test_schema_breaks_and_negative_durations_are_named(synth):
    rows, _ = synth.zero_tp_offload()
    frame = synth.to_frame(rows)
    with pytest.raises(AttributionError, match="missing column 'dur_ns'"):
        breakdown(frame.drop(columns="dur_ns"))
    with pytest.raises(AttributionError, match="column 'step' has dtype float64, expected int32"):
        breakdown(frame.astype({"step": float}))
    twice = pd.concat([frame, frame[["rank"]]], axis=1)
    with pytest.raises(AttributionError, match="column 'rank' appears 2 times"):
        breakdown(twice)
    broken = frame.copy()
    broken.loc[0, "dur_ns"] = -5
    with pytest.raises(AttributionError, match="1 events have a negative duration"):
        breakdown(broken)
    with pytest.raises(AttributionError, match="comm_by_dim expects"):
        comm_by_dim("trace.json")


def test_gpu_steps_come_from_the_work_step_when_there_are_no_gpu_step_annotations(synth):
    # CPU steps end before their kernels do (asynchronous launches); the kernels carry their launch's step.
    kernels = [(1, 100, 50), (1, 160, 40), (2, 230, 30), (2, 300, 20)]
    rows = [dict(synth.gpu_event(0, "compute", s, d), category="compute", step=n) for n, s, d in kernels]
    rows += [synth.annotation(0, "ProfilerStep#1", 0, 120, lane="cpu"),
             synth.annotation(0, "ProfilerStep#2", 120, 120, lane="cpu")]
    table = breakdown(synth.to_frame(rows))
    # step 1: [100, 230) -- first kernel of 1 to first kernel of 2; step 2: [230, 320) -- to its last end.
    assert table[["step", "start_ns", "end_ns", "compute", "idle"]].values.tolist() == [
        [1, 100, 230, 90, 40], [2, 230, 320, 50, 40]]


def test_rows_in_any_order_give_the_grouped_table(synth):
    # ``load`` groups rows by rank (breakdown then slices); any other order takes each rank's positions.
    a, _ = synth.zero_tp_offload(rank=0, t0=0)
    b, _ = synth.zero_tp_offload(rank=1, t0=5_000)
    grouped = synth.to_frame(a + b)
    shuffled = grouped.iloc[np.random.default_rng(3).permutation(len(grouped))].reset_index(drop=True)
    assert not (np.diff(shuffled["rank"].to_numpy()) >= 0).all()
    pd.testing.assert_frame_equal(breakdown(shuffled), breakdown(grouped))


def test_step_markers_are_the_ones_the_reader_counts(synth):
    # The reader gives events no step for a marker beyond int32 or with non-ASCII digits; attribution makes
    # no window of them either, so the windows and the events' ``step`` column agree.
    ops = [dict(rank=0, lane="cpu", stream=1, name="aten::mm", cat="cpu_op", start_ns=s, dur_ns=10)
           for s in (10, 110, 210)]
    markers = [synth.annotation(0, name, start, 100, lane="cpu")
               for name, start in (("ProfilerStep#7", 0), (f"ProfilerStep#{2**31}", 100), ("ProfilerStep#٣", 200))]
    table = breakdown(synth.to_frame(ops + markers))
    assert table[["step", "start_ns", "end_ns", "compute", "idle"]].values.tolist() == [[7, 0, 100, 10, 90]]


@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(-3, 3), max_size=40))
def test_distinct_is_numpy_unique(values):
    array = np.array(values, dtype=np.int64)
    got = iv.distinct(array)
    assert got.dtype == np.int64 and np.array_equal(got, np.unique(array))


def test_breakdown_memory_stays_below_the_table_size(synth):
    # Many segments per rank: the partition must not hold a row-sized int64 array per output column (it did
    # once: ~30 of them at a time, ~3x the table), nor per-row masks of the whole table. The breakdown also
    # splits idle by cause (``idle``: a few gap-sized arrays per rank, on top of the partition), so its budget
    # is 1.5x the table; the partition alone stays below the table. tracemalloc sees numpy's buffers.
    import tracemalloc

    n = 100_000
    rows = []
    for rank in range(2):
        starts = np.arange(n, dtype=np.int64) * 100
        kinds = np.array(["compute", "all_reduce", "memcpy_h2d", "all_gather"])[np.arange(n) % 4]
        rows += [dict(synth.gpu_event(rank, kind, int(s), 70), category=kind) for kind, s in zip(kinds, starts)]
    table = synth.to_frame(rows)
    size = int(table.memory_usage(deep=False).sum())
    breakdown(table)  # first call: caches and lazy imports out of the way
    tracemalloc.start()
    try:
        result = breakdown(table)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (result[list(EXCLUSIVE_COLUMNS)].sum(axis=1) == result["step_ns"]).all()
    assert peak < 1.5 * size, (peak, size)
    from shardline.profiling.attribution.core import attribute

    attribution = attribute(table)
    for rank in attribution.working:
        assert rank.label_sets  # computed first: the sets are the input, not the partition's working memory
    tracemalloc.start()
    try:
        for rank in attribution.working:
            rank.partition_columns()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size, (peak, size)
