"""HybridParallelStrategy in a real Lightning Trainer with real DeepSpeed on forked gloo ranks, against a
single-process dense run of the same model, seed and global batch."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import shardline.plugins  # noqa: F401 - registers the strategy names
from shardline.plugins.errors import ContractError, LayoutError
from shardline.plugins.lightning.registry import parse_strategy_name, registered_names
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, nvme_offload_available, run_ranks

STEPS = 4
GLOBAL_BATCH = 16
LR = 0.1


class Regressor(pl.LightningModule):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.hidden = hidden

    def configure_model(self):
        torch.manual_seed(0)
        h = self.hidden
        self.net = torch.nn.Sequential(torch.nn.Linear(8, h), torch.nn.Tanh(), torch.nn.Linear(h, h),
                                       torch.nn.Tanh(), torch.nn.Linear(h, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        # SGD, not Adam: Adam is invariant to a constant gradient factor and would hide a wrong DP average.
        return torch.optim.SGD(self.parameters(), lr=LR)


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(GLOBAL_BATCH * STEPS, 8, generator=g),
                         torch.randn(GLOBAL_BATCH * STEPS, 1, generator=g))


class _Recorder(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().item())


def _fit(rank, world, strategy_kwargs, extra_callbacks=(), hidden=16):
    adopt_process_group_in_lightning()
    recorder = _Recorder()
    strategy = HybridParallelStrategy(**strategy_kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[recorder, *extra_callbacks])
    dp = world // (strategy_kwargs.get("tp", 1) * strategy_kwargs.get("cp", 1))
    trainer.fit(Regressor(hidden), DataLoader(_dataset(), batch_size=GLOBAL_BATCH // dp, shuffle=False))
    engine = trainer.strategy.deepspeed_engine
    return {"losses": recorder.losses, "layout": strategy.describe(),
            "sampler": trainer.strategy.distributed_sampler_kwargs,
            "optimizer": type(engine.optimizer).__name__, "cpu_offload": bool(engine.zero_cpu_offload()),
            "zero_stage": engine.zero_optimization_stage()}


def _dense_losses(hidden: int = 16) -> list[float]:
    """The reference: one process, the whole global batch, the same optimizer."""
    module = Regressor(hidden)
    module.configure_model()
    optimizer = module.configure_optimizers()
    x, y = _dataset().tensors
    # Lightning always shuffles training data through DistributedSampler(seed=0, epoch 0); rank r takes
    # order[r::dp], so the ranks' k-th batches together are order[16k:16k+16], whatever dp is.
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(STEPS):
        index = order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        xb, yb = x[index], y[index]
        loss = torch.nn.functional.mse_loss(module.net(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def dense_losses():
    return _dense_losses()


@pytest.mark.parametrize("strategy_kwargs", [
    dict(zero_stage=0), dict(zero_stage=1), dict(zero_stage=2), dict(zero_stage=3),
    dict(zero_stage=2, offload_optimizer="cpu"),
], ids=["zero0", "zero1", "zero2", "zero3", "zero2-offload"])
def test_dp2_loss_parity_with_dense(strategy_kwargs, dense_losses):
    results = run_ranks(_fit, 2, strategy_kwargs, timeout=240)
    for rank, res in enumerate(results):
        assert res["sampler"] == {"num_replicas": 2, "rank": rank}
        # DeepSpeed really runs the requested stage and offload (not silently another one).
        assert res["zero_stage"] == strategy_kwargs["zero_stage"]
        assert res["cpu_offload"] == (strategy_kwargs.get("offload_optimizer") == "cpu")
        assert (res["optimizer"] == "DeepSpeedZeroOptimizer") == (strategy_kwargs["zero_stage"] in (1, 2))
        assert res["layout"]["dp"] == 2 and res["layout"]["zero_stage"] == strategy_kwargs["zero_stage"]
        assert len(res["losses"]) == STEPS
    # Each rank's loss is the mean over its half of the global batch; both halves are equal-sized, so their
    # mean is the dense loss. float32 behind a cross-rank gradient average: rtol 1e-5.
    replica_mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert replica_mean == pytest.approx(dense_losses, rel=1e-5)
    assert dense_losses[-1] < dense_losses[0]  # the run actually trains


def test_registry_family_resolves_to_the_right_degrees():
    names = registered_names()
    assert "shardline" in names and "shardline_tp2_pp2_zero2" in names and "shardline_zero3_offload" in names
    assert "shardline_zero0_offload" not in names
    assert parse_strategy_name("shardline") == {"tp": 1, "pp": 1, "zero_stage": 1}
    assert parse_strategy_name("shardline_tp2_zero3") == {"tp": 2, "pp": 1, "zero_stage": 3}
    assert parse_strategy_name("shardline_pp4_zero1") == {"tp": 1, "pp": 4, "zero_stage": 1}
    assert parse_strategy_name("shardline_tp1_pp1_zero2_offload") == {
        "tp": 1, "pp": 1, "zero_stage": 2, "offload_optimizer": "cpu"}
    assert parse_strategy_name("shardline_zero3_offload") == {
        "tp": 1, "pp": 1, "zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
    trainer = pl.Trainer(strategy="shardline_tp2_pp2_zero2", accelerator="cpu", devices=8, logger=False)
    assert isinstance(trainer.strategy, HybridParallelStrategy)
    assert trainer.strategy.degrees == {"tp": 2, "pp": 2, "cp": 1} and trainer.strategy.zero_stage == 2
    assert trainer.strategy.layout_for(8).dp == 2


@pytest.mark.parametrize(("name", "fragment"), [
    ("shardline_tp3", "tp=3 not in (1, 2, 4, 8)"),
    ("shardline_zero4", "zero4"),
    ("shardline_zero0_offload", "_offload needs ZeRO stage 1, 2 or 3"),
    ("shardline_pp2_tp2", "is not of the form"),
])
def test_bad_names_fail_clearly(name, fragment):
    with pytest.raises(ContractError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_strategy_name(name)


def test_impossible_layout_fails_at_trainer_construction():
    # Before any worker or process group exists: in the launcher configuration of the main process.
    with pytest.raises(LayoutError, match="world_size=6 is not divisible by tp\\*cp\\*pp = 4\\*1\\*1 = 4"):
        pl.Trainer(strategy="shardline_tp4", accelerator="cpu", devices=6, logger=False)


@pytest.mark.parametrize(("kwargs", "error", "fragment"), [
    (dict(tp=0), LayoutError, "tp=0"),
    (dict(sp="ring"), LayoutError, "cp > 1"),
    (dict(zero_stage=5), ContractError, "zero_stage=5"),
    (dict(zero_stage=2, offload_params="cpu"), ContractError, "offload_params='cpu' needs zero_stage=3"),
    (dict(zero_stage=3, offload_params="nvme"), ContractError, "needs nvme_path"),
    (dict(zero_stage=2, offload_optimizer="nvme", nvme_path="/tmp"), ContractError, "'nvme' needs zero_stage=3"),
    (dict(offload_optimizer="disk"), ContractError, "offload_optimizer='disk'"),
    (dict(schedule="zigzag"), ContractError, "schedule='zigzag'"),
    (dict(chunks=2), ContractError, "chunks=2"),
    (dict(pipeline_annotations="sometimes"), ContractError, "pipeline_annotations='sometimes'"),
    (dict(deepspeed_config={"gradient_accumulation_steps": 4}), ContractError, "accumulate_grad_batches"),
    (dict(deepspeed_config="/nonexistent/ds.json"), ContractError, "does not exist"),
    (dict(zero_stage=1, deepspeed_config={"zero_optimization": {"stage": 3}}), ContractError,
     "zero_optimization.stage=3 vs zero_stage=1"),
    (dict(zero_stage=2, deepspeed_config={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}),
     ContractError, "offload_optimizer.device='cpu' vs offload_optimizer='none'"),
])
def test_bad_arguments_fail_at_construction(kwargs, error, fragment):
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace("*", r"\*")):
        HybridParallelStrategy(**kwargs)


def test_user_deepspeed_config_is_merged_over_the_derived_one(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"reduce_bucket_size": 1000}, "prescale_gradients": true}')
    strategy = HybridParallelStrategy(zero_stage=2, deepspeed_config=str(path))
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == 2 and zero["reduce_bucket_size"] == 1000 and zero["overlap_comm"] is True
    assert strategy.config["prescale_gradients"] is True



class _SwapFiles(pl.Callback):
    """Counts the files under the NVMe path while training runs (DeepSpeed removes them at teardown)."""

    def __init__(self, root: str):
        self.root, self.seen = root, 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        from pathlib import Path

        self.seen = max(self.seen, sum(1 for p in Path(self.root).rglob("*") if p.is_file()))


def _fit_counting_swaps(rank, world, strategy_kwargs):
    swaps = _SwapFiles(strategy_kwargs["nvme_path"])
    out = _fit(rank, world, strategy_kwargs, extra_callbacks=[swaps], hidden=1024)
    return {**out, "swap_files": swaps.seen}


@pytest.mark.jit_ops
@pytest.mark.skipif(not nvme_offload_available(), reason="DeepSpeed's async_io op cannot build here "
                    "(Debian: apt-get install libaio-dev)")
def test_zero3_nvme_offload_parity(tmp_path):
    # Parameters and optimizer states swapped to files under nvme_path (a local directory stands in for NVMe).
    # DeepSpeed swaps only partitions of at least 1 MB: hidden=1024 gives a 2 MB half of a 1024x1024 weight.
    ds = {"zero_optimization": {"offload_param": {"buffer_count": 4, "buffer_size": 2 ** 20}}}
    dense_losses = _dense_losses(hidden=1024)
    kwargs = dict(zero_stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path),
                  deepspeed_config=ds)
    results = run_ranks(_fit_counting_swaps, 2, kwargs, timeout=900)  # first use JIT-compiles async_io
    replica_mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert replica_mean == pytest.approx(dense_losses, rel=1e-5)  # float32 behind a cross-rank average
    assert all(res["swap_files"] > 0 for res in results), [res["swap_files"] for res in results]


def _shard_batches(rank, world):
    from shardline.plugins.grid import Grid, ParallelDims

    strategy = HybridParallelStrategy(cp=2, sp="ring")
    strategy.grid = Grid.build(ParallelDims(world, cp=2, sp="ring"))
    seq = torch.arange(2 * 8).reshape(2, 8)
    out = {"plain": strategy.shard_batch({"ids": seq, "mask": seq.clone(), "n": torch.tensor([3, 4])})}
    try:
        strategy.shard_batch((seq, torch.zeros(2, 5)))
    except LayoutError as exc:
        out["mixed"] = str(exc)

    class WithHook(pl.LightningModule):
        def cp_shard_batch(self, batch, shard):
            ids, labels = batch
            return shard(ids), labels  # labels [b, classes] stay whole

    strategy._lightning_module = WithHook()
    out["hook"] = strategy.shard_batch((seq, torch.zeros(2, 5)))
    return out


def test_context_parallel_batch_sharding_refuses_ambiguous_tensors():
    results = run_ranks(_shard_batches, 2)
    for rank, out in enumerate(results):
        # BALANCED layout at cp=2: 4 chunks of 2 tokens; rank r keeps chunks r and 3 - r.
        keep = [2 * rank, 2 * rank + 1, 2 * (3 - rank), 2 * (3 - rank) + 1]
        ids = torch.arange(16).reshape(2, 8)[:, keep]
        assert torch.equal(out["plain"]["ids"], ids) and torch.equal(out["plain"]["mask"], ids)
        assert out["plain"]["n"].tolist() == [3, 4]  # 1-D tensors are not cut
        assert "batch[0] [2, 8], batch[1] [2, 5]" in out["mixed"] and "cp_shard_batch" in out["mixed"]
        assert torch.equal(out["hook"][0], ids) and out["hook"][1].shape == (2, 5)
