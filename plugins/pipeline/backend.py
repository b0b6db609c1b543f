"""The seam between the pipeline engine and whatever runs a stage: :class:`StageBackend`.

The engine owns the schedule, the transport, the micro-batching and the loss; a backend owns how one stage is
computed. One call per compute action of the schedule, bracketed by one call before and one after the batch:

- ``begin_batch(forward_only=...)``: before the batch's first action (a backend makes copies of weights
  held on two stages equal here, e.g. after an optimizer step);
- ``forward(stage, x) -> output``: run ``stage`` on its input (the last stage's output goes to ``loss_fn``);
- ``backward(stage, output, grad, last=...)``: back-propagate ``output`` (``grad`` None for the last stage's
  scaled micro-batch loss, else the gradient received for it), accumulating parameter gradients; ``last`` is
  True for the stage's final backward of the batch (after it, the stage's gradients are complete), unless the
  stage has a W after it;
- ``weight(stage, store, last=...)``: a zero-bubble schedule's W: run the weight-gradient work the stage's B left
  in ``store`` (a :class:`~shardline.plugins.layers.split_backward.WeightGradStore`; ``store.run()``
  accumulates each gradient into ``.grad`` through autograd, so parameter hooks fire here, not at B); ``last``
  is True for the stage's final W when it comes after the stage's final B (the gradients are complete after it);
- ``end_batch(loss=..., forward_only=...)``: after the batch's last action and the loss exchange (a training
  backend sums what must be summed across stages here, e.g. tied weights).

and ``device(stage)``, where the stage's activations live (received tensors are allocated there).

:class:`AutogradBackend` is plain torch: the stage modules called directly, ``torch.autograd.backward``. The
strategy's DeepSpeed backend (``shardline.plugins.lightning.deepspeed_compat.DeepSpeedStageBackend``) runs each
stage through a DeepSpeed engine instead. This module never imports Lightning or DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


class StageBackend:
    """How one rank's stages are computed (see the module docstring); subclasses implement ``forward``."""

    def forward(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def begin_batch(self, *, forward_only: bool) -> None:
        """Nothing by default."""

    def backward(self, stage: int, output: torch.Tensor, grad: torch.Tensor | None, *, last: bool) -> None:
        torch.autograd.backward(output, grad_tensors=grad)

    def weight(self, stage: int, store, *, last: bool) -> None:
        store.run()

    @property
    def runs_weight_actions(self) -> bool:
        """Whether this backend may be given W actions: yes unless it overrides ``backward`` and not ``weight``
        (a backend with its own backward, such as one driving a data-parallel engine, must say how its W runs:
        where the gradient reduction and the accumulation boundary go)."""
        kind = type(self)
        return kind.backward is StageBackend.backward or kind.weight is not StageBackend.weight

    def end_batch(self, *, loss: torch.Tensor, forward_only: bool) -> None:
        """Nothing by default."""

    def device(self, stage: int) -> torch.device:
        return torch.device("cpu")


class AutogradBackend(StageBackend):
    """The stage modules called directly; plain autograd. A stage's device is the one it declares
    (``pipeline_device``: a parameter-free stage), else its first parameter's, else the CPU."""

    def __init__(self, stages: Mapping[int, nn.Module]):
        self.stages = dict(stages)

    def forward(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        return self.stages[stage](x)

    def device(self, stage: int) -> torch.device:
        declared = getattr(self.stages[stage], "pipeline_device", None)
        if declared is not None:
            return torch.device(declared)
        param = next(self.stages[stage].parameters(), None)
        return param.device if param is not None else torch.device("cpu")
