"""Idle, decomposed (``shardline.profiling.attribution.idle``): each cause against hand-laid ground truth, the exact sum
to the breakdown's ``idle`` on every corpus trace, and the launch statistics against hand-computed values."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from shardline.profiling.analyses.idle import idle_breakdown, launch_stats
from shardline.profiling.attribution.core import attribute, breakdown
from shardline.profiling.attribution.idle import IDLE_CAUSES, idle_causes, idle_sets
from shardline.profiling.base.errors import MissingRankError, ProfilingError, TraceWarning

_CORPUS = Path(os.environ.get("SHARDLINE_TRACES", Path(__file__).resolve().parents[2].parent / "shared" / "traces"))
_FILES = sorted(p for p in _CORPUS.rglob("*") if p.is_file() and p.suffix != ".md") if _CORPUS.is_dir() else []
T0 = 1_000_000


def _causes(synth, rows) -> dict[str, list[int]]:
    table = idle_breakdown(synth.to_frame(rows))
    return {column: table[column].tolist() for column in ("step", "idle", *IDLE_CAUSES)}


def test_every_cause_against_the_hand_laid_steps(synth):
    rows, truth = synth.idle_causes_steps(t0=T0)
    assert _causes(synth, rows) == truth
    assert breakdown(synth.to_frame(rows))["idle"].tolist() == truth["idle"]  # the breakdown's own idle


def test_columns_are_checked_against_the_partition_idle(synth):
    rows, truth = synth.idle_causes_steps(t0=T0)
    attribution = attribute(synth.to_frame(rows))
    (rank,) = attribution.working
    idle = rank.partition_columns()["idle"]
    columns = idle_causes(attribution, rank, idle=idle)
    assert {c: columns[c].tolist() for c in IDLE_CAUSES} == {c: truth[c] for c in IDLE_CAUSES}
    with pytest.raises(AssertionError, match="do not sum to idle"):
        idle_causes(attribution, rank, idle=idle + np.array([0, 1]))
    sets = idle_sets(attribution, rank)  # disjoint, covering the idle set
    lengths = {c: int((sets[c][1] - sets[c][0]).sum()) for c in ("idle", *IDLE_CAUSES)}
    assert sum(lengths[c] for c in IDLE_CAUSES) == lengths["idle"] == 600


def _queued_gap(synth, *, wait_stream: int | None) -> list[dict]:
    """Kernel [0,100) on stream 7, then one on stream 20 at [300,400) launched at 50 (before the gap
    [100,300) began): a ``Stream Wait Event`` row (Kineto: a cpu-lane row naming the waiting stream, the same
    correlation id as its ``cudaStreamWaitEvent`` call) at 40 for ``wait_stream``; None: no wait at all."""
    rows = synth.launched(0, "compute", T0, 100, launch=T0 - 20, correlation=1)
    rows += synth.launched(0, "compute", T0 + 300, 100, launch=T0 + 50, correlation=2, stream=20)
    if wait_stream is not None:
        rows += [synth.host_row(0, "cudaStreamWaitEvent", T0 + 40, 5, correlation=3),
                 synth.host_row(0, "Stream Wait Event", T0 + 40, 4, cat="cuda_sync", correlation=3,
                                stream=wait_stream)]
    # A host-side sync during the gap does not matter: the work was already queued.
    rows += [synth.host_row(0, "cudaDeviceSynchronize", T0 + 150, 50, correlation=4),
             synth.annotation(0, "ProfilerStep#0", T0, 400)]
    return rows


@pytest.mark.parametrize(("wait_stream", "dependency"), [(20, 200), (7, 0), (None, 0)])
def test_a_wait_counts_for_the_stream_it_names(synth, wait_stream, dependency):
    causes = _causes(synth, _queued_gap(synth, wait_stream=wait_stream))
    assert causes["idle"] == [200]
    assert causes["idle_dependency"] == [dependency] and causes["idle_other"] == [200 - dependency]
    assert causes["idle_sync"] == causes["idle_host_bound"] == [0]


def test_a_wait_call_without_its_row_counts_for_any_stream(synth):
    rows = [r for r in _queued_gap(synth, wait_stream=20) if r["name"] != "Stream Wait Event"]
    assert _causes(synth, rows)["idle_dependency"] == [200]
    # ... but only between the previous launch on the kernel's stream and its own launch.
    late_wait = [dict(r, start_ns=T0 + 60) if r["name"] == "cudaStreamWaitEvent" else r for r in rows]
    assert _causes(synth, late_wait)["idle_dependency"] == [0]


def test_a_query_is_not_a_sync(synth):
    """Kineto reports a non-blocking cudaEventQuery as an ``Event Sync`` row too (same correlation id)."""
    rows = synth.launched(0, "compute", T0, 100, launch=T0 - 20, correlation=1)
    rows += synth.launched(0, "compute", T0 + 300, 100, launch=T0 + 280, correlation=2)
    rows += [synth.host_row(0, "cudaEventQuery", T0 + 120, 10, correlation=3),
             synth.host_row(0, "Event Sync", T0 + 121, 8, cat="cuda_sync", correlation=3, stream=-1),
             synth.host_row(0, "cudaEventSynchronize", T0 + 200, 30, correlation=4),
             synth.host_row(0, "Event Sync", T0 + 201, 28, cat="cuda_sync", correlation=4, stream=-1),
             synth.annotation(0, "ProfilerStep#0", T0, 400)]
    causes = _causes(synth, rows)
    assert causes["idle_sync"] == [30] and causes["idle_host_bound"] == [170]


def test_work_starting_together_the_earliest_launch_decides(synth):
    """Two kernels start when the gap [100,300) ends, one queued at 50, one launched at 250: the GPU had work."""
    rows = synth.launched(0, "compute", T0, 100, launch=T0 - 20, correlation=1)
    rows += synth.launched(0, "compute", T0 + 300, 100, launch=T0 + 250, correlation=2)
    rows += synth.launched(0, "compute", T0 + 300, 50, launch=T0 + 50, correlation=3, stream=20)
    rows.append(synth.annotation(0, "ProfilerStep#0", T0, 400))
    causes = _causes(synth, rows)
    assert causes["idle_other"] == [200] and causes["idle_host_bound"] == [0]


def test_without_launch_rows_only_the_host_state_says_anything(synth):
    rows, _ = synth.idle_causes_steps(t0=T0)
    rows = [r for r in rows if r["name"] != "cudaLaunchKernel"]
    causes = _causes(synth, rows)
    # sync [300,330) [500,540) [700,720); dataloader [450,500) [960,980); the rest of the 600 ns idle: other.
    assert causes["idle_sync"] == [30, 60] and causes["idle_dataloader"] == [50, 20]
    assert causes["idle_host_bound"] == causes["idle_dependency"] == [0, 0]
    assert causes["idle_other"] == [250 - 80, 350 - 80]


def test_cpu_rank_idle_is_data_loading_or_other(synth):
    """A CPU step [0,1000): ops [0,200) and [500,600); the loader's ``__next__`` [150,450) runs ``aten::stack``
    [300,350) and otherwise waits for its workers. Idle [200,300) [350,500) [600,1000) = 650, of which the
    ``__next__`` part [200,300) [350,450) = 200 is data loading."""
    rows = [synth.host_row(3, "aten::linear", T0, 200, cat="cpu_op"),
            synth.host_row(3, "aten::mm", T0 + 500, 100, cat="cpu_op"),
            synth.host_row(3, "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", T0 + 150, 300,
                           cat="user_annotation"),
            synth.host_row(3, "aten::stack", T0 + 300, 50, cat="cpu_op"),
            synth.annotation(3, "ProfilerStep#5", T0, 1000, lane="cpu")]
    table = idle_breakdown(synth.to_frame(rows))
    assert table[["rank", "step", "idle", "idle_dataloader", "idle_other"]].values.tolist() == [[3, 5, 650, 200, 450]]
    assert (table[["idle_host_bound", "idle_sync", "idle_dependency"]] == 0).all().all()


def test_real_event_sync_trace_by_hand(traces_dir):
    """hta/critical_path/cuda_event_sync: one step of five GPU rows, its host calls read from the JSON (µs):
    fill 2810-2811 (launch 2775), reduce 2859-2870 (2847), compare 2900-2901 (2886), DtoH 2935-2937 (2917),
    spin 3037-3073 (3027); aten::item 2912-2957 holds the copy and cudaStreamSynchronize 2947-2953. Every
    gap's next work was launched after the gap began: [2811,2859) 48 and [2870,2900) 30 host-bound;
    [2901,2935): sync from the item's start 2912, 23, host-bound 11; [2937,3037): sync until item returns at
    2957, 20, then host-bound 80. cudaEventSynchronize 3047-3081 waits under the spin kernel (busy)."""
    from shardline.profiling.table.load import load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        traceset = load(traces_dir / "hta" / "critical_path" / "cuda_event_sync" / "event_sync_trace.json.gz")
    (row,) = idle_breakdown(traceset).itertuples(index=False)
    assert (row.step, row.idle) == (100, 212_000)
    assert (row.idle_host_bound, row.idle_sync, row.idle_dataloader, row.idle_dependency, row.idle_other) == (
        169_000, 43_000, 0, 0, 0)
    (stats,) = launch_stats(traceset).itertuples(index=False)
    # delays 35, 12, 14, 18, 10 µs; kernels (no copy) 1, 11, 1, 36 µs, two shorter than 10 µs
    assert (stats.launches, stats.launch_delay_median_ns, stats.launch_delay_max_ns) == (5, 14_000.0, 35_000)
    assert (stats.kernels, stats.short_kernels, stats.short_kernel_ns, stats.busy_ns) == (4, 2, 2_000, 51_000)


def test_launch_stats_by_hand(synth):
    """Rank 0: delays 2000, 5000, 1000, 10000 (an all-reduce), 1000 (a copy) ns -> median 2000, p90 by linear
    interpolation 5000 + 0.6 * 5000 = 8000, max 10000; a kernel without a launch row counts as a kernel only.
    Kernels 5 (the copy is none), short (< 10 µs) 5000, 9999 and 2000 ns: 3, their union 16999 ns of the
    busy 5000 + 20000 + 10000 + 2000 + 2000 = 39000 (a wait marker is not busy). Rank 1 runs on CPU only."""
    rows = synth.launched(0, "compute", 0, 5_000, launch=-2_000, correlation=1)
    rows += synth.launched(0, "compute", 6_000, 20_000, launch=1_000, correlation=2)
    rows += synth.launched(0, "compute", 30_000, 9_999, launch=29_000, correlation=3)
    rows += synth.launched(0, "all_reduce", 30_000, 10_000, launch=20_000, correlation=4)
    rows += synth.launched(0, "memcpy_h2d", 41_000, 2_000, launch=40_000, correlation=5, call="cudaMemcpyAsync")
    rows += [synth.gpu_event(0, "compute", 50_000, 2_000),
             synth.host_row(0, "cudaStreamSynchronize", 45_000, 100, correlation=6),  # no launch
             synth.host_row(0, "cudaEventRecord", -9_000, 10, correlation=1),  # the id, but not a launch call
             # a GPU-lane wait marker and its call: neither a launch nor busy time
             synth.gpu_event(0, "sync", 60_000, 1_000, correlation=7), synth.host_row(0, "cudaStreamWaitEvent",
                                                                                    59_000, 10, correlation=7),
             synth.host_row(1, "aten::mm", 0, 100, cat="cpu_op")]
    table = launch_stats(synth.to_frame(rows)).set_index("rank")
    gpu = table.loc[0]
    assert (gpu["lanes"], gpu["launches"], gpu["launch_delay_median_ns"], gpu["launch_delay_p90_ns"],
            gpu["launch_delay_max_ns"]) == ("gpu", 5, 2_000.0, 8_000.0, 10_000)
    assert (gpu["kernels"], gpu["short_kernels"], gpu["short_kernel_ns"], gpu["busy_ns"]) == (5, 3, 16_999, 39_000)
    assert gpu["short_kernel_share"] == 16_999 / 39_000
    cpu = table.loc[1]
    assert (cpu["lanes"], cpu["launches"], cpu["kernels"], cpu["launch_delay_max_ns"]) == ("cpu", 0, 0, -1)
    assert np.isnan(cpu["launch_delay_median_ns"]) and np.isnan(cpu["short_kernel_share"])


@pytest.mark.parametrize("relative", [str(p.relative_to(_CORPUS)) for p in _FILES])
def test_causes_sum_to_the_breakdown_idle_on_corpus_trace(traces_dir, relative):
    from shardline.profiling.table.load import load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        try:
            try:
                traceset = load(traces_dir / relative)
            except MissingRankError:
                traceset = load(traces_dir / relative, rank=0)
        except ProfilingError as exc:  # the readers decide what loads; not this test's subject
            pytest.skip(f"does not load: {type(exc).__name__}: {exc}")
        table = breakdown(traceset)
        idle = idle_breakdown(traceset)
        stats = launch_stats(traceset)
    assert idle[["rank", "step", "start_ns", "end_ns"]].values.tolist() == \
        table[["rank", "step", "start_ns", "end_ns"]].values.tolist()
    assert idle["idle"].tolist() == table["idle"].tolist()
    causes = idle[list(IDLE_CAUSES)]
    assert (causes.sum(axis=1) == idle["idle"]).all() and (causes >= 0).all().all()
    assert stats["rank"].tolist() == sorted(set(table["rank"]))
    assert (stats["short_kernels"] <= stats["kernels"]).all() and (stats["short_kernel_ns"] <= stats["busy_ns"]).all()
    launched = stats[stats["launches"] > 0]
    assert (launched["launch_delay_median_ns"] <= launched["launch_delay_p90_ns"]).all()
    assert (launched["launch_delay_p90_ns"] <= launched["launch_delay_max_ns"]).all()


def test_the_breakdown_and_the_reports_carry_the_causes(synth):
    """``breakdown`` has the cause columns (summing to ``idle``), and the report's idle section shows them and
    the launch statistics, as exact ms."""
    from shardline.profiling.present.display import display_tables
    from shardline.profiling.present.report_sections import Section, report_sections

    rows, truth = synth.idle_causes_steps(t0=T0)
    frame = synth.to_frame(rows)
    table = breakdown(frame)
    assert {c: table[c].tolist() for c in IDLE_CAUSES} == {c: truth[c] for c in IDLE_CAUSES}
    assert (table[list(IDLE_CAUSES)].sum(axis=1) == table["idle"]).all()
    shown = dict(display_tables(report_sections(frame))[Section.IDLE])
    idle = shown["idle-table"]
    assert idle["host_bound_ms"].tolist() == [f"0.{v:06d}" for v in truth["idle_host_bound"]]
    assert idle["dependency_ms"].tolist() == [f"0.{v:06d}" for v in truth["idle_dependency"]]
    stats = launch_stats(frame)
    assert shown["launch-table"]["launches"].tolist() == stats["launches"].astype(str).tolist()
