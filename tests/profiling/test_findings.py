"""Findings (``shardline.profiling.analyses.findings``): each rule on a synthetic trace that triggers it, with the
numbers worked out from how the trace was laid out, and on one that must not trigger it; the ranking; the reports.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardline.profiling.analyses.findings import DEFAULT_RULES, FINDING_COLUMNS, FindingRule
from shardline.profiling.present.report_sections import findings


def _rules(name):
    return tuple(r for r in DEFAULT_RULES if r.name == name)


def _found(source, name):
    table = findings(source, rules=_rules(name))
    assert list(table.columns) == list(FINDING_COLUMNS)
    return table


def _frame(synth, rows):
    return synth.to_frame(rows)


# --- exposed collectives ----------------------------------------------------------------------------------------

def test_exposed_all_gather_is_found_and_a_hidden_one_is_not(synth):
    # Step [0, 400): compute [0,100) and [300,400), an all-gather [100,300) between them: exposed 50% of the step.
    rows = [dict(synth.gpu_event(0, "compute", 0, 100), category="compute"),
            dict(synth.gpu_event(0, "all_gather", 100, 200), category="all_gather"),
            dict(synth.gpu_event(0, "compute", 300, 100), category="compute"),
            synth.annotation(0, "ProfilerStep#0", 0, 400)]
    table = _found(_frame(synth, rows), "exposed_collective")
    # The path is the one rank's step; a perfect overlap removes the all-gather's 200 ns from it.
    assert table["rule"].tolist() == ["exposed_collective"] and table["saves_ns"].tolist() == [200.0]
    assert table["method"].tolist() == ["critical-path replay"]
    assert table["text"].iloc[0].startswith("exposed all-gather 50.00% of step: ZeRO-3 / FSDP parameter prefetch")
    assert table["text"].iloc[0].endswith("; −0.000200 ms/step")
    # zero_tp_offload: all-gather 50/650, all-reduce 40/650, reduce-scatter 60/650 exposed: all under 10%.
    quiet, _ = synth.zero_tp_offload()
    assert _found(_frame(synth, quiet), "exposed_collective").empty


# --- pageable copies --------------------------------------------------------------------------------------------

def test_pageable_copies_are_found_and_pinned_ones_are_not(synth):
    rows, truth = synth.zero_tp_offload(t0=0)
    for row in rows:
        if row.get("category") == "memcpy_h2d":
            row["memory_kind"] = "Pageable"
    table = _found(_frame(synth, rows), "pageable_copies")
    # The h2d copy [340, 420) is the one pageable copy: 80 ns with it running, in the one step. The trace has no
    # launch call for it, so how long the host was blocked is not recorded: priced by its run time, and says so
    # (with launch calls it is priced by the GPU idle they cause: test_idle_causes.py).
    assert table["measured"].tolist() == ["pageable host memory in 1 copies (no launch calls in the trace: priced "
                                          "by the time they run, not by the host's blocking)"]
    assert table["saves_ns"].tolist() == [80.0]
    pinned, _ = synth.zero_tp_offload(t0=0)
    assert _found(_frame(synth, pinned), "pageable_copies").empty


# --- stragglers -------------------------------------------------------------------------------------------------

def _straggler_found(synth, folder, *, compute: int, extra: int):
    """The straggler rule on ``straggler_all_reduce`` (4 ranks, rank 2 late by ``extra``), written as Kineto."""
    from shardline.profiling.table.load import load

    rows, _ = synth.straggler_all_reduce(4, straggler=2, compute=compute, extra=extra, transfer=200)
    synth.write_kineto(rows, folder)
    return _found(load(folder), "straggler")


def test_straggler_is_found_with_its_cost_and_compute_above_the_median(synth, tmp_path):
    table = _straggler_found(synth, tmp_path / "slow", compute=1000, extra=600)
    # Ranks 0, 1, 3 wait 600 ns each for rank 2's arrival: 1800 ns per step; its compute 1600 vs median 1000;
    # on time, the step would end 600 ns sooner (everyone's compute 1000, then the transfer).
    assert table["text"].tolist() == [
        "rank 2 is last in 1 of 1 collectives and costs the others 0.00180 ms of waiting per step: its compute is "
        "60.00% above the median; without it the step is 0.000600 ms shorter"]
    assert table["saves_ns"].tolist() == [600.0] and table["method"].tolist() == ["critical-path replay"]
    assert _straggler_found(synth, tmp_path / "even", compute=1000, extra=0).empty


def test_straggler_whose_peers_have_no_compute_is_stated_in_ms_not_nan(synth, tmp_path):
    """The other ranks only wait (compute 0: on a CPU gloo trace their collectives ran on worker threads): the
    straggler's compute is stated as its ms per step against a median of 0, where a ratio said "nan% above"."""
    table = _straggler_found(synth, tmp_path / "idle_peers", compute=0, extra=600)
    assert table["text"].tolist() == [
        "rank 2 is last in 1 of 1 collectives and costs the others 0.00180 ms of waiting per step: its compute is "
        "0.000600 ms per step where the median is 0; without it the step is 0.000600 ms shorter"]


