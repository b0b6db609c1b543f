"""The LightningModule of the main job: a GPT-2 or Llama-family language model under any shardline layout, from
random weights or from a Hugging Face checkpoint (``init_from``).

It meets the strategy's contract and is its worked example: the model is built in ``configure_model()`` from the
strategy's grid (dense when the strategy is not shardline's); ``training_step`` and ``validation_step`` are the
module's own at every layout (its logging runs under pp > 1 too) and return the replica's mean loss, which under
pp > 1 comes from ``self.trainer.strategy.pipeline(batch)`` (called once per batch) and otherwise from the model;
``pipeline_layers``/``pipeline_loss`` describe the model to the pipeline. Gradient synchronisation is not the
module's business: the strategy installs the Megatron-SP sums, the tied-weight exchange and DeepSpeed's norm
flags from the parameters' declared roles. One layout detail lives here because it is a property of the loss,
not of the optimizer:

* CP: the model's loss is the global mean and each CP rank's gradient is its share of it, so the replica's
  gradient is the sum over CP. DeepSpeed given ``mpu=grid.mpu`` divides the ``dp x cp`` reduction by
  ``dp x cp / cp``, i.e. sums over CP and averages over DP: exactly that, with no loss scaling. (The parity
  tests use SGD, which, unlike Adam, would expose a wrong constant factor.)

Model fields: ``architecture`` (``gpt2`` or ``llama``) and the shape. The Llama-only ones (``n_kv_head``,
``rope_theta``, ``rms_norm_eps``, ``qkv_bias``) are ignored by GPT-2; ``d_ff`` defaults to ``4 * d_model``.
With ``init_from`` (a Hugging Face folder, see :mod:`shardline.plugins.hf`) the architecture and shape come from
its ``config.json`` and the weights from its safetensors, each rank reading only its slices; the recipe's shape
fields are then not used (a warning names those that differ from the checkpoint's).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Literal

import pytorch_lightning as pl
import torch

from shardline.plugins.errors import ContractError
from shardline.plugins.lightning.quiet import is_worker
from shardline.plugins.lightning.strategy import HybridParallelStrategy

log = logging.getLogger(__name__)
#: Recipe fields that set the model's shape; with ``init_from`` the checkpoint's config.json sets them instead.
SHAPE_FIELDS = ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff", "n_kv_head", "rope_theta",
                "rms_norm_eps", "qkv_bias", "tie_embeddings")
OPTIMIZERS = ("adamw", "cpu_adam", "sgd")


def training_problems(fields: dict) -> list[str]:
    """What no model config checks in the module's fields: every float finite (``lr: .inf`` would train to NaN
    without a word), ``lr > 0``, ``weight_decay >= 0``, ``warmup_steps >= 0`` and a known optimizer. Each
    problem names the field (without a section prefix); values are quoted short."""
    problems = []
    for name in ("lr", "weight_decay", "rope_theta", "rms_norm_eps", "dropout"):
        value = fields.get(name)
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{name}={value!r} must be a finite number")
    lr, decay, warmup = fields.get("lr"), fields.get("weight_decay"), fields.get("warmup_steps")
    if _real(lr) and math.isfinite(lr) and lr <= 0:
        problems.append(f"lr={lr!r} must be > 0")
    if _real(decay) and decay < 0:
        problems.append(f"weight_decay={decay!r} must be >= 0")
    if _real(warmup) and warmup < 0:
        problems.append(f"warmup_steps={warmup!r} must be >= 0")
    optimizer = fields.get("optimizer", "adamw")
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
        problems.append(f"optimizer={_short(optimizer)} must be one of {list(OPTIMIZERS)}")
    return problems


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value, limit: int = 60) -> str:
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def model_config(fields: dict):
    """``(model class, config)`` for the module's fields: from ``init_from``'s config.json, else from the
    fields. ContractError naming the field for a bad combination."""
    from shardline.job.families import FAMILIES
    from shardline.plugins.models import model_class

    if fields.get("init_from"):
        from shardline.plugins import hf

        arch, _, config = hf.read_config(fields["init_from"])
        return model_class(hf.ARCHITECTURES[arch]), config

    architecture = fields.get("architecture", "gpt2")
    if architecture not in FAMILIES:
        raise ContractError(f"model.architecture={architecture!r} must be {' or '.join(map(repr, FAMILIES))}")
    return model_class(architecture), FAMILIES[architecture].config_from_fields(fields)


class LanguageModule(pl.LightningModule):
    """A causal language model: ``batch = (ids [b, S], targets [b, S])``, AdamW (or SGD) with linear warm-up."""

    #: The attribute the model lives under (its parameters' names start with it).
    MODEL_ATTRIBUTE = "lm"

    def __init__(self, architecture: Literal["gpt2", "llama"] = "gpt2", vocab_size: int = 256, seq_len: int = 128,
                 n_layer: int = 4, n_head: int = 4, d_model: int = 128, d_ff: int | None = None,
                 n_kv_head: int | None = None, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6,
                 qkv_bias: bool = False, dropout: float = 0.0, tie_embeddings: bool = True,
                 init_from: str | None = None, lr: float = 3e-3, weight_decay: float = 0.01, warmup_steps: int = 10,
                 seed: int = 0, optimizer: str = "adamw"):
        super().__init__()
        self.save_hyperparameters()
        problems = training_problems(dict(self.hparams))
        if problems:
            raise ContractError(f"{type(self).__name__}: " + "; ".join(problems))
        self.model_class, self.config = model_config(dict(self.hparams))
        setattr(self, self.MODEL_ATTRIBUTE, None)
        if init_from and not is_worker():  # the same on every rank: said once, by the launching process
            self._warn_ignored_shape_fields()

    def _warn_ignored_shape_fields(self) -> None:
        config = dataclasses.asdict(self.config)
        differ = [f"{name}={self.hparams[name]!r} (checkpoint: {config[name]!r})"
                  for name in SHAPE_FIELDS if name in config and self.hparams[name] is not None
                  and self.hparams[name] != config[name]]
        if differ:
            log.warning("model.init_from=%s sets the model's shape; these recipe fields are not used: %s",
                        self.hparams.init_from, ", ".join(differ))

    def configure_callbacks(self):
        """The model summary with the whole model's parameter count (Lightning's counts rank 0's shard), in place
        of the trainer's summary and at its depth; none where the trainer shows none
        (``enable_model_summary=False``)."""
        from pytorch_lightning.callbacks import ModelSummary

        from shardline.plugins.lightning.callbacks import WholeModelSummary
        from shardline.recipes.planning.models import ModelSpec

        callbacks = self.trainer.callbacks if self._trainer is not None else []
        summaries = [c for c in callbacks if isinstance(c, ModelSummary)]
        if not summaries:
            return []
        depth = getattr(summaries[0], "_max_depth", 1)
        return [WholeModelSummary(ModelSpec.from_config(self.config, name="model").params(), max_depth=depth)]

    @property
    def network(self):
        """The language model (``GPT`` or ``Llama``), once ``configure_model`` has built it."""
        return getattr(self, self.MODEL_ATTRIBUTE)

    @property
    def grid(self):
        strategy = self.trainer.strategy if self._trainer is not None else None
        return strategy.grid if isinstance(strategy, HybridParallelStrategy) else None

    def configure_model(self) -> None:
        if self.network is not None:
            return
        grid = self.grid
        strategy = self.trainer.strategy if self._trainer is not None else None
        checkpointing = bool(getattr(strategy, "activation_checkpointing", False))
        # Built per rank: under pp > 1 only this rank's stages of the strategy's cut (chunks included).
        chunks = strategy.layout.pipeline.chunks if isinstance(strategy, HybridParallelStrategy) else 1
        if self.hparams.init_from:
            from shardline.plugins import hf

            model = hf.from_pretrained(self.hparams.init_from, grid=grid, activation_checkpointing=checkpointing,
                                       chunks=chunks)
        else:
            config = self.config
            if checkpointing and not config.activation_checkpointing:
                config = dataclasses.replace(config, activation_checkpointing=True)
            model = self.model_class(config, grid=grid, seed=self.hparams.seed, chunks=chunks)
        setattr(self, self.MODEL_ATTRIBUTE, model)

    # The pipeline contract (pp > 1): the layers in order and the loss of one micro-batch.
    def pipeline_layers(self):
        return self.network.pipeline_layers()

    def pipeline_loss(self, output, targets):
        return self.network.loss(output, targets)

    def _loss(self, batch):
        """The batch loss: through the strategy's pipeline when pp > 1 (``strategy.pipeline`` runs the
        micro-batches, their backwards too when training), else the model on the whole batch."""
        strategy = self.trainer.strategy
        if isinstance(strategy, HybridParallelStrategy) and strategy.pipeline_driver is not None:
            return strategy.pipeline(batch)
        ids, targets = batch
        return self.network(ids, targets)

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
        elif self.hparams.optimizer == "cpu_adam":
            # DeepSpeed's vectorised AdamW for ZeRO-Offload (a C++ op, built on first use): the optimizer step on
            # the CPU partitions that offload_optimizer='cpu'/'nvme' puts there, several times torch's AdamW.
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(self.parameters(), lr=self.hparams.lr, betas=(0.9, 0.95),
                                         weight_decay=self.hparams.weight_decay, adamw_mode=True)
        else:  # refused at construction too (training_problems)
            raise ContractError(f"optimizer={self.hparams.optimizer!r} must be one of {list(OPTIMIZERS)}")
        warmup = max(1, self.hparams.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
