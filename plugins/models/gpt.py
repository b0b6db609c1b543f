"""A reference pre-LayerNorm GPT (GPT-2 style: LayerNorm, GELU, learned positions, fused QKV) on the shared
decoder skeleton of :mod:`shardline.plugins.models.decoder`; the same function at every layout.

``GPT(config, grid=None)`` is an ordinary dense model; with a :class:`~shardline.plugins.grid.Grid` the sharded
version of the same function (same ``seed``: every TP shard a slice of the dense weights). The layouts, the
pipeline contract (:meth:`GPT.pipeline_layers`), tied embeddings, the global-mean loss and the gradient scaling
rules are the skeleton's, documented there once. Specific to the GPT: the learned positions ``embedding.wpe`` are
indexed by each hidden row's global position (the CP rank's BALANCED tokens, under Megatron-SP its TP chunk), and
are ``SEQUENCE_REPLICATED`` under Megatron-SP, like the LayerNorms and the row-parallel biases.

The config (re-exported here), the layout rules, the Hugging Face names and the parameter counts are the
family's, torch-free, in :mod:`shardline.job.gpt`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardline.job.gpt import GPT2, GPTConfig
from shardline.plugins.layers.roles import LayerNorm, ParamRole, declare
from shardline.plugins.layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from shardline.plugins.models.decoder import (
    IGNORE_INDEX,
    DecoderBlock,
    DecoderHead,
    DecoderLM,
    SPContext,
    TokenEmbedding,
    layout_context,
)

__all__ = ["GPTConfig", "GPT", "GPTEmbedding", "Block", "GPTHead"]
__all__ += ["IGNORE_INDEX", "SPContext"]  # re-exported from the skeleton for existing importers


def _layer_norm(config: GPTConfig, ctx: SPContext, dtype, device) -> nn.LayerNorm:
    # Replicated; under Megatron-SP each rank sees only its tokens (the role says so; the strategy sums).
    return LayerNorm(config.d_model, sequence_parallel=ctx.megatron, eps=config.layer_norm_eps, dtype=dtype,
                     device=device)


class GPTEmbedding(TokenEmbedding):
    """``ids [b, S/cp] -> [b, s_h, d]``: vocab-parallel token embedding plus learned positions.

    The positions are the global positions of this CP rank's tokens (BALANCED layout) and, under Megatron-SP,
    of this TP rank's sequence chunk (the token embedding is reduce-scattered along the sequence).
    """

    def __init__(self, config: GPTConfig, *, ctx: SPContext, generator, dtype=None, device=None):
        super().__init__(config, ctx=ctx, generator=generator, dtype=dtype, device=device)
        wpe = torch.randn((config.seq_len, config.d_model), generator=generator) * config.init_std
        self.wpe = declare(nn.Parameter(wpe.to(dtype=dtype or torch.get_default_dtype(), device=device)),
                           ParamRole.replicated(sequence_parallel=ctx.megatron))

    def add_positions(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return x + self.wpe[self.hidden_positions(ids)]


class Block(DecoderBlock):
    """One pre-LN transformer block, ``[b, s_h, d] -> [b, s_h, d]`` (the skeleton's, with GPT-2's parts).

    Attention runs on this TP rank's ``n_head/tp`` heads. QKV output features are ordered head by head
    (``[h0: q k v, h1: q k v, ..]``) so a contiguous TP slice holds whole heads.
    """

    def __init__(self, config: GPTConfig, *, ctx: SPContext, generator, dtype=None, device=None):
        super().__init__(config, ctx=ctx)
        d, g, sp = config.d_model, ctx.tp_group, ctx.megatron
        kw = dict(generator=generator, dtype=dtype, device=device)
        self.ln1 = _layer_norm(config, ctx, dtype, device)
        self.qkv = ColumnParallelLinear(d, 3 * d, group=g, sequence_parallel=sp, **kw)
        self.proj = RowParallelLinear(d, d, group=g, sequence_parallel=sp, **kw)
        self.ln2 = _layer_norm(config, ctx, dtype, device)
        self.fc1 = ColumnParallelLinear(d, config.d_ff, group=g, sequence_parallel=sp, **kw)
        self.fc2 = RowParallelLinear(config.d_ff, d, group=g, sequence_parallel=sp, **kw)

    def pre_attention(self, x):
        return self.ln1(x)

    def project_qkv(self, h):
        qkv = self.qkv(h)  # [b, s, 3d/tp], whole sequence of this CP rank
        b, s = qkv.shape[:2]
        return qkv.view(b, s, -1, 3, self.config.head_dim).permute(3, 0, 2, 1, 4).unbind(0)

    def project_out(self, a):
        return self.proj(a)

    def pre_mlp(self, x):
        return self.ln2(x)

    def feed_forward(self, h):
        return self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class GPTHead(DecoderHead):
    """``[b, s_h, d] -> logits [b, S/cp, V'/tp]``: final LayerNorm, then the (tied) vocab-parallel projection."""

    def __init__(self, config: GPTConfig, *, ctx: SPContext, tied_weight=None, generator, dtype=None,
                 device=None):
        super().__init__(config, ctx=ctx, norm=_layer_norm(config, ctx, dtype, device), tied_weight=tied_weight,
                         generator=generator, dtype=dtype, device=device)


class GPT(DecoderLM):
    """Pre-LN GPT: ``embedding -> n_layer blocks -> final LayerNorm + (tied) vocab projection``.

    Block: ``x = x + Proj(Attn(QKV(LN1(x))))``; ``x = x + FC2(GELU(FC1(LN2(x))))``, causal attention, QKV and FC1
    column-parallel, Proj and FC2 row-parallel. ``seed`` seeds a private generator that draws every weight, so
    two models built with the same seed compute the same function at any layout. ``dtype``/``device`` as usual.
    """

    family = GPT2
    config_type = GPTConfig
    model_name = GPT2.model_name

    def make_embedding(self, config: GPTConfig, *, generator, ctx, dtype, device) -> nn.Module:
        return GPTEmbedding(config, ctx=ctx, generator=generator, dtype=dtype, device=device)

    def make_block(self, config: GPTConfig, index: int, *, generator, ctx, dtype, device) -> nn.Module:
        return Block(config, ctx=ctx, generator=generator, dtype=dtype, device=device)

    def make_head(self, config: GPTConfig, *, tied_weight, generator, ctx, dtype, device) -> nn.Module:
        return GPTHead(config, ctx=ctx, tied_weight=tied_weight, generator=generator, dtype=dtype, device=device)


def _sp_context(config: GPTConfig, grid) -> SPContext:
    """The groups and mode the layers need, checked against the config (LayoutError naming every number).
    ``grid`` may be a stand-in with ``dims``, ``group`` and ``rank`` (recipes check a model before any process
    group exists this way)."""
    problems = [] if grid is None else GPT.layout_problems(config, grid.dims)
    return layout_context(grid, problems, model=GPT.model_name)
