"""The reference GPT under HybridParallelStrategy (real Trainer, real DeepSpeed, gloo ranks) against the same
GPT dense in one process, same seed, same global batch. SGD, not Adam: Adam is invariant to a constant gradient
factor, so it would hide a wrong TP/CP/DP gradient scale; SGD's losses move with it."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.models.gpt import GPT
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.lit_gpt import GPTModule

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 8, 16, 64
MODEL = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32, lr=0.5, warmup_steps=1,
             optimizer="sgd")


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class _Recorder(pl.Callback):
    def __init__(self):
        self.losses, self.grad_norms = [], []
        self.record_engine_norm = True

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"] if trainer.strategy.pipeline_driver is not None else module.last_loss
        self.losses.append(loss.item())
        if self.record_engine_norm:
            norm = trainer.strategy.deepspeed_engine.get_global_grad_norm()
            self.grad_norms.append(None if norm is None else float(norm))


def _record_zero0_norms(recorder) -> None:
    """ZeRO-0 keeps no global norm (get_global_grad_norm is None); record the one its fp32 clipping computes."""
    import deepspeed.runtime.engine as ds_engine

    clip = ds_engine.clip_grad_norm_

    def recording(*args, **kwargs):
        norm = clip(*args, **kwargs)
        recorder.grad_norms.append(float(norm))
        return norm

    ds_engine.clip_grad_norm_ = recording  # this forked worker's copy of the module only


def _fit(rank, world, kwargs, model_overrides=None, trainer_kwargs=None):
    adopt_process_group_in_lightning()
    recorder = _Recorder()
    if kwargs.get("zero_stage") == 0:
        recorder.record_engine_norm = False
        _record_zero0_norms(recorder)
    strategy = HybridParallelStrategy(**kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[recorder], **(trainer_kwargs or {}))
    dp = strategy.layout_for(world).dp
    module = GPTModule(**{**MODEL, **(model_overrides or {})})
    trainer.fit(module, DataLoader(_dataset(), batch_size=GLOBAL_BATCH // dp))
    optimizer = strategy.deepspeed_engine.optimizer
    local = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in module.parameters())
    if strategy.zero_stage in (1, 2):
        held = sum(t.numel() for t in optimizer.single_partition_of_fp32_groups)
    elif strategy.zero_stage == 3:
        held = sum(t.numel() for t in optimizer.fp32_partitioned_groups_flat)
    else:
        held = None
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "dp_rank": strategy.grid.rank("dp"),
            "local_params": local,
            "fp32_partition": held, "dp": strategy.grid.size("dp_cp")}


def _replica_mean(results, *, dp: int) -> list[float]:
    """Per step, the mean over data-parallel replicas of the loss each replica reports.

    Every TP/CP/PP rank of one replica must report the same loss: TP and CP reduce it, the pipeline broadcasts it
    from the last stage (float32, rtol 1e-6)."""
    per_replica = {}
    for res in results:
        per_replica.setdefault(res["dp_rank"], res["losses"])
        assert res["losses"] == pytest.approx(per_replica[res["dp_rank"]], rel=1e-6)
    return [sum(per_replica[r][i] for r in range(dp)) / dp for i in range(STEPS)]


def _assert_zero_shards_over_dp_only(results) -> None:
    """Each rank's fp32 master partition is its own (TP shard / pipeline stage) parameters divided by the
    data-parallel degree (dp x cp), up to DeepSpeed's alignment padding: never divided by the TP or PP degree."""
    for res in results:
        if res["fp32_partition"] is None:
            continue
        n, dp = res["local_params"], res["dp"]
        assert n / dp <= res["fp32_partition"] <= n / dp + 2 * dp * 8, res  # padding: a few elements per rank


def _dense_losses(clip: float | None = None, **model_overrides) -> list[float]:
    module = GPTModule(**{**MODEL, **model_overrides})
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]  # warm-up of 1 step: the full lr from step 0
    ids, targets = _dataset().tensors
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))  # DistributedSampler's order
    losses = []
    for step in range(STEPS):
        index = order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        loss = module.gpt(ids[index], targets[index])
        optimizer.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def dense_losses():
    return _dense_losses()


@pytest.fixture(scope="module")
def dense_losses_untied():
    return _dense_losses(tie_embeddings=False)


@pytest.mark.parametrize(("world", "kwargs"), [
    (4, dict(tp=2, zero_stage=2)),
    (4, dict(tp=2, sp="megatron", zero_stage=2)),
    (2, dict(cp=2, sp="ring", zero_stage=1)),
    (4, dict(tp=2, zero_stage=3)),
], ids=["tp2-dp2-zero2", "tp2-megatron-dp2-zero2", "cp2-ring-zero1", "tp2-dp2-zero3"])
def test_gpt_loss_parity(world, kwargs, dense_losses):
    results = run_ranks(_fit, world, kwargs, timeout=300)
    mean = _replica_mean(results, dp=HybridParallelStrategy(**kwargs).layout_for(world).dp)
    _assert_zero_shards_over_dp_only(results)
    # float32 behind TP/CP/DP reductions of a 2-layer GPT: rtol 1e-4.
    assert mean == pytest.approx(dense_losses, rel=1e-4)


