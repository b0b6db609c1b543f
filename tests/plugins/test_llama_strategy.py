"""The Llama under HybridParallelStrategy (real Trainer, real DeepSpeed, gloo ranks) against the same Llama dense in
one process: the strategy derives every gradient synchronisation from the declared roles, so a user module that
just builds ``Llama(config, grid=strategy.grid)`` trains like the dense model, replicated KV heads included
(n_kv_head=1 at tp=2), and DeepSpeed's global gradient norm counts every dense element once. SGD, not Adam: a
wrong gradient scale shows in SGD's losses."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.models.llama import Llama, LlamaConfig
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks

STEPS, BATCH, SEQ, VOCAB, LR = 3, 4, 16, 40, 0.5
CONFIG = LlamaConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, n_kv_head=1, d_model=32, d_ff=48,
                     qkv_bias=True)


class LlamaModule(pl.LightningModule):
    """The model built from the strategy's grid in ``configure_model``; no gradient code of its own."""

    def __init__(self):
        super().__init__()
        self.llama = None

    def configure_model(self):
        if self.llama is None:
            strategy = self.trainer.strategy if self._trainer is not None else None
            grid = strategy.grid if isinstance(strategy, HybridParallelStrategy) else None
            self.llama = Llama(CONFIG, grid=grid, seed=3, dtype=torch.float32)

    def training_step(self, batch, batch_idx):
        loss = self.llama(*batch)
        self.last_loss = loss.detach()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class _Recorder(pl.Callback):
    def __init__(self):
        self.losses, self.norms = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(module.last_loss.item())
        self.norms.append(float(trainer.strategy.deepspeed_engine.get_global_grad_norm()))


def _fit(rank, world, layout):
    adopt_process_group_in_lightning()
    recorder = _Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=HybridParallelStrategy(**layout),
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, precision="32-true", callbacks=[recorder],
                         gradient_clip_val=1e6)  # huge: DeepSpeed computes the global norm, the step is unchanged
    trainer.fit(LlamaModule(), DataLoader(_data(), batch_size=BATCH, shuffle=False))
    return recorder.losses, recorder.norms


def _dense():
    module = LlamaModule()
    module.configure_model()
    optimizer = module.configure_optimizers()
    ids, targets = _data().tensors
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))  # DistributedSampler's order
    losses, norms = [], []
    for step in range(STEPS):
        take = order[step * BATCH:(step + 1) * BATCH]
        loss = module.llama(ids[take], targets[take])
        optimizer.zero_grad()
        loss.backward()
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()])).item())
        optimizer.step()
        losses.append(loss.item())
    return losses, norms


@pytest.mark.parametrize("layout", [dict(tp=2, sp="megatron", zero_stage=1)], ids=["tp2-megatron-zero1"])
def test_llama_with_replicated_kv_heads_trains_like_dense_under_the_strategy(layout):
    results = run_ranks(_fit, 2, layout, timeout=300)
    dense_losses, dense_norms = _dense()
    for losses, norms in results:
        # float32 behind TP sums over 3 SGD steps: rtol 1e-5 (as the gradient-roles test).
        assert losses == pytest.approx(dense_losses, rel=1e-5)
        # the global norm: each KV row lives on one TP rank (a SHARDED slice), so nothing is counted twice
        assert norms == pytest.approx(dense_norms, rel=1e-5)
