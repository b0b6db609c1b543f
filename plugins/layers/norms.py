"""RMSNorm with its parameter role declared (the LayerNorm counterpart lives in :mod:`.roles`).

``y = w * x / sqrt(mean(x^2) + eps)`` over the last dim. The statistic is computed in float32 for 16-bit inputs
(and in the input dtype otherwise), and the normalised value is cast back before the weight multiplies it: the
convention of the Llama family's reference implementations, so bf16 checkpoints reproduce their numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from shardline.plugins.layers.roles import declare_module

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, weight initialised to one.

    The weight is replicated over TP; with ``sequence_parallel`` (Megatron-SP: each rank sees only its tokens)
    it is declared ``SEQUENCE_REPLICATED`` so the strategy sums its gradient over the TP group.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, sequence_parallel: bool = False, dtype=None, device=None):
        super().__init__()
        self.dim, self.eps, self.sequence_parallel = dim, eps, sequence_parallel
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype or torch.get_default_dtype(), device=device))
        declare_module(self, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        normed = wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"
