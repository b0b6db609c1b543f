"""One GPT block, forward + backward, at tp=2 on 2 CPU ranks: shardline's TP layers vs torch's own
``torch.distributed.tensor.parallel`` (ColwiseParallel/RowwiseParallel on a DeviceMesh), identical shapes and
weights, one thread per rank (forked gloo ranks via ``run_ranks``). Also the dense block on one thread.

Both sides run in the same process, interleaved round by round so drift hits both alike; a round's time is the
slowest rank's. Writes bench/results/bench_tp.md and prints it. Target: shardline / torch <= 1.0.

    python bench/bench_tp.py
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _publish import publish
from torch import nn

from shardline.plugins.grid import Grid, ParallelDims, SPMode
from shardline.plugins.models.gpt import Block, GPTConfig, SPContext
from shardline.plugins.testing import run_ranks

CFG = GPTConfig(vocab_size=128, seq_len=256, n_layer=1, n_head=8, d_model=512)
BATCH, ROUNDS, ITERS, WARMUP = 4, 7, 3, 2
SEED = 0
RESULTS = Path(__file__).resolve().parent / "results" / "bench_tp.md"


class TorchBlock(nn.Module):
    """The same pre-LN block in plain torch modules (parameter names match shardline's Block)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, cfg.d_ff), nn.Linear(cfg.d_ff, d)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x))  # after ColwiseParallel: this rank's heads (local tensor)
        q, k, v = qkv.view(b, s, -1, 3, self.cfg.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def _blocks(group, world):
    ctx = SPContext(tp_group=group, cp_group=None, tp=world, cp=1, tp_rank=dist.get_rank(), cp_rank=0,
                    mode=SPMode.NONE)
    ours = Block(CFG, ctx=ctx, generator=torch.Generator().manual_seed(SEED))
    dense_ctx = SPContext(tp_group=None, cp_group=None, tp=1, cp=1, tp_rank=0, cp_rank=0, mode=SPMode.NONE)
    dense = Block(CFG, ctx=dense_ctx, generator=torch.Generator().manual_seed(SEED))
    theirs = TorchBlock(CFG)
    theirs.load_state_dict(dense.state_dict())  # identical full weights before torch shards them
    return ours, theirs, dense


def _time(fn, x, grad):
    dist.barrier()
    start = time.perf_counter()
    for _ in range(ITERS):
        fn(x).backward(grad)
    return (time.perf_counter() - start) / ITERS


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    group = Grid.build(ParallelDims(world, tp=world)).group("tp")
    ours, theirs, dense = _blocks(group, world)
    mesh = init_device_mesh("cpu", (world,))
    plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    theirs = parallelize_module(theirs, mesh, plan)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, CFG.seq_len, CFG.d_model, generator=gen)
    grad = torch.randn(BATCH, CFG.seq_len, CFG.d_model, generator=gen)
    # Same function first: otherwise the timing compares different work.
    agree = max((ours(x) - dense(x)).abs().max().item(), (theirs(x) - dense(x)).abs().max().item())
    for fn in (ours, theirs, dense):
        for _ in range(WARMUP):
            fn(x).backward(grad)
    rounds = {"shardline": [], "torch": [], "dense": []}
    for _ in range(ROUNDS):
        rounds["shardline"].append(_time(ours, x, grad))
        rounds["torch"].append(_time(theirs, x, grad))
        if rank == 0:
            rounds["dense"].append(_time_dense(dense, x, grad))
        dist.barrier()
    return rounds, agree


def _time_dense(block, x, grad):
    start = time.perf_counter()
    for _ in range(ITERS):
        block(x).backward(grad)
    return (time.perf_counter() - start) / ITERS


def main() -> str:
    world = 2
    load = os.getloadavg()[0]
    results = run_ranks(_worker, world, timeout=600)
    per_round = {k: [max(r[0][k][i] for r in results if r[0][k]) for i in range(ROUNDS)]
                 for k in ("shardline", "torch", "dense")}
    med = {k: statistics.median(v) for k, v in per_round.items()}
    agree = max(r[1] for r in results)
    ratio = med["shardline"] / med["torch"]
    shape = (f"batch {BATCH}, seq {CFG.seq_len}, d_model {CFG.d_model}, heads {CFG.n_head}, d_ff {CFG.d_ff}, "
             f"float32")
    lines = [
        "# bench_tp: one GPT block, forward + backward, tp=2 on 2 CPU ranks (1 thread each)",
        "",
        f"Shapes: {shape}. Median of {ROUNDS} interleaved rounds x {ITERS} iterations; a round counts its "
        f"slowest rank. Max |output - dense output| over both TP versions: {agree:.2e}. Load average at start: "
        f"{load:.1f} on {os.cpu_count()} cores (shared machine: absolute times are noisy, the interleaved ratio "
        f"less so).",
        "",
        "| implementation | ms / step | vs dense 1 thread |",
        "|---|---:|---:|",
        f"| dense block, 1 rank | {med['dense'] * 1e3:.1f} | 1.00 |",
        f"| torch.distributed.tensor.parallel (Colwise/Rowwise, DeviceMesh) | {med['torch'] * 1e3:.1f} | "
        f"{med['torch'] / med['dense']:.2f} |",
        f"| shardline ColumnParallelLinear/RowParallelLinear | {med['shardline'] * 1e3:.1f} | "
        f"{med['shardline'] / med['dense']:.2f} |",
        "",
        f"**shardline / torch = {ratio:.2f}** (target <= 1.0)",
        "",
    ]
    return publish(lines, RESULTS)


if __name__ == "__main__":
    main()