@pytest.mark.parametrize(("world", "kwargs", "tied"), [
    (2, dict(pp=2, zero_stage=1), True),
    (4, dict(tp=2, pp=2, zero_stage=1), True),
    (4, dict(pp=2, zero_stage=2), False),
    (4, dict(pp=2, zero_stage=3), False),
    (4, dict(pp=2, zero_stage=3, offload_optimizer="cpu", offload_params="cpu"), False),
    (4, dict(pp=2, zero_stage=1, schedule="gpipe"), True),
    (2, dict(pp=2, zero_stage=1, schedule="interleaved", chunks=2), True),
], ids=["pp2-zero1-tied", "tp2-pp2-1f1b-zero1", "pp2-dp2-zero2", "pp2-dp2-zero3", "pp2-dp2-zero3-offload",
        "pp2-dp2-gpipe", "pp2-interleaved-v2"])
def test_gpt_pipeline_loss_parity(world, kwargs, tied, dense_losses, dense_losses_untied):
    # ZeRO-2 and ZeRO-3 under our pipeline: the combination DeepSpeed's own PipelineEngine refuses.
    expected = dense_losses if tied else dense_losses_untied
    results = run_ranks(_fit, world, kwargs, {"tie_embeddings": tied}, timeout=300)
    mean = _replica_mean(results, dp=HybridParallelStrategy(**kwargs).layout_for(world).dp)
    _assert_zero_shards_over_dp_only(results)
    # float32, micro-batched (mean of equal micro-batch means) behind DP/TP reductions: rtol 1e-4.
    assert mean == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize(("world", "kwargs", "tied"), [
    (4, dict(tp=2, pp=2, zero_stage=1), False),
    (4, dict(tp=2, pp=2, zero_stage=1), True),
    (4, dict(tp=2, zero_stage=2), False),
], ids=["tp2-pp2-zero1", "tp2-pp2-zero1-tied", "tp2-dp2-zero2"])
def test_gradient_clipping_uses_the_global_norm(world, kwargs, tied):
    # The clipping norm must be the norm of the whole model's gradient: summed over TP shards and pipeline stages
    # (DeepSpeed's model-parallel group = grid "mp"), replicated parameters counted once. A clip far below the
    # gradient norm makes every step depend on that norm.
    # A weight tied across the first and last stage has a copy on each: the norm must count it once.
    clip = 0.05
    expected = _dense_losses(clip=clip, tie_embeddings=tied)
    results = run_ranks(_fit, world, kwargs, {"tie_embeddings": tied}, {"gradient_clip_val": clip}, timeout=300)
    mean = _replica_mean(results, dp=HybridParallelStrategy(**kwargs).layout_for(world).dp)
    assert mean == pytest.approx(expected, rel=1e-4)  # float32 behind TP/PP/DP reductions
    assert expected != pytest.approx(_dense_losses(tie_embeddings=tied), rel=1e-4)  # the clip really bites


@pytest.mark.parametrize(("world", "kwargs"), [
    (4, dict(tp=2, zero_stage=2)),
    (2, dict(pp=2, zero_stage=1)),
], ids=["tp2-dp2-zero2", "pp2-zero1"])
def test_bf16_mixed_tracks_the_float32_dense_run(world, kwargs):
    # DeepSpeed's bf16 (bf16 weights and activations, fp32 master weights and optimizer) under our layouts.
    expected = _dense_losses(tie_embeddings=False)
    results = run_ranks(_fit, world, kwargs, {"tie_embeddings": False}, {"precision": "bf16-mixed"}, timeout=300)
    mean = _replica_mean(results, dp=HybridParallelStrategy(**kwargs).layout_for(world).dp)
    # bf16 noise floor: 8 mantissa bits (~4e-3 relative per rounding) averaged over a cross-entropy of ~4.2;
    # measured here within 5e-4 of float32, asserted at 3e-3.
    assert mean == pytest.approx(expected, rel=3e-3)


