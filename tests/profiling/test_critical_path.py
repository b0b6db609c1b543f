"""The critical path across ranks (``shardline.profiling.analyses.critical_path``) on traces whose path is known by
construction: a straggler before an all-reduce, a 1F1B pipeline traced with only send/recv, a ZeRO-3-like
step, a gloo (CPU) run, the walk's edge rules (a wait hidden under compute, a jump into a wait, waits for two
ranks at once, ranks waiting for each other, an annotation bubble, one rank); and the real 8-rank DLRM set.

Expected paths are written from the generators' timelines (``synthetic_traces``), never from the module.
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pandas as pd
import pytest

from shardline.profiling.analyses.critical_path import (
    BUSY_LABELS,
    CHAIN_COLUMNS,
    PATH_LABELS,
    critical_path,
    critical_path_summary,
    describe,
)
from shardline.profiling.base.errors import AttributionError


def _load(synth, rows, tmp_path):
    from shardline.profiling.table.load import load

    synth.write_kineto(rows, tmp_path)
    return load(tmp_path)


def _rows(chain: pd.DataFrame, step: int | None = None, *, shift: int = 0) -> list[tuple]:
    """(rank, label, start, end) of a chain's rows (one step), times less ``shift``."""
    if step is not None:
        chain = chain[chain["step"] == step]
    return [(int(r), str(label), int(s) - shift, int(e) - shift)
            for r, label, s, e in chain[["rank", "label", "start_ns", "end_ns"]].itertuples(index=False)]


def _check_tiles(chain: pd.DataFrame) -> None:
    """Each step's rows tile its path window: no gap, no overlap, positive lengths, known labels."""
    assert list(chain.columns) == list(CHAIN_COLUMNS)
    assert set(chain["label"]) <= set(PATH_LABELS)
    assert (chain["busy"] == chain["label"].isin(BUSY_LABELS)).all()
    for _, rows in chain.groupby("step"):
        start, end = rows["start_ns"].to_numpy(), rows["end_ns"].to_numpy()
        assert (start[1:] == end[:-1]).all() and (end > start).all()
        assert (rows["dur_ns"] == end - start).all()


# --- (1) a straggler before an all-reduce ---------------------------------------------------------------------

@pytest.mark.parametrize("straggler, offsets", [(2, None), (3, [0, 4_000, -2_500, 9_000]), (0, None)])
def test_straggler_compute_then_the_transfer(synth, tmp_path, straggler, offsets):
    rows, truth = synth.straggler_all_reduce(4, straggler=straggler, offsets=offsets)
    chain = critical_path(_load(synth, rows, tmp_path))
    _check_tiles(chain)
    # On the aligned clock (rank 0's: its offset is 0, the all-reduce's ends align the others exactly).
    assert _rows(chain) == truth["path"]
    want_offsets = offsets or [0] * 4
    assert (chain["offset_ns"] == [want_offsets[r] for r in chain["rank"]]).all()
    transfer = chain[chain["label"] == "all_reduce transfer"]
    assert transfer["dim"].tolist() == ["world"] and transfer["category"].tolist() == ["all_reduce"]
    assert transfer["resolution"].tolist() == ["transfer"]
    compute = chain[chain["label"] == "compute"]
    if straggler:  # the walk started on rank 0 and jumped at the wait to the straggler
        assert compute[["via", "from_rank"]].values.tolist() == [["collective", 0]]
    assert (chain["busy"]).all()


