"""The merged trace: valid Chrome-trace JSON, ranks as processes, exact ns on re-reading, category tracks that
sum to the breakdown, and flow arrows from each collective's last arriver to the ranks that waited for it."""

from __future__ import annotations

import gzip
import json
from decimal import Decimal

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, breakdown
from shardline.profiling.base.errors import TraceFormatError
from shardline.profiling.present.merge import category_segments, merged_trace, us_text
from shardline.profiling.table.load import load

# Absolute ns clocks with non-zero ns digits: a float µs timestamp would lose them.
T0 = 1_700_000_000_123_456_789


@pytest.fixture(scope="module")
def job(tmp_path_factory, synth):
    arrivals = np.array([[0, 50, 20], [100, 130, 180], [300, 301, 250]])
    rows, truth = synth.skewed_collectives(arrivals + T0, transfer=np.array([30, 40, 7]),
                                           offsets=np.array([0, 3, 11]))
    pipe, _ = synth.one_f_one_b(3, 4, t0=T0 + 1_001)
    folder = tmp_path_factory.mktemp("job")
    synth.write_kineto(rows + pipe, folder / "run")
    return load(folder / "run"), truth


def _doc(path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def test_valid_chrome_trace_with_ranks_as_processes(job, tmp_path):
    ts, _ = job
    doc = _doc(merged_trace(ts, path=tmp_path / "m.json"))
    assert doc["displayTimeUnit"] == "ns" and isinstance(doc["traceEvents"], list)
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert names == {r: f"rank {r}" for r in ts.ranks}
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == set(ts.ranks)
    threads = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in slices} <= threads  # every slice lies on a named track
    assert sum(e.get("cat") not in ("sl_step", "sl_category", "sl_bubble", "sl_critical_path")
               for e in slices) == len(ts.events)


def test_gzip_and_plain_hold_the_same_document(job, tmp_path):
    ts, _ = job
    plain = merged_trace(ts, path=tmp_path / "m.json")
    packed = merged_trace(ts, path=tmp_path / "m.json.gz")
    assert packed.read_bytes()[:2] == b"\x1f\x8b"
    assert _doc(packed) == _doc(plain)


def _key(frame: pd.DataFrame) -> list[tuple]:
    gpu = frame["lane"].astype(str) == "gpu"
    return sorted(zip(frame["name"].astype(str), frame["start_ns"], frame["dur_ns"], frame["lane"].astype(str),
                      frame["device"].where(gpu, -1), frame["stream"].where(gpu, -1),
                      frame["seq"], frame["pg_name"].astype(str)))


def test_reread_with_load_keeps_every_event_to_the_ns(job, tmp_path):
    ts, _ = job
    back = load(merged_trace(ts, path=tmp_path / "m.json.gz"), rank=0)
    original = back.events[~back.events["cat"].astype(str).str.startswith("sl_")]
    assert _key(original) == _key(ts.events)
    assert int(ts.events["start_ns"].min()) == T0  # the clocks really are large absolute ns


def test_category_track_sums_to_the_breakdown_exactly(job, tmp_path):
    ts, _ = job
    bd = breakdown(ts)
    for rank, grp in ts.events.groupby("rank", observed=True):
        seg = category_segments(grp)
        totals = (seg["end_ns"] - seg["start_ns"]).groupby([seg["step"], seg["label"]]).sum()
        for row in bd[bd["rank"] == rank].itertuples(index=False):
            for column in EXCLUSIVE_COLUMNS:
                assert totals.get((row.step, column), 0) == getattr(row, column), (rank, row.step, column)
    # and the file carries those segments on each rank's "sl: categories" track
    doc = _doc(merged_trace(ts, path=tmp_path / "m.json"))
    cat_slices = [e for e in doc["traceEvents"] if e.get("cat") == "sl_category"]
    assert sum(round(Decimal(str(e["dur"])) * 1000) for e in cat_slices) == int(bd["step_ns"].sum())


