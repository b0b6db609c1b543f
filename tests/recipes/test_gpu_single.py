"""What one CUDA device can check (marked ``gpu``; skipped without one): the strategy's CUDA path at world 1.

- A Llama trained on one GPU (float32, DeepSpeed ZeRO-1, torch's AdamW) follows the same run on the CPU: its
  per-step losses within 1e-4 relative (cuBLAS against the CPU's BLAS, float32, TF32 off; no collective).
- bf16-mixed on the GPU trains (finite, decreasing) within bf16's noise of the float32 run.
- A checkpoint saved from the GPU run loads into a CPU run of another module instance bit for bit (the pieces are
  copied off the device on save) and StepProfiler's trace of the GPU run holds CUDA kernels.

What needs two or more GPUs (NCCL across ranks: tp2, pp2, ZeRO-2 parity, resume on NCCL) is in
``test_gpt_parity.py`` and ``test_checkpoint_resume.py``; ``bench/gpu/validate.sh`` runs both sets.
"""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.lit_lm import LanguageModule

# device_count asks NVML: CUDA is not initialised in this process, whose ranks fork from it
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs CUDA: one device")]

MODEL = dict(architecture="llama", vocab_size=64, seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
             tie_embeddings=False, lr=1e-3, warmup_steps=1)
STEPS, BATCH = 6, 8


class _Losses(pl.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def _data() -> DataLoader:
    tokens = torch.randint(0, MODEL["vocab_size"], (BATCH * STEPS, MODEL["seq_len"] + 1),
                           generator=torch.Generator().manual_seed(5))
    return DataLoader(TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), batch_size=BATCH)


def _fit(rank, world, accelerator, precision, save=None, load=None, profile=None):
    adopt_process_group_in_lightning()
    torch.manual_seed(0)
    losses = _Losses()
    callbacks = [losses]
    if profile:
        from shardline.plugins.lightning.profiler_callback import StepProfiler

        callbacks.append(StepProfiler(wait=1, warmup=1, active=1, output_dir=profile))
    trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=HybridParallelStrategy(zero_stage=1),
                         precision=precision, max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    module = LanguageModule(**MODEL)
    trainer.fit(module, _data())
    if save:
        trainer.save_checkpoint(save)
    weights = {}
    if load:
        trainer.strategy.load_checkpoint(load)
        weights = {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}
    return {"losses": losses.losses, "weights": weights}


def test_one_gpu_follows_the_cpu_and_its_checkpoint_loads_on_the_cpu(tmp_path):
    gpu = run_ranks(_fit, 1, "gpu", "32-true", str(tmp_path / "gpu.ckpt"), None, str(tmp_path / "prof"),
                    backend="nccl", timeout=300)[0]
    cpu = run_ranks(_fit, 1, "cpu", "32-true", None, str(tmp_path / "gpu.ckpt"), timeout=300)[0]
    # float32 on both, no collective: cuBLAS vs the CPU's BLAS summation order only
    assert gpu["losses"] == pytest.approx(cpu["losses"], rel=1e-4)
    from shardline.plugins.checkpoint.reader import CheckpointReader

    with CheckpointReader(tmp_path / "gpu.ckpt") as reader:
        saved = {name: reader.read(name) for name in reader.tensors if not name.startswith("optimizer.")}
    loaded = torch.cat([w.reshape(-1) for w in cpu["weights"].values()])
    assert sum(t.numel() for t in saved.values()) == loaded.numel()
    assert sorted(torch.cat([t.reshape(-1) for t in saved.values()]).tolist()) == sorted(loaded.tolist())
    traces = list((tmp_path / "prof").rglob("rank0.pt.trace.json.gz"))
    assert traces, "StepProfiler wrote no trace"
    from shardline.profiling import load

    events = load(traces[0]).events
    assert (events["lane"] == "gpu").any(), "the CUDA run's trace holds no GPU kernel"


def test_bf16_mixed_trains_on_one_gpu_within_bf16_noise_of_float32():
    bf16 = run_ranks(_fit, 1, "gpu", "bf16-mixed", backend="nccl", timeout=300)[0]["losses"]
    fp32 = run_ranks(_fit, 1, "gpu", "32-true", backend="nccl", timeout=300)[0]["losses"]
    assert all(torch.isfinite(torch.tensor(bf16)))
    # bf16's 8 mantissa bits: ~4e-3 relative per rounding, averaged by the cross-entropy; 2e-2 over 6 steps
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16[-1] < bf16[0]
