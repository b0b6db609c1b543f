"""Checkpoints through HybridParallelStrategy on one layout: save at step k, resume, and the next losses equal
the uninterrupted run's (GPT-2, untied head, pp2 x dp2 x ZeRO-2). Other layouts:
tests/plugins/test_reshard.py."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.lit_gpt import GPTModule

SEQ, VOCAB, BATCH = 16, 64, 8
MODEL = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32, lr=3e-3, warmup_steps=3,
             tie_embeddings=False)  # AdamW with warm-up: optimizer and scheduler state both matter on resume


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH * 2, SEQ + 1), generator=g)  # two global batches per epoch
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class _Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _run(rank, world, kwargs, max_epochs, save_to, resume_from, accelerator="cpu"):
    adopt_process_group_in_lightning()
    recorder = _Losses()
    strategy = HybridParallelStrategy(**kwargs)
    trainer = pl.Trainer(accelerator=accelerator, devices=world, strategy=strategy, max_epochs=max_epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[recorder])
    dp = strategy.layout_for(world).dp
    trainer.fit(GPTModule(**MODEL), DataLoader(_dataset(), batch_size=BATCH // dp), ckpt_path=resume_from)
    if save_to:
        trainer.save_checkpoint(save_to)
    return recorder.losses


def test_resume_continues_exactly(tmp_path):
    layout = dict(pp=2, zero_stage=2)  # pp2 x dp2 with ZeRO-2: sharded optimizer states on every rank
    # Two batches per epoch; saved at the end of epoch 1 (step 2), resumed to the end of epoch 2 (step 4).
    full = run_ranks(_run, 4, layout, 2, None, None, timeout=300)
    ckpt = str(tmp_path / "step2.ckpt")
    first = run_ranks(_run, 4, layout, 1, ckpt, None, timeout=300)
    resumed = run_ranks(_run, 4, layout, 2, None, ckpt, timeout=300)
    for rank in range(4):
        assert first[rank] == pytest.approx(full[rank][:2], rel=1e-6)  # the same run so far (float32)
        # Exactly where it left off: model, AdamW moments, LR schedule and data order all restored. The
        # arithmetic is identical, so only float32 summation noise across processes would differ: rtol 1e-6.
        assert resumed[rank] == pytest.approx(full[rank][2:], rel=1e-6)
    assert full[0][2:] != pytest.approx(full[0][:2], rel=1e-3)  # the later steps really differ


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (one per NCCL rank)")
def test_resume_continues_exactly_on_nccl(tmp_path):
    """The same on NCCL (dp2 x ZeRO-2): the checkpoint's own few-word CPU collectives run on the strategy's gloo
    ``control_group`` (an NCCL-only group has no backend for a CPU tensor)."""
    layout = dict(zero_stage=2)
    full = run_ranks(_run, 2, layout, 2, None, None, "gpu", timeout=300, backend="nccl")
    ckpt = str(tmp_path / "step2.ckpt")
    run_ranks(_run, 2, layout, 1, ckpt, None, "gpu", timeout=300, backend="nccl")
    resumed = run_ranks(_run, 2, layout, 2, None, ckpt, "gpu", timeout=300, backend="nccl")
    for rank in range(2):
        assert resumed[rank] == pytest.approx(full[rank][2:], rel=1e-5)  # cuBLAS, not bit-exact across processes