def _fit_gpu(rank, world, kwargs):
    return _fit(rank, world, kwargs, {"tie_embeddings": False}, {"accelerator": "gpu"})


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices (NCCL)")
@pytest.mark.parametrize("kwargs", [dict(tp=2, zero_stage=2), dict(pp=2, zero_stage=3)], ids=["tp2-dp2", "pp2-dp2"])
def test_gpt_parity_on_cuda_nccl(kwargs):
    # The same parity as on CPU, on CUDA with NCCL: the pipeline's shape headers travel on a gloo twin group.
    results = run_ranks(_fit_gpu, 4, kwargs, backend="nccl", timeout=600)
    mean = _replica_mean(results, dp=HybridParallelStrategy(**kwargs).layout_for(4).dp)
    # float32 on GPU (TF32 off by default for matmul in torch) behind NCCL reductions: rtol 1e-4.
    assert mean == pytest.approx(_dense_losses(tie_embeddings=False), rel=1e-4)


def _fit_by_name(rank, world, name):
    adopt_process_group_in_lightning()
    recorder = _Recorder()
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=world, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[recorder])
    dp = trainer.strategy.layout_for(world).dp
    trainer.fit(GPTModule(**{**MODEL, "tie_embeddings": False}), DataLoader(_dataset(), batch_size=GLOBAL_BATCH // dp))
    return {"losses": recorder.losses, "dp_rank": trainer.strategy.grid.rank("dp")}


def test_registered_name_on_eight_ranks_tp2_pp2_dp2_zero2():
    # Trainer(strategy="shardline_tp2_pp2_zero2", accelerator="cpu", devices=8) just works: all three at once.
    results = run_ranks(_fit_by_name, 8, "shardline_tp2_pp2_zero2", timeout=600)
    assert _replica_mean(results, dp=2) == pytest.approx(_dense_losses(tie_embeddings=False), rel=1e-4)


def test_pipeline_refuses_lightning_gradient_accumulation():
    # Each optimizer step is the pipeline's reduction boundary: accumulation across batches would step too often.
    with pytest.raises(Exception) as info:
        run_ranks(_fit, 2, dict(pp=2, zero_stage=1), {"tie_embeddings": False}, {"accumulate_grad_batches": 2},
                  timeout=120)
    assert "accumulate_grad_batches=2 with pp=2" in str(info.value) and "micro_batches" in str(info.value)


def _validate(rank, world, kwargs):
    adopt_process_group_in_lightning()
    strategy = HybridParallelStrategy(**kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = GPTModule(**{**MODEL, "tie_embeddings": False})
    dp = strategy.layout_for(world).dp
    ids, targets = _dataset().tensors
    data = TensorDataset(ids[:GLOBAL_BATCH], targets[:GLOBAL_BATCH])
    (metrics,) = trainer.validate(module, DataLoader(data, batch_size=GLOBAL_BATCH // dp))
    fresh = GPT(module.config, grid=strategy.grid, seed=MODEL.get("seed", 0)).state_dict()
    kept = all(torch.equal(fresh[k], v) for k, v in module.gpt.state_dict().items())
    return {"val_loss": metrics["val_loss"], "weights_are_this_ranks_shards": kept}


@pytest.mark.parametrize("kwargs", [dict(tp=2, zero_stage=2), dict(tp=2, pp=2, zero_stage=1)], ids=["tp2", "tp2-pp2"])
def test_validate_outside_fit_keeps_every_ranks_shards(kwargs):
    # trainer.validate() initialises DeepSpeed for inference: it must not broadcast rank 0's TP shard to all.
    results = run_ranks(_validate, 4, kwargs, timeout=300)
    assert all(res["weights_are_this_ranks_shards"] for res in results if "pp" not in kwargs)
    module = GPTModule(**{**MODEL, "tie_embeddings": False})
    module.configure_model()
    ids, targets = _dataset().tensors
    with torch.no_grad():
        dense = module.gpt(ids[:GLOBAL_BATCH], targets[:GLOBAL_BATCH]).item()
    for res in results:  # float32 behind TP (and PP) reductions: rtol 1e-5
        assert res["val_loss"] == pytest.approx(dense, rel=1e-5)


def _dense_first_grad_norm() -> float:
    module = GPTModule(**{**MODEL, "tie_embeddings": False})
    module.configure_model()
    ids, targets = _dataset().tensors
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))[:GLOBAL_BATCH]
    module.gpt(ids[order], targets[order]).backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()])).item()


@pytest.mark.parametrize("zero", [0, 1, 3])  # ZeRO-0: the norm its clipping computed (see _record_zero0_norms)
def test_global_grad_norm_counts_every_stage_once(zero):
    # DeepSpeed's norm (clipping, overflow) over tp2 x pp2: TP shards summed, replicated parameters of every stage
    # counted once. A huge clip value makes DeepSpeed compute the norm without changing the step.
    results = run_ranks(_fit, 4, dict(tp=2, pp=2, zero_stage=zero), {"tie_embeddings": False},
                        {"gradient_clip_val": 1e6}, timeout=300)
    expected = _dense_first_grad_norm()
    for res in results:  # float32 sums of squares across ranks: rtol 1e-5
        assert res["grad_norms"][0] == pytest.approx(expected, rel=1e-5)