def test_summary_and_describe_of_the_straggler(synth, tmp_path):
    rows, truth = synth.straggler_all_reduce(4, straggler=2, compute=1000, extra=600, transfer=200)
    chain = critical_path(_load(synth, rows, tmp_path))
    summary = critical_path_summary(chain)
    assert summary[["rank", "label", "dim", "dur_ns", "path_ns"]].values.tolist() == [
        [2, "compute", "", 1600, 1800], [0, "all_reduce transfer", "world", 200, 1800]]
    assert summary["share"].tolist() == pytest.approx([1600 / 1800, 200 / 1800])
    assert describe(summary, 0) == "step 0, path 1.8 µs: 89% rank 2 compute, 11% rank 0 world all-reduce transfer"
    by_dim = critical_path_summary(chain, by=("dim",))
    assert by_dim.set_index("dim")["dur_ns"].to_dict() == {"": 1600, "world": 200}
    with pytest.raises(AttributionError, match="step 5"):
        describe(summary, 5)


def test_gloo_cpu_straggler(synth):
    """CPU ranks (gloo): the comm ops nest in the thread's ops; rank 1 computes 60 ns longer, both end at 300."""
    rows = synth.gloo_all_reduce([100, 160], end=300, step=4)
    chain = critical_path(synth.to_frame(rows))
    _check_tiles(chain)
    assert _rows(chain) == [(1, "compute", 0, 160), (0, "all_reduce transfer", 160, 300)]
    assert chain["step"].unique().tolist() == [4]


# --- (2) a 1F1B pipeline traced with only send/recv -----------------------------------------------------------

@pytest.mark.parametrize("offsets", [None, [0, 7_000]])
def test_1f1b_pipeline_path_by_hand(synth, tmp_path, offsets):
    """p=2, m=2, F=f, B=b, every message T = nbytes / gbps. From ``spinning_pipeline``'s event loop:

    stage 0: F0 [0,f) F1 [f,2f) | recv B0 [2f, 2f+2T+b) | B0 [2f+2T+b, 2f+2T+2b) | recv B1 waits for stage 1's
             send at 3f+2T+2b, lands T later | B1 [3f+3T+2b, 3f+3T+3b) | all-reduce, the last arriver, 50 ns
    stage 1: recv F0 waits for stage 0's send at f, lands at f+T | F0, B0 [f+T, 2f+T+b) | recv F1 (sent at 2f,
             long ago: no wait) lands T later | F1, B1 [2f+2T+b, 3f+2T+2b) | all-reduce wait

    The step ends on both at E = 3f+3T+3b+50 (the tie: rank 0). Walking back on rank 0: the all-reduce's
    transfer, B1, the receive's transfer, then its wait -> stage 1 at the send, 3f+2T+2b: its compute back to
    the F1 receive (transfer, no wait), compute back to the F0 receive's transfer, its wait -> stage 0 at f:
    F0 back to the step's start. Step 1 repeats it E later."""
    f, b, T = 1000, 2000, 1000
    rows, truth = synth.spinning_pipeline(2, 2, f=f, b=b, nbytes=450_000, gbps=450.0, steps=2, offsets=offsets)
    chain = critical_path(_load(synth, rows, tmp_path))
    _check_tiles(chain)
    E = 3 * f + 3 * T + 3 * b + 50
    want = [(0, "compute", 0, f), (1, "p2p transfer", f, f + T), (1, "compute", f + T, 2 * f + T + b),
            (1, "p2p transfer", 2 * f + T + b, 2 * f + 2 * T + b),
            (1, "compute", 2 * f + 2 * T + b, 3 * f + 2 * T + 2 * b),
            (0, "p2p transfer", 3 * f + 2 * T + 2 * b, 3 * f + 3 * T + 2 * b),
            (0, "compute", 3 * f + 3 * T + 2 * b, 3 * f + 3 * T + 3 * b), (0, "all_reduce transfer", E - 50, E)]
    assert truth["step_end"] == [E, 2 * E]
    assert _rows(chain, 0) == want
    assert _rows(chain, 1, shift=E) == want
    stretches = chain[chain["step"] == 0].drop_duplicates(["rank", "via", "from_rank"])
    assert stretches[["rank", "via", "from_rank"]].values.tolist() == [[0, "p2p", 1], [1, "p2p", 0], [0, "end", -1]]
    receive = chain[(chain["label"] == "p2p transfer") & (chain["rank"] == 0)]
    assert set(receive["dim"]) == {"pp"}  # the generator's PIPELINE_MODEL_PARALLEL_GROUP


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_path_is_all_work_and_spans_the_step(synth, tmp_path, schedule):
    """Every wait of a spinning pipeline is a receive's (or the closing all-reduce's) and ends where the walk
    meets it, so the path of each step is busy end to end: from the step's start to its end, with every
    stage's share of compute and the closing all-reduce's 50 ns."""
    rows, truth = synth.spinning_pipeline(4, 6, schedule=schedule, steps=2, offsets=[0, 3_000, -1_000, 2_000])
    chain = critical_path(_load(synth, rows, tmp_path))
    _check_tiles(chain)
    assert chain["busy"].all(), chain[~chain["busy"]]
    for step in range(2):
        rows_ = chain[chain["step"] == step]
        assert rows_["start_ns"].iloc[0] == truth["step_start"][step]
        assert rows_["end_ns"].iloc[-1] == truth["step_end"][step]
        assert rows_.iloc[-1]["label"] == "all_reduce transfer" and rows_.iloc[-1]["dur_ns"] == 50
        assert set(rows_["rank"]) == {0, 1, 2, 3}  # a pipeline's path crosses every stage


