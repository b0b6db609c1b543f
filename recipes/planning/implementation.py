"""What the step-time model prices besides the layout: the implementation that runs it (one value, not a dozen
keyword flags).

:data:`SHARDLINE` describes shardline (eager PyTorch, SDPA flash attention, no dropout, synchronous TP autograd
pairs, DeepSpeed's bf16 gradients, the pipeline cut over the ``n_layer + 2`` layers). :data:`MEGATRON` describes
Megatron-LM as its papers measure it: async backward TP collectives (``tp_overlap``), ``/t`` pipeline transfers
plus an all-gather without SP (``pp_scatter_gather``), fp32 main gradients (``grad_bytes=4``) accumulated in the
GEMM (``fused_wgrad``), fused norm/rotary/SwiGLU kernels (``fused_kernels``), its local DDP's division of the
whole gradient buffer by the DP size before the all-reduce (``grad_scale_pass``) and the blocks cut evenly with
the embedding and head added to the first and last stage (``cut='blocks'``); attention and dropout are the
experiment's (``replace(MEGATRON, attention=Attention.MATERIALIZED, dropout=True)`` for the 2022 paper's runs).
``zero``: the DeepSpeed settings that decide what NVMe offload reads from and writes to the drive.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from shardline.recipes.planning.catalog import PlanError
from shardline.recipes.planning.memory import DEFAULT_ZERO, ZeroSettings


class Precision(str, enum.Enum):
    """The GEMMs' input precision (peaks and bytes); fp16 adds the loss scaler's optimizer passes."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"


class Attention(str, enum.Enum):
    """``flash``: fused attention that never stores the ``s x s`` scores; ``materialized``: scores, softmax and
    dropout as separate kernels and stored tensors."""

    FLASH = "flash"
    MATERIALIZED = "materialized"


class Cut(str, enum.Enum):
    """How the pipeline splits the model (:func:`~.steptime.stage_layers`)."""

    LAYERS = "layers"  # shardline: the n_layer + 2 layers (embedding and head included) cut uniformly
    BLOCKS = "blocks"  # Megatron-LM: the blocks cut evenly, embedding and head added to the first and last stage


_CHOICES = {"dtype": Precision, "attention": Attention, "cut": Cut}
_FLAGS = ("dropout", "tp_overlap", "overlap_dp", "pp_scatter_gather", "fused_wgrad", "fused_kernels",
          "grad_scale_pass")


@dataclass(frozen=True)
class Implementation:
    """The implementation a step is priced for (see the module docstring). String values of the enum fields are
    accepted and normalised; PlanError names every bad value."""

    dtype: Precision | str = Precision.BF16
    attention: Attention | str = Attention.FLASH
    dropout: bool = False
    tp_overlap: bool = False
    overlap_dp: bool = True
    pp_scatter_gather: bool = False
    grad_bytes: int = 2
    fused_wgrad: bool = False
    fused_kernels: bool = False
    cut: Cut | str = Cut.LAYERS
    grad_scale_pass: bool = False
    zero: ZeroSettings = DEFAULT_ZERO

    def __post_init__(self) -> None:
        problems = []
        for name, kind in _CHOICES.items():
            try:
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                problems.append(f"{name}={getattr(self, name)!r} must be one of {tuple(k.value for k in kind)}")
        problems += [f"{name}={getattr(self, name)!r} must be true or false" for name in _FLAGS
                     if not isinstance(getattr(self, name), bool)]
        if not isinstance(self.grad_bytes, int) or isinstance(self.grad_bytes, bool) or self.grad_bytes < 1:
            problems.append(f"grad_bytes={self.grad_bytes!r} must be a positive integer (2: bf16, 4: fp32)")
        if not isinstance(self.zero, ZeroSettings):
            problems.append(f"zero={self.zero!r} must be a ZeroSettings")
        if problems:
            raise PlanError("implementation: " + "; ".join(problems))

    def with_(self, **changes: Any) -> Implementation:
        """This implementation with ``changes`` (the fields' names); PlanError naming an unknown one."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise PlanError(f"implementation: unknown field(s) {unknown}")
        return dataclasses.replace(self, **changes) if changes else self


SHARDLINE = Implementation()
MEGATRON = Implementation(tp_overlap=True, pp_scatter_gather=True, grad_bytes=4, fused_wgrad=True,
                          fused_kernels=True, cut=Cut.BLOCKS, grad_scale_pass=True)

__all__ = ["Attention", "Cut", "Implementation", "MEGATRON", "Precision", "SHARDLINE"]
