"""How :class:`~shardline.plugins.lightning.strategy.HybridParallelStrategy` runs pp > 1 under DeepSpeed and Lightning.

The LightningModule contract for pp > 1 (checked at setup, with an error that says what to add):

* ``pipeline_layers() -> list[nn.Module]``: the model as a sequence of one-tensor-in, one-tensor-out layers, in
  order (for the reference GPT: ``self.gpt.pipeline_layers()``), built in ``configure_model()``;
* ``pipeline_loss(output, targets) -> Tensor``: the mean loss of one micro-batch from the last layer's output;
* batches are ``(inputs, targets)`` pairs.

At setup the layers are cut into ``pp * chunks`` stages (uniform by layer count); stage ``c * pp + r`` goes to
pipeline rank ``r``. Every layer this rank does not host is replaced by an empty placeholder in the module, so the
optimizer, DeepSpeed and checkpoints see exactly this rank's parameters. A parameter shared by the first and
the last pipeline stage (tied input/output embeddings) is a parameter of the first stage only; the last stage
computes with a shadow of it, kept equal to it and whose gradient joins the first stage's before ZeRO reduces it
(:class:`~shardline.plugins.lightning.deepspeed_compat.TiedAcrossStages`), so it trains under every ZeRO
stage, with or without offload. These two cuts (placeholders, the shadow) are the one place the user's module
is changed; they go once models are built per rank (only the hosted layers, the shadow in place).

Per batch (``strategy.pipeline(batch)``, from the module's own ``training_step``/``validation_step``): the batch
is split into ``m`` micro-batches and :class:`~shardline.plugins.pipeline.PipelineEngine` runs the validated
schedule (the forward-only one in evaluation), computing each stage through its backend,
:class:`~shardline.plugins.lightning.deepspeed_compat.DeepSpeedStageBackend`: forwards through the DeepSpeed
engine (ZeRO-3 gathers, DeepSpeed's backward hooks attach), backwards by ``deepspeed_engine.backward``, the
tied-weight exchange around the batch and ZeRO-3's step at its end. DeepSpeed runs with
``managed_gradient_accumulation=False``: backward only accumulates, and the optimizer step that Lightning calls
once per batch is the one reduction boundary. That is how ZeRO-2 and ZeRO-3 (and offload) compose with
pipelining, which DeepSpeed's own PipelineEngine forbids.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from shardline.job import placement
from shardline.job.pipeline.schedule import ScheduleKind, build_schedule
from shardline.job.pipeline.theory import bubble_fraction
from shardline.plugins.errors import ContractError, LayoutError
from shardline.plugins.layers.roles import tie_key
from shardline.plugins.lightning.deepspeed_compat import (
    DeepSpeedStageBackend,
    TiedAcrossStages,
    set_norm_flags,
)
from shardline.plugins.models.decoder import LayerPlaceholder
from shardline.plugins.pipeline.engine import PipelineEngine
from shardline.plugins.pipeline.partition import build_stages, partition_layers

#: ``micro_batches=None`` picks the smallest m dividing the batch with a bubble (p-1)/(v*m+p-1) under this.
TARGET_BUBBLE = 0.2


def default_microbatches(batch_size: int, *, p: int, v: int) -> int:
    """Smallest m dividing ``batch_size`` (a multiple of p when v > 1) with bubble (p-1)/(v*m+p-1) < 20%;
    else the largest valid m, with a warning naming the bubble it gives."""
    valid = [m for m in range(1, batch_size + 1) if batch_size % m == 0 and (v == 1 or m % p == 0)]
    if not valid:
        raise LayoutError(f"batch size {batch_size} cannot be split into micro-batches for the interleaved "
                          f"schedule (m must divide the batch and be a multiple of pp={p})")
    schedule = "interleaved" if v > 1 else "1f1b"
    for m in valid:
        if bubble_fraction(schedule, p=p, m=m, v=v) < TARGET_BUBBLE:
            return m
    m = valid[-1]
    warnings.warn(f"batch size {batch_size} allows at most m={m} micro-batches at pp={p}, chunks={v}: the bubble "
                  f"(p-1)/(v*m+p-1) = {bubble_fraction(schedule, p=p, m=m, v=v):.2f} stays above {TARGET_BUBBLE}; "
                  f"use a batch size of at least {4 * (p - 1) + 1} per replica", stacklevel=3)
    return m


def _require(module: Any) -> None:
    missing = [name for name in ("pipeline_layers", "pipeline_loss") if not callable(getattr(module, name, None))]
    if missing:
        raise ContractError(
            f"{type(module).__name__} cannot run with pp > 1: add {', '.join(missing)} to it — "
            "pipeline_layers() -> list[nn.Module] (the model's layers in order, each one tensor in and out) and "
            "pipeline_loss(output, targets) -> Tensor (mean loss of a micro-batch); see "
            "shardline.plugins.lightning.pipeline_driver")


def _replace_layers(module: nn.Module, keep: set[int], layers: list[nn.Module]) -> None:
    """Swap every layer not in ``keep`` (indices into ``layers``) for a placeholder, wherever it sits. A model
    built per rank (shardline's) has placeholders there already and is left as it is."""
    drop = {id(layer): i for i, layer in enumerate(layers)
            if i not in keep and not isinstance(layer, LayerPlaceholder)}
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in drop:
                setattr(parent, name, LayerPlaceholder(drop[id(child)]))


class PipelineDriver:
    """This rank's stages, their schedule engines (one per micro-batch count) and the tied-weight sync."""

    def __init__(self, strategy, module: nn.Module):
        _require(module)
        grid = strategy.grid
        self.strategy, self.module = strategy, module
        self.spec = strategy.layout.pipeline
        self.p, self.v, self.rank = grid.size("pp"), self.spec.chunks, grid.rank("pp")
        self.n_stages = self.p * self.v
        layers = list(module.pipeline_layers())
        if len(layers) < self.n_stages:
            raise LayoutError(f"{len(layers)} pipeline layers cannot fill pp*chunks = {self.p}*{self.v} = "
                              f"{self.n_stages} stages")
        partition = partition_layers(layers, self.n_stages, method="uniform")
        bounds = partition.bounds
        stages = build_stages(layers, partition)
        self.local = {s: stages[s] for s in placement.stages_of_rank(self.rank, n_stages=self.n_stages, pp=self.p)}
        keep = {i for s in self.local for i in range(*bounds[s])}
        strays = [i for i in keep if isinstance(layers[i], LayerPlaceholder)]
        if strays:
            raise LayoutError(f"pipeline layers {strays} were built for another pipeline rank (the model was built "
                              f"for a different cut than pp*chunks = {self.p}*{self.v}: pass the strategy's chunks "
                              "to the model)")
        hosted = list({id(p): p for i in keep for p in layers[i].parameters()}.values())
        tied = self._tied_parameters(layers, bounds, {id(p) for p in hosted})
        self.tied = self._tie(tied, [layers[i] for i in sorted(keep)])
        set_norm_flags([p for p in hosted if self.rank == 0 or all(p is not t for t in tied)],
                       tp_rank=strategy.grid.rank("tp"), first_stage=self.rank == 0)
        _replace_layers(module, keep, layers)
        self.micro_losses: list[torch.Tensor] = []
        self.micro_outputs: list[torch.Tensor] = []
        self._engines: dict[tuple[str, int], PipelineEngine] = {}
        self._stage_backend: DeepSpeedStageBackend | None = None

    def _tied_parameters(self, layers, bounds, hosted: set[int]) -> list[nn.Parameter]:
        """This rank's copies (``hosted``: ids of its parameters) of weights used on two pipeline ranks (which
        must be the first and the last): declared copies (``roles.tie``, a model built per rank), in key
        order, else one Parameter object used by layers on both ranks (a model built whole)."""
        declared = sorted({id(p): p for layer in layers for p in layer.parameters()
                           if tie_key(p) is not None and id(p) in hosted}.values(), key=tie_key)
        if declared:
            if self.rank not in (0, self.p - 1):
                raise ContractError(f"tied weights {[tie_key(p) for p in declared]} on pipeline rank "
                                    f"{self.rank}: a weight may be tied only between the first and last stage")
            return declared
        owner_of_layer = {i: placement.stage_rank(s, pp=self.p) for s, (a, b) in enumerate(bounds) for i in range(a, b)}
        ranks_of: dict[int, set[int]] = {}
        params: dict[int, nn.Parameter] = {}
        for i, layer in enumerate(layers):
            for param in layer.parameters():
                ranks_of.setdefault(id(param), set()).add(owner_of_layer[i])
                params[id(param)] = param
        shared = [pid for pid, ranks in ranks_of.items() if len(ranks) > 1]
        bad = [sorted(ranks_of[pid]) for pid in shared if ranks_of[pid] != {0, self.p - 1}]
        if bad:
            raise ContractError(f"parameters shared across pipeline ranks {bad}: only a weight tied between the "
                                f"first and the last stage (ranks 0 and {self.p - 1}) is supported")
        return [params[pid] for pid in shared if pid in hosted]

    def _tie(self, tied: list[nn.Parameter], hosted_layers: list[nn.Module]) -> TiedAcrossStages | None:
        """The tied weights' exchange: on the first stage's rank its parameters, on the last's their shadows
        (taken out of the hosted layers here, before DeepSpeed sees them)."""
        if not tied:
            return None
        grid = self.strategy.grid
        group = grid.group("embed")
        (peer,) = [r for r in grid.ranks("embed") if r != grid.global_rank]
        if self.rank == 0:
            return TiedAcrossStages(group=group, peer=peer, first=tied)
        return TiedAcrossStages.shadow(hosted_layers, tied, group=group, peer=peer)

    def rebind(self) -> None:
        """For a new DeepSpeed engine over the same, already cut module (a second ``setup``): its engines and
        backend are rebuilt when next needed; the stages and the tied-weight exchange stay."""
        self._engines.clear()
        self._stage_backend = None

    # --- per batch ------------------------------------------------------------------------------------------

    def engine_for(self, batch_size: int, *, evaluate: bool = False) -> PipelineEngine:
        """The engine for a batch of ``batch_size``: the training schedule, or with ``evaluate`` the
        forward-only schedule (its micro-batch count divides the batch: any count works for it)."""
        m = self.spec.micro_batches or default_microbatches(batch_size, p=self.p, v=self.v)
        if evaluate:
            m = math.gcd(m, batch_size)
        key = ("evaluate" if evaluate else "train", m)
        if key not in self._engines:
            kind = ScheduleKind.FORWARD_ONLY if evaluate else self.spec.schedule
            schedule = build_schedule(kind, n_ranks=self.p, n_microbatches=m, n_chunks=self.v)
            grid = self.strategy.grid
            self._engines[key] = PipelineEngine(
                self.local, schedule=schedule, pp_rank=self.rank, loss_fn=self.module.pipeline_loss,
                group=grid.group("pp"),
                meta_group=None if grid.backend == "gloo" else self.strategy.pipeline_meta_group,
                backend=self._backend(), annotations=self.strategy.pipeline_annotations)
        return self._engines[key]

    def _backend(self) -> DeepSpeedStageBackend:
        """One backend for every engine of this rank (built once DeepSpeed's engine exists)."""
        if self._stage_backend is None:
            strategy = self.strategy
            self._stage_backend = DeepSpeedStageBackend(
                strategy.model, device=strategy.root_device, tied=self.tied, first_stage=0,
                last_stage=self.n_stages - 1, zero_stage=strategy.layout.zero.stage)
        return self._stage_backend

    def train_batch(self, inputs: torch.Tensor, targets: torch.Tensor, *, outputs: bool = False) -> torch.Tensor:
        return self._run(self.engine_for(inputs.shape[0]), inputs, targets, outputs)

    def eval_batch(self, inputs: torch.Tensor, targets: torch.Tensor, *, outputs: bool = False) -> torch.Tensor:
        """The batch's loss on every pipeline rank, from the forward-only schedule on the same engine."""
        with torch.no_grad():
            return self._run(self.engine_for(inputs.shape[0], evaluate=True), inputs, targets, outputs)

    def _run(self, engine: PipelineEngine, inputs, targets, outputs: bool) -> torch.Tensor:
        engine.keep_outputs = outputs
        loss = engine.run_batch(inputs, targets)
        self.micro_losses, self.micro_outputs = list(engine.micro_losses), list(engine.micro_outputs)
        return loss