# --- (3) a ZeRO-3-like step -----------------------------------------------------------------------------------

@pytest.mark.parametrize("world, slow, offsets", [(3, 1, None), (4, 3, [0, 2_000, -5_000, 11_000]), (2, 0, None)])
def test_zero3_step_follows_the_slow_rank(synth, tmp_path, world, slow, offsets):
    rows, truth = synth.zero3_step(world, slow=slow, offsets=offsets)
    chain = critical_path(_load(synth, rows, tmp_path))
    _check_tiles(chain)
    want = truth["path"]
    if slow == 0:  # the last two rows are on one rank: its compute, then the reduce-scatter's transfer
        want = [(0, *row[1:]) for row in want]
    assert _rows(chain) == want
    comm = chain[chain["category"] != "compute"]
    assert set(comm["dim"]) == {"dp"} and (comm["resolution"] == "transfer").all()
    summary = critical_path_summary(chain, by=("rank", "label"))
    top = summary.iloc[0]
    assert (top["rank"], top["label"], top["dur_ns"]) == (slow, "compute", 3 * 1400)
    assert top["share"] == pytest.approx(3 * 1400 / truth["end"])


def _compute(synth, rank, start, end, stream=7):
    return dict(synth.gpu_event(rank, "compute", start, end - start, stream=stream), category="compute")


def _all_reduce(synth, rank, start, end, *, ranks, stream=20):
    """An all-reduce kernel of the group ``ranks`` (its text is the group's key, one instance each)."""
    return dict(synth.gpu_event(rank, "all_reduce", start, end - start, stream=stream, pg_name="", pg_desc="",
                                pg_ranks=str(list(ranks)), pg_size=len(ranks), seq=0), category="all_reduce")


def _steps(synth, ranks, end):
    return [synth.annotation(rank, "ProfilerStep#1", 0, end) for rank in ranks]


def test_a_wait_hidden_under_compute_jumps_where_the_walk_meets_it(synth):
    """Rank 1 computes [0, 1000) then all-reduces to 1200. Rank 0 computes [0, 400), all-reduces from 400 (its
    wait ends at 1000), and a second compute kernel runs [900, 1100) on another stream, hiding the end of the
    wait. Walking back on rank 0: the transfer [1100, 1200), that compute [900, 1100), then the wait at 900,
    which waits for rank 1: its compute [0, 900)."""
    rows = [_compute(synth, 1, 0, 1000), _compute(synth, 0, 0, 400), _compute(synth, 0, 900, 1100, stream=8),
            _all_reduce(synth, 0, 400, 1200, ranks=[0, 1]), _all_reduce(synth, 1, 1000, 1200, ranks=[0, 1]),
            *_steps(synth, [0, 1], 1200)]
    chain = critical_path(synth.to_frame(rows))
    _check_tiles(chain)
    assert _rows(chain) == [(1, "compute", 0, 900), (0, "compute", 900, 1100), (0, "all_reduce transfer", 1100, 1200)]


