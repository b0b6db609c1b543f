"""The LightningModule of the main job: the reference GPT under any shardline layout.

It meets the strategy's contract, and is its worked example: the model is built in ``configure_model()`` from the
strategy's grid (dense when the strategy is not shardline's); ``training_step`` and ``validation_step`` are the
module's own at every layout (its logging runs under pp > 1 too) and return the replica's mean loss, which under
pp > 1 comes from ``self.trainer.strategy.pipeline(batch)`` (called once per batch) and otherwise from the model;
``pipeline_layers``/``pipeline_loss`` describe the model to the pipeline. Gradient
synchronisation is not the module's business: the strategy installs the Megatron-SP sums, tied-weight sums and
DeepSpeed's norm flags from the parameters' declared roles. One layout detail lives here because it is a
property of the loss, not of the optimizer:

* CP: ``GPT.loss`` is the global mean and each CP rank's gradient is its share of it, so the replica's gradient
  is the sum over CP. DeepSpeed given ``mpu=grid.mpu`` divides the ``dp x cp`` reduction by ``dp x cp / cp``,
  i.e. sums over CP and averages over DP: exactly that, with no loss scaling. (The parity tests use SGD, which,
  unlike Adam, would expose a wrong constant factor.)
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch

from shardline.plugins.errors import ContractError
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.models.gpt import GPT, GPTConfig


class GPTModule(pl.LightningModule):
    """A GPT language model: ``batch = (ids [b, S], targets [b, S])``, AdamW with linear warm-up."""

    def __init__(self, vocab_size: int = 256, seq_len: int = 128, n_layer: int = 4, n_head: int = 4,
                 d_model: int = 128, d_ff: int | None = None, dropout: float = 0.0, tie_embeddings: bool = True,
                 lr: float = 3e-3, weight_decay: float = 0.01, warmup_steps: int = 10, seed: int = 0,
                 optimizer: str = "adamw"):
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head,
                                d_model=d_model, d_ff=d_ff, dropout=dropout, tie_embeddings=tie_embeddings)
        self.gpt: GPT | None = None

    @property
    def grid(self):
        strategy = self.trainer.strategy if self._trainer is not None else None
        return strategy.grid if isinstance(strategy, HybridParallelStrategy) else None

    def configure_model(self) -> None:
        if self.gpt is not None:
            return
        grid = self.grid
        checkpointing = bool(getattr(self._trainer and self.trainer.strategy, "activation_checkpointing", False))
        config = self.config
        if checkpointing and not config.activation_checkpointing:
            config = GPTConfig(**{**config.__dict__, "activation_checkpointing": True})
        self.gpt = GPT(config, grid=grid, seed=self.hparams.seed)

    # The pipeline contract (pp > 1): the layers in order and the loss of one micro-batch.
    def pipeline_layers(self):
        return self.gpt.pipeline_layers()

    def pipeline_loss(self, output, targets):
        return self.gpt.loss(output, targets)

    def _loss(self, batch):
        """The batch loss: through the strategy's pipeline when pp > 1 (``strategy.pipeline`` runs the
        micro-batches, their backwards too when training), else the model on the whole batch."""
        strategy = self.trainer.strategy
        if isinstance(strategy, HybridParallelStrategy) and strategy.pipeline_driver is not None:
            return strategy.pipeline(batch)
        ids, targets = batch
        return self.gpt(ids, targets)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.last_loss = loss.detach()
        self.log("train_loss", self.last_loss.float(), prog_bar=True, sync_dist=True)  # the mean over replicas
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss.detach().float(), prog_bar=True, sync_dist=True)  # the mean over replicas
        return loss

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":  # scale-sensitive: what parity tests need
            optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        elif self.hparams.optimizer == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr,
                                          weight_decay=self.hparams.weight_decay, betas=(0.9, 0.95))
        else:
            raise ContractError(f"optimizer={self.hparams.optimizer!r} must be 'adamw' or 'sgd'")
        warmup = max(1, self.hparams.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
