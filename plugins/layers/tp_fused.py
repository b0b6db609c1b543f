"""Several column-parallel projections of one input behind one entry collective, with grouped-query heads.

:class:`FusedColumnParallelLinear` computes ``y_p = x A_p^T + b_p`` for named parts ``p`` (q/k/v, gate/up) from
one input: the entry collective (``copy_to_tp``: identity / all-reduce, or ``gather_from_sequence`` under
Megatron-SP: all-gather / reduce-scatter) runs once for all parts instead of once per part. Each part is its own
parameter ``{p}_weight`` (and ``{p}_bias``), drawn full from the generator in part order (weight, then bias; the
``nn.Linear`` rule) and declared ``SHARDED(0)``: rank ``r`` of ``n`` holds rows ``[r*out/n, (r+1)*out/n)`` of the
dense tensor, so shards are slices of the dense model built with the same seed.

Heads. A part may be a stack of ``heads`` heads of ``head_dim`` rows each. When ``n`` divides ``heads`` a rank's
rows are whole heads (``heads/n`` of them) and are used as they are. When ``heads`` divides ``n`` (grouped-query
attention with fewer KV heads than TP ranks), ``rep = n/heads`` consecutive ranks need the same head ``r // rep``
while each holds only ``head_dim/rep`` of its rows. Those parts are *replicated in use but sharded in storage*:

- forward: all-gather the part's shards over the TP group along dim 0 (the dense ``[heads*head_dim, in]``
  weight; every replicated part is packed into one buffer, so one all-gather per layer), then keep head
  ``r // rep``'s rows;
- backward: the adjoint, a reduce-scatter along dim 0 (``gather_from_sequence`` on the weight). The gradient of
  the kept rows is this rank's contribution (from its own query heads) and zero elsewhere, so the reduce-scatter
  hands every rank the *sum over the ranks sharing its head* of their contributions, restricted to its own rows:
  exactly its slice of the dense gradient.

So the gradient is right inside backward, with no synchronisation for the strategy to add; the role is the plain
``SHARDED(0)`` (each element lives on exactly one TP rank: DeepSpeed's gradient norm counts it once, ZeRO keeps
one optimizer state per element, a checkpoint slices it like any column-parallel weight). The price is that
all-gather and its reduce-scatter: ``heads * head_dim * in`` elements per replicated part and step, the size of
the dense K/V projection (small beside the Q projection it serves, ``n_heads/heads`` times larger).

Split backward (:mod:`shardline.plugins.layers.split_backward`): whole-head parts defer ``dA_p``/``db_p`` to W
like any column-parallel linear (the gathered input kept under Megatron-SP); a replicated-head part's weight is
computed in the forward (the all-gather above), so its gradient, with the reduce-scatter it flows through, runs
whole in B.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from shardline.job.family import head_partition_problems
from shardline.plugins.errors import LayoutError
from shardline.plugins.layers.roles import ParamRole, declare
from shardline.plugins.layers.split_backward import linear
from shardline.plugins.layers.tp_comm import (
    copy_to_tp,
    draw_slice,
    gather_from_sequence,
    group_rank,
    group_size,
    owned,
)

__all__ = ["FusedColumnParallelLinear", "head_partition_problems"]


class FusedColumnParallelLinear(nn.Module):
    """Named column-parallel projections of one input (see the module docstring).

    ``parts``: ``{name: out_features}`` or ``{name: (heads, head_dim)}`` (``out_features = heads * head_dim``).
    Input ``[b, s, in]`` replicated over ``group``, or ``[b, s/n, in]`` with ``sequence_parallel``; output the
    tuple of ``[b, s, local_out_p]`` in part order, ``local_out_p = out_p/n`` for whole-head parts and
    ``head_dim`` for replicated-head parts.
    """

    def __init__(self, in_features: int, parts: Mapping[str, int | tuple[int, int]], *, group, bias: bool = False,
                 sequence_parallel: bool = False, generator=None, dtype=None, device=None):
        super().__init__()
        n, r = group_size(group), group_rank(group)
        self.in_features, self.group = in_features, group
        self.sequence_parallel = sequence_parallel and n > 1
        self.names = tuple(parts)
        self.heads, self.out_features, self.replicated = {}, {}, ()
        problems, replicated = [], []
        for name, spec in parts.items():
            heads, head_dim = spec if isinstance(spec, tuple) else (spec, 1)
            self.heads[name], self.out_features[name] = (heads, head_dim), heads * head_dim
            part_problems = head_partition_problems(heads, head_dim, tp=n, what=f"{name} heads")
            if isinstance(spec, int) and part_problems:
                part_problems = [f"{name} out_features={spec} is not divisible by tp={n}"]
            problems += part_problems
            if not part_problems and heads % n:
                replicated.append(name)
        if problems:
            raise LayoutError("FusedColumnParallelLinear: " + "; ".join(problems))
        self.replicated = tuple(replicated)
        if len({self.heads[p] for p in replicated}) > 1:
            raise LayoutError(f"replicated-head parts {replicated} must share one (heads, head_dim): "
                              f"{[self.heads[p] for p in replicated]}")
        bound = 1.0 / math.sqrt(in_features)
        target = dict(dtype=dtype or torch.get_default_dtype(), device=device)
        for name in self.names:
            shape = (self.out_features[name], in_features)
            rows = shape[0] // n
            for kind, part_shape in [("weight", shape)] + ([("bias", shape[:1])] if bias else []):
                part = draw_slice(part_shape, dim=0, start=r * rows, stop=(r + 1) * rows, generator=generator,
                                  bound=bound)
                param = declare(nn.Parameter(owned(part, **target)), ParamRole.sharded(0))
                self.register_parameter(f"{name}_{kind}", param)
        if not bias:
            for name in self.names:
                self.register_parameter(f"{name}_bias", None)

    def _replicated_weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """The dense rows of this rank's head for every replicated part: one all-gather (backward: reduce-scatter)."""
        if not self.replicated:
            return {}
        n, r = group_size(self.group), group_rank(self.group)
        heads, head_dim = self.heads[self.replicated[0]]
        pieces = []
        for name in self.replicated:
            pieces.append(getattr(self, f"{name}_weight"))
            b = getattr(self, f"{name}_bias")
            if b is not None:
                pieces.append(b.unsqueeze(1))
        full = gather_from_sequence(torch.cat(pieces, dim=1), group=self.group, dim=0)
        head = r // (n // heads)
        rows = full[head * head_dim:(head + 1) * head_dim]
        out, col = {}, 0
        for name in self.replicated:
            w = rows[:, col:col + self.in_features]
            col += self.in_features
            b = None
            if getattr(self, f"{name}_bias") is not None:
                b = rows[:, col]
                col += 1
            out[name] = (w, b)
        return out

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.sequence_parallel:
            x = gather_from_sequence(x, group=self.group, dim=1)
        else:
            x = copy_to_tp(x, group=self.group)
        gathered = self._replicated_weights()
        outputs = []
        for name in self.names:
            w, b = gathered.get(name) or (getattr(self, f"{name}_weight"), getattr(self, f"{name}_bias"))
            outputs.append(linear(x, w, b))
        return tuple(outputs)

    def extra_repr(self) -> str:
        n = group_size(self.group)
        parts = ", ".join(f"{p}={self.out_features[p]}" + (" (replicated heads)" if p in self.replicated else "")
                          for p in self.names)
        return f"in={self.in_features}, {parts}, tp={n}, sequence_parallel={self.sequence_parallel}"
