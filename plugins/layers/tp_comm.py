"""Conjugate collectives for tensor and sequence parallelism, as ``torch.autograd.Function`` pairs.

Every region boundary of a Megatron-style layer is one of these functions. Each is documented as
"forward: X, backward: Y", and Y is the adjoint (transpose) of X, which is what makes the gradients exact:

=============================  ===============================  ================================
function                       forward                          backward
=============================  ===============================  ================================
``copy_to_tp``                 identity                         all-reduce (sum) over the group
``reduce_from_tp``             all-reduce (sum)                 identity
``split_to_tp``                keep this rank's chunk of dim    all-gather along dim
``gather_from_tp``             all-gather along dim             keep this rank's chunk of dim
``gather_from_sequence``       all-gather along the seq dim     reduce-scatter (sum) along seq
``reduce_scatter_to_sequence`` reduce-scatter (sum) along seq   all-gather along the seq dim
=============================  ===============================  ================================

``split``/``gather`` act on the last dimension by default (the hidden/feature dimension of a TP shard);
the sequence pair acts on ``dim=1`` by default (activations are ``[batch, seq, hidden]``). Chunks are contiguous
and in group-rank order: rank ``r`` of a group of size ``n`` holds elements ``[r*L/n, (r+1)*L/n)``.

``group`` None or of size 1 makes every function the identity (the dense model). ``group`` may also be a
:class:`~shardline.plugins.grid.StandInGroup` (a description of a group, no communicator: a rank's part of a
layout built in one process, e.g. on the meta device, to count its bytes); sizes and ranks answer as the real
group's would, and a collective over it raises ``ContractError``. Every collective runs inside a
``torch.profiler.record_function`` named by :func:`shardline.job.annotations.comm_name`, so the profiler can
attribute its time. No function here holds a process group: the group is always an argument.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardline.job.annotations import comm_name
from shardline.plugins.errors import LayoutError
from shardline.plugins.grid import StandInGroup

_all_gather_single = dist.all_gather_single
_reduce_scatter_single = dist.reduce_scatter_single


def group_size(group) -> int:
    """Size of ``group``; 1 for None (dense) so callers need no special case."""
    if group is None:
        return 1
    if isinstance(group, StandInGroup):
        return len(group.ranks)
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group``; 0 for None."""
    if group is None:
        return 0
    if isinstance(group, StandInGroup):
        return group.ranks.index(group.rank)
    return dist.get_rank(group)


def draw_slice(shape: tuple[int, ...], *, dim: int, start: int, stop: int, generator, std: float | None = None,
               bound: float | None = None) -> torch.Tensor:
    """Indices ``[start, stop)`` along ``dim`` of a dense float32 random tensor of ``shape`` (``U(-bound, bound)``
    or ``N(0, std^2)``) on the CPU, whatever the target dtype/device.

    With a ``generator``, the slices along ``dim`` each come from a generator of their own, seeded from one number
    drawn from ``generator``: the dense tensor is the same whichever part of it a rank draws, and a rank draws (and
    allocates) only its part, so construction costs its share of the model, not the model. Without one, the dense
    tensor is drawn whole from the global RNG and the part taken from it. On the meta device
    (``torch.device("meta")`` context) nothing is drawn."""
    if generator is None:
        full = (torch.randn(shape, dtype=torch.float32).mul_(std) if std is not None
                else torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound))
        return full.narrow(dim, start, stop - start)
    base = int(torch.randint(0, 2**62, (1,), generator=generator, device="cpu"))
    other = tuple(shape[:dim]) + tuple(shape[dim + 1:])
    if torch.empty(()).device.type == "meta":
        return torch.empty((stop - start, *other)).movedim(0, dim)
    out = torch.empty((stop - start, *other), dtype=torch.float32, device="cpu")
    g = torch.Generator()
    for k, index in enumerate(range(start, stop)):
        g.manual_seed(base + index)
        if std is not None:
            out[k].normal_(0.0, std, generator=g)
        else:
            out[k].uniform_(-bound, bound, generator=g)
    return out.movedim(0, dim)


def owned(part: torch.Tensor, *, dtype=None, device=None) -> torch.Tensor:
    """``part`` (a slice of a freshly drawn dense tensor) in ``dtype``/``device``, contiguous, in storage of its
    own. A row slice is already contiguous, so ``.to(...).contiguous()`` would return a view that keeps the
    whole dense tensor alive (every TP rank would hold the dense weight)."""
    out = part.to(dtype=dtype or torch.get_default_dtype(), device=device)
    if out.device.type == "meta":
        return out.contiguous()
    if not out.is_contiguous() or out.untyped_storage().nbytes() > out.numel() * out.element_size():
        out = out.clone(memory_format=torch.contiguous_format)
    return out


