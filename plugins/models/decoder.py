"""The decoder skeleton every shardline language model shares (GPT-2 in :mod:`.gpt`, the Llama family in
:mod:`.llama`): the layout context, the pre-norm block, the head, the loss and the pipeline contract. A family
supplies its parts (norm, embedding, how q/k/v are projected and positioned, the MLP) and names its parameters;
everything about layouts lives here once.

``DecoderLM(config, grid=None)`` is an ordinary dense model. With a :class:`~shardline.plugins.grid.Grid` it is
the sharded version of the same function: with the same ``seed`` every TP shard is exactly a slice of the dense
weights (see :mod:`shardline.plugins.layers.tensor_parallel`), so loss and gradients equal the dense model's up to
summation order. Dropout masks are the one exception: they come from the global RNG on each rank and are not
layout-independent. Every TP rank draws them at the same points with the same shapes, so ranks of one TP group
that share a seed (``seed_everything`` on every rank) apply identical masks to the activations they replicate.

Layouts (``grid.dims``): ``tp`` shards heads, FFN and vocabulary; ``sp="megatron"`` additionally shards the
sequence over the TP group between the TP regions; ``cp > 1`` with ``sp="ring"`` or ``"ulysses"`` shards the
sequence over the CP group (inputs in the BALANCED layout: :meth:`DecoderLM.shard_batch`). Position information
(learned positions, rotary angles) always uses the *global* position of each token
(:func:`token_positions`), so it follows every sequence layout.

The pipeline contract (:meth:`DecoderLM.pipeline_layers`): ``[embedding, block_0 .. block_{L-1}, head]``, each
taking and returning one plain tensor:

- embedding ``ids [b, s_cp] -> hidden [b, s_h, d]``: token ids of this CP rank (already sharded); ``s_cp =
  S/cp``, and ``s_h = s_cp/tp`` under Megatron-SP, else ``s_cp``.
- block ``hidden [b, s_h, d] -> hidden [b, s_h, d]``.
- head ``hidden [b, s_h, d] -> logits [b, s_cp, V'/tp]`` (final norm, then the vocab-parallel projection; ``V'``
  is the vocabulary padded to a multiple of tp; padded columns are meaningless and excluded by
  :meth:`DecoderLM.loss`).

Tied embeddings (:meth:`DecoderLM.tied_parameters`): ``embedding.wte.weight`` and ``head.weight`` are one
Parameter in one process. A pipeline that puts them on different stages holds two copies, initialised identically
by the seed; their gradients must be summed over the grid's ``embed`` group before the step.

Loss and gradient scaling (:meth:`DecoderLM.loss`): the returned loss is the *global* mean over every non-ignored
token of the whole sequence (all CP ranks), the same value on every rank. Its gradient on each CP rank is the
gradient of the global mean with respect to that rank's own tokens only, so the dense gradient of every parameter
is the *sum* over the CP group of the ranks' gradients (:meth:`DecoderLM.allreduce_context_parallel_grads`).
DeepSpeed ZeRO given ``mpu=grid.mpu`` does exactly that without help: it all-reduces over ``dp_cp`` and divides by
``dp_cp_size / sequence_parallel_size = dp`` (the mpu reports cp as its sequence-parallel size), i.e. sums over CP
and averages over DP. An engine that instead *averages* over all ``dp * cp`` ranks must be given ``loss * cp``
(Megatron's rule). Under Megatron-SP, replicated parameters are declared ``SEQUENCE_REPLICATED``
(:mod:`shardline.plugins.layers.roles`): their gradients need a sum over TP, which no data-parallel engine does,
before the data-parallel reduction. The strategy installs it from the roles; outside the strategy call
:meth:`DecoderLM.allreduce_sequence_parallel_grads` after backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardline.job.family import Family
from shardline.job.family import decoder_layout_problems as layout_problems
from shardline.plugins.errors import ContractError, LayoutError
from shardline.plugins.grid import ParallelDims, SPMode
from shardline.plugins.layers.roles import tie
from shardline.plugins.layers.sequence_parallel import (
    SequenceLayout,
    local_positions,
    ring_attention,
    shard_sequence,
    ulysses_attention,
)
from shardline.plugins.layers.split_backward import linear
from shardline.plugins.layers.tensor_parallel import (
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
    vocab_parallel_weight,
)
from shardline.plugins.layers.tp_comm import all_reduce, copy_to_tp, gather_from_sequence

__all__ = ["SPContext", "layout_problems", "layout_context", "token_positions", "TokenEmbedding",
           "DecoderBlock", "DecoderHead", "DecoderLM", "IGNORE_INDEX"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class SPContext:
    """What every layer of one model needs to know about the layout (groups None when the degree is 1)."""

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


DENSE = SPContext(tp_group=None, cp_group=None, tp=1, cp=1, tp_rank=0, cp_rank=0, mode=SPMode.NONE)


def layout_context(grid, problems: list[str], *, model: str) -> SPContext:
    """Raise LayoutError listing ``problems`` (each naming its numbers), else the grid's SPContext."""
    if grid is None:
        return DENSE
    dims = grid.dims
    if problems:
        raise LayoutError(f"{model} does not fit layout {dims._summary()}: " + "; ".join(problems))
    tp, cp = dims.tp, dims.cp
    return SPContext(tp_group=grid.group("tp") if tp > 1 else None, cp_group=grid.group("cp") if cp > 1 else None,
                     tp=tp, cp=cp, tp_rank=grid.rank("tp"), cp_rank=grid.rank("cp"), mode=dims.sp)


