"""Context (sequence) parallelism: the sequence layouts, ring attention and Ulysses attention.

A sequence of length ``S`` is sharded over a context-parallel group of size ``n``. Two layouts
(:class:`SequenceLayout`):

- ``CONTIGUOUS``: rank ``i`` holds tokens ``[i*S/n, (i+1)*S/n)``. Under a causal mask rank ``n-1`` does ``2n-1``
  times the work of rank 0.
- ``BALANCED`` (the default, what :func:`shard_sequence` produces): the sequence is cut into ``2n`` chunks of
  ``c = S/(2n)`` tokens and rank ``i`` holds chunks ``i`` and ``2n-1-i``, in that order, so every rank does the
  same causal work. Local token ``j`` has global position ``i*c + j`` for ``j < c`` and ``(2n-1-i)*c + j - c``
  otherwise (:func:`local_positions`).

Attention inputs are ``[batch, heads, local_seq, head_dim]`` and every function must be told the layout its
inputs are in (the causal mask depends on global positions). ``group`` None or of size 1 means dense attention.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from shardline.job.annotations import comm_name
from shardline.plugins.errors import LayoutError
from shardline.plugins.layers.sp_ring import ring_attention_impl
from shardline.plugins.layers.tp_comm import all_gather, group_rank, group_size

__all__ = [
    "SequenceLayout",
    "local_positions",
    "shard_sequence",
    "unshard_sequence",
    "ring_attention",
    "ulysses_attention",
]


class SequenceLayout(str, enum.Enum):
    """Which tokens of the global sequence a context-parallel rank holds (see the module docstring)."""

    BALANCED = "balanced"
    CONTIGUOUS = "contiguous"


def check_sequence(seq_len: int, *, n: int, layout: SequenceLayout | str) -> SequenceLayout:
    """Validate ``layout`` and that ``seq_len`` splits into it over ``n`` ranks (LayoutError naming both)."""
    try:
        layout = SequenceLayout(layout)
    except ValueError:
        raise LayoutError(f"layout={layout!r} is not one of {[m.value for m in SequenceLayout]}") from None
    if n > 1:
        parts = 2 * n if layout is SequenceLayout.BALANCED else n
        if seq_len % parts:
            what = "2*cp" if layout is SequenceLayout.BALANCED else "cp"
            raise LayoutError(f"sequence length {seq_len} is not divisible by {what}={parts} "
                              f"(layout {layout.value!r}, cp={n})")
    return layout


def local_positions(seq_len: int, *, n: int, rank: int, layout: SequenceLayout | str = SequenceLayout.BALANCED,
                    device=None) -> torch.Tensor:
    """Global positions (int64, ``[seq_len/n]``) of the tokens rank ``rank`` of ``n`` holds."""
    layout = check_sequence(seq_len, n=n, layout=layout)
    local = seq_len // n
    if n == 1 or layout is SequenceLayout.CONTIGUOUS:
        return torch.arange(rank * local, (rank + 1) * local, device=device)
    c = local // 2
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c, device=device)
    return torch.cat([first, second])


def _gathered_order(seq_len: int, n: int, layout: SequenceLayout, device) -> torch.Tensor:
    """``idx`` with ``global = gathered.index_select(dim, idx)``, where gathered = ranks' local parts concatenated."""
    owner_pos = torch.cat([local_positions(seq_len, n=n, rank=r, layout=layout) for r in range(n)])
    return torch.argsort(owner_pos).to(device)


class _ShardSequence(torch.autograd.Function):
    """forward: keep this rank's tokens (no communication); backward: all-gather and restore global order."""

    @staticmethod
    def forward(ctx, x, group, dim, layout):
        n, seq_len = group_size(group), x.shape[dim]
        ctx.group, ctx.dim, ctx.layout, ctx.seq_len = group, dim, layout, seq_len
        pos = local_positions(seq_len, n=n, rank=group_rank(group), layout=layout, device=x.device)
        return x.index_select(dim, pos)

    @staticmethod
    def backward(ctx, grad):
        n = group_size(ctx.group)
        gathered = all_gather(grad, group=ctx.group, dim=ctx.dim, dim_name="cp")
        return gathered.index_select(ctx.dim, _gathered_order(ctx.seq_len, n, ctx.layout, grad.device)), \
            None, None, None


class _UnshardSequence(torch.autograd.Function):
    """forward: all-gather and restore global order; backward: keep this rank's tokens of the gradient."""

    @staticmethod
    def forward(ctx, x, group, dim, layout):
        n = group_size(group)
        seq_len = x.shape[dim] * n
        check_sequence(seq_len, n=n, layout=layout)
        ctx.group, ctx.dim, ctx.layout, ctx.seq_len = group, dim, layout, seq_len
        gathered = all_gather(x, group=group, dim=dim, dim_name="cp")
        return gathered.index_select(dim, _gathered_order(seq_len, n, layout, x.device))

    @staticmethod
    def backward(ctx, grad):
        pos = local_positions(ctx.seq_len, n=group_size(ctx.group), rank=group_rank(ctx.group),
                              layout=ctx.layout, device=grad.device)
        return grad.index_select(ctx.dim, pos), None, None, None


