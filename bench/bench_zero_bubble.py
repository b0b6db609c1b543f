"""Split backward and the zero-bubble schedules on CPU: how much of the backward W carries, and ZB-H1 against 1F1B.

1. W's share. shardline's reference GPT (float32, one thread) runs forward, then its backward split
   (``split_backward.deferring_weight_grads``): B (``loss.backward()``, input gradients only for the split
   layers) and W (``store.run()``: every deferred weight gradient), each timed, median over repeats; next to the
   unsplit backward of the same batch. The issue's target: W carries at least a quarter of B + W.
2. The schedules. The same GPT cut into 2 stages on 2 gloo ranks (forked, one thread each), 1F1B and ZB-H1 with
   ``m`` micro-batches, interleaved batch by batch: median step time (the slowest rank's), the engine's measured
   bubble (``1 - compute / window``, mean over ranks) and ``simulate`` fed the measured mean F, B and W of the
   same run (and, for 1F1B, B meaning the whole backward). Two ranks on two shared cores measure the schedule
   only as well as the cores are quiet: read the quartiles.

Writes bench/results/bench_zero_bubble.md and prints it.

    python bench/bench_zero_bubble.py
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _publish import publish

from shardline.job.pipeline.schedule import build_schedule, simulate
from shardline.plugins.layers.split_backward import WeightGradStore, deferring_weight_grads
from shardline.plugins.pipeline.engine import PipelineEngine
from shardline.plugins.pipeline.partition import build_stages, partition_layers, stages_of_rank
from shardline.plugins.testing import run_ranks

RESULTS = Path(__file__).resolve().parent / "results" / "bench_zero_bubble.md"
VOCAB, SEQ, D_MODEL, N_HEAD, D_FF, N_LAYER = 512, 128, 256, 4, 1024, 4
BATCH, MICROBATCHES = 16, 8
REPEATS, WARMUP, BATCHES = 15, 3, 20


def _gpt():
    from shardline.plugins.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=N_LAYER, n_head=N_HEAD, d_model=D_MODEL, d_ff=D_FF,
                       tie_embeddings=False)
    return GPT(config, seed=0)


def _batch(rows: int, index: int = 0):
    gen = torch.Generator().manual_seed(index)
    return torch.randint(VOCAB, (rows, SEQ), generator=gen), torch.randint(VOCAB, (rows, SEQ), generator=gen)


def w_share() -> dict[str, float]:
    torch.set_num_threads(1)
    model = _gpt()
    ids, targets = _batch(BATCH // MICROBATCHES)
    times = {"F": [], "B": [], "W": [], "backward": []}
    for rep in range(WARMUP + REPEATS):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = model(ids, targets)
        unsplit_f = time.perf_counter() - start
        start = time.perf_counter()
        loss.backward()
        backward = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        store = WeightGradStore()
        with deferring_weight_grads(store):
            start = time.perf_counter()
            loss = model(ids, targets)
            t_f = time.perf_counter() - start
            start = time.perf_counter()
            loss.backward()
            t_b = time.perf_counter() - start
        start = time.perf_counter()
        store.run()
        t_w = time.perf_counter() - start
        if rep >= WARMUP:
            for key, value in (("F", t_f), ("B", t_b), ("W", t_w), ("backward", backward), ("F0", unsplit_f)):
                times.setdefault(key, []).append(value)
    return {k: statistics.median(v) for k, v in times.items()}


def _ranks(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    model = _gpt()
    layers = model.pipeline_layers()
    stages = stages_of_rank(build_stages(layers, partition_layers(layers, world, method="parameters")),
                            rank=rank, n_ranks=world)
    engines = {kind: PipelineEngine(stages, schedule=build_schedule(kind, n_ranks=world,
                                                                     n_microbatches=MICROBATCHES),
                                    pp_rank=rank, loss_fn=model.loss) for kind in ("1f1b", "zb_h1")}
    out = {kind: {"step": [], "bubble": [], "F": [], "B": [], "W": []} for kind in engines}
    for index in range(WARMUP + BATCHES):
        for kind, engine in engines.items():
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            engine.run_batch(*_batch(BATCH, index))
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if index < WARMUP:
                continue
            row = out[kind]
            row["step"].append(float(elapsed))
            row["bubble"].append(engine.stats.bubble_fraction)
            for name in ("F", "B", "W"):
                row[name] += [(e - s) / 1e9 for n, _, _, s, e in engine.stats.records if n == name]
    return out


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    share = w_share()
    lines = ["# Zero-bubble pipelines on CPU: W's share of the backward, ZB-H1 against 1F1B", "",
             f"GPT d_model={D_MODEL}, n_head={N_HEAD}, d_ff={D_FF}, n_layer={N_LAYER}, vocab={VOCAB}, seq={SEQ}, "
             f"float32, one thread per process; micro-batch {BATCH // MICROBATCHES} rows.", "",
             "## 1. W's share (one process, whole model, one micro-batch; medians of "
             f"{REPEATS} repeats)", "",
             "| F (ms) | B (ms) | W (ms) | W / (B + W) | unsplit backward (ms) | (B + W) / unsplit |",
             "|---|---|---|---|---|---|",
             f"| {share['F'] * 1e3:.1f} | {share['B'] * 1e3:.1f} | {share['W'] * 1e3:.1f} | "
             f"{share['W'] / (share['B'] + share['W']):.2f} | {share['backward'] * 1e3:.1f} | "
             f"{(share['B'] + share['W']) / share['backward']:.2f} |", "",
             "Target: W / (B + W) >= 0.25.", ""]
    results = run_ranks(_ranks, 2, timeout=1800)
    lines += [f"## 2. 1F1B and ZB-H1 on 2 ranks, m={MICROBATCHES} (medians over {BATCHES} batches, interleaved)", "",
              "| schedule | step (ms) [q1, q3] | measured bubble | simulated bubble (measured F, B, W) |",
              "|---|---|---|---|"]
    for kind in ("1f1b", "zb_h1"):
        rows = [r[kind] for r in results]
        q1, med, q3 = _quartiles(rows[0]["step"])
        bubble = statistics.mean(statistics.median(r["bubble"]) for r in rows)
        costs = {n: statistics.mean(statistics.median(r[n]) for r in rows) if rows[0][n] else 0.0
                 for n in ("F", "B", "W")}
        schedule = build_schedule(kind, n_ranks=2, n_microbatches=MICROBATCHES)
        sim = simulate(schedule, t_forward=costs["F"], t_backward=costs["B"], t_weight=costs["W"])
        lines.append(f"| {kind} | {med * 1e3:.1f} [{q1 * 1e3:.1f}, {q3 * 1e3:.1f}] | {bubble:.3f} | "
                     f"{sim.bubble_fraction:.3f} |")
    publish(lines, RESULTS)


if __name__ == "__main__":
    main()
