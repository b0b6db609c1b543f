"""The architecture numbers the planner needs, for packaged model names and for a user's model.

A :class:`ModelSpec` is torch-free: it counts parameters in closed form and names the shardline model class
(``gpt2`` -> :class:`~shardline.plugins.models.gpt.GPT`, ``llama`` -> :class:`~shardline.plugins.models.llama.Llama`)
whose per-rank construction on the meta device is the exact reference for those counts.

Packaged sizes (public configurations): GPT-2 (Radford et al. 2019), GPT-3 (Brown et al. 2020, Table 2.1),
Llama 2 (Touvron et al. 2023) and Llama 3 / 3.1 (Meta's released ``config.json`` files).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardline.recipes.schema import RecipeError


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: ``architecture`` is ``gpt2`` (LayerNorm, GELU MLP of ``d_ff``, learned
    positions, biases) or ``llama`` (RMSNorm, SwiGLU of ``d_ff``, rotary, grouped-query attention with
    ``n_kv_head`` KV heads, no biases unless ``qkv_bias``)."""

    name: str
    architecture: str
    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int
    n_kv_head: int | None = None
    head_dim: int | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        problems = [f"{k}={getattr(self, k)!r} must be an integer >= 1" for k in
                    ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff")
                    if not isinstance(getattr(self, k), int) or getattr(self, k) < 1]
        if self.architecture not in ("gpt2", "llama"):
            problems.append(f"architecture={self.architecture!r} must be 'gpt2' or 'llama'")
        if not problems and self.d_model % self.n_head and self.head_dim is None:
            problems.append(f"d_model={self.d_model} is not a multiple of n_head={self.n_head}")
        if self.kv_heads < 1 or self.n_head % self.kv_heads:
            problems.append(f"n_kv_head={self.n_kv_head!r} must divide n_head={self.n_head}")
        if problems:
            raise RecipeError(f"model {self.name!r}: " + "; ".join(problems))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    def block_params(self) -> int:
        """Parameters of one transformer block."""
        d, hd = self.d_model, self.dim_per_head
        q, kv = self.n_head * hd, self.kv_heads * hd
        if self.architecture == "gpt2":
            attn = d * (q + 2 * kv) + (q + 2 * kv) + q * d + d
            mlp = 2 * d * self.d_ff + self.d_ff + d
            return attn + mlp + 4 * d  # two LayerNorms, weight and bias
        attn = d * (q + 2 * kv) + q * d + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * d * self.d_ff + 2 * d  # SwiGLU's gate, up and down; two RMSNorm weights

    def embedding_params(self) -> int:
        positions = self.seq_len * self.d_model if self.architecture == "gpt2" else 0
        return self.vocab_size * self.d_model + positions

    def head_params(self) -> int:
        norm = 2 * self.d_model if self.architecture == "gpt2" else self.d_model
        return norm + (0 if self.tie_embeddings else self.vocab_size * self.d_model)

    def params(self) -> int:
        """All parameters (a tied head counted once), unpadded."""
        return self.embedding_params() + self.n_layer * self.block_params() + self.head_params()

    def shardline_config(self):
        """The shardline model config of this spec (imports torch)."""
        if self.architecture == "gpt2":
            from shardline.plugins.models.gpt import GPTConfig

            return GPTConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, n_layer=self.n_layer,
                             n_head=self.n_head, d_model=self.d_model, d_ff=self.d_ff,
                             tie_embeddings=self.tie_embeddings)
        from shardline.plugins.models.llama import LlamaConfig

        return LlamaConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, n_layer=self.n_layer,
                           n_head=self.n_head, n_kv_head=self.kv_heads, d_model=self.d_model, d_ff=self.d_ff,
                           head_dim=self.head_dim, tie_embeddings=self.tie_embeddings, qkv_bias=self.qkv_bias)

    def replace(self, **changes) -> ModelSpec:
        return dataclasses.replace(self, **changes)


def _gpt(name, n_layer, d_model, n_head, *, seq_len, vocab=50257):
    return ModelSpec(name=name, architecture="gpt2", vocab_size=vocab, seq_len=seq_len, n_layer=n_layer,
                     n_head=n_head, d_model=d_model, d_ff=4 * d_model, tie_embeddings=True)


def _llama(name, n_layer, d_model, n_head, n_kv, d_ff, *, vocab, seq_len):
    return ModelSpec(name=name, architecture="llama", vocab_size=vocab, seq_len=seq_len, n_layer=n_layer,
                     n_head=n_head, n_kv_head=n_kv, d_model=d_model, d_ff=d_ff)


PACKAGED: dict[str, ModelSpec] = {m.name: m for m in (
    _gpt("gpt2-125m", 12, 768, 12, seq_len=1024), _gpt("gpt2-350m", 24, 1024, 16, seq_len=1024),
    _gpt("gpt2-760m", 24, 1536, 16, seq_len=1024), _gpt("gpt2-1.5b", 48, 1600, 25, seq_len=1024),
    _gpt("gpt3-2.7b", 32, 2560, 32, seq_len=2048), _gpt("gpt3-6.7b", 32, 4096, 32, seq_len=2048),
    _gpt("gpt3-13b", 40, 5120, 40, seq_len=2048), _gpt("gpt3-175b", 96, 12288, 96, seq_len=2048),
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, vocab=32000, seq_len=4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, vocab=32000, seq_len=4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, vocab=32000, seq_len=4096),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, vocab=128256, seq_len=8192),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, vocab=128256, seq_len=8192),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, vocab=128256, seq_len=8192),
)}


def packaged(name: str) -> ModelSpec:
    if name not in PACKAGED:
        raise RecipeError(f"model {name!r} is not a packaged model (packaged: {', '.join(PACKAGED)})")
    return PACKAGED[name]


__all__ = ["PACKAGED", "ModelSpec", "packaged"]