# --- host-bound idle --------------------------------------------------------------------------------------------

def test_host_bound_idle_is_found_and_absent_without_late_launches(synth):
    rows, truth = synth.idle_causes_steps(t0=1_000_000)
    frame = _frame(synth, rows)
    table = _found(frame, "host_bound")
    share = np.mean([h / 500 for h in truth["idle_host_bound"]])  # two steps of 500 ns
    assert table["measured"].iloc[0].startswith(f"GPU idle waiting for the host {100 * share:.2f}% of step")
    assert table["saves_ns"].iloc[0] > 0
    quiet, _ = synth.zero_tp_offload()
    assert _found(_frame(synth, quiet), "host_bound").empty  # no launch rows: no gap is host-late


# --- pipelines ----------------------------------------------------------------------------------------------------

def test_pipeline_bubble_suggests_more_micro_batches(synth, tmp_path):
    from shardline.profiling.analyses.bubbles import pipeline_bubbles
    from shardline.profiling.table.load import load

    rows, _ = synth.spinning_pipeline(4, 4, steps=1, f=20_000, b=40_000)
    synth.write_kineto(rows, tmp_path / "p4")
    traceset = load(tmp_path / "p4")
    table = _found(traceset, "pipeline_bubble")
    worst = pipeline_bubbles(traceset).sort_values("bubble_fraction").iloc[-1]
    assert table["text"].iloc[0].startswith(
        f"micro_batches 4 → 8: bubble {100 * worst['bubble_fraction']:.2f}% → {100 * 3 / 11:.2f}% (ideal)")
    assert table["saves_ns"].iloc[0] > 0
    # Two stages and 64 micro-batches: the bubble is already near the ideal at 128.
    rows, _ = synth.spinning_pipeline(2, 64, steps=1, f=20_000, b=40_000, nbytes=45_000)
    synth.write_kineto(rows, tmp_path / "p2")
    assert _found(load(tmp_path / "p2"), "pipeline_bubble").empty


# --- tp across nodes ----------------------------------------------------------------------------------------------

def test_tp_group_across_nodes_is_found_and_one_within_a_node_is_not(synth, tmp_path):
    from shardline.profiling.table.load import load

    def write(folder, group):
        rows = []
        for rank in range(10):  # 8 GPUs per node (the default): ranks 8, 9 are on the second node
            rows.append(dict(synth.gpu_event(rank, "compute", 0, 1000), category="compute"))
            if rank in group:
                rows.append(dict(synth.gpu_event(rank, "all_reduce", 1000, 1000, pg_name="7", pg_desc="mesh_tp",
                                                 pg_ranks=str(group), pg_size=len(group), in_nelems=8 << 10,
                                                 out_nelems=8 << 10, dtype="BFloat16", seq=0),
                                 category="all_reduce"))
            rows.append(synth.annotation(rank, "ProfilerStep#0", 0, 2000))
        synth.write_kineto(rows, folder, device_name="NVIDIA H100 80GB HBM3")
        return load(folder)

    table = _found(write(tmp_path / "across", [6, 7, 8, 9]), "tp_across_nodes")
    assert table["measured"].iloc[0].startswith("tp group spans 2 nodes: all-reduce busbw ")
    # 16 KiB of bf16 in 1 µs: busbw 16384 / 1000 x 2(4-1)/4 = 24.58 GB/s; the ring crosses each node on the NDR
    # ports of its 2 ranks there: 2 x 50 GB/s (collective_bandwidth's limit)
    assert "busbw 24.58 GB/s of the ib-ndr's 100.00" in table["measured"].iloc[0]
    assert _found(write(tmp_path / "within", [4, 5, 6, 7]), "tp_across_nodes").empty


# --- coverage -----------------------------------------------------------------------------------------------------

def test_an_unknown_communication_kernel_is_a_diagnostic_finding(synth, tmp_path):
    """The coverage test's own trace (an ``nccl:all_reduce`` op that launched only a kernel no rule knows, and an
    all-gather kernel under no op) gives both diagnostics, unranked by saving; a covered trace gives none."""
    import importlib.util
    from pathlib import Path

    from shardline.profiling.table.load import load

    spec = importlib.util.spec_from_file_location("coverage_case", Path(__file__).with_name("test_comm_coverage.py"))
    case = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(case)
    table = _found(load(case.write_trace(tmp_path / "job.pt.trace.json.gz")), "comm_coverage")
    assert table["text"].tolist() == [
        "communication kernel with no communication op: 1 × (ncclDevKernel_AllGather_RING_LL"
        "(ncclDevKernelArgsStorage<4096ul>))",
        "communication op with no communication kernel: 1 × (nccl:all_reduce)"]
    assert table["saves_ns"].isna().all() and (table["method"] == "").all()
    quiet, _ = synth.straggler_all_reduce(4)
    assert _found(_frame(synth, quiet), "comm_coverage").empty


