"""Pipeline 1F1B on 2 CPU ranks: shardline's ``PipelineEngine`` vs ``torch.distributed.pipelining.Schedule1F1B``.

Same stage modules (identical weights), same micro-batches, one thread per rank, forked gloo ranks
(``run_ranks``). Both sides run in the same processes, interleaved batch by batch so drift hits both alike; a
batch's time is the slowest rank's, and the table shows medians, plus the median and quartiles of the per-batch
ratio (each batch of ours against the torch batch run right next to it), which shows how much of the ratio is
noise. Also:

- the ideal pipeline time ``dense_mb / p * (m + p - 1) / m``, where ``dense_mb`` is one process running the
  whole model on the same ``m`` micro-batches one after another (small micro-batches are slower per sample than
  one big batch on a CPU thread, so this is the fair dense baseline);
- the bubble fraction measured by the engine's own per-action timing (``1 - compute / window``, mean over
  ranks) next to ``simulate()`` fed the measured mean F and B times, and the closed form ``(p-1)/(m+p-1)``.

Before timing, the first batch's loss and every gradient of both sides are compared (float32, same arithmetic
up to reduction order; tolerance 1e-4 relative), so the two are doing the same work.

Writes bench/results/bench_pipeline.md and prints it. Target: shardline / torch <= 1.0.

    python bench/bench_pipeline.py
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as torch_f
from _publish import publish
from torch import nn

from shardline.job.pipeline.schedule import one_f_one_b, simulate
from shardline.plugins.pipeline.engine import PipelineEngine
from shardline.plugins.testing import run_ranks

WORLD, D_MODEL, BLOCKS_PER_STAGE, MB_ROWS = 2, 256, 3, 32
MICROBATCHES = (4, 8)
# the ratio of two 20-batch medians moved by +-0.05 between runs here, of 60-batch ones by +-0.03
WARMUP, BATCHES = 3, 150
RESULTS = Path(__file__).resolve().parent / "results" / "bench_pipeline.md"


class MLPBlock(nn.Module):
    """Pre-LN transformer MLP block: x + W2 gelu(W1 LN(x))."""

    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch_f.gelu(self.fc1(self.ln(x))))


def make_stages(seed: int = 0) -> list[nn.Sequential]:
    torch.manual_seed(seed)
    return [nn.Sequential(*[MLPBlock(D_MODEL) for _ in range(BLOCKS_PER_STAGE)]) for _ in range(WORLD)]


def loss_fn(out, target):
    return torch_f.mse_loss(out, target)


def make_batch(m: int, index: int):
    gen = torch.Generator().manual_seed(1000 + index)
    rows = m * MB_ROWS
    return torch.randn(rows, D_MODEL, generator=gen), torch.randn(rows, D_MODEL, generator=gen)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _one_way_latency(rank: int) -> float:
    """Half the median round trip of one activation-sized message between the two ranks (seconds)."""
    buf = torch.randn(MB_ROWS, D_MODEL)
    trips = []
    for _ in range(30):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, dst=1)
            dist.recv(buf, src=1)
        else:
            dist.recv(buf, src=0)
            dist.send(buf, dst=0)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2


def _bench_rank(rank: int, world: int, m: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    ours_module, theirs_module = make_stages()[rank], make_stages()[rank]
    engine = PipelineEngine(ours_module, schedule=one_f_one_b(world, m), pp_rank=rank, loss_fn=loss_fn)
    stage = PipelineStage(theirs_module, rank, world, torch.device("cpu"))
    theirs = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)  # scale_grads: grads of the batch mean

    def run_ours(x, y):
        return engine.run_batch(x, y)

    def run_theirs(x, y):
        losses = []
        theirs.step(x) if rank == 0 else theirs.step(target=y, losses=losses)
        return losses

    check = _compare_once(rank, run_ours, run_theirs, ours_module, theirs_module, m)
    t_comm = _one_way_latency(rank)
    times = {"ours": [], "theirs": []}
    bubbles, f_ns, b_ns, ratios = [], [], [], []
    for index in range(WARMUP + BATCHES):
        x, y = make_batch(m, index + 1)
        sides = [("ours", run_ours, ours_module), ("theirs", run_theirs, theirs_module)]
        for name, fn, module in sides if index % 2 else sides[::-1]:  # alternate who goes first
            module.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            fn(x, y)
            elapsed = _slowest(time.perf_counter() - start)
            if index >= WARMUP:
                times[name].append(elapsed)
        if index >= WARMUP:
            ratios.append(times["ours"][-1] / times["theirs"][-1])
            stats = engine.stats
            bubbles.append(stats.bubble_fraction)
            f_ns += [e - s for n, _, _, s, e in stats.records if n == "F"]
            b_ns += [e - s for n, _, _, s, e in stats.records if n == "B"]
    return {"ours": statistics.median(times["ours"]), "theirs": statistics.median(times["theirs"]),
            "bubble": statistics.mean(bubbles), "t_f": statistics.mean(f_ns) / 1e9,
            "t_b": statistics.mean(b_ns) / 1e9, "check": check, "t_comm": t_comm,
            "paired": statistics.quantiles(ratios, n=4)}


def _compare_once(rank, run_ours, run_theirs, ours_module, theirs_module, m) -> float:
    """Largest relative difference between the two sides' gradients (and loss) on one batch."""
    x, y = make_batch(m, 0)
    loss = run_ours(x, y)
    losses = run_theirs(x, y)
    worst = 0.0
    if losses:
        theirs_loss = torch.stack([v.detach() for v in losses]).mean()
        worst = float((loss - theirs_loss).abs() / theirs_loss.abs())
    for p, q in zip(ours_module.parameters(), theirs_module.parameters()):
        worst = max(worst, float((p.grad - q.grad).abs().max() / q.grad.abs().max()))
    ours_module.zero_grad(set_to_none=True)
    theirs_module.zero_grad(set_to_none=True)
    return worst


