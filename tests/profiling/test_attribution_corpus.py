"""Every corpus trace that loads attributes cleanly: exact sum, no negative part, sane ratios; and the whole
file path (write Kineto JSON -> load -> classify -> breakdown / match) recovers synthetic ground truth."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, OVERLAP_COLUMNS, attribute, breakdown
from shardline.profiling.base.errors import MissingRankError, ProfilingError, TraceWarning
from shardline.profiling.matching.collectives import clock_offsets, match_collectives

# The same setting as tests/conftest.py (needed at collection time, to parametrize by file).
_CORPUS = Path(os.environ.get("SHARDLINE_TRACES", Path(__file__).resolve().parents[2].parent / "shared" / "traces"))
_FILES = sorted(p for p in _CORPUS.rglob("*") if p.is_file() and p.suffix != ".md") if _CORPUS.is_dir() else []


@pytest.mark.parametrize("relative", [str(p.relative_to(_CORPUS)) for p in _FILES])
def test_sum_invariant_on_corpus_trace(traces_dir, relative):
    from shardline.profiling.table.load import load

    path = traces_dir / relative
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceWarning)
            try:
                traceset = load(path)
            except MissingRankError:  # a single-rank trace without rank info: say it is rank 0
                traceset = load(path, rank=0)
    except ProfilingError as exc:  # the readers decide what loads; not this test's subject
        pytest.skip(f"does not load: {type(exc).__name__}: {exc}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        table = breakdown(traceset)
    if table.empty:  # allowed only when no rank has anything to attribute
        assert all(rank.work().empty for rank in attribute(traceset).ranks)
        return
    parts = table[list(EXCLUSIVE_COLUMNS)]
    assert (parts.sum(axis=1) == table["step_ns"]).all()
    assert (parts >= 0).all().all() and (table["step_ns"] >= 0).all()
    comm = [c.removeprefix("overlapped_") for c in OVERLAP_COLUMNS]
    assert (table[list(OVERLAP_COLUMNS)].to_numpy() <= table["comm_ns"].to_numpy()[:, None]).all()
    assert (table[comm].sum(axis=1) <= table["comm_ns"]).all()
    ratio = table["overlap_ratio"].dropna()
    assert ((ratio >= 0) & (ratio <= 1)).all()
    assert set(table["rank"]) <= set(traceset.events["rank"].unique())


def test_file_round_trip_multi_rank_with_clock_skew(synth, tmp_path):
    """Four ranks run the hand-laid ZeRO/TP/offload step at the same true time, each clock skewed."""
    from shardline.profiling.table.load import load

    skew = [0, 3_217, -41_000, 1_000_000]
    rows = []
    for rank, offset in enumerate(skew):
        mine, truth = synth.zero_tp_offload(rank=rank, t0=5_000_000 + offset)
        rows += mine
    synth.write_kineto(rows, tmp_path, world=4)
    traceset = load(tmp_path)
    table = breakdown(traceset)
    for key in ("compute", "all_gather", "overlapped_all_gather", "all_reduce", "memcpy_h2d", "reduce_scatter",
                "overlapped_reduce_scatter", "memcpy_d2h", "idle", "step_ns", "comm_ns"):
        assert table[key].tolist() == [truth[key]] * 4, key
    matched = match_collectives(traceset)
    assert (matched["wait_ns"] == 0).all()  # all arrive together in true time once clocks are aligned
    offsets = clock_offsets(matched)
    assert offsets["offset_ns"].tolist() == [s - skew[0] for s in skew]
    assert (offsets["residual_skew_max_ns"] == 0).all()


def test_file_round_trip_1f1b(synth, tmp_path):
    from shardline.profiling.analyses.bubbles import pipeline_bubbles
    from shardline.profiling.table.load import load

    rows, truth = synth.one_f_one_b(4, 6, f=1_500, b=2_750, t0=10_000_000)
    synth.write_kineto(rows, tmp_path)
    traceset = load(tmp_path)
    table = breakdown(traceset)
    assert (table["bubble"] == truth["bubble_ns"]).all() and (table["compute"] == truth["compute"]).all()
    bubbles = pipeline_bubbles(traceset)
    assert np.allclose(bubbles["bubble_fraction"], truth["fraction"], rtol=0, atol=1e-15)


def test_real_cpu_only_gloo_trace_against_the_raw_json(traces_dir):
    """hta/cpu_only: two gloo threads all-reducing inside ProfilerStep#551; reference computed from the JSON
    text with exact decimals (ts in µs relative to baseTimeNanoseconds), union by a ns-ordered sweep."""
    import gzip
    import json
    from decimal import Decimal

    from shardline.profiling.table.load import load

    path = traces_dir / "hta" / "cpu_only" / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"
    doc = json.loads(gzip.open(path).read(), parse_float=Decimal)
    base = int(doc.get("baseTimeNanoseconds", 0))

    def span(e):
        start = base + int(e["ts"] * 1000)
        return start, start + int(e["dur"] * 1000)

    (step,) = [span(e) for e in doc["traceEvents"] if e.get("name") == "ProfilerStep#551"]
    gloo = sorted(span(e) for e in doc["traceEvents"] if e.get("name") == "gloo:all_reduce")
    covered, reach = 0, step[0]
    for s, e in gloo:  # union clipped to the step window
        s, e = max(s, reach), min(e, step[1])
        if e > s:
            covered += e - s
            reach = e
    (row,) = breakdown(load(path)).itertuples(index=False)
    assert (row.rank, row.step, row.lanes, row.step_ns) == (34, 551, "cpu", step[1] - step[0])
    assert row.all_reduce == covered and row.idle == row.step_ns - covered and row.compute == 0