def token_positions(ctx: SPContext, local_len: int, *, max_len: int, device=None) -> torch.Tensor:
    """Global positions (int64 ``[local_len]``) of this CP rank's ``local_len`` tokens (BALANCED layout).

    LayoutError when the global length ``local_len * cp`` exceeds ``max_len``."""
    seq_len = local_len * ctx.cp
    if seq_len > max_len:
        raise LayoutError(f"sequence length {seq_len} (local {local_len} x cp={ctx.cp}) exceeds "
                          f"config.seq_len={max_len}")
    return local_positions(seq_len, n=ctx.cp, rank=ctx.cp_rank, layout=SequenceLayout.BALANCED, device=device)


class TokenEmbedding(nn.Module):
    """``ids [b, S/cp] -> [b, s_h, d]``: the vocab-parallel token embedding (reduce-scattered along the sequence
    under Megatron-SP), plus :meth:`add_positions` (a family's learned positions; none by default)."""

    def __init__(self, config, *, ctx: SPContext, generator, dtype=None, device=None):
        super().__init__()
        self.config, self.ctx = config, ctx
        self.wte = VocabParallelEmbedding(config.vocab_size, config.d_model, group=ctx.tp_group,
                                          sequence_parallel=ctx.megatron, init_std=config.init_std,
                                          generator=generator, dtype=dtype, device=device)
        self.drop = nn.Dropout(config.dropout)

    def hidden_positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Global positions of the hidden rows this rank holds: its CP tokens, under Megatron-SP its TP chunk."""
        ctx = self.ctx
        pos = token_positions(ctx, ids.shape[1], max_len=self.config.seq_len, device=ids.device)
        if ctx.megatron:
            if pos.numel() % ctx.tp:
                raise LayoutError(f"megatron-SP: local sequence length {pos.numel()} is not divisible by "
                                  f"tp={ctx.tp}")
            pos = pos.chunk(ctx.tp)[ctx.tp_rank]
        return pos

    def add_positions(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.hidden_positions(ids)  # the length checks, even without learned positions
        return x

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.add_positions(self.wte(ids), ids))


class DecoderBlock(nn.Module):
    """The pre-norm residual block, ``[b, s_h, d] -> [b, s_h, d]``::

        q, k, v = project_qkv(pre_attention(x))      # [b, heads/tp, s_cp, head_dim]; k, v may have fewer heads
        x = x + drop(project_out(attention(q, k, v)))
        x = x + drop(feed_forward(pre_mlp(x)))

    A family builds and names the parts in its ``__init__`` and implements the five methods. ``attention`` runs
    this TP rank's heads: causal SDPA at cp=1, else ring or Ulysses attention over the CP group. Grouped-query
    K/V (fewer heads than q) are repeated to q's heads first, each KV head serving the consecutive q heads of its
    group (simple, and every attention takes it; the price under CP is that ring and Ulysses move the repeated
    K/V, ``n_head/n_kv_head`` times the bytes a grouped-aware kernel would). ``activation_checkpointing`` (the
    config's) recomputes the block in backward.
    """

    def __init__(self, config, *, ctx: SPContext):
        super().__init__()
        self.config, self.ctx = config, ctx
        self.drop = nn.Dropout(config.dropout)

    def pre_attention(self, x): raise NotImplementedError
    def project_qkv(self, h): raise NotImplementedError
    def project_out(self, a): raise NotImplementedError
    def pre_mlp(self, x): raise NotImplementedError
    def feed_forward(self, h): raise NotImplementedError

    def attention(self, q, k, v) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
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
        q, k, v = self.project_qkv(self.pre_attention(x))
        b, _, s, _ = q.shape
        a = self.attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.drop(self.project_out(a))
        return x + self.drop(self.feed_forward(self.pre_mlp(x)))


class DecoderHead(nn.Module):
    """``[b, s_h, d] -> logits [b, S/cp, V'/tp]``: the final norm ``ln_f``, then ``h E^T`` with ``E``
    vocab-sharded.

    Entry: ``gather_from_sequence`` under Megatron-SP (all-gather / reduce-scatter), else ``copy_to_tp``
    (identity / all-reduce). ``tied_weight`` (the embedding's) is used as is; otherwise a weight is drawn like
    the embedding's.
    """

    def __init__(self, config, *, ctx: SPContext, norm: nn.Module, tied_weight=None, generator, dtype=None,
                 device=None):
        super().__init__()
        self.ctx = ctx
        self.ln_f = norm
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
        return linear(h, self.weight)  # split_backward: its weight gradient in W under a split schedule


#: The tie key of a weight shared by the input embedding and the output head (``roles.tie``).
TIED_EMBEDDING = "embedding.wte.weight"


def layer_seed(seed: int, index: int) -> int:
    """The seed of pipeline layer ``index``'s generator: every layer draws from its own, so a rank draws only
    the layers it hosts and the weights are the same at every layout."""
    return (seed << 20) + index


def hosted_layers(n_layers: int, grid, *, chunks: int = 1, placement: str = "loop") -> frozenset[int]:
    """The pipeline layers (indices into ``[embedding, *blocks, head]``) this rank hosts: the pipeline's uniform
    cut into ``pp * chunks`` stages, stage ``s`` on the pipeline rank the schedule's ``placement`` gives (``s %
    pp`` for ``"loop"``; ``"v"`` zig-zags, :mod:`shardline.job.placement`): what the strategy's pipeline driver
    cuts. All of them without a grid or at pp = 1."""
    if grid is None or grid.dims.pp == 1:
        return frozenset(range(n_layers))
    from shardline.job import placement as placements
    from shardline.plugins.pipeline.partition import partition_layers

    pp = grid.dims.pp
    bounds = partition_layers(n_layers, pp * chunks, method="uniform").bounds
    stages = placements.stages_of_rank(grid.rank("pp"), n_stages=pp * chunks, pp=pp, style=placement)
    return frozenset(i for s in stages for i in range(*bounds[s]))


class LayerPlaceholder(nn.Module):
    """Stands where a pipeline layer hosted by another rank would be; it holds nothing and refuses to run."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise ContractError(f"pipeline layer {self.index} lives on another pipeline rank")


class DecoderLM(nn.Module):
    """``embedding -> n_layer blocks -> head``, the layout machinery of every family (see the module docstring).

    A family sets ``config_type`` and ``model_name`` and implements :meth:`layout_problems` (classmethod; every
    reason a layout cannot take the config, each naming its numbers) and the three ``make_*`` methods (one
    layer from its generator); :meth:`prepare` makes what its layers share.

    Per-rank construction: with a grid of pp > 1 (and the pipeline's ``chunks`` and stage ``placement``,
    ``"loop"`` or ``"v"``) only this rank's stages are built (:attr:`hosted`); the others are placeholders
    (:class:`LayerPlaceholder`), so nothing of them is drawn or allocated. Every layer draws from a generator of
    its own (:func:`layer_seed`), which is what keeps the weights layout-independent when a rank skips layers.
    """

    #: The family's torch-free room (:mod:`shardline.job.families`): its config type, name and layout rules.
    family: type[Family]
    config_type: type = object
    model_name = "decoder"

    def __init__(self, config, *, grid=None, seed: int = 0, dtype=None, device=None, chunks: int = 1,
                 placement: str = "loop"):
        super().__init__()
        if not isinstance(config, self.config_type):
            raise ContractError(f"{type(self).__name__} needs a {self.config_type.__name__}, got "
                                f"{type(config).__name__}")
        self.config, self.grid = config, grid
        problems = [] if grid is None else self.layout_problems(config, grid.dims)
        self.ctx = layout_context(grid, problems, model=self.model_name)
        #: Indices into :meth:`pipeline_layers` this rank builds (all of them unless the grid has pp > 1).
        self.hosted = hosted_layers(config.n_layer + 2, grid, chunks=chunks, placement=placement)
        # On the meta device nothing is drawn either: every factory call makes a meta tensor (counting a rank's
        # bytes, or the frame from_pretrained fills, costs no memory and no random numbers).
        on_meta = device is not None and torch.device(device).type == "meta"
        self.prepare(config, ctx=self.ctx)  # shared tables stay real (on the CPU)
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            self.build(config, ctx=self.ctx, seed=seed, dtype=dtype, device=device)

    def build(self, config, *, ctx: SPContext, seed: int, dtype, device) -> None:
        """``embedding``, ``blocks`` and ``head``: each hosted layer from its own generator (:func:`layer_seed`),
        a :class:`LayerPlaceholder` for every other one. A tied head on a rank without the embedding draws its
        own copy of the embedding's weight (the same generator, the same first draw) and both declare the tie
        (``roles.tie``), so the pipeline keeps the two copies one weight."""
        kw = dict(ctx=ctx, dtype=dtype, device=device)
        n = config.n_layer + 2

        def layer(index, make):
            if index not in self.hosted:
                return LayerPlaceholder(index)
            return make(torch.Generator().manual_seed(layer_seed(seed, index)))

        self.embedding = layer(0, lambda g: self.make_embedding(config, generator=g, **kw))
        self.blocks = nn.ModuleList([layer(i + 1, lambda g, i=i: self.make_block(config, i, generator=g, **kw))
                                     for i in range(config.n_layer)])
        if n - 1 not in self.hosted:
            self.head = LayerPlaceholder(n - 1)
            if config.tie_embeddings and 0 in self.hosted:
                tie(self.embedding.wte.weight, TIED_EMBEDDING)
            return
        if config.tie_embeddings and 0 in self.hosted:
            self.head = self.make_head(config, tied_weight=self.embedding.wte.weight, generator=None, **kw)
            return
        index = 0 if config.tie_embeddings else n - 1  # a tied copy is drawn as the embedding's weight was
        self.head = self.make_head(config, tied_weight=None, generator=torch.Generator().manual_seed(
            layer_seed(seed, index)), **kw)
        if config.tie_embeddings:
            tie(self.head.weight, TIED_EMBEDDING)

    def prepare(self, config, *, ctx: SPContext) -> None:
        """Objects the layers share (no parameters), made before any layer; nothing by default."""

    def make_embedding(self, config, *, generator, ctx, dtype, device) -> nn.Module:
        raise NotImplementedError

    def make_block(self, config, index: int, *, generator, ctx, dtype, device) -> nn.Module:
        raise NotImplementedError

    def make_head(self, config, *, tied_weight, generator, ctx, dtype, device) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def layout_problems(cls, config, dims: ParallelDims) -> list[str]:
        """Every reason ``dims`` cannot take ``config``: the family's rules (:mod:`shardline.job.family`)."""
        return cls.family.layout_problems(config, dims)

    @classmethod
    def check_layout(cls, config, dims: ParallelDims) -> None:
        """LayoutError naming every number when ``dims`` cannot take ``config``; needs no process group."""
        problems = cls.layout_problems(config, dims)
        if problems:
            raise LayoutError(f"{cls.model_name} does not fit layout {dims._summary()}: " + "; ".join(problems))

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
