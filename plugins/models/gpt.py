"""A reference pre-LayerNorm GPT built only from shardline's TP/SP layers; the same function at every layout.

``GPT(config, grid=None)`` is an ordinary dense model. With a :class:`~shardline.plugins.grid.Grid` it is the
sharded version of the same function: with the same ``seed`` every TP shard is exactly a slice of the dense
weights (see :mod:`shardline.plugins.layers.tensor_parallel`), so loss and gradients equal the dense model's up to
summation order. Dropout masks are the one exception: they come from the global RNG on each rank and are not
layout-independent. Every TP rank draws them at the same points with the same shapes, so ranks of one TP group
that share a seed (``seed_everything`` on every rank) apply identical masks to the activations they replicate.

Layouts (``grid.dims``): ``tp`` shards heads, FFN and vocabulary; ``sp="megatron"`` additionally shards the
sequence over the TP group between the TP regions; ``cp > 1`` with ``sp="ring"`` or ``"ulysses"`` shards the
sequence over the CP group (inputs in the BALANCED layout: :meth:`GPT.shard_batch`).

The pipeline contract (:meth:`GPT.pipeline_layers`): ``[embedding, block_0 .. block_{L-1}, head]``, each taking
and returning one plain tensor:

- embedding ``ids [b, s_cp] -> hidden [b, s_h, d]``: token ids of this CP rank (already sharded), positions
  computed globally; ``s_cp = S/cp``, and ``s_h = s_cp/tp`` under Megatron-SP, else ``s_cp``.
- block ``hidden [b, s_h, d] -> hidden [b, s_h, d]``.
- head ``hidden [b, s_h, d] -> logits [b, s_cp, V'/tp]`` (final LayerNorm, then the vocab-parallel projection;
  ``V'`` is the vocabulary padded to a multiple of tp; padded columns are meaningless and excluded by
  :meth:`GPT.loss`).

Tied embeddings (:meth:`GPT.tied_parameters`): ``embedding.wte.weight`` and ``head.weight`` are one Parameter in
one process. A pipeline that puts them on different stages holds two copies, initialised identically by the
seed; their gradients must be summed over the grid's ``embed`` group before the step.

Loss and gradient scaling (:meth:`GPT.loss`): the returned loss is the *global* mean over every non-ignored token
of the whole sequence (all CP ranks), the same value on every rank. Its gradient on each CP rank is the gradient
of the global mean with respect to that rank's own tokens only, so the dense gradient of every parameter is the
*sum* over the CP group of the ranks' gradients (:meth:`GPT.allreduce_context_parallel_grads`). DeepSpeed ZeRO
given ``mpu=grid.mpu`` does exactly that without help: it all-reduces over ``dp_cp`` and divides by
``dp_cp_size / sequence_parallel_size = dp`` (the mpu reports cp as its sequence-parallel size), i.e. sums over CP
and averages over DP. An engine that instead *averages* over all ``dp * cp`` ranks must be given ``loss * cp``
(Megatron's rule). Under Megatron-SP, replicated parameters are declared ``SEQUENCE_REPLICATED``
(:mod:`shardline.plugins.layers.roles`): their gradients need a sum over TP, which no data-parallel engine does,
before the data-parallel reduction. The strategy installs it from the roles; outside the strategy call
:meth:`GPT.allreduce_sequence_parallel_grads` after backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardline.plugins.errors import ContractError, LayoutError
from shardline.plugins.grid import SPMode
from shardline.plugins.layers.roles import LayerNorm, ParamRole, declare
from shardline.plugins.layers.sequence_parallel import (
    SequenceLayout,
    local_positions,
    ring_attention,
    shard_sequence,
    ulysses_attention,
)
from shardline.plugins.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
    vocab_parallel_weight,
)
from shardline.plugins.layers.tp_comm import all_reduce, copy_to_tp, gather_from_sequence

__all__ = ["GPTConfig", "GPT", "GPTEmbedding", "Block", "GPTHead"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class GPTConfig:
    """Shape and options of a GPT; validated at construction (ContractError naming every bad field).

    ``d_ff`` defaults to ``4 * d_model``. ``activation_checkpointing`` makes every block recompute its
    activations in backward (``torch.utils.checkpoint``, non-reentrant; inside the block, so pipeline stages
    built from :meth:`GPT.pipeline_layers` get it too). ``init_std`` is the std of the token and position
    embeddings (linear layers use the ``nn.Linear`` rule ``U(-1/sqrt(in), 1/sqrt(in))``).
    """

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int | None = None
    dropout: float = 0.0
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5
    activation_checkpointing: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model if isinstance(self.d_model, int) else None)
        problems = []
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1")
        if not problems and self.d_model % self.n_head:
            problems.append(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout!r} must be a number in [0, 1)")
        if not isinstance(self.init_std, (int, float)) or self.init_std <= 0:
            problems.append(f"init_std={self.init_std!r} must be a positive number")
        if not isinstance(self.layer_norm_eps, (int, float)) or self.layer_norm_eps <= 0:
            problems.append(f"layer_norm_eps={self.layer_norm_eps!r} must be a positive number")
        if problems:
            raise ContractError("invalid GPTConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


@dataclass(frozen=True)
class SPContext:
    """What every layer of one GPT needs to know about the layout (groups None when the degree is 1)."""

    tp_group: object
    cp_group: object
    tp: int
    cp: int
    tp_rank: int
    cp_rank: int
    mode: SPMode

    @property
    def megatron(self) -> bool:
        return self.mode is SPMode.MEGATRON


def _layer_norm(config: GPTConfig, ctx: SPContext, dtype, device) -> nn.LayerNorm:
    # Replicated; under Megatron-SP each rank sees only its tokens (the role says so; the strategy sums).
    return LayerNorm(config.d_model, sequence_parallel=ctx.megatron, eps=config.layer_norm_eps, dtype=dtype,
                     device=device)


class GPTEmbedding(nn.Module):
    """``ids [b, S/cp] -> [b, s_h, d]``: vocab-parallel token embedding plus learned positions.

    The positions are the global positions of this CP rank's tokens (BALANCED layout) and, under Megatron-SP,
    of this TP rank's sequence chunk (the token embedding is reduce-scattered along the sequence).
    """

    def __init__(self, config: GPTConfig, *, ctx: SPContext, generator, dtype=None, device=None):
        super().__init__()
        self.config, self.ctx = config, ctx
        self.wte = VocabParallelEmbedding(config.vocab_size, config.d_model, group=ctx.tp_group,
                                          sequence_parallel=ctx.megatron, init_std=config.init_std,
                                          generator=generator, dtype=dtype, device=device)
        wpe = torch.randn((config.seq_len, config.d_model), generator=generator) * config.init_std
        self.wpe = declare(nn.Parameter(wpe.to(dtype=dtype or torch.get_default_dtype(), device=device)),
                           ParamRole.replicated(sequence_parallel=ctx.megatron))
        self.drop = nn.Dropout(config.dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        seq_len = ids.shape[1] * ctx.cp
        if seq_len > self.config.seq_len:
            raise LayoutError(f"sequence length {seq_len} (local {ids.shape[1]} x cp={ctx.cp}) exceeds "
                              f"config.seq_len={self.config.seq_len}")
        pos = local_positions(seq_len, n=ctx.cp, rank=ctx.cp_rank, layout=SequenceLayout.BALANCED,
                              device=ids.device)
        if ctx.megatron:
            if pos.numel() % ctx.tp:
                raise LayoutError(f"megatron-SP: local sequence length {pos.numel()} is not divisible by "
                                  f"tp={ctx.tp}")
            pos = pos.chunk(ctx.tp)[ctx.tp_rank]
        return self.drop(self.wte(ids) + self.wpe[pos])


class Block(nn.Module):
    """One pre-LN transformer block, ``[b, s_h, d] -> [b, s_h, d]`` (see :class:`GPT`).

    Attention runs on this TP rank's ``n_head/tp`` heads: locally (causal SDPA) at cp=1, else ring or Ulysses
    attention over the CP group. QKV output features are ordered head by head (``[h0: q k v, h1: q k v, ..]``)
    so a contiguous TP slice holds whole heads.
    """

    def __init__(self, config: GPTConfig, *, ctx: SPContext, generator, dtype=None, device=None):
        super().__init__()
        self.config, self.ctx = config, ctx
        d, g, sp = config.d_model, ctx.tp_group, ctx.megatron
        kw = dict(generator=generator, dtype=dtype, device=device)
        self.ln1 = _layer_norm(config, ctx, dtype, device)
        self.qkv = ColumnParallelLinear(d, 3 * d, group=g, sequence_parallel=sp, **kw)
        self.proj = RowParallelLinear(d, d, group=g, sequence_parallel=sp, **kw)
        self.ln2 = _layer_norm(config, ctx, dtype, device)
        self.fc1 = ColumnParallelLinear(d, config.d_ff, group=g, sequence_parallel=sp, **kw)
        self.fc2 = RowParallelLinear(config.d_ff, d, group=g, sequence_parallel=sp, **kw)
        self.drop = nn.Dropout(config.dropout)

    def attention(self, q, k, v) -> torch.Tensor:
        ctx = self.ctx
        if ctx.cp == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        fn = ring_attention if ctx.mode is SPMode.RING else ulysses_attention
        return fn(q, k, v, group=ctx.cp_group, causal=True, layout=SequenceLayout.BALANCED)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.activation_checkpointing and torch.is_grad_enabled():
            # Non-reentrant: works with inputs that need no grad and replays the collectives in backward in
            # the same order on every rank (the recompute is the same program).
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        qkv = self.qkv(self.ln1(x))  # [b, s, 3d/tp], whole sequence of this CP rank
        s = qkv.shape[1]
        q, k, v = qkv.view(b, s, -1, 3, self.config.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        a = self.attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.drop(self.proj(a))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh")))


class GPTHead(nn.Module):
    """``[b, s_h, d] -> logits [b, S/cp, V'/tp]``: final LayerNorm, then ``h E^T`` with ``E`` vocab-sharded.

    Entry: ``gather_from_sequence`` under Megatron-SP (all-gather / reduce-scatter), else ``copy_to_tp``
    (identity / all-reduce). ``tied_weight`` (the embedding's) is used as is; otherwise a weight is drawn like
    the embedding's.
    """

    def __init__(self, config: GPTConfig, *, ctx: SPContext, tied_weight=None, generator, dtype=None,
                 device=None):
        super().__init__()
        self.ctx = ctx
        self.ln_f = _layer_norm(config, ctx, dtype, device)
        if tied_weight is None:
            tied_weight = vocab_parallel_weight(config.vocab_size, config.d_model, group=ctx.tp_group,
                                                init_std=config.init_std, generator=generator, dtype=dtype,
                                                device=device)
        self.weight = tied_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_f(x)
        if self.ctx.megatron:
            h = gather_from_sequence(h, group=self.ctx.tp_group, dim=1)
        else:
            h = copy_to_tp(h, group=self.ctx.tp_group)
        return F.linear(h, self.weight)


def _sp_context(config: GPTConfig, grid) -> SPContext:
    """The groups and mode the layers need, checked against the config (LayoutError naming both numbers)."""
    if grid is None:
        return SPContext(tp_group=None, cp_group=None, tp=1, cp=1, tp_rank=0, cp_rank=0, mode=SPMode.NONE)
    dims = grid.dims
    tp, cp = dims.tp, dims.cp
    problems = []
    for what, value in (("n_head", config.n_head), ("d_ff", config.d_ff)):
        if value % tp:
            problems.append(f"{what}={value} is not divisible by tp={tp}")
    if cp > 1 and dims.sp not in (SPMode.RING, SPMode.ULYSSES):
        problems.append(f"cp={cp} needs sp='ring' or 'ulysses' (sp={dims.sp.value!r})")
    if dims.sp is SPMode.ULYSSES and (config.n_head // tp) % cp:
        problems.append(f"ulysses: heads per TP rank n_head/tp={config.n_head // tp} is not divisible by cp={cp}")
    if cp > 1 and config.seq_len % (2 * cp):
        problems.append(f"seq_len={config.seq_len} is not divisible by 2*cp={2 * cp}")
    if dims.sp is SPMode.MEGATRON and (config.seq_len // cp) % tp:
        problems.append(f"megatron-SP: seq_len/cp={config.seq_len // cp} is not divisible by tp={tp}")
    if problems:
        raise LayoutError(f"GPT does not fit layout {dims._summary()}: " + "; ".join(problems))
    return SPContext(tp_group=grid.group("tp") if tp > 1 else None, cp_group=grid.group("cp") if cp > 1 else None,
                     tp=tp, cp=cp, tp_rank=grid.rank("tp"), cp_rank=grid.rank("cp"), mode=dims.sp)


class GPT(nn.Module):
    """Pre-LN GPT: ``embedding -> n_layer blocks -> final LayerNorm + (tied) vocab projection``.

    Block: ``x = x + Proj(Attn(QKV(LN1(x))))``; ``x = x + FC2(GELU(FC1(LN2(x))))``, causal attention, QKV and FC1
    column-parallel, Proj and FC2 row-parallel. ``seed`` seeds a private generator that draws every weight, so
    two models built with the same seed compute the same function at any layout. ``dtype``/``device`` as usual.
    """

    def __init__(self, config: GPTConfig, *, grid=None, seed: int = 0, dtype=None, device=None):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ContractError(f"GPT needs a GPTConfig, got {type(config).__name__}")
        self.config, self.grid = config, grid
        self.ctx = _sp_context(config, grid)
        gen = torch.Generator().manual_seed(seed)
        kw = dict(ctx=self.ctx, generator=gen, dtype=dtype, device=device)
        self.embedding = GPTEmbedding(config, **kw)
        self.blocks = nn.ModuleList([Block(config, **kw) for _ in range(config.n_layer)])
        self.head = GPTHead(config, tied_weight=self.embedding.wte.weight if config.tie_embeddings else None, **kw)

    def pipeline_layers(self) -> list[nn.Module]:
        """``[embedding, *blocks, head]``: the cut points of a pipeline (see the module docstring)."""
        return [self.embedding, *self.blocks, self.head]

    def tied_parameters(self) -> list[tuple[str, str]]:
        """Pairs of parameter names that must hold the same values: ``[("embedding.wte.weight", "head.weight")]``."""
        return [("embedding.wte.weight", "head.weight")] if self.config.tie_embeddings else []

    def shard_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Full-sequence ``[b, S]`` ids/targets -> this CP rank's tokens (BALANCED layout); identity at cp=1."""
        return tuple(shard_sequence(t, group=self.ctx.cp_group, dim=1, layout=SequenceLayout.BALANCED)
                     for t in tensors)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``ids [b, S/cp]`` -> logits ``[b, S/cp, V'/tp]``, or the loss (:meth:`loss`) when ``targets`` given."""
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits if targets is None else self.loss(logits, targets)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Global mean cross-entropy over all non-ignored (``-100``) tokens of every CP rank (float32 for bf16).

        Vocab-parallel over TP (logits never gathered). Under CP: value = the global mean on every rank;
        gradient = d(global mean)/d(this rank's logits) (see the module docstring for the scaling rules).
        """
        total = vocab_parallel_cross_entropy(logits, targets, group=self.ctx.tp_group, ignore_index=IGNORE_INDEX,
                                             vocab_size=self.config.vocab_size, reduction="sum")
        count = (targets != IGNORE_INDEX).sum().to(total.dtype)
        if self.ctx.cp == 1:
            return total / count
        stats = all_reduce(torch.stack([total.detach(), count]), group=self.ctx.cp_group, dim_name="cp")
        local = total / stats[1]
        return local + (stats[0] / stats[1] - local.detach())

    def allreduce_sequence_parallel_grads(self) -> int:
        """Megatron-SP: sum the grads of replicated, sequence-fed parameters over TP (no-op otherwise)."""
        if self.ctx.mode is not SPMode.MEGATRON:
            return 0
        return allreduce_sequence_parallel_grads(self, group=self.ctx.tp_group)

    def allreduce_context_parallel_grads(self) -> None:
        """Sum every gradient over the CP group (one flat all-reduce): the dense gradient of the global loss."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if self.ctx.cp == 1 or not grads:
            return
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), group=self.ctx.cp_group, dim_name="cp")
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
