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


class _Block(torch.nn.Module):
    """``h + down(gelu(up(norm(h))))`` on ``[b, S/n, D]`` (Megatron-SP between the TP regions)."""

    def __init__(self, group, sp, gen):
        super().__init__()
        self.norm = LayerNorm(D, sequence_parallel=sp, dtype=F32)
        self.up = ColumnParallelLinear(D, HIDDEN, group=group, sequence_parallel=sp, generator=gen, dtype=F32)
        self.down = RowParallelLinear(HIDDEN, D, group=group, sequence_parallel=sp, generator=gen, dtype=F32)
        with torch.no_grad():  # a non-trivial LayerNorm, the same on every rank
            self.norm.weight.copy_(1 + torch.randn(D, generator=gen, dtype=F32) / 4)
            self.norm.bias.copy_(torch.randn(D, generator=gen, dtype=F32) / 4)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class Tagger(pl.LightningModule):
    """ids [b, S] -> per-token vectors [b, S, D], regressed onto targets; Megatron-SP when a TP group exists.
    Its own training_step logs its own metrics and gets the loss from ``strategy.pipeline(batch)`` (which runs
    ``pipeline_layers`` at pp = 1 and the pipeline schedule at pp > 1)."""

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
        embed = VocabParallelEmbedding(VOCAB, D, group=group, sequence_parallel=sp, generator=gen, dtype=F32)
        self.net = torch.nn.ModuleList([embed, _Block(group, sp, gen), _Block(group, sp, gen)])

    def pipeline_layers(self):
        return list(self.net)

    def pipeline_loss(self, out, targets):
        n, r = group_size(self.group), group_rank(self.group)
        mine = targets.chunk(n, dim=1)[r] if n > 1 else targets
        total = all_reduce(((out - mine) ** 2).sum(), group=self.group)  # a sum of the TP ranks' partial sums
        return total / targets.numel()

    def training_step(self, batch, batch_idx):
        loss = self.trainer.strategy.pipeline(batch)
        self.log("user_mse", loss.detach().float())
        self.log("user_tokens", float(batch[0].numel()))
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


def _fit(rank, world, layout, install_sums=True):
    adopt_process_group_in_lightning()
    if not install_sums:  # the control: the strategy installs no Megatron-SP sum
        strategy_module.sum_sequence_parallel_gradients = lambda module, *, group: 0
    losses = _Losses()
    strategy = HybridParallelStrategy(tp=2, sp="megatron", **layout)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision="32-true", callbacks=[losses])
    module = Tagger()
    trainer.fit(module, DataLoader(_data(), batch_size=BATCH, shuffle=False))
    hosted = {name: p.detach().clone() for name, p in module.net.named_parameters()}
    return {"losses": losses.losses, "metrics": sorted(k for k in trainer.callback_metrics if k.startswith("user_")),
            "weights": hosted, "tp_rank": strategy.grid.rank("tp")}


def _dense():
    module = Tagger()
    module.configure_model()
    module.group = None
    optimizer = module.configure_optimizers()
    ids, targets = _data().tensors
    # Lightning's DistributedSampler (seed 0, epoch 0) shuffles; with dp = 1 every rank sees this order.
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(STEPS):
        take = order[step * BATCH:(step + 1) * BATCH]
        x = ids[take]
        for layer in module.pipeline_layers():
            x = layer(x)
        loss = module.pipeline_loss(x, targets[take])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in module.net.named_parameters()}


def _dense_slice(name: str, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """This TP rank's part of a dense parameter, by the layer's partition (see layers/tensor_parallel)."""
    if name.endswith("up.weight") or name.endswith("up.bias") or name == "0.weight":
        return full.chunk(2, dim=0)[tp_rank]  # column-parallel rows; vocab rows (50 divides by 2: no padding)
    if name.endswith("down.weight"):
        return full.chunk(2, dim=1)[tp_rank]
    return full  # replicated: norms and the row-parallel bias


LAYOUTS = {"tp2-zero1": dict(zero_stage=1), "tp2-zero2": dict(zero_stage=2),
           "tp2-pp2-zero1": dict(pp=2, zero_stage=1, micro_batches=2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_user_module_of_shardline_layers_matches_dense_under_tp2_megatron_sp(layout):
    world = 2 * LAYOUTS[layout].get("pp", 1)
    results = run_ranks(_fit, world, LAYOUTS[layout], timeout=300)
    dense_losses, dense = _dense()
    checked = set()
    for res in results:
        # float32 behind TP sums (and micro-batch means) over 3 SGD steps: rtol 1e-5, atol 1e-6.
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(dense_losses), rtol=1e-5, atol=0)
        for name, weight in res["weights"].items():  # the parameters this rank hosts
            expected = _dense_slice(name, dense[name], res["tp_rank"])
            torch.testing.assert_close(weight, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            checked.add(name)
        assert res["metrics"] == ["user_mse", "user_tokens"]  # the user's own logging ran, at every layout
    assert checked == set(dense)  # every parameter was compared on the ranks that hold it


def test_without_the_installed_sums_the_same_run_is_wrong():
    results = run_ranks(_fit, 2, LAYOUTS["tp2-zero1"], False, timeout=300)
    dense_losses, dense = _dense()
    # The LayerNorms and the row-parallel biases see half the tokens each: their gradient is a partial sum.
    gap = (results[0]["weights"]["1.norm.weight"] - dense["1.norm.weight"]).abs().max().item()
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


class _TaggerWithOutputs(Tagger):
    """Asks the pipeline for its per-micro-batch outputs (the last stage's, what pipeline_loss received)."""

    def training_step(self, batch, batch_idx):
        loss, outputs = self.trainer.strategy.pipeline(batch, outputs=True)
        if batch_idx == 0:
            self.first_outputs = None if outputs is None else [o.clone() for o in outputs]
        return loss


def _fit_outputs(rank, world, layout):
    adopt_process_group_in_lightning()
    strategy = HybridParallelStrategy(tp=2, sp="megatron", **layout)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision="32-true")
    module = _TaggerWithOutputs()
    trainer.fit(module, DataLoader(_data(), batch_size=BATCH, shuffle=False))
    return {"outputs": module.first_outputs, "tp_rank": strategy.grid.rank("tp"), "last": strategy.grid.is_last_stage}


@pytest.mark.parametrize("layout", ["tp2-zero1", "tp2-pp2-zero1"])
def test_the_pipeline_hands_the_step_its_per_micro_batch_outputs(layout):
    world = 2 * LAYOUTS[layout].get("pp", 1)
    results = run_ranks(_fit_outputs, world, LAYOUTS[layout], timeout=300)
    module = Tagger()
    module.configure_model()
    module.group = None
    ids, _ = _data().tensors
    take = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))[:BATCH]
    with torch.no_grad():
        x = ids[take]
        for layer in module.pipeline_layers():
            x = layer(x)
    micro = LAYOUTS[layout].get("micro_batches", 1)
    for res in results:
        if not res["last"]:
            assert res["outputs"] is None  # only the rank holding the last stage has them
            continue
        assert len(res["outputs"]) == micro
        mine = x.chunk(2, dim=1)[res["tp_rank"]]  # this TP rank's sequence chunk under Megatron-SP
        # float32 behind TP sums of one forward: rtol 1e-5, atol 1e-6
        torch.testing.assert_close(torch.cat(res["outputs"]), mine, rtol=1e-5, atol=1e-6)
