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

Context parallelism's traffic (:func:`~.steptime._cp_comm`): ``cp_repeats_kv`` says whether grouped-query K/V are
repeated to the query heads before the ring hops or Ulysses' all-to-alls (shardline: yes, ``DecoderBlock.attention``
repeats them, so the exchanges carry ``n_head/t`` heads; Megatron-LM's Transformer Engine ring passes the
``n_kv_head/t`` heads it has), and ``ring_grad_bytes`` the bytes per element of the dK/dV accumulators the ring's
backward passes on (shardline: 4, they accumulate in float32 for 16-bit inputs, ``plugins/layers/sp_ring.py``;
Megatron-LM: 2, Transformer Engine sends them in the input dtype, beside K/V in one buffer).
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
          "grad_scale_pass", "cp_repeats_kv")


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
    cp_repeats_kv: bool = True
    ring_grad_bytes: int = 4
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
        for name in ("grad_bytes", "ring_grad_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer (2: bf16, 4: fp32)")
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
                          fused_kernels=True, cut=Cut.BLOCKS, grad_scale_pass=True, cp_repeats_kv=False,
                          ring_grad_bytes=2)

__all__ = ["Attention", "Cut", "Implementation", "MEGATRON", "Precision", "SHARDLINE"]
