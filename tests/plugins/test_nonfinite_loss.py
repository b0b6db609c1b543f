"""``nonfinite_loss``: a NaN or infinite training loss on any rank stops the run (or, asked, skips the step) on
every rank at the same step, never trains on. Real Lightning + DeepSpeed on forked gloo ranks."""

from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.errors import ContractError
from shardline.plugins.lightning.strategy import HybridParallelStrategy, NonFiniteLossError
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.lit_gpt import GPTModule

STEPS, BATCH = 4, 8


class Poisoned(pl.LightningModule):
    """A regressor whose loss is multiplied by ``scale`` (infinite) at global step ``bad_step`` on the ranks
    ``bad_ranks``. ``scale=0.0`` on every rank is the reference of a skipped step: zero gradients, which plain SGD
    turns into no update at all."""

    def __init__(self, bad_step: int, bad_ranks: tuple[int, ...], scale: float = float("inf")):
        super().__init__()
        self.bad_step, self.bad_ranks, self.scale = bad_step, bad_ranks, scale

    def configure_model(self):
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_step == self.bad_step and self.global_rank in self.bad_ranks:
            loss = loss * self.scale
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(BATCH * STEPS * 2, 8, generator=g),
                                    torch.randn(BATCH * STEPS * 2, 1, generator=g)), batch_size=BATCH)


def _trainer(world: int, **strategy) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=world, strategy=HybridParallelStrategy(**strategy),
                      max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)


def _fit(rank, world, module, strategy):
    """``(error message or None, RuntimeWarnings about skipping, global step, the weights)``."""
    adopt_process_group_in_lightning()
    trainer = _trainer(world, **strategy)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, _data())
        except NonFiniteLossError as raised:
            error = str(raised)
    skipped = [str(w.message) for w in caught if "non-finite training loss" in str(w.message)]
    weights = [p.detach().clone() for p in module.parameters()]
    return error, skipped, trainer.global_step, weights


def test_bad_modes_are_refused_at_construction():
    with pytest.raises(ContractError, match=r"nonfinite_loss='ignore' must be one of \['raise', 'skip', 'off'\]"):
        HybridParallelStrategy(nonfinite_loss="ignore")
    with pytest.raises(ContractError, match=r"nonfinite_loss='skip' with pp=2: the pipeline runs every "
                                            r"micro-batch's backward inside training_step"):
        HybridParallelStrategy(pp=2, nonfinite_loss="skip")


def test_an_infinite_loss_on_one_rank_stops_every_rank_at_that_step():
    results = run_ranks(_fit, 2, Poisoned(bad_step=2, bad_ranks=(1,)), dict(zero_stage=1), timeout=180)
    for error, skipped, step, weights in results:
        # every rank, also rank 0 whose own loss was finite, stops at the same step with the same one line
        assert error == results[0][0] and "\n" not in error
        assert error.startswith("non-finite training loss at global step 2 (epoch 0, batch 2): rank 1: inf; "
                                "stopped before its optimizer step")
        assert step == 2 and not skipped
        assert all(torch.isfinite(w).all() for w in weights)  # the bad step never reached the weights


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_skip_leaves_the_step_out_on_every_rank(zero_stage):
    skip = run_ranks(_fit, 2, Poisoned(bad_step=2, bad_ranks=(1,)),
                     dict(zero_stage=zero_stage, nonfinite_loss="skip"), timeout=180)
    # the reference: the same run with zero gradients on both ranks at that step (plain SGD: no update)
    reference = run_ranks(_fit, 2, Poisoned(bad_step=2, bad_ranks=(0, 1), scale=0.0), dict(zero_stage=zero_stage),
                          timeout=180)
    for (error, skipped, step, weights), (_, _, ref_step, ref_weights) in zip(skip, reference):
        assert error is None and step == ref_step == STEPS
        assert len(skipped) == 1 and skipped[0].startswith(
            "non-finite training loss at global step 2 (epoch 0, batch 2): rank 1: inf; skipped")
        for w, r in zip(weights, ref_weights):
            torch.testing.assert_close(w, r, rtol=0, atol=0)  # exact: no reduction differs between the runs


def _fit_gpt_pp2(rank, world):
    adopt_process_group_in_lightning()
    trainer = _trainer(world, pp=2, zero_stage=1)
    module = GPTModule(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32, lr=1e30, warmup_steps=1)
    tokens = torch.randint(0, 64, (BATCH * STEPS, 17), generator=torch.Generator().manual_seed(9))
    try:
        trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH))
    except NonFiniteLossError as raised:
        return str(raised), trainer.global_step
    return None, trainer.global_step


def test_a_learning_rate_that_diverges_stops_a_pipeline_on_both_stages():
    # lr=1e30: the first AdamW step makes every weight ~1e30 and the next loss non-finite; under pp the loss is
    # the last stage's, sent to every stage, and the all-reduce makes both stages stop at the same step.
    results = run_ranks(_fit_gpt_pp2, 2, timeout=240)
    (error0, step0), (error1, step1) = results
    assert error0 is not None and error0 == error1 and step0 == step1 >= 1
    assert error0.startswith(f"non-finite training loss at global step {step0} (epoch 0, batch {step0}): rank 0: ")
    assert "rank 1: " in error0
