"""The contract end to end: our pipeline engine, profiled on real gloo ranks, read back by the profiler.

Tier 2 (forked gloo ranks, needs torch); the profiler itself never imports torch -- only this test does.
"""

from __future__ import annotations

import torch


def _run_profiled(rank, world, folder, m):
    from torch import nn

    from shardline.job.pipeline.schedule import one_f_one_b
    from shardline.plugins.pipeline import PipelineEngine
    from shardline.plugins.pipeline.partition import build_stages, partition_layers

    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(16, 16, dtype=torch.float64) for _ in range(2 * world)])
    stages = build_stages(layers, partition_layers(layers, world))
    engine = PipelineEngine(stages[rank], schedule=one_f_one_b(world, m), pp_rank=rank,
                            loss_fn=lambda out, target: ((out - target) ** 2).mean())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4 * m, 16, dtype=torch.float64, generator=gen)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.run_batch(x, torch.zeros_like(x))
    prof.export_chrome_trace(str(folder / f"rank{rank}.pt.trace.json"))
    return rank


def test_real_engine_trace_gives_annotated_bubbles_that_sum(tmp_path):
    from shardline.plugins.testing import run_ranks
    from shardline.profiling.analyses.bubbles import pipeline_bubbles
    from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, breakdown
    from shardline.profiling.matching.pipelines import BubbleMethod
    from shardline.profiling.table.load import load

    world, m = 2, 3
    assert run_ranks(_run_profiled, world, tmp_path, m, timeout=90) == [0, 1]
    traceset = load(tmp_path)
    table = breakdown(traceset)
    assert sorted(table["rank"]) == [0, 1] and (table["lanes"] == "cpu").all()
    assert (table[list(EXCLUSIVE_COLUMNS)].sum(axis=1) == table["step_ns"]).all()
    assert (table["bubble"] > 0).all() and (table["compute"] > 0).all()

    bubbles = pipeline_bubbles(traceset).set_index("rank")
    assert (bubbles["method"] == BubbleMethod.ANNOTATIONS.value).all()
    assert (bubbles["p"] == world).all() and (bubbles["m"] == m).all() and (bubbles["m_seen"] == m).all()
    assert bubbles.loc[[0, 1], "stage"].tolist() == [0, 1]
    phases = bubbles[["warmup_ns", "steady_ns", "cooldown_ns"]].sum(axis=1)
    assert (phases == bubbles["bubble_ns"]).all()
    assert ((bubbles["bubble_ns"] > 0) & (bubbles["bubble_ns"] < bubbles["batch_ns"])).all()
    # The last stage waits for the first forward: its warm-up bubble is not empty.
    assert bubbles.loc[world - 1, "warmup_ns"] > 0
