"""Megatron-style tensor-parallel layers, built on the conjugate collectives of :mod:`shardline.plugins.layers.tp_comm`.

Partitions (``n`` = TP group size, ``r`` = this rank's index in it; chunks are contiguous, in rank order):

- :class:`ColumnParallelLinear` ``y = x A^T + b`` with ``A: [out, in]`` split by rows (output features):
  rank r holds ``A[r*out/n:(r+1)*out/n]`` and the same slice of ``b``; it produces ``y[..., out/n]``.
- :class:`RowParallelLinear` ``y = x A^T + b`` with ``A`` split by columns (input features): rank r holds
  ``A[:, r*in/n:(r+1)*in/n]``, computes a partial ``x_r A_r^T`` that is summed over the group; ``b`` is replicated
  and added once, after the sum.
- :class:`VocabParallelEmbedding` rows (vocabulary) split: rank r holds ids ``[r*V'/n, (r+1)*V'/n)`` of the
  vocabulary padded to ``V' = ceil(V/n)*n``; lookups outside the shard give zero and the results are summed.
- :func:`vocab_parallel_cross_entropy` the loss over vocab-sharded logits without gathering them.

Layout-independent initialisation: with a ``generator``, every weight takes one seed from it and draws each index
along its sharded dim from a generator of its own (:func:`~shardline.plugins.layers.tp_comm.draw_slice`), float32
on the CPU, then casts to ``dtype``: so with the same seed the shards of a TP=k model are exactly the slices of the
dense model's weights, and a rank draws and holds only its slice (construction costs the rank's share). Without a
generator the full dense weight is drawn from the global RNG and sliced.

Every parameter declares its role (:mod:`shardline.plugins.layers.roles`): weights and the column-parallel bias are
``SHARDED`` along the dim they are split on; the row-parallel bias is ``REPLICATED``, or ``SEQUENCE_REPLICATED``
under Megatron-SP (each rank's gradient then covers only its tokens and must be summed over the TP group: the
strategy installs that sum; :func:`allreduce_sequence_parallel_grads` does it by hand outside the strategy).

Split backward (:mod:`shardline.plugins.layers.split_backward`): inside ``deferring_weight_grads`` both linears
compute their input gradient in backward (B) and leave ``dA = dy^T x`` and the bias gradient to the store's W.
Under Megatron-SP the column-parallel W reads the sequence-gathered input the forward kept (not re-gathered: see
that module). Outside the mode they are ``F.linear`` and ``+`` as ever.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardline.plugins.errors import LayoutError
from shardline.plugins.layers.roles import ParamRole, RoleKind, declare, parameters_with
from shardline.plugins.layers.split_backward import add_bias, linear
from shardline.plugins.layers.tp_comm import (
    all_reduce,
    check_divisible,
    copy_to_tp,
    draw_slice,
    gather_from_sequence,
    gather_from_tp,
    group_rank,
    group_size,
    owned,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    split_to_tp,
)
from shardline.plugins.layers.tp_vocab import (
    VocabParallelEmbedding,
    pad_vocab,
    vocab_parallel_cross_entropy,
    vocab_parallel_weight,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "pad_vocab",
    "vocab_parallel_weight",
    "copy_to_tp",
    "reduce_from_tp",
    "split_to_tp",
    "gather_from_tp",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "allreduce_sequence_parallel_grads",
    "sequence_parallel_parameters",
]



def _uniform(shape, *, bound: float, generator, group, dim: int, dtype, device) -> nn.Parameter:
    """This rank's slice along ``dim`` (over ``group``; all of it for None) of a ``U(-bound, bound)`` dense tensor,
    drawn by :func:`~.tp_comm.draw_slice` (the same numbers at every layout and dtype)."""
    n, r = group_size(group), group_rank(group)
    length = shape[dim] // n
    part = draw_slice(shape, dim=dim, start=r * length, stop=(r + 1) * length, generator=generator, bound=bound)
    return nn.Parameter(owned(part, dtype=dtype, device=device))


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b``, ``A: [out, in]`` split along ``out`` over ``group`` (see the module docstring).

    Input ``[..., in]`` replicated over the group, or with ``sequence_parallel`` ``[b, s/n, in]`` (this rank's
    sequence chunk, dim 1). Output ``[..., out/n]`` (full sequence), or ``[..., out]`` with ``gather_output``.
    Entry collective: ``copy_to_tp`` (forward identity / backward all-reduce), or ``gather_from_sequence``
    (all-gather / reduce-scatter) under sequence parallelism. Init: ``A, b ~ U(-1/sqrt(in), 1/sqrt(in))`` drawn
    full, then sliced (as ``nn.Linear``).
    """

    def __init__(self, in_features: int, out_features: int, *, group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, generator=None,
                 dtype=None, device=None):
        super().__init__()
        n = group_size(group)
        check_divisible(out_features, n=n, what="out_features", by="tp")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel = sequence_parallel and n > 1
        bound = 1.0 / math.sqrt(in_features)
        kw = dict(bound=bound, generator=generator, group=group, dtype=dtype, device=device)
        self.weight = declare(_uniform((out_features, in_features), dim=0, **kw), ParamRole.sharded(0))
        if bias:
            self.bias = declare(_uniform((out_features,), dim=0, **kw), ParamRole.sharded(0))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence(x, group=self.group, dim=1)
        else:
            x = copy_to_tp(x, group=self.group)
        y = linear(x, self.weight, self.bias)
        return gather_from_tp(y, group=self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        # From the configured sizes, not the weight: ZeRO-3 replaces a partitioned weight by an empty placeholder.
        local = self.out_features // group_size(self.group)
        return (f"in={self.in_features}, out={self.out_features} (local {local}), "
                f"tp={group_size(self.group)}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``y = x A^T + b``, ``A: [out, in]`` split along ``in`` over ``group`` (see the module docstring).

    Input ``[..., in/n]`` (``input_is_parallel``, e.g. a ColumnParallelLinear's output) or ``[..., in]`` replicated,
    which is split first (``split_to_tp``: forward split / backward all-gather). Output ``[..., out]`` summed over
    the group by ``reduce_from_tp`` (all-reduce / identity), or with ``sequence_parallel`` ``[b, s/n, out]`` by
    ``reduce_scatter_to_sequence`` (reduce-scatter / all-gather). The bias is replicated and added after the sum;
    under sequence parallelism it is marked ``sequence_parallel`` (its gradient covers only this rank's tokens).
    """

    def __init__(self, in_features: int, out_features: int, *, group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, generator=None,
                 dtype=None, device=None):
        super().__init__()
        n = group_size(group)
        check_divisible(in_features, n=n, what="in_features", by="tp")
        self.sequence_parallel = sequence_parallel and n > 1
        if self.sequence_parallel and not input_is_parallel:
            raise LayoutError("RowParallelLinear(sequence_parallel=True) needs input_is_parallel=True "
                              "(got input_is_parallel=False): a sequence-parallel input is never replicated")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.input_is_parallel = group, input_is_parallel
        bound = 1.0 / math.sqrt(in_features)
        kw = dict(bound=bound, generator=generator, dtype=dtype, device=device)
        self.weight = declare(_uniform((out_features, in_features), group=group, dim=1, **kw), ParamRole.sharded(1))
        if bias:
            self.bias = declare(_uniform((out_features,), group=None, dim=0, **kw),
                                ParamRole.replicated(sequence_parallel=self.sequence_parallel))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to_tp(x, group=self.group)
        partial = linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(partial, group=self.group, dim=1)
        else:
            y = reduce_from_tp(partial, group=self.group)
        return add_bias(y, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_features // group_size(self.group)}), out={self.out_features}, "
                f"tp={group_size(self.group)}, sequence_parallel={self.sequence_parallel}")


def sequence_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of ``module`` declared ``SEQUENCE_REPLICATED`` (replicated, fed sequence-sharded activations)."""
    return parameters_with(module, RoleKind.SEQUENCE_REPLICATED)


def allreduce_sequence_parallel_grads(module: nn.Module, *, group) -> int:
    """Sum over ``group`` the gradients of every ``SEQUENCE_REPLICATED`` parameter; returns how many.

    Under Megatron-SP a replicated parameter (LayerNorm weight/bias, RowParallelLinear bias, position embedding)
    sees only this rank's ``s/n`` tokens, so its local gradient is a partial sum; the dense gradient is the sum
    over the TP group. Call after backward and before the optimizer step (and before any data-parallel reduction,
    which averages over a different group). The gradients are flattened into one buffer: one all-reduce.
    """
    params = [p for p in sequence_parallel_parameters(module) if p.grad is not None]
    if not params or group_size(group) == 1:
        return len(params)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    flat = all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n
    return len(params)
