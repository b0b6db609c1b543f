"""Checkpoints change layout: save in one, load in another (tp, pp, interleaved chunks, dp, cp with ring
attention, Megatron-SP, ZeRO 0-3, CPU offload, the world size), and training goes on with the same weights and
optimizer state.

Every load is checked twice, independently:
- bit for bit: the loaded run saves again before its first step, and every consolidated tensor of that
  checkpoint (weights, Adam's ``exp_avg`` and ``exp_avg_sq``) equals the original's exactly;
- by its next 3 losses against the uninterrupted run's (the global-batch mean, the same batches in every
  layout: the data is sharded over dp only and each global batch is the same 8 windows).

A Llama with GQA (4 query heads, 2 KV heads: tp4 shares KV heads), untied head and a vocabulary of 61 that tp
pads (the padding is not saved), AdamW with warm-up (the step count and scheduled lr matter).

Chunks of 512 bytes instead of 8 MiB (:data:`~shardline.plugins.checkpoint.files.CHUNK`, set in the parent before
the ranks fork): every piece over 512 bytes carries chunk CRCs, so a layout that needs some rows of a saved piece
reads only their chunks (the partial-read path a large model takes) in every load below.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.checkpoint import files
from shardline.plugins.checkpoint.reader import CheckpointReader
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.lit_lm import LanguageModule

SEQ, VOCAB, BATCH, STEPS_PER_EPOCH = 16, 61, 8, 3
MODEL = dict(architecture="llama", vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
             lr=3e-3, warmup_steps=4, tie_embeddings=False)


class _Counted(LanguageModule):
    """With a persistent buffer outside the model (every pipeline stage holds one: saved once, restored on all)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_buffer("steps_seen", torch.zeros(2))

    def training_step(self, batch, batch_idx):
        self.steps_seen += 1
        return super().training_step(batch, batch_idx)


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS_PER_EPOCH, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class _Record(pl.Callback):
    """The global-batch loss of every step (every rank of a replica reports its replica's mean: the mean over
    the world is the mean over replicas), and a save right after the load, before the first step."""

    def __init__(self, resave: str | None, resumed_from: str | None = None):
        self.losses, self.resave, self.resumed_from = [], resave, resumed_from

    def on_train_start(self, trainer, module):
        if self.resumed_from:  # the load read through maps of the files: every value was copied out of them
            gc.collect()
            mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if self.resumed_from in line]
            assert not mapped, mapped
        if self.resave:
            trainer.save_checkpoint(self.resave)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = torch.tensor([float(outputs["loss"])], dtype=torch.float64)
        dist.all_reduce(loss)
        self.losses.append(float(loss) / dist.get_world_size())