def test_a_jump_into_a_wait_jumps_on_at_once(synth):
    """Rank 0 waits in X (group 0-1) from 200, the end of that wait (600, rank 1's arrival) hidden under its
    compute [500, 1300): the walk meets the wait at 500 and jumps to rank 1, which at 500 is itself waiting in
    Y (group 1-2, another stream) for rank 2 (arrives at 1000): on to rank 2 at 500, at once. Rank 1 adds no
    row; rank 2's compute [0, 500) starts the path."""
    rows = [_compute(synth, 0, 0, 200), _compute(synth, 0, 500, 1300, stream=8),
            _all_reduce(synth, 0, 200, 700, ranks=[0, 1]),
            _compute(synth, 1, 0, 300), _all_reduce(synth, 1, 300, 1100, ranks=[1, 2], stream=21),
            _all_reduce(synth, 1, 600, 700, ranks=[0, 1]),
            _compute(synth, 2, 0, 1000), _all_reduce(synth, 2, 1000, 1100, ranks=[1, 2]),
            *_steps(synth, [0, 1, 2], 1300)]
    chain = critical_path(synth.to_frame(rows))
    _check_tiles(chain)
    assert _rows(chain) == [(2, "compute", 0, 500), (0, "compute", 500, 1300)]
    assert chain[["via", "from_rank"]].values.tolist() == [["collective", 1], ["end", -1]]


def test_waits_for_two_ranks_at_once_follow_the_lowest(synth):
    """Rank 0 waits in two all-reduces at once, one with rank 1 and one with rank 2, both arriving at 1000:
    the wait [100, 1000) waits for both, and the walk follows the lower rank, 1."""
    rows = [_compute(synth, 0, 0, 100), _all_reduce(synth, 0, 100, 1100, ranks=[0, 1]),
            _all_reduce(synth, 0, 100, 1100, ranks=[0, 2], stream=21),
            *[row for r in (1, 2) for row in (_compute(synth, r, 0, 1000),
                                              _all_reduce(synth, r, 1000, 1100, ranks=[0, r]))],
            *_steps(synth, [0, 1, 2], 1100)]
    chain = critical_path(synth.to_frame(rows))
    _check_tiles(chain)
    assert _rows(chain) == [(1, "compute", 0, 1000), (0, "all_reduce transfer", 1000, 1100)]


def test_ranks_waiting_for_each_other_end_the_walk_with_the_wait_on_the_path(synth):
    """Two all-reduces of ranks 0-1 on two streams, issued in opposite orders: rank 0 waits in X from 100 for
    rank 1 (arrives at 500), rank 1 waits in Z from 200 for rank 0 (arrives at 500). From rank 0 at 500 the
    walk goes to rank 1, whose wait leads back to rank 0 at 500; there the jump to rank 1 at 500 was taken
    already, so the wait stays on rank 0's path, back to its compute."""
    rows = [_compute(synth, 0, 0, 100), _all_reduce(synth, 0, 100, 600, ranks=[0, 1]),
            _all_reduce(synth, 0, 500, 600, ranks=[1, 0], stream=21),
            _compute(synth, 1, 0, 200), _all_reduce(synth, 1, 200, 600, ranks=[1, 0], stream=21),
            _all_reduce(synth, 1, 500, 600, ranks=[0, 1]), *_steps(synth, [0, 1], 600)]
    chain = critical_path(synth.to_frame(rows))
    _check_tiles(chain)
    assert _rows(chain) == [(0, "compute", 0, 100), (0, "all_reduce wait", 100, 500),
                            (0, "all_reduce transfer", 500, 600)]
    assert chain[["via", "from_rank"]].values.tolist() == [["collective", 1]] * 2 + [["end", -1]]
    assert chain["busy"].tolist() == [True, False, True]


