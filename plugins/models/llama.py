"""The Llama family (Llama 2/3, Mistral-style GQA, Qwen2's q/k/v bias) on the shared decoder skeleton of
:mod:`shardline.plugins.models.decoder`; the same function at every layout.

Block (pre-norm, no biases except Qwen2's optional q/k/v bias)::

    h = RMSNorm(x);  q, k, v = h W_q^T, h W_k^T, h W_v^T          (n_head q heads, n_kv_head k/v heads)
    q, k = RoPE(q, pos), RoPE(k, pos)                               (pos: each token's global position)
    x = x + O(causal_attention(q, k, v))                            (q head i reads kv head i // (n_head/n_kv_head))
    x = x + Down(silu(Gate(RMSNorm(x))) * Up(RMSNorm(x)))

then a final RMSNorm and the (untied by default) vocabulary projection.

Layouts (the skeleton's, plus): q/k/v are column-parallel by heads in one :class:`FusedColumnParallelLinear`
(one entry collective). With ``tp <= n_kv_head`` every rank holds ``n_kv_head/tp`` whole KV heads; with
``tp > n_kv_head`` each KV head serves ``tp/n_kv_head`` consecutive ranks: it is stored sharded (each of those
ranks holds ``head_dim*n_kv_head/tp`` of its rows, a plain ``SHARDED(0)`` slice of the dense weight), all-gathered
for use in forward and reduce-scattered in backward, which sums the gradient contributions of every rank sharing
the head (see :mod:`shardline.plugins.layers.tp_fused`). Gate/up are column-parallel (one fused layer), O and Down
row-parallel. Rotary angles are taken at each token's global position (:func:`~.decoder.token_positions`): the
CP rank's BALANCED tokens, so ring and Ulysses attention see the dense model's rotated q and k. Under Megatron-SP
the rotation happens after the sequence all-gather, on the CP rank's whole local sequence.

Initialisation is layout-independent (every weight drawn full from the seeded generator, then sliced): linear
weights by the ``nn.Linear`` rule ``U(-1/sqrt(in), 1/sqrt(in))``, q/k/v biases likewise, embeddings
``N(0, init_std^2)``, norms one.

The config (re-exported here), the layout rules, the Hugging Face names and the parameter counts are the
family's, torch-free, in :mod:`shardline.job.llama`.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from shardline.job.llama import LlamaConfig, LlamaFamily, RopeScaling
from shardline.plugins.layers.norms import RMSNorm
from shardline.plugins.layers.rotary import Rotary, apply_rotary
from shardline.plugins.layers.tensor_parallel import RowParallelLinear
from shardline.plugins.layers.tp_fused import FusedColumnParallelLinear
from shardline.plugins.models.decoder import (
    DecoderBlock,
    DecoderHead,
    DecoderLM,
    SPContext,
    TokenEmbedding,
    token_positions,
)

__all__ = ["LlamaConfig", "Llama", "LlamaBlock", "RopeScaling"]


class LlamaBlock(DecoderBlock):
    """One Llama block on the skeleton (see the module docstring). Parameters: ``attn_norm.weight``,
    ``qkv.{q,k,v}_weight`` (and ``_bias`` with ``qkv_bias``), ``o_proj.weight``, ``mlp_norm.weight``,
    ``gate_up.{gate,up}_weight``, ``down.weight``."""

    def __init__(self, config: LlamaConfig, *, ctx: SPContext, rotary: Rotary, generator, dtype=None, device=None):
        super().__init__(config, ctx=ctx)
        d, g, sp, hd = config.d_model, ctx.tp_group, ctx.megatron, config.head_dim
        kw = dict(generator=generator, dtype=dtype, device=device)
        norm = dict(eps=config.rms_norm_eps, sequence_parallel=sp, dtype=dtype, device=device)
        self.rotary = rotary
        self.attn_norm = RMSNorm(d, **norm)
        self.qkv = FusedColumnParallelLinear(
            d, {"q": (config.n_head, hd), "k": (config.n_kv_head, hd), "v": (config.n_kv_head, hd)}, group=g,
            bias=config.qkv_bias, sequence_parallel=sp, **kw)
        self.o_proj = RowParallelLinear(config.n_head * hd, d, group=g, bias=False, sequence_parallel=sp, **kw)
        self.mlp_norm = RMSNorm(d, **norm)
        self.gate_up = FusedColumnParallelLinear(d, {"gate": config.d_ff, "up": config.d_ff}, group=g,
                                                 sequence_parallel=sp, **kw)
        self.down = RowParallelLinear(config.d_ff, d, group=g, bias=False, sequence_parallel=sp, **kw)

    def pre_attention(self, x):
        return self.attn_norm(x)

    def project_qkv(self, h):
        hd = self.config.head_dim
        q, k, v = (t.view(*t.shape[:2], -1, hd).transpose(1, 2) for t in self.qkv(h))  # [b, heads, s_cp, hd]
        s = q.shape[2]  # the CP rank's whole local sequence (after the Megatron-SP all-gather)
        pos = token_positions(self.ctx, s, max_len=self.config.seq_len, device=q.device)
        cos, sin = self.rotary.tables(pos, dtype=q.dtype, device=q.device, key=s)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def project_out(self, a):
        return self.o_proj(a)

    def pre_mlp(self, x):
        return self.mlp_norm(x)

    def feed_forward(self, h):
        gate, up = self.gate_up(h)
        return self.down(F.silu(gate) * up)


class Llama(DecoderLM):
    """A Llama-family decoder: ``embedding -> n_layer LlamaBlocks -> final RMSNorm + vocab projection``.

    ``seed`` seeds a private generator that draws every weight, so two models built with the same seed compute
    the same function at any layout. ``model(ids, targets)`` returns the global mean loss; ``model(ids)`` this
    rank's vocab-sharded logits. :meth:`check_layout` refuses a layout from its ``ParallelDims`` alone.
    """

    family = LlamaFamily
    config_type = LlamaConfig
    model_name = LlamaFamily.model_name

    def prepare(self, config: LlamaConfig, *, ctx: SPContext) -> None:
        self._rotary = Rotary(config.head_dim, theta=config.rope_theta, scaling=config.rope_scaling)

    def make_embedding(self, config: LlamaConfig, *, generator, ctx, dtype, device) -> nn.Module:
        return TokenEmbedding(config, ctx=ctx, generator=generator, dtype=dtype, device=device)

    def make_block(self, config: LlamaConfig, index: int, *, generator, ctx, dtype, device) -> nn.Module:
        return LlamaBlock(config, ctx=ctx, rotary=self._rotary, generator=generator, dtype=dtype, device=device)

    def make_head(self, config: LlamaConfig, *, tied_weight, generator, ctx, dtype, device) -> nn.Module:
        norm = RMSNorm(config.d_model, eps=config.rms_norm_eps, sequence_parallel=ctx.megatron, dtype=dtype,
                       device=device)
        return DecoderHead(config, ctx=ctx, norm=norm, tied_weight=tied_weight, generator=generator, dtype=dtype,
                           device=device)