def shard_sequence(x: torch.Tensor, *, group, dim: int, layout: SequenceLayout | str = SequenceLayout.BALANCED):
    """The full sequence (replicated on every rank) -> this rank's tokens in ``layout`` along ``dim``.

    forward: select (no communication); backward: all-gather (the gradient of a replicated input is the same
    on every rank, so each rank's slice is all that travels). Sequence length not divisible by ``2*cp``
    (balanced) or ``cp`` (contiguous) raises LayoutError naming both numbers.
    """
    dim = dim % x.dim()
    layout = check_sequence(x.shape[dim], n=group_size(group), layout=layout)
    return x if group_size(group) == 1 else _ShardSequence.apply(x, group, dim, layout)


def unshard_sequence(x: torch.Tensor, *, group, dim: int, layout: SequenceLayout | str = SequenceLayout.BALANCED):
    """Inverse of :func:`shard_sequence`. forward: all-gather + reorder; backward: select this rank's tokens."""
    dim = dim % x.dim()
    layout = check_sequence(x.shape[dim] * group_size(group), n=group_size(group), layout=layout)
    return x if group_size(group) == 1 else _UnshardSequence.apply(x, group, dim, layout)


def check_attention_inputs(q, k, v) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise LayoutError(f"attention expects q, k, v of one shape [batch, heads, local_seq, head_dim]; got "
                          f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Exchange dim 0 chunks: chunk j goes to rank j; the result's chunk i came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps strides, the collective assumes dense rows
    with record_function(comm_name("cp", "all_to_all")):
        dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    b, h, s, d = x.shape
    parts = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4)  # chunk j: heads of rank j, my tokens
    got = _all_to_all(parts, group)  # chunk i: my heads, rank i's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    b, hl, ns, d = x.shape
    parts = x.reshape(b, hl, n, ns // n, d).permute(2, 0, 1, 3, 4)  # chunk j: my heads, rank j's tokens
    got = _all_to_all(parts, group)  # chunk i: rank i's heads, my tokens
    return got.permute(1, 0, 2, 3, 4).reshape(b, n * hl, ns // n, d)


class _SeqToHeads(torch.autograd.Function):
    """forward: all-to-all ``[b, h, s/n, d] -> [b, h/n, s, d]``; backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """forward: all-to-all ``[b, h/n, s, d] -> [b, h, s/n, d]``; backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def ulysses_attention(q, k, v, *, group, causal: bool = True, scale: float | None = None,
                      layout: SequenceLayout | str = SequenceLayout.BALANCED) -> torch.Tensor:
    """Exact attention over a sequence sharded across ``group`` by switching to head sharding (DeepSpeed-Ulysses).

    ``q, k, v: [b, h, s/n, d]`` in ``layout`` -> all-to-all to ``[b, h/n, s, d]`` (every token, this rank's
    heads), reorder to global token order, ``softmax(q k^T * scale + mask) v`` locally, and back: output
    ``[b, h, s/n, d]``. Backward: the same all-to-alls reversed (each is the other's adjoint). Heads not
    divisible by the group size raise LayoutError naming both.
    """
    check_attention_inputs(q, k, v)
    n = group_size(group)
    if n == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if q.shape[1] % n:
        raise LayoutError(f"ulysses_attention: heads={q.shape[1]} is not divisible by cp={n}")
    seq_len = q.shape[2] * n
    layout = check_sequence(seq_len, n=n, layout=layout)
    qh, kh, vh = (_SeqToHeads.apply(t, group) for t in (q, k, v))
    if layout is SequenceLayout.CONTIGUOUS:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    else:
        order = _gathered_order(seq_len, n, layout, q.device)  # gathered -> global
        back = torch.argsort(order)  # global -> gathered
        qh, kh, vh = (t.index_select(2, order) for t in (qh, kh, vh))
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale).index_select(2, back)
    return _HeadsToSeq.apply(out, group)


def ring_attention(q, k, v, *, group, causal: bool = True, scale: float | None = None,
                   layout: SequenceLayout | str = SequenceLayout.BALANCED) -> torch.Tensor:
    """Exact attention over a sequence sharded across ``group``, K/V passed around a ring.

    ``q, k, v: [b, h, s/n, d]`` in ``layout`` (default BALANCED, what :func:`shard_sequence` gives) -> output
    ``[b, h, s/n, d]`` equal to ``softmax(q K^T * scale + mask) V`` over the whole sequence, ``scale`` defaulting
    to ``1/sqrt(d)``. Forward: K/V blocks travel around the ring (isend/irecv overlapping the local block's
    compute), partial results merge by the log-sum-exp rule. Backward: its own ring, dK/dV travelling with
    their blocks back to the owner. Per-rank memory is O(s/n); the math is in :mod:`shardline.plugins.layers.sp_ring`.
    """
    check_attention_inputs(q, k, v)
    n = group_size(group)
    if n == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    layout = check_sequence(q.shape[2] * n, n=n, layout=layout)
    return ring_attention_impl(q, k, v, group=group, causal=causal, scale=scale,
                               balanced=layout is SequenceLayout.BALANCED)
