"""Tied input/output embeddings across the first and last pipeline stage under every ZeRO stage (DeepSpeed's own
PipelineEngine allows only ZeRO-1 with pipelining): the losses and the clipping norm of a real Trainer run equal a
dense float64 model's, step by step, with clipping on; after training, evaluation sees the updated weight on the
last stage; a checkpoint resumes exactly.

Lightning's DeepSpeed precision has no 64-bit mode (``32-true`` casts the module to float32) and DeepSpeed's ZeRO
keeps float32 master weights, so the distributed runs are float32 against a float64 dense reference."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.models.gpt import GPT
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.lit_gpt import GPTModule

STEPS, BATCH, SEQ, VOCAB, CLIP = 3, 8, 16, 64, 0.2
MODEL = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32, lr=0.5, warmup_steps=1,
             optimizer="sgd", tie_embeddings=True)  # SGD: a wrong gradient scale moves the losses


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class _Record(pl.Callback):
    def __init__(self):
        self.losses, self.norms = [], []
        self.engine_norm = True  # ZeRO-0 keeps none: see _record_zero0_norms

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if self.engine_norm:
            self.norms.append(float(trainer.strategy.deepspeed_engine.get_global_grad_norm()))


def _record_zero0_norms(recorder: _Record) -> None:
    """ZeRO-0 keeps no global norm: record the one its float32 clipping computes (this worker's module only)."""
    import deepspeed.runtime.engine as ds_engine

    clip = ds_engine.clip_grad_norm_

    def recording(*args, **kwargs):
        norm = clip(*args, **kwargs)
        recorder.norms.append(float(norm))
        return norm

    ds_engine.clip_grad_norm_ = recording
    recorder.engine_norm = False


def _fit(rank, world, kwargs):
    adopt_process_group_in_lightning()
    recorder = _Record()
    if kwargs.get("zero_stage") == 0:
        _record_zero0_norms(recorder)
    strategy = HybridParallelStrategy(**kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[recorder], gradient_clip_val=CLIP)
    dp = strategy.layout_for(world).dp
    module = GPTModule(**MODEL)
    trainer.fit(module, DataLoader(_dataset(), batch_size=BATCH // dp))
    ids, targets = _dataset().tensors
    (metrics,) = trainer.validate(module, DataLoader(TensorDataset(ids[:BATCH], targets[:BATCH]),
                                                     batch_size=BATCH // dp), verbose=False)
    names = {name for name, _ in module.named_parameters()}
    pp_rank = strategy.grid.rank("pp")
    return {"losses": recorder.losses, "norms": recorder.norms, "val": metrics["val_loss"], "pp_rank": pp_rank,
            "dp_rank": strategy.grid.rank("dp"), "has_head_weight": "gpt.head.weight" in names,
            "has_embedding": "gpt.embedding.wte.weight" in names}


def _dense() -> tuple[list[float], list[float], float]:
    """The same GPT in float64 in one process: SGD on the whole global batch, the same clipping."""
    module = GPTModule(**MODEL)
    module.gpt = GPT(module.config, seed=module.hparams.seed, dtype=torch.float64)
    optimizer = module.configure_optimizers()["optimizer"]
    ids, targets = _dataset().tensors
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))  # DistributedSampler's order
    losses, norms = [], []
    for step in range(STEPS):
        index = order[step * BATCH:(step + 1) * BATCH]
        loss = module.gpt(ids[index], targets[index])
        optimizer.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(module.gpt.parameters(), CLIP)))
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        val = module.gpt(ids[:BATCH], targets[:BATCH]).item()
    return losses, norms, val


@pytest.fixture(scope="module")
def dense():
    return _dense()


@pytest.mark.parametrize(("world", "kwargs"), [
    (4, dict(tp=2, pp=2, zero_stage=2)),
    (4, dict(tp=2, pp=2, zero_stage=3)),
    (4, dict(pp=2, zero_stage=2)),
    (4, dict(pp=2, zero_stage=3)),
    (4, dict(pp=2, zero_stage=3, offload_optimizer="cpu", offload_params="cpu")),
    (4, dict(tp=2, pp=2, zero_stage=0)),
    (2, dict(pp=2, zero_stage=2, schedule="interleaved", chunks=2)),
], ids=["tp2-pp2-zero2", "tp2-pp2-zero3", "pp2-dp2-zero2", "pp2-dp2-zero3", "pp2-dp2-zero3-offload",
        "tp2-pp2-zero0", "pp2-interleaved-v2-zero2"])
def test_tied_embeddings_under_pp_match_dense(world, kwargs, dense):
    dense_losses, dense_norms, dense_val = dense
    assert dense_norms[0] > 2 * CLIP  # the clip really bites: every step depends on the global norm
    results = run_ranks(_fit, world, kwargs, timeout=300)
    dp = HybridParallelStrategy(**kwargs).layout_for(world).dp
    per_replica = {}
    for res in results:
        per_replica.setdefault(res["dp_rank"], res["losses"])
        assert res["losses"] == pytest.approx(per_replica[res["dp_rank"]], rel=1e-6)  # one loss per replica
    mean = [sum(per_replica[r][i] for r in range(dp)) / dp for i in range(STEPS)]
    # float32 (DeepSpeed's master weights) against float64 behind TP/PP/DP reductions and micro-batch means:
    # measured within 2e-8 relative; rtol 1e-5.
    assert mean == pytest.approx(dense_losses, rel=1e-5)
    for res in results:
        # DeepSpeed's clipping norm on every rank: the whole model's, the tied weight counted once.
        assert res["norms"] == pytest.approx(dense_norms, rel=1e-5)
        # Evaluation after the last step runs the last stage with the first stage's updated weight.
        assert res["val"] == pytest.approx(dense_val, rel=1e-5)
    # The weight is a parameter of the first stage only: the last stage's optimizer and ZeRO partition never
    # hold it (it computes with a shadow).
    for res in results:
        if res["pp_rank"] == 0:
            assert res["has_embedding"] and not res["has_head_weight"]
        else:
            assert not res["has_embedding"] and not res["has_head_weight"]


def _run(rank, world, kwargs, steps, save_to, resume_from):
    adopt_process_group_in_lightning()
    recorder = _Record()
    strategy = HybridParallelStrategy(**kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[recorder])
    dp = strategy.layout_for(world).dp
    ids, targets = _dataset().tensors  # one batch per epoch: every checkpoint is at an epoch's end
    trainer.fit(GPTModule(**{**MODEL, "optimizer": "adamw", "lr": 3e-3}),
                DataLoader(TensorDataset(ids[:BATCH], targets[:BATCH]), batch_size=BATCH // dp),
                ckpt_path=resume_from)
    if save_to:
        trainer.save_checkpoint(save_to)
    return recorder.losses


def test_tied_embeddings_resume_exactly_under_zero3(tmp_path):
    # The last stage's shadow is not in its checkpoint: it is refilled from the first stage before the first
    # batch after a resume, so the resumed run continues exactly.
    layout = dict(pp=2, zero_stage=3)
    full = run_ranks(_run, 4, layout, 3, None, None, timeout=300)
    ckpt = str(tmp_path / "step1.ckpt")
    run_ranks(_run, 4, layout, 1, ckpt, None, timeout=300)
    resumed = run_ranks(_run, 4, layout, 3, None, ckpt, timeout=300)
    for rank in range(4):
        assert resumed[rank] == pytest.approx(full[rank][1:], rel=1e-6)  # identical arithmetic; float32 noise
    assert full[0][2] != pytest.approx(full[0][0], rel=1e-3)  # the steps really differ
