"""Mixture-of-experts block with expert parallelism: a top-k router, token dispatch and combine over the EP group,
SwiGLU experts on a grouped GEMM, shared experts, the load-balancing and z losses, and router statistics.

Expert parallelism folds the ranks of a pipeline stage as ``etp x ep x edp``
(:class:`~shardline.plugins.grid.ParallelDims`): EP rank ``r`` of ``ep`` holds experts ``[r*E/ep, (r+1)*E/ep)``
(``E/ep`` local experts), each split over the ``etp`` group along its FFN dimension when ``etp = tp``.

The conjugate pair beside the TP/SP ones of :mod:`~shardline.plugins.layers.tp_comm` (each the other's adjoint):

=====================  ===============================================  ===============================================
function               forward                                          backward
=====================  ===============================================  ===============================================
``dispatch_tokens``    all-to-all, uneven: ``send[j]`` rows to rank j,  the inverse all-to-all (``recv[i]`` rows back to
                       ``recv[i]`` rows from rank i                     rank i): what ``combine_tokens`` does forward
``combine_tokens``     the inverse all-to-all (rows back to their       the forward all-to-all: what ``dispatch_tokens``
                       source rank)                                     does forward
=====================  ===============================================  ===============================================

One block on one rank (``N`` tokens dispatched, ``k`` choices each, ``E`` experts):

1. route: ``logits = x W_r^T``; ``softmax_topk`` (Mixtral, Qwen-MoE): ``p = softmax(logits)``, keep the k largest,
   optionally renormalised to sum 1; ``topk_softmax``: the k largest logits, softmax over those k. DeepSeek-V3's
   sigmoid scores with the aux-loss-free bias and group-limited routing are not here yet.
2. plan (:func:`dispatch_plan`): the ``N*k`` (token, choice) slots sorted by expert, stable in slot order ``(choice,
   token)`` (every token's first choice before any second choice). Capacity mode keeps, per expert, the first
   ``C = ceil(capacity_factor * N * k / E)`` slots of that order and drops the rest (their output is 0):
   capacity is what *each source rank* may send each expert, so a single-process reference that knows which
   tokens each rank holds reproduces exactly which are dropped. Dropless: ``capacity_factor=None``.
3. exchange counts (an all-to-all of ``E`` integers), then :func:`dispatch_tokens` the rows (split sizes: the
   routed counts per destination rank); received rows (source-major) are regrouped expert-major.
4. experts: SwiGLU ``(silu(x W_g) * (x W_u)) W_d`` per local expert on :func:`grouped_matmul`; with ``etp = tp``
   the FFN dimension is split over TP (``copy_to_tp`` before, ``reduce_from_tp`` after: the partial sums add up).
5. regroup source-major, :func:`combine_tokens`, then unpermute and weight: ``y[t] = sum_j w[t, j] out[t, j]``.

Tokens over TP. The attention's TP ranks hold the same tokens. With ``etp = 1`` and ``tp > 1`` each TP rank
dispatches only its ``1/tp`` of them (``split_to_tp`` / ``gather_from_tp`` on the token dim), so expert work is
not repeated; the router runs on every token, replicated, so its gradient is the same on every TP rank. Under
Megatron-SP (``sequence_parallel=True``) the tokens are already split: with ``etp = 1`` nothing more is done (the
router and shared expert then see this rank's tokens only: their parameters are ``SEQUENCE_REPLICATED``); with
``etp = tp`` they are gathered on entry and split on exit.

Losses (returned, never added behind the caller's back): Hugging Face's load-balancing loss per micro-batch
(:func:`load_balancing_loss`: ``E * sum_e f_e P_e`` with ``f_e`` the fraction of (token, choice) slots routed
to ``e`` and ``P_e`` the mean router probability; Mixtral/Qwen-MoE concatenate every layer's tokens before
taking it, which the function accepts as lists) and the router z-loss (``mean_t logsumexp(logits_t)^2``),
weighted by ``aux_loss_coef`` and ``z_loss_coef``. Both are means over the tokens the router saw: the dp rank's
tokens, except under Megatron-SP with ``etp = 1``, where they are this TP rank's share (DeepSeek-V3's
sequence-wise form and Megatron's global one over dp x cp are not here yet). A pipeline stage must add the
aux loss of its own blocks to what it backpropagates.

Expert parameters carry ``EXPERT_ATTRIBUTE`` (their gradients reduce over ``edp``, not ``dp``): see
:func:`is_expert_parameter`.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from shardline.job.annotations import comm_name
from shardline.plugins import torch_compat
from shardline.plugins.errors import ContractError, LayoutError
from shardline.plugins.grid import StandInGroup
from shardline.plugins.layers.roles import ParamRole, declare
from shardline.plugins.layers.tp_comm import (
    copy_to_tp,
    draw_slice,
    gather_from_tp,
    group_size,
    local_chunk,
    owned,
    reduce_from_tp,
    split_to_tp,
)

EXPERT_ATTRIBUTE = "shardline_expert"


class RouterKind(str, enum.Enum):
    SOFTMAX_TOPK = "softmax_topk"  # softmax over every expert, keep the k largest (Mixtral, Qwen-MoE)
    TOPK_SOFTMAX = "topk_softmax"  # the k largest logits, softmax over those k


@dataclass(frozen=True)
class MoEConfig:
    """One MoE block: ``hidden`` size, each expert's ``ffn`` size, ``experts`` routed experts, ``top_k`` per
    token, the router kind (``renormalize``: rescale the k softmax weights to sum 1), ``capacity_factor`` (None:
    dropless), a shared always-on SwiGLU expert of ``shared_ffn`` (0: none), gated by ``sigmoid(x w_g)`` when
    ``shared_gate``, and the loss coefficients."""

    hidden: int
    ffn: int
    experts: int
    top_k: int
    router: RouterKind | str = RouterKind.SOFTMAX_TOPK
    renormalize: bool = False
    capacity_factor: float | None = None
    shared_ffn: int = 0
    shared_gate: bool = False
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        problems = [f"{name}={value!r} must be an integer >= 1" for name, value in
                    (("hidden", self.hidden), ("ffn", self.ffn), ("experts", self.experts), ("top_k", self.top_k))
                    if not isinstance(value, int) or isinstance(value, bool) or value < 1]
        try:
            object.__setattr__(self, "router", RouterKind(self.router))
        except ValueError:
            problems.append(f"router={self.router!r} is not one of {[k.value for k in RouterKind]}")
        if not problems and self.top_k > self.experts:
            problems.append(f"top_k={self.top_k} is more than experts={self.experts}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            problems.append(f"capacity_factor={cf!r} must be None (dropless) or a number > 0")
        if not isinstance(self.shared_ffn, int) or isinstance(self.shared_ffn, bool) or self.shared_ffn < 0:
            problems.append(f"shared_ffn={self.shared_ffn!r} must be an integer >= 0 (0: no shared expert)")
        elif self.shared_gate and self.shared_ffn == 0:
            problems.append("shared_gate=True needs a shared expert (shared_ffn=0)")
        for name in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                problems.append(f"{name}={value!r} must be a number >= 0")
        if problems:
            raise ContractError("invalid MoE config: " + "; ".join(problems))

    def layout_problems(self, *, ep: int, etp: int) -> list[str]:
        """Why this block cannot be split ``ep`` ways over experts and ``etp`` ways over the FFN dimension."""
        problems = []
        if self.experts % ep:
            problems.append(f"experts={self.experts} is not divisible by ep={ep}")
        if self.ffn % etp:
            problems.append(f"ffn={self.ffn} is not divisible by etp={etp}")
        return problems


@dataclass(frozen=True)
class RouterStats:
    """One block's routing on this rank for one forward: ``tokens_per_expert`` (the (token, choice) slots this
    rank's router sent to each expert, before any drop), ``dropped`` (slots this rank dispatched that capacity
    dropped), ``balance_loss`` and ``z_loss`` (unweighted)."""

    tokens_per_expert: tuple[int, ...]
    dropped: int
    balance_loss: float
    z_loss: float

    @property
    def imbalance(self) -> float:
        """max / mean tokens per expert (1.0: perfectly balanced)."""
        mean = sum(self.tokens_per_expert) / len(self.tokens_per_expert)
        return max(self.tokens_per_expert) / mean if mean else 1.0


@dataclass
class MoEOutput:
    """``output`` (the input's shape), ``aux_loss`` (coefficient-weighted balance + z loss: add it to the loss),
    ``stats``, and the router's ``logits``, ``probs`` and ``indices`` (for a loss taken over every layer)."""

    output: torch.Tensor
    aux_loss: torch.Tensor
    stats: RouterStats
    logits: torch.Tensor
    probs: torch.Tensor
    indices: torch.Tensor


# --- routing ------------------------------------------------------------------------------------------------------

def route(logits: torch.Tensor, *, top_k: int, kind: RouterKind | str = RouterKind.SOFTMAX_TOPK,
          renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits: [T, E]`` -> ``(weights [T, k], indices [T, k], probs [T, E])``, computed in at least float32
    (``probs`` is the softmax over every expert, whatever the kind: the balance loss reads it)."""
    kind = RouterKind(kind)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    probs = logits.softmax(dim=-1)
    if kind is RouterKind.SOFTMAX_TOPK:
        weights, indices = probs.topk(top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, indices = logits.topk(top_k, dim=-1)
        weights = top.softmax(dim=-1)
    return weights, indices, probs


def load_balancing_loss(probs: torch.Tensor | list[torch.Tensor], indices: torch.Tensor | list[torch.Tensor], *,
                        experts: int) -> torch.Tensor:
    """Hugging Face's load-balancing loss (Switch Transformer's): ``E * sum_e f_e P_e`` over the tokens given
    (lists: every layer's tokens concatenated, as Mixtral/Qwen-MoE do per micro-batch), with ``f_e`` the
    fraction of tokens whose k choices include ``e`` summed over the k choices, ``P_e`` the mean probability."""
    probs = torch.cat(list(probs)) if isinstance(probs, (list, tuple)) else probs
    indices = torch.cat(list(indices)) if isinstance(indices, (list, tuple)) else indices
    tokens = probs.shape[0]
    counts = torch.bincount(indices.reshape(-1), minlength=experts).to(probs.dtype)
    return experts * (counts / tokens * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: ``mean_t (logsumexp_e logits[t, e])^2``."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(logits, dim=-1).square().mean()


def capacity_of(tokens: int, *, top_k: int, experts: int, factor: float) -> int:
    """Slots a source rank dispatching ``tokens`` tokens may send each expert: ``ceil(factor * tokens * k / E)``."""
    return math.ceil(factor * tokens * top_k / experts)


def dispatch_plan(indices: torch.Tensor, *, experts: int, capacity: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``indices: [N, k]`` -> ``(order, counts, dropped)``: ``order`` the kept slots (slot ``s = j*N + t`` is token
    ``t``'s ``j``-th choice) sorted by expert, within an expert in slot order; ``counts[e]`` the kept slots of
    expert ``e``; ``dropped`` how many slots ``capacity`` (None: dropless) left out."""
    flat = indices.t().reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    if capacity is None:
        return order, counts, 0
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(flat.numel(), device=flat.device) - torch.repeat_interleave(starts, counts)
    kept = order[position < capacity]
    return kept, counts.clamp(max=capacity), flat.numel() - kept.numel()


# --- the all-to-all pair ------------------------------------------------------------------------------------------

def _all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    if isinstance(group, StandInGroup):
        group.refuse("all_to_all")
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    with record_function(comm_name("ep", "all_to_all")):
        dist.all_to_all_single(out, x, output_split_sizes=list(recv), input_split_sizes=list(send), group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    """forward: all-to-all of rows with ``send``/``recv`` split sizes; backward: the same with the two swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_rows(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def dispatch_tokens(rows: torch.Tensor, *, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Send ``send[j]`` rows (consecutive, in rank order) to EP rank j and receive ``recv[i]`` from rank i.
    forward: all-to-all; backward: the inverse all-to-all."""
    return rows if group_size(group) == 1 else _AllToAllRows.apply(rows, list(send), list(recv), group)


def combine_tokens(rows: torch.Tensor, *, send: list[int], recv: list[int], group) -> torch.Tensor:
    """The inverse of :func:`dispatch_tokens` called with the same ``send``/``recv``: the ``recv[i]`` rows go
    back to rank i, the ``send[j]`` rows come back from rank j. forward: inverse all-to-all; backward: the
    dispatch all-to-all."""
    return rows if group_size(group) == 1 else _AllToAllRows.apply(rows, list(recv), list(send), group)


def exchange_counts(counts: torch.Tensor, *, group) -> torch.Tensor:
    """``counts: [E]`` slots this rank sends each expert -> ``[ep, E/ep]``: row i what rank i sends each of this
    rank's experts (an all-to-all of integers; no gradient)."""
    n = group_size(group)
    if n == 1:
        return counts.view(1, -1)
    if isinstance(group, StandInGroup):
        group.refuse("all_to_all")
    out = torch.empty_like(counts)
    with record_function(comm_name("ep", "all_to_all")):
        dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out.view(n, -1)


# --- grouped GEMM -------------------------------------------------------------------------------------------------

class _ContiguousGrad(torch.autograd.Function):
    """forward: identity; backward: the gradient made contiguous (grouped-GEMM kernels refuse broadcast strides)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def fast_grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`grouped_matmul` takes torch's grouped matmul: CUDA, bfloat16, rows of 16-byte multiples."""
    return (torch_compat.grouped_mm() is not None and x.is_cuda and x.dtype == torch.bfloat16
            and w.dtype == torch.bfloat16 and x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int], *, fast: bool | None = None) -> torch.Tensor:
    """``x: [M, K]`` (rows grouped by expert: ``counts[g]`` rows for expert g), ``w: [G, K, N]`` -> ``[M, N]``,
    ``x_g @ w[g]`` per group. ``fast`` None picks torch's grouped matmul where it applies
    (:func:`fast_grouped_mm_applies`) and one matmul per expert elsewhere; True/False force one path."""
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0]:
        raise ContractError(f"grouped_matmul: counts={list(counts)} must have one entry per expert "
                            f"({w.shape[0]}) summing to the {x.shape[0]} rows")
    if fast is None:
        fast = fast_grouped_mm_applies(x, w)
    if fast:
        fn = torch_compat.grouped_mm()
        if fn is None:
            raise ContractError(f"torch {torch.__version__} offers no grouped matmul (fast=True)")
        offs = torch.tensor(list(itertools.accumulate(int(c) for c in counts)), dtype=torch.int32, device=x.device)
        return _ContiguousGrad.apply(fn(x.contiguous(), w, offs=offs))
    parts = torch.split(x, list(counts))
    return torch.cat([part @ w[g] for g, part in enumerate(parts)])


# --- modules ------------------------------------------------------------------------------------------------------

def mark_expert(param: nn.Parameter) -> nn.Parameter:
    """Mark ``param`` as an expert parameter (its gradient reduces over ``edp``). Returns it."""
    setattr(param, EXPERT_ATTRIBUTE, True)
    return param


def is_expert_parameter(param: nn.Parameter) -> bool:
    return bool(getattr(param, EXPERT_ATTRIBUTE, False))


def _param(shape, *, dim: int, start: int, stop: int, generator, std: float, dtype, device) -> nn.Parameter:
    return nn.Parameter(owned(draw_slice(tuple(shape), dim=dim, start=start, stop=stop, generator=generator, std=std),
                              dtype=dtype, device=device))


class GroupedExperts(nn.Module):
    """``local`` SwiGLU experts, weights stacked ``w_gate, w_up: [local, hidden, ffn_local]``,
    ``w_down: [local, ffn_local, hidden]``: experts ``[first, first + local)`` of ``experts``, FFN columns
    ``[ffn_rank * ffn_local, ...)`` of ``ffn``, drawn as slices of the dense ``[experts, ...]`` tensors so the
    dense model is the same on every layout."""

    def __init__(self, *, experts: int, first: int, local: int, hidden: int, ffn: int, ffn_parts: int = 1,
                 ffn_rank: int = 0, generator=None, std: float = 0.02, dtype=None, device=None):
        super().__init__()
        f = ffn // ffn_parts
        lo, hi = ffn_rank * f, (ffn_rank + 1) * f

        def draw(shape, ffn_dim):
            dense = draw_slice(tuple(shape), dim=0, start=first, stop=first + local, generator=generator, std=std)
            return mark_expert(nn.Parameter(owned(dense.narrow(ffn_dim, lo, hi - lo), dtype=dtype, device=device)))

        self.w_gate = draw((experts, hidden, ffn), 2)
        self.w_up = draw((experts, hidden, ffn), 2)
        self.w_down = draw((experts, ffn, hidden), 1)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        gate = grouped_matmul(rows, self.w_gate, counts)
        up = grouped_matmul(rows, self.w_up, counts)
        return grouped_matmul(F.silu(gate) * up, self.w_down, counts)


class SharedExpert(nn.Module):
    """An always-on SwiGLU MLP ``(silu(x W_g) * (x W_u)) W_d``, times ``sigmoid(x w_s)`` when ``gated``
    (Qwen2-MoE's shared expert gate), whole on every rank."""

    def __init__(self, *, hidden: int, ffn: int, gated: bool, generator=None, std: float = 0.02, dtype=None,
                 device=None):
        super().__init__()

        def draw(*shape):
            return _param(shape, dim=0, start=0, stop=shape[0], generator=generator, std=std, dtype=dtype,
                          device=device)

        self.w_gate, self.w_up, self.w_down = draw(hidden, ffn), draw(hidden, ffn), draw(ffn, hidden)
        self.gate = draw(1, hidden) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (F.silu(x @ self.w_gate) * (x @ self.w_up)) @ self.w_down
        return out if self.gate is None else torch.sigmoid(x @ self.gate.t()) * out


class MoEBlock(nn.Module):
    """The MoE block of one layer on one rank of ``grid`` (None: the dense single-process block holding every
    expert). ``forward(x: [..., hidden]) -> MoEOutput``; see the module docstring for the data path.

    ``router_weight: [E, hidden]``; ``experts``: this rank's ``E/ep`` experts (``ffn/etp`` columns each);
    ``shared``: the shared expert or None. A layout the config cannot take raises LayoutError naming the numbers.
    """

    def __init__(self, config: MoEConfig, *, grid=None, sequence_parallel: bool = False, generator=None,
                 std: float = 0.02, dtype=None, device=None):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise ContractError(f"config={config!r} must be a MoEConfig")
        dims = None if grid is None else grid.dims
        tp, ep, etp = (1, 1, 1) if dims is None else (dims.tp, dims.ep, dims.etp)
        problems = config.layout_problems(ep=ep, etp=etp)
        if problems:
            raise LayoutError("MoE block cannot take this layout: " + "; ".join(problems))
        self.config = config
        self.ep_group = None if grid is None else grid.group("ep")
        self.tp_group = None if grid is None else grid.group("tp")
        self.etp_group = self.tp_group if etp > 1 else None
        self.ep, self.local = ep, config.experts // ep
        ep_rank = 0 if grid is None else grid.rank("ep")
        self.first_expert = ep_rank * self.local
        # Who dispatches which tokens (module docstring, "Tokens over TP").
        self.split_tokens = etp == 1 and tp > 1 and not sequence_parallel
        self.gather_tokens = etp > 1 and sequence_parallel
        role = ParamRole.replicated(sequence_parallel=sequence_parallel and etp == 1)
        self.router_weight = declare(_param((config.experts, config.hidden), dim=0, start=0, stop=config.experts,
                                            generator=generator, std=std, dtype=dtype, device=device), role)
        self.experts = GroupedExperts(experts=config.experts, first=self.first_expert, local=self.local,
                                      hidden=config.hidden, ffn=config.ffn, ffn_parts=etp,
                                      ffn_rank=0 if grid is None or etp == 1 else grid.rank("tp"),
                                      generator=generator, std=std, dtype=dtype, device=device)
        self.shared = None
        if config.shared_ffn:
            self.shared = SharedExpert(hidden=config.hidden, ffn=config.shared_ffn, gated=config.shared_gate,
                                       generator=generator, std=std, dtype=dtype, device=device)
            for p in self.shared.parameters():
                declare(p, role)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        cfg = self.config
        if x.shape[-1] != cfg.hidden:
            raise ContractError(f"MoE input has hidden size {x.shape[-1]}, the block hidden={cfg.hidden}")
        shape = x.shape
        tokens = x.reshape(-1, cfg.hidden)
        if self.gather_tokens:
            tokens = gather_from_tp(tokens, group=self.tp_group, dim=0)
        logits = tokens @ self.router_weight.t()
        weights, indices, probs = route(logits, top_k=cfg.top_k, kind=cfg.router, renormalize=cfg.renormalize)
        balance = load_balancing_loss(probs, indices, experts=cfg.experts)
        z = router_z_loss(logits)
        aux = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z
        weights = weights.to(tokens.dtype)
        if self.split_tokens:
            mine = split_to_tp(tokens, group=self.tp_group, dim=0)
            routed, dropped = self._routed(mine, split_to_tp(weights, group=self.tp_group, dim=0),
                                           local_chunk(indices, group=self.tp_group, dim=0))
            routed = gather_from_tp(routed, group=self.tp_group, dim=0)
        else:
            routed, dropped = self._routed(tokens, weights, indices)
        out = routed if self.shared is None else routed + self.shared(tokens)
        if self.gather_tokens:
            out = split_to_tp(out, group=self.tp_group, dim=0)
        counts = torch.bincount(indices.reshape(-1), minlength=cfg.experts)
        stats = RouterStats(tuple(int(c) for c in counts.tolist()), dropped, float(balance), float(z))
        return MoEOutput(out.reshape(shape), aux, stats, logits, probs, indices)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Dispatch ``x: [N, hidden]`` to the experts of ``indices: [N, k]``, run them, combine back weighted."""
        cfg, n = self.config, x.shape[0]
        capacity = None if cfg.capacity_factor is None else capacity_of(
            n, top_k=cfg.top_k, experts=cfg.experts, factor=cfg.capacity_factor)
        order, counts, dropped = dispatch_plan(indices, experts=cfg.experts, capacity=capacity)
        slot_token = order % n
        received = exchange_counts(counts, group=self.ep_group)  # [ep, local]: row i from source rank i
        send = counts.view(self.ep, self.local).sum(dim=1).tolist()
        recv = received.sum(dim=1).tolist()
        rows = dispatch_tokens(x.index_select(0, slot_token), send=send, recv=recv, group=self.ep_group)
        # received rows are source-major (rank i's rows for my experts in expert order); regroup expert-major
        labels = torch.arange(self.local, device=x.device).repeat(self.ep)
        expert_major = torch.argsort(torch.repeat_interleave(labels, received.reshape(-1)), stable=True)
        grouped = copy_to_tp(rows.index_select(0, expert_major), group=self.etp_group)
        out = reduce_from_tp(self.experts(grouped, received.sum(dim=0).tolist()), group=self.etp_group)
        back = combine_tokens(out.index_select(0, torch.argsort(expert_major)), send=send, recv=recv,
                              group=self.ep_group)
        slot_weight = weights.t().reshape(-1).index_select(0, order)
        y = x.new_zeros(x.shape).index_add(0, slot_token, back * slot_weight.unsqueeze(-1))
        return y, dropped


__all__ = ["EXPERT_ATTRIBUTE", "GroupedExperts", "MoEBlock", "MoEConfig", "MoEOutput", "RouterKind", "RouterStats",
           "SharedExpert", "capacity_of", "combine_tokens", "dispatch_plan", "dispatch_tokens", "exchange_counts",
           "fast_grouped_mm_applies", "grouped_matmul", "is_expert_parameter", "load_balancing_loss",
           "mark_expert", "route", "router_z_loss"]