def test_one_rank_path_is_its_own_timeline_and_is_kept(synth):
    """One rank, no step annotations: the step is the one window [first start, last end) with step -1; its
    all-reduce is an instance of one member (no wait), the gap before it idle on the path."""
    from shardline.profiling.attribution.core import attribute

    rows = [synth.gpu_event(0, "compute", 0, 400),
            synth.gpu_event(0, "all_reduce", 500, 300, pg_name="0", pg_desc="mesh_tp", pg_ranks="[0, 1]", pg_size=2,
                            seq=0)]
    attribution = attribute(synth.to_frame(rows))  # unclassified: classified here, dim from the group's desc
    chain = critical_path(attribution)
    _check_tiles(chain)
    assert _rows(chain) == [(0, "compute", 0, 400), (0, "idle", 400, 500), (0, "all_reduce transfer", 500, 800)]
    assert chain["step"].tolist() == [-1, -1, -1] and chain["dim"].tolist() == ["", "", "tp"]
    assert chain["busy"].tolist() == [True, False, True]
    chain.loc[0, "label"] = "changed"  # a copy: the kept chain is not touched
    assert critical_path(attribution)["label"].iloc[0] == "compute"
    assert critical_path(attribution.events).equals(critical_path(attribution))


def test_annotated_bubble_without_matched_receives_stays_on_the_path(synth):
    """``one_f_one_b``'s receive kernels name no peer, so on 3 stages nothing is matched: the ``sl:pp``
    bubble is waiting the walk cannot follow. Every stage's step ends at the makespan, so the walk starts on
    stage 0 (the lowest rank) and never leaves it: its compute m·(f+b), the rest bubble, (p-1)·(f+b)."""
    import warnings

    from shardline.profiling.base.errors import TraceWarning

    p, m, f, b = 3, 2, 100, 200
    rows, truth = synth.one_f_one_b(p, m, f=f, b=b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)  # the unmatched receives are announced; not this test's
        chain = critical_path(synth.to_frame(rows))
    _check_tiles(chain)
    assert set(chain["rank"]) == {0}
    assert chain["start_ns"].iloc[0] == 0 and chain["end_ns"].iloc[-1] == truth["makespan"]
    totals = chain.groupby("label")["dur_ns"].sum().to_dict()
    assert totals == {"compute": m * (f + b), "bubble": truth["bubble_ns"]}
    assert not chain.loc[chain["label"] == "bubble", "busy"].any()


# --- (4) the real 8-rank DLRM set -----------------------------------------------------------------------------

def _first_gpu_start_us(path) -> float:
    """The earliest GPU kernel or copy of one raw Kineto file (µs), read with plain json."""
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    return min(e["ts"] for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))


