"""Throughput of ``recipes/tiny.yaml``'s GPT per parallel layout on 4 CPU ranks (forked gloo ranks, 1 thread each,
on this 2-core machine: 4 ranks share 2 cores, so these are CPU numbers, not a GPU forecast).

Each layout trains the recipe's model on the recipe's data (the standard library's sources, byte-level) with
the real Trainer and HybridParallelStrategy for ``STEPS`` steps, same global batch for every layout (the
recipe's 16 windows of 128 tokens: ``16 / dp`` per replica), AdamW + warm-up, 8 micro-batches where pp > 1.
Gradient clipping is on (the recipe's 1.0) for every layout and for the dense reference: the clipping norm
counts a weight tied across pipeline stages once, as the dense model does. A step is the time between two
``on_train_batch_end`` calls (the slower rank); the first ``DROP`` steps are dropped. Every layout runs
``PASSES`` times, alternately in the list's order and in reverse, so load drift on the shared machine does not
favour one end of the list; the table pools the passes.

Before any timing is reported, every layout's per-step loss (mean over replicas) is checked against one
process training the same model densely on the same global batches (float32 behind TP/PP/DP reductions and
AdamW and clipping over 12 steps: rtol 1e-5). Every layout keeps the recipe's tied embeddings, under ZeRO-2 and
ZeRO-3 with pp too (the first stage owns the tied weight; the last computes with a shadow of it).

Writes bench/results/bench_tiny_layouts.md and prints it.

    python bench/bench_tiny_layouts.py
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
import yaml
from _publish import publish

from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.data import TextDataModule
from shardline.recipes.lit_gpt import GPTModule

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "bench_tiny_layouts.md"
WORLD, STEPS, DROP, PASSES = 4, 12, 2, 3
RECIPE = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
MODEL = RECIPE["model"]
GLOBAL_BATCH = RECIPE["data"]["batch_size"]  # the recipe runs dp=1: its global batch
MICRO = RECIPE["trainer"]["strategy"]["init_args"]["micro_batches"]
CLIP = RECIPE["trainer"]["gradient_clip_val"]

# (name, strategy kwargs, tie_embeddings)
LAYOUTS = [
    ("tp2 x pp2 x zero1 (the recipe)", dict(tp=2, pp=2, zero_stage=1), True),
    ("tp2 x dp2 x zero1", dict(tp=2, zero_stage=1), True),
    ("pp2 x dp2 x zero2", dict(pp=2, zero_stage=2), True),
    ("pp2 x dp2 x zero3", dict(pp=2, zero_stage=3), True),
    ("dp4 x zero1", dict(zero_stage=1), True),
    ("tp4 x zero1", dict(tp=4, zero_stage=1), True),
    ("pp4 x zero1", dict(pp=4, zero_stage=1), True),
]

_DATA: TextDataModule | None = None  # read once in the parent; forked ranks inherit it


def data(batch_size: int) -> TextDataModule:
    module = TextDataModule(**{**RECIPE["data"], "batch_size": batch_size})
    module.train_set, module.val_set = _DATA.train_set, _DATA.val_set
    return module


class Meter(pl.Callback):
    def __init__(self):
        self.ends, self.losses, self.bubbles = [], [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())
        pipeline = trainer.strategy.pipeline_driver
        if pipeline is None:
            self.losses.append(module.last_loss.item())
        else:
            self.losses.append(outputs["loss"].item())
            self.bubbles.append(pipeline.engine_for(batch[0].shape[0]).stats.bubble_fraction)


def _fit(rank, world, kwargs, tied, clip=CLIP):
    adopt_process_group_in_lightning()
    strategy = HybridParallelStrategy(**kwargs, **({"micro_batches": MICRO} if kwargs.get("pp", 1) > 1 else {}))
    meter = Meter()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=clip,
                         precision="32-true", callbacks=[meter])
    dp = strategy.layout_for(world).dp
    trainer.fit(GPTModule(**{**MODEL, "tie_embeddings": tied}), datamodule=data(GLOBAL_BATCH // dp))
    return {"ends": meter.ends, "losses": meter.losses, "bubbles": meter.bubbles,
            "dp_rank": strategy.grid.rank("dp"), "dp": dp}


def _dense(rank, world, tied, clip=CLIP):
    """One process, the whole global batch: Lightning's DistributedSampler order (seed, epoch 0), same AdamW.
    ``clip``: clip the global gradient norm to it (DeepSpeed's rule)."""
    module = GPTModule(**{**MODEL, "tie_embeddings": tied})
    module.configure_model()
    opt = module.configure_optimizers()
    optimizer, scheduler = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
    train = _DATA.train_set
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    losses = []
    for step in range(STEPS):
        ids, targets = zip(*(train[int(i)] for i in order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]),
                           strict=True)
        loss = module.gpt(torch.stack(ids), torch.stack(targets))
        optimizer.zero_grad()
        loss.backward()
        if clip:
            grads = [p.grad for p in module.gpt.parameters() if p.grad is not None]
            square = sum(g.pow(2).sum() for g in grads)
            scale = min(1.0, clip / (square.sqrt().item() + 1e-6))  # DeepSpeed's rule: clip / (norm + 1e-6)
            for g in grads:
                g.mul_(scale)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def summarise(results: list[dict]) -> dict:
    dp = results[0]["dp"]
    per_replica = {}
    for res in results:
        per_replica.setdefault(res["dp_rank"], res["losses"])
    losses = [sum(per_replica[r][i] for r in range(dp)) / dp for i in range(STEPS)]
    steps = [max(res["ends"][i] - res["ends"][i - 1] for res in results) for i in range(DROP, STEPS)]
    bubbles = [b for res in results for b in res["bubbles"][DROP:]]
    return {"losses": losses, "steps": steps, "bubble": statistics.mean(bubbles) if bubbles else None}