def dense_microbatched(m: int) -> float:
    """One thread, the whole model, the same m micro-batches one after another (median seconds per batch)."""
    torch.set_num_threads(1)
    model = nn.Sequential(*make_stages())
    times = []
    for index in range(WARMUP + BATCHES):
        x, y = make_batch(m, index + 1)
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for xi, yi in zip(x.chunk(m), y.chunk(m)):
            (loss_fn(model(xi), yi) / m).backward()
        if index >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> str:
    p = WORLD
    load_before = os.getloadavg()[0]
    rows = []
    for m in MICROBATCHES:
        per_rank = run_ranks(_bench_rank, p, m, timeout=300)
        ours, theirs = per_rank[0]["ours"], per_rank[0]["theirs"]
        check = max(r["check"] for r in per_rank)
        if check > 1e-4:
            raise SystemExit(f"m={m}: shardline and torch disagree (max relative gradient difference {check:.2e})")
        ideal = dense_microbatched(m) / p * (m + p - 1) / m
        t_f = statistics.mean(r["t_f"] for r in per_rank)
        t_b = statistics.mean(r["t_b"] for r in per_rank)
        t_comm = statistics.mean(r["t_comm"] for r in per_rank)
        predicted = simulate(one_f_one_b(p, m), t_forward=t_f, t_backward=t_b).bubble_fraction
        with_comm = simulate(one_f_one_b(p, m), t_forward=t_f, t_backward=t_b, t_comm=t_comm).bubble_fraction
        measured = statistics.mean(r["bubble"] for r in per_rank)
        q1, med, q3 = per_rank[0]["paired"]
        rows.append(f"| {p} | {m} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | **{ours / theirs:.2f}** | "
                    f"{med:.2f} [{q1:.2f}, {q3:.2f}] | "
                    f"{ideal * 1e3:.1f} | {ours / ideal:.2f} | {theirs / ideal:.2f} | {measured:.3f} | "
                    f"{predicted:.3f} | {with_comm:.3f} | {(p - 1) / (m + p - 1):.3f} | "
                    f"{t_f * 1e3:.2f} / {t_b * 1e3:.2f} / {t_comm * 1e3:.2f} | {check:.1e} |")
    table = "\n".join([
        f"# bench_pipeline: 1F1B, {p} CPU ranks (gloo, 1 thread each), {BLOCKS_PER_STAGE} MLP blocks "
        f"(d={D_MODEL}) per stage, {MB_ROWS} rows per micro-batch, float32; medians of {BATCHES} batches",
        "",
        "| p | m | shardline ms/batch | torch Schedule1F1B ms/batch | shardline / torch | per-batch ratio median "
        "[quartiles] | ideal ms "
        "(dense_mb/p*(m+p-1)/m) | shardline / ideal | torch / ideal | bubble measured (engine timing) "
        "| bubble simulate(F,B) | bubble simulate(F,B,comm) | bubble (p-1)/(m+p-1) | measured F / B / comm ms "
        "| max rel. grad diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Machine: {os.cpu_count()} cores, 1-minute load average {load_before:.1f} before the run and "
        f"{os.getloadavg()[0]:.1f} after (other work on the machine inflates both sides alike, and the "
        "ideal, which runs alone, less).",
        "",
        "Target: shardline / torch <= 1.0. The measured bubble counts every moment of the batch window that is "
        "not an F or B (waits, posting, the shape header, the batch loss reaching every rank). simulate(F,B) takes "
        "communication as free and equals the closed form when F and B are uniform; simulate(F,B,comm) adds "
        "the measured one-way latency of an activation message (half a gloo ping-pong) to every transfer.",
    ])
    return publish([*table.split("\n"), ""], RESULTS)


if __name__ == "__main__":
    main()
