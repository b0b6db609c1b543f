"""The library owns gradient correctness: a user's own LightningModule built from shardline's layers (not the
reference GPT, no gradient code of its own) trains under tp2 x sp=megatron exactly like the dense model, because
the strategy installs every synchronisation the parameters' declared roles imply. A control run without the
installed sums shows the check can fail."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.errors import ContractError
from shardline.plugins.layers.roles import LayerNorm, ParamRole, RoleKind, declare, role_of
from shardline.plugins.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shardline.plugins.layers.tp_comm import all_reduce, group_rank, group_size
from shardline.plugins.lightning import strategy as strategy_module
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks

VOCAB, D, HIDDEN, SEQ, BATCH, STEPS, LR = 50, 12, 24, 8, 4, 3, 0.5
F32 = torch.float32  # Lightning's 32-true precision (DeepSpeed's) keeps the module in float32


class Tagger(pl.LightningModule):
    """ids [b, S] -> per-token vectors [b, S, D], regressed onto targets; Megatron-SP when a TP group exists."""

    def __init__(self):
        super().__init__()
        self.net = None

    def _group(self):
        strategy = self.trainer.strategy if self._trainer is not None else None
        return strategy.grid.group("tp") if isinstance(strategy, HybridParallelStrategy) else None

    def configure_model(self):
        if self.net is not None:
            return
        group = self._group()
        sp = group_size(group) > 1
        gen = torch.Generator().manual_seed(3)
        self.group = group
        self.net = torch.nn.ModuleDict({
            "embed": VocabParallelEmbedding(VOCAB, D, group=group, sequence_parallel=sp, generator=gen, dtype=F32),
            "norm": LayerNorm(D, sequence_parallel=sp, dtype=F32),
            "up": ColumnParallelLinear(D, HIDDEN, group=group, sequence_parallel=sp, generator=gen, dtype=F32),
            "down": RowParallelLinear(HIDDEN, D, group=group, sequence_parallel=sp, generator=gen, dtype=F32),
        })
        with torch.no_grad():  # a non-trivial LayerNorm, the same on every rank
            self.net["norm"].weight.copy_(1 + torch.randn(D, generator=gen, dtype=F32) / 4)
            self.net["norm"].bias.copy_(torch.randn(D, generator=gen, dtype=F32) / 4)

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        n, r = group_size(self.group), group_rank(self.group)
        h = self.net["embed"](ids)  # [b, S/n, D] under Megatron-SP
        out = h + self.net["down"](torch.nn.functional.gelu(self.net["up"](self.net["norm"](h))))
        mine = targets.chunk(n, dim=1)[r] if n > 1 else targets
        total = all_reduce(((out - mine) ** 2).sum(), group=self.group)  # a sum of the TP ranks' partial sums
        loss = total / targets.numel()
        self.log("user_mse", loss.detach())
        self.log("user_tokens", float(ids.numel()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)  # scale-sensitive: a half-sized gradient shows


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=g),
                         torch.randn(BATCH * STEPS, SEQ, D, generator=g))


class _Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _fit(rank, world, zero_stage, install_sums=True):
    adopt_process_group_in_lightning()
    if not install_sums:  # the control: the strategy installs no Megatron-SP sum
        strategy_module.sum_sequence_parallel_gradients = lambda module, *, group: 0
    losses = _Losses()
    strategy = HybridParallelStrategy(tp=2, sp="megatron", zero_stage=zero_stage)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision="32-true", callbacks=[losses])
    module = Tagger()
    trainer.fit(module, DataLoader(_data(), batch_size=BATCH, shuffle=False))
    net = module.net
    return {"losses": losses.losses, "metrics": sorted(k for k in trainer.callback_metrics if k.startswith("user_")),
            "norm": net["norm"].weight.detach().clone(), "down_bias": net["down"].bias.detach().clone(),
            "up": net["up"].weight.detach().clone()}


def _dense():
    module = Tagger()
    module.configure_model()
    module.group = None
    optimizer = module.configure_optimizers()
    module.log = lambda *args, **kwargs: None
    ids, targets = _data().tensors
    # Lightning's DistributedSampler (seed 0, epoch 0) shuffles; with dp = 1 every rank sees this order.
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(STEPS):
        take = order[step * BATCH:(step + 1) * BATCH]
        loss = module.training_step((ids[take], targets[take]), step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, module.net


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_a_user_module_of_shardline_layers_matches_dense_under_tp2_megatron_sp(zero_stage):
    results = run_ranks(_fit, 2, zero_stage, timeout=300)
    dense_losses, dense = _dense()
    for rank, res in enumerate(results):
        # float32 behind TP sums (summation order only) over 3 SGD steps: rtol 1e-5, atol 1e-6.
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(dense_losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(res["norm"], dense["norm"].weight.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["down_bias"], dense["down"].bias.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["up"], dense["up"].weight.detach().chunk(2, dim=0)[rank], rtol=1e-5,
                                   atol=1e-6)
        assert res["metrics"] == ["user_mse", "user_tokens"]  # the user's own logging ran


def test_without_the_installed_sums_the_same_run_is_wrong():
    results = run_ranks(_fit, 2, 1, False, timeout=300)
    dense_losses, dense = _dense()
    # The LayerNorm and the row-parallel bias see half the tokens each: their gradient is a partial sum.
    gap = (results[0]["norm"] - dense["norm"].weight.detach()).abs().max().item()
    assert gap > 1e-3, gap  # two orders of magnitude above the tolerance of the test above
    assert abs(results[0]["losses"][-1] - dense_losses[-1]) > 1e-6


def test_roles_are_declared_by_the_layers_and_conflicts_refused():
    gen = torch.Generator().manual_seed(0)
    col = ColumnParallelLinear(4, 6, group=None, generator=gen)
    row = RowParallelLinear(6, 4, group=None, generator=gen)
    assert role_of(col.weight) == ParamRole.sharded(0) and role_of(row.weight) == ParamRole.sharded(1)
    assert role_of(row.bias).kind is RoleKind.REPLICATED  # sequence_parallel is off at tp = 1
    assert role_of(LayerNorm(4, sequence_parallel=True).weight).kind is RoleKind.SEQUENCE_REPLICATED
    assert role_of(torch.nn.Linear(2, 2).weight).kind is RoleKind.REPLICATED  # undeclared
    with pytest.raises(ContractError, match=r"declared .*sharded.* and now"):
        declare(col.weight, ParamRole.replicated())
    with pytest.raises(ContractError, match=r"SHARDED role needs the dim"):
        ParamRole(RoleKind.SHARDED)