def test_flow_arrows_point_from_the_last_arriver(job, tmp_path):
    ts, truth = job
    doc = _doc(merged_trace(ts, path=tmp_path / "m.json"))
    starts = {e["id"]: e for e in doc["traceEvents"] if e["ph"] == "s"}
    ends = {e["id"]: e for e in doc["traceEvents"] if e["ph"] == "f"}
    assert set(starts) == set(ends) and all(e["bp"] == "e" for e in ends.values())
    world = truth["wait"].shape[1]
    per_instance: dict[str, list] = {}
    for fid, s in starts.items():
        per_instance.setdefault(s["name"], []).append((s["pid"], ends[fid]["pid"]))
    assert len(per_instance) == len(truth["straggler"])
    for k, straggler in enumerate(truth["straggler"]):
        arrows = per_instance[f"all_reduce 0#{k}"]
        assert {src for src, _ in arrows} == {int(straggler)}
        assert sorted(dst for _, dst in arrows) == [r for r in range(world) if r != straggler]
    # each arrow starts inside a slice of its source track (the viewer binds it to the enclosing slice)
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for s in starts.values():
        assert any(x["pid"] == s["pid"] and x["tid"] == s["tid"] and x["ts"] <= s["ts"] <= x["ts"] + x["dur"]
                   for x in slices)


def test_bubble_track_holds_the_pipeline_bubbles(job, tmp_path):
    ts, _ = job
    doc = _doc(merged_trace(ts, path=tmp_path / "m.json"))
    bubbles = [e for e in doc["traceEvents"] if e.get("cat") == "sl_bubble"]
    per_rank = {}
    for e in bubbles:
        per_rank[e["pid"]] = per_rank.get(e["pid"], 0) + round(Decimal(str(e["dur"])) * 1000)
    assert per_rank == {r: (3 - 1) * (100 + 200) for r in range(3)}  # (p-1)(f+b) on every stage


@pytest.mark.parametrize("corpus_path", ["tracelens/b200/eager_trace.json.gz", "hta/trace_filter"])
def test_corpus_traces_merge_and_reread(traces_dir, tmp_path, corpus_path):
    ts = load(traces_dir / corpus_path)
    path = merged_trace(ts, path=tmp_path / "m.json.gz")
    doc = _doc(path)
    assert {e["pid"] for e in doc["traceEvents"] if e["ph"] == "X"} == set(ts.ranks)
    back = load(path, rank=0).events
    original = back[~back["cat"].astype(str).str.startswith("sl_")]
    assert len(original) == len(ts.events)
    assert sorted(zip(original["start_ns"], original["dur_ns"])) == sorted(zip(ts.events["start_ns"],
                                                                             ts.events["dur_ns"]))


def test_dlrm_merges_rereads_and_flows_join_the_eight_ranks(traces_dir, tmp_path):
    from shardline.profiling.matching.collectives import match_collectives

    ts = load(traces_dir / "param" / "dlrm_kineto")
    path = merged_trace(ts, path=tmp_path / "m.json.gz")
    doc = _doc(path)
    starts = [e for e in doc["traceEvents"] if e["ph"] == "s"]
    assert {e["pid"] for e in doc["traceEvents"] if e["ph"] in "sf"} == set(range(8))
    matched = match_collectives(ts)
    # one arrow per waiting member of every matched instance
    assert len(starts) == int((matched.groupby(["group", "category", "instance"])["rank"].size() - 1).sum())
    back = load(path, rank=0).events
    original = back[~back["cat"].astype(str).str.startswith("sl_")]
    assert _key(original) == _key(ts.events)


def test_nccl_log_rows_of_unknown_rank_get_their_own_process(traces_dir, tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the log lacks its init lines; the reader says so
        ts = load(traces_dir / "nccl_debug_logs" / "pytorch_torchtitan_issue1369_tp2_ag_rs.log")
    doc = _doc(merged_trace(ts, path=tmp_path / "m.json"))
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert names[-1] == "rank unknown" and set(names) == set(ts.events["rank"].unique().tolist())
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) >= len(ts.events)


def test_unwritable_path_is_our_error(job, tmp_path):
    ts, _ = job
    with pytest.raises(TraceFormatError, match="no_such_dir"):
        merged_trace(ts, path=tmp_path / "no_such_dir" / "m.json")


@given(st.integers(min_value=-(2**63) + 1, max_value=2**63 - 1))
def test_us_text_is_exact(ns):
    text = us_text(np.array([ns]))[0]
    assert Decimal(text) * 1000 == ns and len(text.split(".")[1]) == 3