def check_divisible(length: int, *, n: int, what: str, by: str) -> None:
    """Raise LayoutError naming both numbers when ``length`` is not a multiple of ``n``."""
    if length % n:
        raise LayoutError(f"{what}={length} is not divisible by {by}={n}")


def all_reduce(x: torch.Tensor, *, group, dim_name: str = "tp") -> torch.Tensor:
    """Sum ``x`` over ``group`` (out of place: the autograd input must not be mutated)."""
    if group_size(group) == 1:
        return x
    if isinstance(group, StandInGroup):
        group.refuse("all_reduce")
    out = x.contiguous().clone()
    with record_function(comm_name(dim_name, "all_reduce")):
        dist.all_reduce(out, group=group)
    return out


def all_gather(x: torch.Tensor, *, group, dim: int, dim_name: str = "tp") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order."""
    n = group_size(group)
    if n == 1:
        return x
    if isinstance(group, StandInGroup):
        group.refuse("all_gather")
    dim = dim % x.dim()
    # The single-tensor collective gathers along dim 0; move ``dim`` to the front and back.
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((n * front.shape[0], *front.shape[1:]))
    with record_function(comm_name(dim_name, "all_gather")):
        _all_gather_single(out, front, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, *, group, dim: int, dim_name: str = "tp") -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's chunk of ``dim``."""
    n = group_size(group)
    if n == 1:
        return x
    if isinstance(group, StandInGroup):
        group.refuse("reduce_scatter")
    dim = dim % x.dim()
    check_divisible(x.shape[dim], n=n, what=f"reduce-scatter length of dim {dim}", by="group size")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // n, *front.shape[1:]))
    with record_function(comm_name(dim_name, "reduce_scatter")):
        _reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim)


def local_chunk(x: torch.Tensor, *, group, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    check_divisible(x.shape[dim], n=n, what=f"length of dim {dim % x.dim()}", by="group size")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce (sum) over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, group=ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce (sum) over the group; backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SplitToTP(torch.autograd.Function):
    """forward: keep this rank's chunk of ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return local_chunk(x, group=group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, group=ctx.group, dim=ctx.dim), None, None


class _GatherFromTP(torch.autograd.Function):
    """forward: all-gather along ``dim``; backward: keep this rank's chunk of ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group=group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return local_chunk(grad, group=ctx.group, dim=ctx.dim), None, None


class _GatherFromSequence(torch.autograd.Function):
    """forward: all-gather along the sequence dim; backward: reduce-scatter (sum) along it."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group=group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, group=ctx.group, dim=ctx.dim), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """forward: reduce-scatter (sum) along the sequence dim; backward: all-gather along it."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group=group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, group=ctx.group, dim=ctx.dim), None, None


def copy_to_tp(x: torch.Tensor, *, group) -> torch.Tensor:
    """Enter a TP region with a replicated input. forward: identity; backward: all-reduce (sum)."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, *, group) -> torch.Tensor:
    """Leave a TP region by summing partial results. forward: all-reduce (sum); backward: identity."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def split_to_tp(x: torch.Tensor, *, group, dim: int = -1) -> torch.Tensor:
    """``[..., L] -> [..., L/n]``, this rank's chunk. forward: split; backward: all-gather along ``dim``."""
    return x if group_size(group) == 1 else _SplitToTP.apply(x, group, dim)


def gather_from_tp(x: torch.Tensor, *, group, dim: int = -1) -> torch.Tensor:
    """``[..., L/n] -> [..., L]``. forward: all-gather along ``dim``; backward: split (keep own chunk)."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group, dim)


def gather_from_sequence(x: torch.Tensor, *, group, dim: int = 1) -> torch.Tensor:
    """Megatron-SP entry: ``[b, s/n, h] -> [b, s, h]``. forward: all-gather along seq; backward: reduce-scatter."""
    return x if group_size(group) == 1 else _GatherFromSequence.apply(x, group, dim)


def reduce_scatter_to_sequence(x: torch.Tensor, *, group, dim: int = 1) -> torch.Tensor:
    """Megatron-SP exit: partial ``[b, s, h] -> [b, s/n, h]`` summed. forward: reduce-scatter; backward: all-gather."""
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group, dim)
