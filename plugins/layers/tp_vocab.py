"""Vocabulary-parallel embedding and cross-entropy (re-exported by :mod:`shardline.plugins.layers.tensor_parallel`).

The vocabulary ``V`` is padded to ``V' = ceil(V/n)*n`` for a TP group of size ``n`` (logged once per (V, n));
rank ``r`` owns the ids ``[r*V'/n, (r+1)*V'/n)``. Padded rows of the embedding are zero, and padded logit columns
are excluded from the loss when the loss is told ``vocab_size``, so padding never changes the function.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from shardline.job.annotations import comm_name
from shardline.plugins.errors import ContractError, LayoutError
from shardline.plugins.layers.roles import ParamRole, declare
from shardline.plugins.layers.split_backward import embedding
from shardline.plugins.layers.tp_comm import (
    draw_slice,
    group_rank,
    group_size,
    owned,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)

log = logging.getLogger(__name__)
_logged_paddings: set[tuple[int, int]] = set()  # (V, n) pairs already reported: log once, not per layer


def pad_vocab(vocab_size: int, *, tp: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``tp`` (logged once per pair when it changes)."""
    padded = -(-vocab_size // tp) * tp
    if padded != vocab_size and (vocab_size, tp) not in _logged_paddings:
        _logged_paddings.add((vocab_size, tp))
        log.info("vocab_size=%d is not divisible by tp=%d: padded to %d (%d zero rows, excluded from the loss)",
                 vocab_size, tp, padded, padded - vocab_size)
    return padded


def vocab_shard_range(padded_vocab: int, *, group) -> tuple[int, int]:
    """``[start, end)`` of the ids this rank owns."""
    per = padded_vocab // group_size(group)
    start = group_rank(group) * per
    return start, start + per


def vocab_parallel_weight(num_embeddings: int, embedding_dim: int, *, group, init_std: float, generator=None,
                          dtype=None, device=None) -> nn.Parameter:
    """This rank's rows ``[V'/n, d]`` of ``E ~ N(0, init_std^2)`` (``[V, d]`` float32, zero-padded to ``V'`` rows),
    each row from its own stream seeded from ``generator`` (layout-independent; only this rank's rows are drawn).
    Declared ``SHARDED`` along dim 0."""
    padded = pad_vocab(num_embeddings, tp=group_size(group))
    start, end = vocab_shard_range(padded, group=group)
    # only this rank's real rows are drawn (tp_comm.draw_slice), and only they are padded
    lo, hi = min(start, num_embeddings), min(end, num_embeddings)
    rows = draw_slice((num_embeddings, embedding_dim), dim=0, start=lo, stop=hi, generator=generator, std=init_std)
    if rows.shape[0] < end - start:
        rows = F.pad(rows, (0, 0, 0, end - start - rows.shape[0]))
    weight = nn.Parameter(owned(rows, dtype=dtype, device=device))
    return declare(weight, ParamRole.sharded(0))


class VocabParallelEmbedding(nn.Module):
    """``E[ids]`` with ``E: [V', d]`` split by rows over ``group``; ``ids: [b, s] -> [b, s, d]``.

    forward: local lookup (ids outside this rank's range give zero), then the sum over the group: an all-reduce
    (``reduce_from_tp``), or with ``sequence_parallel`` a reduce-scatter along dim 1 giving ``[b, s/n, d]``
    (``reduce_scatter_to_sequence``). Init: ``E ~ N(0, init_std^2)`` drawn full ``[V, d]`` in float32 from
    ``generator``, zero-padded to ``V'`` rows, then sliced. Ids must lie in ``[0, V)``; out-of-range ids are not
    detected under TP (that would cost a device sync) and silently embed to zero. Split backward: inside
    ``split_backward.deferring_weight_grads`` the weight's scatter-add runs in W and B computes nothing here.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group, sequence_parallel: bool = False,
                 init_std: float = 1.0, generator=None, dtype=None, device=None):
        super().__init__()
        n = group_size(group)
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.padded_num_embeddings = pad_vocab(num_embeddings, tp=n)
        self.sequence_parallel = sequence_parallel and n > 1
        self.vocab_start, self.vocab_end = vocab_shard_range(self.padded_num_embeddings, group=group)
        self.weight = vocab_parallel_weight(num_embeddings, embedding_dim, group=group, init_std=init_std,
                                            generator=generator, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, group=self.group, dim=1)
        return reduce_from_tp(out, group=self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}, local "
                f"[{self.vocab_start}, {self.vocab_end})), {self.embedding_dim}, tp={group_size(self.group)}")


def _sum_over(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        with record_function(comm_name("tp", "all_reduce")):
            dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token ``logsumexp_j z_j - z_target`` over logits split along the vocabulary.

    forward: ``m = max`` (all-reduce MAX), then ``sum_j exp(z_j - m)`` and the target's shifted logit (both in
    one all-reduce SUM: only the owning rank contributes the target). backward: ``dz = (softmax(z) - onehot) * g``
    on the local columns, no communication. Ignored tokens give loss 0 and gradient 0; columns at global index
    ``>= vocab_size`` (padding) are excluded. bf16/fp16 logits are computed in float32.
    """

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, vocab_size):
        z = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits.clone()
        local_v = z.shape[-1]
        start = group_rank(group) * local_v
        if vocab_size is not None and start + local_v > vocab_size:
            z[..., max(vocab_size - start, 0):] = float("-inf")
        m = _sum_over(z.amax(dim=-1), group, dist.ReduceOp.MAX)
        z.sub_(m.unsqueeze(-1))
        ignored = target == ignore_index
        local_t = target - start
        mine = (local_t >= 0) & (local_t < local_v) & ~ignored
        idx = local_t.clamp(0, local_v - 1).unsqueeze(-1)
        target_z = torch.gather(z, -1, idx).squeeze(-1) * mine
        z.exp_()
        stats = _sum_over(torch.stack([z.sum(dim=-1), target_z]), group)
        loss = (stats[0].log() - stats[1]).masked_fill(ignored, 0.0)
        z.div_(stats[0].unsqueeze(-1))  # z is now the local softmax
        ctx.save_for_backward(z, idx, mine, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, ignored = ctx.saved_tensors
        grad = softmax.scatter_add(-1, idx, -mine.to(softmax.dtype).unsqueeze(-1))
        grad.mul_((grad_loss.masked_fill(ignored, 0.0)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, group, ignore_index: int = -100,
                                 vocab_size: int | None = None, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of vocab-sharded ``logits [..., V'/n]`` against global ids ``target [...]``, never gathered.

    Equals ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), ignore_index=...)`` (``reduction``
    ``"mean"`` over the non-ignored tokens, ``"sum"``, or ``"none"`` per token), identically on every rank of the
    group. ``vocab_size`` (the unpadded V) excludes padded columns. Returned in float32 for bf16/fp16 logits.
    """
    if logits.shape[:-1] != target.shape:
        raise LayoutError(f"logits shape {tuple(logits.shape)} and target shape {tuple(target.shape)} disagree: "
                          f"logits must be target's shape plus a vocabulary dim")
    if reduction not in ("mean", "sum", "none"):
        raise ContractError(f"reduction={reduction!r} is not one of 'mean', 'sum', 'none'")
    per_token = _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index, vocab_size)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (target != ignore_index).sum()