def main() -> str:
    global _DATA
    _DATA = TextDataModule(**RECIPE["data"])
    _DATA.setup("fit")
    load_before = os.getloadavg()
    dense = {tied: run_ranks(_dense, 1, tied, timeout=600)[0] for tied in {tied for _, _, tied in LAYOUTS}}
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in LAYOUTS}
    loads = []
    started = time.perf_counter()
    for n in range(PASSES):
        for name, kwargs, tied in (LAYOUTS if n % 2 == 0 else LAYOUTS[::-1]):
            loads.append(os.getloadavg()[0])
            runs[name].append(summarise(run_ranks(_fit, WORLD, kwargs, tied, timeout=600)))
    wall = time.perf_counter() - started

    worst = {}
    for name, _, tied in LAYOUTS:
        worst[name] = max(abs(a - b) / abs(b) for run in runs[name] for a, b in
                          zip(run["losses"], dense[tied], strict=True))
    bad = {k: v for k, v in worst.items() if v > 1e-5}  # float32 behind TP/PP/DP reductions, AdamW, clipping
    if bad:
        raise SystemExit(f"layouts disagree with the dense run (max relative loss difference): {bad}")

    tokens = GLOBAL_BATCH * MODEL["seq_len"]
    rows = []
    for name, kwargs, tied in LAYOUTS:
        steps = [s for run in runs[name] for s in run["steps"]]
        med = statistics.median(steps)
        passes = " / ".join(f"{statistics.median(run['steps']):.3f}" for run in runs[name])
        p = kwargs.get("pp", 1)
        bubble = "—"
        if p > 1:
            measured = statistics.mean(run["bubble"] for run in runs[name])
            bubble = f"{measured:.2f} (closed form {(p - 1) / (MICRO + p - 1):.2f})"
        rows.append(f"| {name} | {'tied' if tied else 'untied'} | {med:.3f} | {passes} | {tokens / med:,.0f} | "
                    f"{bubble} | {worst[name]:.1e} |")
    lines = [
        "# bench_tiny_layouts: recipes/tiny.yaml's GPT per layout, 4 CPU ranks on 2 cores",
        "",
        f"Model: vocab {MODEL['vocab_size']}, seq {MODEL['seq_len']}, {MODEL['n_layer']} layers, {MODEL['n_head']} "
        f"heads, d_model {MODEL['d_model']}; AdamW (lr {MODEL['lr']}, warm-up {MODEL['warmup_steps']}), float32, "
        f"gradient clipping at {CLIP} (the recipe's) for every layout and the dense reference. Data: the "
        f"recipe's (standard-library sources, byte-level). Global batch {GLOBAL_BATCH} "
        f"x {MODEL['seq_len']} = {tokens} tokens per step for every layout ({GLOBAL_BATCH}/dp per replica); "
        f"{MICRO} micro-batches (1F1B) where pp > 1. Real Trainer + HybridParallelStrategy on 4 forked gloo ranks, "
        f"1 thread each: **4 ranks share 2 cores**, so a rank waits for a core as well as for its peers; these are "
        f"honest CPU numbers, not a forecast for GPUs.",
        "",
        f"Each layout ran {PASSES} times ({STEPS} steps each, the first {DROP} dropped; passes alternate "
        f"between the list's order and its reverse); s/step is the median over all passes' "
        f"{PASSES * (STEPS - DROP)} steps, a step being the slower rank's time between two "
        f"`on_train_batch_end`. Progress bar, logger and checkpointing off; the module's "
        f"`self.log(sync_dist=True)` stays. Same computation checked first: every layout's per-step loss "
        f"(mean over replicas, all {STEPS} steps, every pass) against a dense one-process run of the same model "
        f"on the same global batches (limit rtol 1e-5).",
        "",
        "| layout | embeddings | s/step (median) | per pass | tokens/s | pipeline bubble (measured, mean over ranks) "
        "| max rel. loss diff vs dense |",
        "|---|---|---:|---|---:|---|---:|",
        *rows,
        "",
        "Measured bubble: the pipeline engine's own per-action timing (`trainer.strategy.pipeline_driver` -> its "
        "`PipelineEngine.stats`, `1 - (F+B time) / batch window`) per rank and step; it counts every non-compute "
        "moment, including waits for a core that another rank holds. Closed form: (p-1)/(m+p-1). Under pp the "
        "tied embedding is a parameter of the first stage only; the last stage computes with a shadow of it "
        "(refreshed after each step, its gradient added to the first stage's before ZeRO reduces it).",
        "",
        f"Machine: {os.cpu_count()} cores shared with other work; 1-minute load average {load_before[0]:.1f} at "
        f"the start, {min(loads):.1f}-{max(loads):.1f} at the layouts' starts, {os.getloadavg()[0]:.1f} at the end; "
        f"{wall:.0f} s for all runs.",
        "",
    ]
    return publish(lines, RESULTS)


if __name__ == "__main__":
    main()
