"""What DeepSpeed wraps under pp > 1, so that nothing is set on or replaced in the user's LightningModule.

:class:`StageHost` is the module given to ``deepspeed.initialize``: it holds the LightningModule's own parameter,
buffer and child dicts (the very same objects, so ``state_dict`` keys, checkpoints, dtype casts and ZeRO-3's
partitioning are exactly the LightningModule's) and its ``forward(x, stage)`` runs one of this rank's pipeline
stages. The engine's forward (ZeRO-3 gathers, DeepSpeed's backward hooks on the output) therefore wraps each
stage call, with no method patched onto the user's module.

:class:`PipelineOptimizer` is the optimizer Lightning sees under pp > 1: DeepSpeed's, except that ``zero_grad``
does nothing. Lightning zeroes gradients between ``training_step`` and ``backward``; under a pipeline every
micro-batch's backward already ran inside ``training_step`` (``strategy.pipeline``), so that zeroing would erase
the batch's gradients. The user's ``optimizer_zero_grad`` hook still runs where Lightning documents it; DeepSpeed
zeroes the gradients itself after each optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from shardline.plugins.torch_compat import share_module_tables


class StageHost(nn.Module):
    """The LightningModule's parameters and children under their own names, with a stage-running forward."""

    def __init__(self, module: nn.Module, stages: Mapping[int, nn.Module]):
        super().__init__()
        # Shared, not copied: the host is a second view of the same module tree (see the module docstring).
        share_module_tables(self, module)
        self.training = module.training
        object.__setattr__(self, "_stages", dict(stages))  # not submodules: they already sit in the tree

    def forward(self, x: torch.Tensor, stage: int) -> torch.Tensor:
        return self._stages[stage](x)


class PipelineOptimizer:
    """DeepSpeed's optimizer with a ``zero_grad`` that leaves the pipeline's gradients alone."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: DeepSpeed zeroes after each step, and the batch's backward already ran (module docstring)."""

    def __getattr__(self, name: str):
        return getattr(self._optimizer, name)

    def __repr__(self) -> str:
        return f"PipelineOptimizer({self._optimizer!r})"