def _run(rank, world, layout, epochs, save_to, resume_from, resave):
    adopt_process_group_in_lightning()
    record = _Record(resave, resume_from)
    strategy = HybridParallelStrategy(**layout)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[record])
    dp = strategy.layout_for(world).dp
    trainer.fit(_Counted(**MODEL), DataLoader(_dataset(), batch_size=BATCH // dp), ckpt_path=resume_from)
    if save_to:
        trainer.save_checkpoint(save_to)
    return record.losses


def _same_tensors(a: str, b: str) -> int:
    """Every tensor of checkpoint ``a`` equals checkpoint ``b``'s, consolidated, bit for bit; returns the count."""
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    assert sorted(ra.tensors) == sorted(rb.tensors)
    for name in ra.tensors:
        x, y = ra.read(name), rb.read(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    return len(ra.tensors)


A = dict(tp=2, pp=2, zero_stage=1)
TARGETS = {
    "dp4_zero3_offload": dict(zero_stage=3, offload_optimizer="cpu"),
    "pp2_chunks2_dp2_zero2": dict(pp=2, chunks=2, schedule="interleaved", zero_stage=2),
    "pp4_zero0": dict(pp=4, zero_stage=0),
    "tp4_megatron_sp_zero2": dict(tp=4, sp="megatron", zero_stage=2),
}


@pytest.fixture(scope="module", autouse=True)
def small_chunks():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(files, "CHUNK", 512)
        yield


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A (tp2 x pp2 x ZeRO-1) saved after epoch 1 (step 3), and its uninterrupted 2-epoch losses."""
    root = tmp_path_factory.mktemp("reshard")
    ckpt = str(root / "a_step3")
    reference = run_ranks(_run, 4, A, 2, None, None, None, timeout=300)[0]
    first = run_ranks(_run, 4, A, 1, ckpt, None, None, timeout=300)[0]
    assert first == reference[:STEPS_PER_EPOCH]  # the same layout, the same arithmetic: exactly
    chunked = CheckpointReader(ckpt).manifest["chunk_crc32"]
    assert chunked["bytes"] == 512 and sum(map(len, chunked["pieces"].values())) > 30
    return root, ckpt, reference


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_reshard_into_another_layout(source, target):
    root, ckpt, reference = source
    resave = str(root / f"resave_{target}")
    losses = run_ranks(_run, 4, TARGETS[target], 2, None, ckpt, resave, timeout=300)[0]
    # 2 blocks x 9 tensors + embedding, final norm, head; each as weight, exp_avg and exp_avg_sq; the buffer
    assert _same_tensors(ckpt, resave) == 3 * (2 * 9 + 3) + 1
    # A different layout sums in a different order (TP all-reduces, ZeRO reduce-scatters, vocab-parallel loss):
    # float32 rounding, carried through 3 Adam steps. Measured <= 7.5e-8 relative over these layouts.
    assert losses == pytest.approx(reference[STEPS_PER_EPOCH:], rel=1e-6)
    assert losses != pytest.approx(reference[:STEPS_PER_EPOCH], rel=1e-3)  # the later steps really differ


def test_reshard_there_and_back_is_exact(source):
    root, ckpt, reference = source
    there = str(root / "there")
    back = str(root / "back")
    run_ranks(_run, 4, TARGETS["dp4_zero3_offload"], 2, None, ckpt, there, timeout=300)
    losses = run_ranks(_run, 4, A, 2, None, there, back, timeout=300)[0]
    _same_tensors(ckpt, back)
    # Back in the saving layout with bit-identical state: the same arithmetic as the uninterrupted run.
    assert losses == reference[STEPS_PER_EPOCH:]


def test_world_size_and_context_parallel_change(source, tmp_path):
    _, _, reference = source
    small = str(tmp_path / "dp2_step3")
    run_ranks(_run, 2, dict(zero_stage=2), 1, small, None, None, timeout=300)  # world 2: dp2 x ZeRO-2
    ring = str(tmp_path / "tp2_cp2_ring")
    losses = run_ranks(_run, 4, dict(tp=2, cp=2, sp="ring", zero_stage=1), 2, None, small, ring, timeout=300)[0]
    _same_tensors(small, ring)
    assert losses == pytest.approx(reference[STEPS_PER_EPOCH:], rel=1e-6)  # as above: float32 order only
    back = str(tmp_path / "back_to_dp2")
    again = run_ranks(_run, 2, dict(zero_stage=2), 2, None, ring, back, timeout=300)[0]
    _same_tensors(small, back)
    assert again == pytest.approx(reference[STEPS_PER_EPOCH:], rel=1e-6)


def _validate(rank, world, layout, ckpt):
    adopt_process_group_in_lightning()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=HybridParallelStrategy(**layout), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    dp = trainer.strategy.layout_for(world).dp
    out = trainer.validate(_Counted(**MODEL), DataLoader(_dataset(), batch_size=BATCH // dp), ckpt_path=ckpt,
                           verbose=False)
    return out[0]["val_loss"]


def test_validate_from_a_checkpoint_in_another_layout(source):
    _, ckpt, _ = source
    # Weights only (no optimizer): ZeRO-3's inference engine under a pipeline, and the saving layout.
    there = run_ranks(_validate, 4, dict(pp=2, zero_stage=3), ckpt, timeout=300)[0]
    here = run_ranks(_validate, 4, A, ckpt, timeout=300)[0]
    assert there == pytest.approx(here, rel=1e-6)  # the same weights; float32 summation order only
    fresh = run_ranks(_validate, 4, A, None, timeout=300)[0]
    assert fresh != pytest.approx(here, rel=1e-3)  # the checkpoint's weights were really used