# --- ranking, rules as data, the reports -------------------------------------------------------------------------

def test_findings_are_ranked_by_saving_and_rules_are_data(synth, tmp_path):
    from shardline.profiling.base.errors import ProfilingError
    from shardline.profiling.table.load import load

    rows, _ = synth.straggler_all_reduce(4, straggler=2, compute=1000, extra=600, transfer=200)
    synth.write_kineto(rows, tmp_path)
    traceset = load(tmp_path)
    table = findings(traceset)
    assert table["rank"].tolist() == list(range(1, len(table) + 1))
    saves = table["saves_ns"].dropna().to_numpy()
    assert (np.diff(saves) <= 0).all()
    # A stricter threshold is a different rule: the straggler's caused 1800 ns of a 1800 ns step is 100%.
    strict = (FindingRule("straggler", 1.01, _rules("straggler")[0].test),)
    assert findings(traceset, rules=strict).empty
    with pytest.raises(ProfilingError, match="FindingRule"):
        findings(traceset, rules=("straggler",))


def test_findings_lead_every_report(synth, tmp_path):
    from shardline.profiling.present.cli import ReportFormat, _render_report
    from shardline.profiling.present.report_md import render_markdown
    from shardline.profiling.present.report_sections import report_sections
    from shardline.profiling.table.load import load

    rows, _ = synth.straggler_all_reduce(4, straggler=2, compute=1000, extra=600, transfer=200)
    synth.write_kineto(rows, tmp_path)
    traceset = load(tmp_path)
    line = ("rank 2 is last in 1 of 1 collectives and costs the others 0.00180 ms of waiting per step: its compute "
            "is 60.00% above the median; without it the step is 0.000600 ms shorter")
    text = render_markdown(report_sections(traceset))
    assert text.index("Findings") < text.index("Step time per rank") and line in text
    terminal = _render_report(traceset, fmt=ReportFormat.TABLE, source="x", progress=False)
    assert terminal.startswith("findings (what to change") and line in terminal.split("\n\n")[0]


def test_readme_findings_block_is_this_report(traces_dir):
    """The README's findings, critical-path and idle lines are the terminal report of the DLRM set, and its
    what-if rows are ``what_if``'s (same numbers, same text)."""
    import re
    from pathlib import Path

    from shardline.profiling.present.cli import ReportFormat, _render_report
    from shardline.profiling.present.scenarios import what_if
    from shardline.profiling.table.load import load

    traceset = load(traces_dir / "param" / "dlrm_kineto")
    terminal = _render_report(traceset, fmt=ReportFormat.TABLE, source="dlrm", progress=False).splitlines()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme[readme.index("$ shardline profile report $SHARDLINE_TRACES/param/dlrm_kineto"):]
    block = block[:block.index("```")].splitlines()[1:]
    shown = [line for line in block if line.strip() and line != "..."]
    assert shown and all(line in terminal for line in shown), [line for line in shown if line not in terminal]
    rows = what_if(traceset, ["no_straggler", "no_host_bound"])
    whole = rows[rows["rank"] == -1]
    for row in whole.itertuples(index=False):
        pattern = (rf"^\s+{row.step}\s+all\s+{row.scenario}\s+{row.method}\s+{row.measured_ns / 1e6:.3f}\s+"
                   rf"{row.predicted_ns / 1e6:.3f}\s+{row.saved_ns / 1e6:.3f}\s+{re.escape(row.note)}$")
        assert re.search(pattern, readme, flags=re.M), row


def test_report_timings_name_every_analysis(synth, tmp_path, capsys):
    """``--timings`` says where the report's time went: load, each analysis (the issue-20 ones included: idle
    causes, critical path, findings with their what-ifs), and the total."""
    import re

    from shardline.recipes.cli import main

    rows, _ = synth.straggler_all_reduce(4, straggler=2)
    synth.write_kineto(rows, tmp_path / "t")
    assert main(["profile", "report", str(tmp_path / "t"), "--timings", "-o", str(tmp_path / "r.html")]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("shardline profile report: seconds: load ")
    stages = dict(re.findall(r"(\w+) (\d+\.\d{3})", line.split("seconds: ")[1]))
    for name in ("load", "breakdown", "critical_path", "launch_stats", "findings", "idle_causes", "total"):
        assert name in stages, (name, line)
    parts = sum(float(v) for k, v in stages.items() if k not in ("total", "idle_causes"))  # idle: in breakdown
    assert parts <= float(stages["total"]) + 0.002 and float(stages["idle_causes"]) <= float(stages["breakdown"])
