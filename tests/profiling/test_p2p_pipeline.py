"""Pipelines traced with nothing but send/recv: matching receives with sends across ranks, the stage order, the
bubble/transfer split of spinning receive kernels, and one rank's estimate (``shardline.profiling.matching.p2p``).

Ground truth comes from ``synthetic_traces.spinning_pipeline``: a 1F1B/GPipe timeline laid out by its own
event loop (no code of the analysis), written as Kineto files with NCCL ``SendRecv`` kernels whose args name
their peer as torch records it (``Src Rank`` / ``Dst Rank``, global ranks). The truth bubble of a rank is the
time its receive kernels spin before the sender's kernel starts.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

H100 = "NVIDIA H100 80GB HBM3"  # NVLink 4: 900 GB/s bidirectional, 450 GB/s per direction (the founding doc)


def _load(synth, tmp_path, **kwargs):
    from shardline.profiling.table.load import load

    rows, truth = synth.spinning_pipeline(**kwargs)
    synth.write_kineto(rows, tmp_path, device_name=H100)
    return load(tmp_path), truth


@pytest.mark.parametrize("variant", [
    {"p": 4, "m": 8},                                                   # the group recorded, one clock
    {"p": 4, "m": 8, "stage_rank": [2, 0, 3, 1], "group_ranks": False,  # only peers: the ring gives the order
     "offsets": [0, 5_000, -3_000, 12_000]},                            # and the clocks disagree
    {"p": 4, "m": 4, "schedule": "gpipe", "f": 3_000, "b": 6_000},
    {"p": 4, "m": 2},  # m <= p-1: stage 0 runs both forwards first, as under GPipe; the last stage alternates
])
def test_spinning_receives_split_into_bubble_and_transfer(synth, tmp_path, variant):
    from shardline.profiling.analyses.bubbles import pipeline_bubbles
    from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, breakdown
    from shardline.profiling.matching.p2p import match_p2p
    from shardline.profiling.matching.pipelines import BubbleMethod

    traceset, truth = _load(synth, tmp_path, **variant)
    table = breakdown(traceset).sort_values(["step", "rank"])
    assert (table[list(EXCLUSIVE_COLUMNS)].sum(axis=1) == table["step_ns"]).all()
    p, m = variant["p"], variant["m"]
    for row in table.itertuples(index=False):
        want = truth["wait"][row.step, row.rank]
        assert want > 0
        assert abs(row.bubble - want) <= 0.02 * want, (row.rank, row.step, row.bubble, want)
        assert row.compute == truth["compute"][row.step, row.rank]

    matched = match_p2p(traceset)
    receives = matched[matched["kind"] == "recv"]
    assert (receives["method"] == "matched").all()
    assert len(receives) == truth["steps"] * 2 * m * (p - 1)  # every activation and gradient crossing a boundary
    assert (receives["wait_ns"] + receives["transfer_ns"] == receives["dur_ns"]).all()
    # Per rank and step the transfer part is what the truth says landed after the send started.
    got = receives.groupby(["step", "rank"])["transfer_ns"].sum()
    for (step, rank), value in got.items():
        assert value == truth["transfer"][step, rank]

    bubbles = pipeline_bubbles(traceset)
    assert (bubbles["method"] == BubbleMethod.P2P_MATCHED.value).all()
    stage_rank = variant.get("stage_rank", list(range(p)))
    assert bubbles.set_index("rank")["stage"].groupby(level=0).first().to_dict() == {
        rank: stage for stage, rank in enumerate(stage_rank)}
    assert (bubbles["p"] == p).all() and (bubbles["m"] == m).all() and (bubbles["v"] == 1).all()
    assert (bubbles["schedule"] == variant.get("schedule", "1f1b")).all()
    assert np.allclose(bubbles["ideal_fraction"], (p - 1) / (m + p - 1))
    phases = bubbles[["warmup_ns", "steady_ns", "cooldown_ns"]].sum(axis=1)
    assert (phases == bubbles["bubble_ns"]).all()
    merged = bubbles.merge(table, on=["rank", "step"])
    assert (merged["bubble_ns"] == merged["bubble"]).all()  # one computation: the breakdown's column
    # The last stage waits for its first activation: (p - 1) forwards plus their transfers, all warm-up.
    last = bubbles[bubbles["stage"] == p - 1]
    assert (last["warmup_ns"] >= (p - 1) * variant.get("f", 1000)).all()


def test_one_rank_trace_gives_the_size_and_bandwidth_estimate(synth, tmp_path):
    """Only rank 2's file: the sender is not in the set, so each receive's transfer is its size over NVLink 4's
    450 GB/s per direction, which is how the generator moved it."""
    from shardline.profiling.analyses.bubbles import pipeline_bubbles
    from shardline.profiling.attribution.core import breakdown
    from shardline.profiling.matching.p2p import match_p2p
    from shardline.profiling.matching.pipelines import BubbleMethod
    from shardline.profiling.table.load import load

    rows, truth = synth.spinning_pipeline(4, 8, gbps=450.0)
    synth.write_kineto(rows, tmp_path, device_name=H100)
    one = load(tmp_path / "rank2.pt.trace.json.gz")
    receives = match_p2p(one).query("kind == 'recv'")
    assert (receives["method"] == "estimated").all()
    assert (receives["transfer_ns"] == 10_000).all()  # 4.5 MB / 450 GB/s
    table = breakdown(one)
    for row in table.itertuples(index=False):
        want = truth["wait"][row.step, 2]
        assert abs(row.bubble - want) <= 0.02 * want
    assert (pipeline_bubbles(one)["method"] == BubbleMethod.P2P_ESTIMATED.value).all()


def test_receives_without_peers_on_more_than_two_ranks_stay_p2p_with_a_warning(synth):
    from shardline.profiling.attribution.core import breakdown
    from shardline.profiling.base.errors import TraceWarning

    rows, _ = synth.spinning_pipeline(3, 2, steps=1)
    for row in rows:
        row.pop("peer_arg", None), row.pop("peer", None)
    frame = synth.to_frame(rows)
    with pytest.warns(TraceWarning, match=r"ranks \[0, 1, 2\] record no peer"):
        table = breakdown(frame)
    assert (table["bubble"] == 0).all() and (table["p2p_recv"] > 0).any()


def test_uneven_pairs_are_matched_in_order_with_a_warning(synth):
    from shardline.profiling.base.errors import TraceWarning
    from shardline.profiling.matching.p2p import match_p2p

    rows, truth = synth.spinning_pipeline(2, 4, steps=1)
    sends = [i for i, r in enumerate(rows) if r.get("category") == "p2p_send" and r["rank"] == 0]
    del rows[sends[-1]]  # rank 0's last activation send is lost from the trace
    with pytest.warns(TraceWarning, match="rank 0 sends 3 messages to rank 1, which receives 4"):
        matched = match_p2p(synth.to_frame(rows))
    receives = matched[(matched["kind"] == "recv") & (matched["rank"] == 1)]
    assert receives["method"].tolist() == ["matched"] * 3 + ["unmatched"]


def test_gloo_messages_join_the_op_and_its_transport_span():
    """A CPU rank's message is the c10d op plus the gloo span that starts in it, even past the op's end (an
    irecv's lifetime); a transport span outside any op is a message of its own and takes nothing in."""
    from shardline.profiling.matching.messages import _cpu_messages

    rows = pd.DataFrame([
        ("cpu_op", 1, "p2p_recv", 100, 10, 1, 64, "[0, 1]"),           # c10d::recv_ posts ...
        ("user_annotation", 1, "p2p_recv", 105, 400, -1, -1, ""),      # ... gloo:recv completes at 505
        ("cpu_op", 1, "p2p_send", 200, 30, 1, 64, "[0, 1]"),           # a send inside the recv's lifetime
        ("user_annotation", 1, "p2p_send", 210, 10, -1, -1, ""),
        ("user_annotation", 1, "p2p_send", 600, 50, -1, -1, ""),       # no op around it
        ("cpu_op", 2, "p2p_recv", 100, 20, 1, 64, "[0, 1]"),           # another thread
    ], columns=["cat", "stream", "category", "start_ns", "dur_ns", "peer", "msg_bytes", "pg_ranks"])
    rows = rows.assign(rank=0, pg_name="", lane="cpu", external_id=-1)
    got = _cpu_messages(rows).sort_values(["start_ns", "kind"])
    assert got[["kind", "peer", "start_ns", "end_ns", "bytes"]].values.tolist() == [
        ["recv", 1, 100, 505, 64], ["recv", 1, 100, 120, 64], ["send", 1, 200, 230, 64], ["send", -1, 600, 650, -1]]


def test_send_recv_of_a_context_parallel_ring_is_not_a_pipeline(synth, tmp_path):
    """Ring attention's K/V exchange is send/recv too; over a cp group its waits are not pipeline bubble."""
    from shardline.profiling.attribution.core import breakdown
    from shardline.profiling.matching.messages import p2p_messages
    from shardline.profiling.table.load import load

    rows, _ = synth.spinning_pipeline(4, 2, steps=1)
    for row in rows:
        if row.get("pg_desc") == "PIPELINE_MODEL_PARALLEL_GROUP":
            row["pg_desc"] = "CONTEXT_PARALLEL_GROUP"
    synth.write_kineto(rows, tmp_path)
    traceset = load(tmp_path)
    table = breakdown(traceset)
    assert p2p_messages(traceset).empty
    assert (table["bubble"] == 0).all() and (table["p2p_recv"] + table["p2p_send"] > 0).all()


def test_report_shows_the_measured_third_party_bubble(synth, tmp_path):
    from shardline.profiling.present.report_md import render_markdown
    from shardline.profiling.present.report_sections import report_sections

    traceset, truth = _load(synth, tmp_path, p=4, m=8)
    text = render_markdown(report_sections(traceset))
    pipeline = text[text.index("Pipeline timeline"):]
    assert "p2p_matched" in pipeline and "no pipeline found" not in pipeline
    assert f"{truth['wait'][0, 2] / 1e6:.3f}" in pipeline  # rank 2's bubble in ms, as the table prints it


def test_readme_table_is_this_trace(synth, tmp_path):
    """The README's third-party bubble table is this generated trace's ``pipeline_bubbles``, and its truth."""
    import re
    from pathlib import Path

    from shardline.profiling.analyses.bubbles import pipeline_bubbles

    traceset, truth = _load(synth, tmp_path, p=4, m=8, steps=1, f=20_000, b=40_000)
    got = pipeline_bubbles(traceset).sort_values("rank")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = [line for line in readme.splitlines() if re.match(r"^\| \d \| \d \| p2p_matched \|", line)]
    assert len(lines) == 4
    for line, row in zip(lines, got.itertuples(index=False)):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells == [str(row.rank), str(row.stage), row.method, row.schedule, str(row.p), str(row.m),
                         f"{row.bubble_ns / 1e3:.0f}", f"{row.warmup_ns / 1e3:.0f}", f"{row.steady_ns / 1e3:.0f}",
                         f"{row.cooldown_ns / 1e3:.0f}", f"{100 * row.bubble_fraction:.1f}",
                         f"{100 * row.ideal_fraction:.1f}"]
        assert row.bubble_ns == truth["wait"][0, row.rank]


def test_megatron_nvtx_phase_ranges_set_the_phases(synth):
    """An Nsight-shaped rank set of Megatron-core: its ``...forward_backward_pipelining_without_interleaving.
    {warmup,steady,cooldown}`` NVTX ranges, moved onto the GPU through the launches inside them, bound the
    phases; each receive's wait falls in the phase of the action it feeds (the generator's truth)."""
    from shardline.profiling.analyses.bubbles import pipeline_bubbles
    from shardline.profiling.matching.pipeline_adapters import megatron_phases

    rows, truth = synth.spinning_pipeline(4, 6, megatron_nvtx=True, f=3_000, b=6_000)
    frame = synth.to_frame(rows)
    bubbles = pipeline_bubbles(frame).sort_values(["step", "rank"])
    assert (bubbles["schedule"] == "1f1b").all() and (bubbles["method"] == "p2p_matched").all()
    for row in bubbles.itertuples(index=False):
        want = truth["phase_wait"][row.step, row.rank]
        assert (row.warmup_ns, row.steady_ns, row.cooldown_ns) == tuple(int(x) for x in want), row
    # The projection itself: rank 0's steady phase starts on the GPU at its first steady kernel.
    phases = megatron_phases(frame[frame["rank"] == 0], "gpu")
    assert phases["phase"].tolist()[:3] == ["warmup", "steady", "cooldown"]
    kernels = frame[(frame["rank"] == 0) & (frame["lane"] == "gpu")]
    host = frame[(frame["rank"] == 0) & (frame["name"] == "cudaLaunchKernel")]
    steady = phases.iloc[1]
    nvtx = frame[(frame["rank"] == 0) & frame["name"].astype(str).str.endswith(".steady")].iloc[0]
    inside = host[(host["start_ns"] >= nvtx["start_ns"]) & (host["start_ns"] < nvtx["start_ns"] + nvtx["dur_ns"])]
    launched = kernels[kernels["correlation"].isin(inside["correlation"])]
    assert steady["start_ns"] == launched["start_ns"].min()
    assert steady["end_ns"] == (launched["start_ns"] + launched["dur_ns"]).max()


def test_a_one_way_p2p_ring_is_not_a_pipeline(traces_dir):
    """The NCCL profiler plugin's dump of a 4-GPU p2p ring (real, see PROVENANCE.md): each rank sends to the next
    and receives from the previous, never back -- an exchange, not a pipeline. Its receives stay p2p."""
    from shardline.profiling.attribution.core import breakdown
    from shardline.profiling.base.errors import TraceWarning
    from shardline.profiling.matching.p2p import match_p2p, pipelines_of
    from shardline.profiling.table.load import load

    with pytest.warns(TraceWarning):
        traceset = load(traces_dir / "nccl_profiler_plugin" / "example_profiler_p2p_ring_4gpu.txt")
    with pytest.warns(TraceWarning, match=r"ranks \[0, 1, 2, 3\] pass p2p messages around a one-way ring"):
        table = breakdown(traceset)
    assert (table["bubble"] == 0).all() and (table["p2p_send"] > 0).all()
    assert pipelines_of(traceset) == []
    with pytest.warns(TraceWarning, match="one-way ring"):  # match_p2p repeats its inference's warnings
        receives = match_p2p(traceset).query("kind == 'recv'")
    assert len(receives) and (receives["method"] == "matched").all()  # still matched: the wait is known