def test_dlrm_path_runs_through_rank_7(traces_dir):
    """Rank 7 is the DLRM set's straggler: it arrives last at the first four all-to-alls and the first
    all-reduce (``test_collectives``), because its step starts last -- its first GPU work comes about
    0.5 ms after every other rank's in the raw files (clock offsets are about 1 µs). So the path starts on
    rank 7 at its step start, the walk reaches it through a collective's wait, and rank 7 holds the largest
    share of the path. (Its compute on the path is not most of the path's compute: the ranks the walk passes
    later, 4 and 5, run theirs after rank 7's waits are over.)"""
    from shardline.profiling.attribution.core import attribute
    from shardline.profiling.matching.collectives import clock_offsets, match_collectives
    from shardline.profiling.table.load import load

    folder = traces_dir / "param" / "dlrm_kineto"
    firsts = {int(p.name.split("_")[0][len("worker"):]): _first_gpu_start_us(p)
              for p in sorted(folder.glob("worker*.json.gz"))}
    assert max(firsts, key=firsts.get) == 7
    assert firsts[7] - max(v for r, v in firsts.items() if r != 7) > 400  # µs: far beyond any clock offset

    attribution = attribute(load(folder))
    chain = critical_path(attribution)
    _check_tiles(chain)
    assert chain["step"].unique().tolist() == [10]
    first = chain.iloc[0]
    assert first["rank"] == 7 and first["via"] == "collective"
    offsets = clock_offsets(match_collectives(attribution)).set_index("rank")["offset_ns"]
    windows = attribution.breakdown.set_index("rank")
    assert first["start_ns"] == windows.loc[7, "start_ns"] - offsets[7]
    aligned_end = windows["end_ns"] - offsets
    assert chain["end_ns"].iloc[-1] == aligned_end.max() and chain["rank"].iloc[-1] == aligned_end.idxmax()
    by_rank = critical_path_summary(chain, by=("rank",))
    assert by_rank["rank"].iloc[0] == 7 and by_rank["share"].iloc[0] > 0.5
    # Every comm row on the path is a transfer: each wait the walk met led to another rank.
    comm = chain[chain["category"].isin(["all_reduce", "all_to_all"])]
    assert len(comm) and (comm["resolution"] == "transfer").all()
    assert np.isclose(by_rank["share"].sum(), 1.0)


def test_every_output_shows_the_path(synth, tmp_path):
    """The report sections (Markdown here; HTML renders the same tables), the terminal report and the merged
    trace carry the path the chain gives: its one-line description, its table, and its pieces on each rank's
    ``sl: critical path`` track at the rank's recorded clock."""
    import gzip
    import json

    from shardline.profiling.present.cli import ReportFormat, _render_report
    from shardline.profiling.present.merge import merged_trace
    from shardline.profiling.present.report_md import render_markdown
    from shardline.profiling.present.report_sections import report_sections

    offsets = [0, 300, -200, 50]
    rows, truth = synth.straggler_all_reduce(4, straggler=2, compute=1000, extra=600, transfer=200, offsets=offsets)
    traceset = _load(synth, rows, tmp_path / "in")
    line = "step 0, path 1.8 µs: 89% rank 2 compute, 11% rank 0 world all-reduce transfer"
    text = render_markdown(report_sections(traceset))
    section = text[text.index("Critical path across ranks"):text.index("Idle by cause")]
    assert line in section and "| 0 | 2 | compute |  | 0.001600 | 88.89 |" in section
    terminal = _render_report(traceset, fmt=ReportFormat.TABLE, source="in", progress=False)
    assert f"critical path:\n  {line}" in terminal
    out = merged_trace(traceset, path=tmp_path / "merged.json.gz")
    with gzip.open(out, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    pieces = [e for e in events if e.get("cat") == "sl_critical_path"]
    assert sorted((e["pid"], e["name"]) for e in pieces) == [(0, "step 0: all_reduce transfer"), (2, "step 0: compute")]
    base = min(float(e["ts"]) for e in events if e.get("ph") == "X")
    compute = next(e for e in pieces if e["pid"] == 2)
    # Rank 2's compute starts at its recorded time (true 0 + its offset) and lasts to its arrival.
    assert round(float(compute["dur"]) * 1000) == truth["last"]
    assert round((float(compute["ts"]) - base) * 1000) == offsets[2] - min(offsets)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shardline.profiling.present.tensorboard import WHY_TAG, write_tensorboard

    acc = EventAccumulator(str(write_tensorboard(traceset, logdir=tmp_path / "tb")), size_guidance={"tensors": 0})
    acc.Reload()
    text = acc.Tensors(WHY_TAG)[0].tensor_proto.string_val[0].decode()
    assert line in text and "| 0 | 2 | compute |  | 0.001600 | 88.89 |" in text and "### Idle by cause" in text
