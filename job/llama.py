"""The Llama family's room (torch-free): :class:`LlamaConfig` (with :class:`RopeScaling`), its layout rules, its
Hugging Face names and ``config.json`` mapping, and its parameter closed forms (see :mod:`shardline.job.family`).

Llama 2/3, Mistral-style grouped-query attention and Qwen2's q/k/v biases: pre-RMSNorm blocks without biases
(except Qwen2's), a SwiGLU MLP of ``d_ff``, rotary positions, ``n_kv_head`` key/value heads. The nn.Module is
:class:`shardline.plugins.models.llama.Llama`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.job.errors import ContractError
from shardline.job.family import (
    F32,
    Family,
    MicroBatch,
    Source,
    TensorKind,
    attention_activation_bytes,
    dim_per_head,
    head_partition_problems,
    kv_heads,
    need,
)


@dataclass(frozen=True)
class RopeScaling:
    """The Llama-3 frequency scaling (the only ``rope_type`` supported); validated at construction."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self):
        problems = []
        if self.rope_type != "llama3":
            problems.append(f"rope_type={self.rope_type!r} is not supported (only 'llama3')")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                problems.append(f"{name}={value!r} must be a positive number")
        m = self.original_max_position_embeddings
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            problems.append(f"original_max_position_embeddings={m!r} must be an integer >= 1")
        if not problems and not self.high_freq_factor > self.low_freq_factor:
            problems.append(f"high_freq_factor={self.high_freq_factor} must exceed "
                            f"low_freq_factor={self.low_freq_factor}")
        if problems:
            raise ContractError("invalid rope_scaling: " + "; ".join(problems))

    @classmethod
    def from_value(cls, value) -> RopeScaling | None:
        """None, a RopeScaling, or a Hugging Face style dict (``rope_type`` or the older ``type`` key)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ContractError(f"rope_scaling={value!r} must be None, a RopeScaling or a dict")
        fields = dict(value)
        kind = fields.pop("rope_type", None) or fields.pop("type", None)
        fields.pop("type", None)
        known = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        extra, missing = sorted(set(fields) - known), sorted(known - set(fields))
        if kind != "llama3" or extra or missing:
            raise ContractError(f"rope_scaling={value!r}: only rope_type='llama3' with exactly the keys "
                                f"{sorted(known)} is supported (rope_type={kind!r}, unknown {extra}, "
                                f"missing {missing})")
        return cls(rope_type=kind, **fields)


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and options of a Llama-family model; validated at construction (ContractError naming every bad field).

    ``n_kv_head`` defaults to ``n_head`` (no grouping) and must divide it; ``head_dim`` defaults to
    ``d_model // n_head``; ``seq_len`` is the longest sequence the model accepts (Hugging Face's
    ``max_position_embeddings``). ``rope_scaling``: None, a :class:`RopeScaling`, or Hugging Face's dict
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` (stored as a RopeScaling). ``qkv_bias``: Qwen2's biases on q/k/v.
    ``activation_checkpointing`` recomputes every block in backward.
    """

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int
    n_kv_head: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | dict | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    dropout: float = 0.0
    activation_checkpointing: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        set_ = object.__setattr__
        if self.n_kv_head is None:
            set_(self, "n_kv_head", self.n_head)
        if self.head_dim is None and isinstance(self.d_model, int) and isinstance(self.n_head, int) \
                and self.n_head > 0:
            set_(self, "head_dim", self.d_model // self.n_head)
        problems, valid = [], set()
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1")
            else:
                valid.add(name)
        if {"n_head", "n_kv_head"} <= valid and self.n_head % self.n_kv_head:
            problems.append(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if "head_dim" in valid and self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even (rotary pairs)")
        for name, value in (("rope_theta", self.rope_theta), ("rms_norm_eps", self.rms_norm_eps),
                            ("init_std", self.init_std)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                problems.append(f"{name}={value!r} must be a positive number")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout!r} must be a number in [0, 1)")
        try:
            set_(self, "rope_scaling", RopeScaling.from_value(self.rope_scaling))
        except ContractError as exc:
            problems.append(str(exc))
        if problems:
            raise ContractError("invalid LlamaConfig: " + "; ".join(problems))


def _rope(hf: dict) -> tuple[float, dict | None]:
    """``(theta, llama3 scaling or None)`` from transformers 5's ``rope_parameters`` or the older
    ``rope_theta``/``rope_scaling`` pair."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], dict(params)
        scaling.pop("rope_theta")
    else:
        theta, scaling = hf.get("rope_theta", 10000.0), dict(hf.get("rope_scaling") or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ContractError(f"rope type {kind!r} is not supported (only the default and 'llama3')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, {"rope_type": "llama3", **{k: scaling[k] for k in keys if k in scaling}}


class LlamaFamily(Family):
    name = "llama"
    model_name = "Llama"
    config_type = LlamaConfig
    hf_architectures = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
    mlp_matrices = 3

    @classmethod
    def config_from_hf(cls, arch: str, hf: dict) -> LlamaConfig:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ContractError(f"hidden_act={act!r} is not supported (the Llama family uses 'silu')")
        if hf.get("attention_bias") and arch != "Qwen2ForCausalLM":
            raise ContractError("attention_bias=True is not supported (a bias on o_proj too; only Qwen2's q/k/v "
                                "biases are)")
        if hf.get("mlp_bias"):
            raise ContractError("mlp_bias=True is not supported")
        seq_len = need(hf, "max_position_embeddings")
        window = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "MistralForCausalLM") else None
        if isinstance(window, int) and window < seq_len:
            raise ContractError(f"sliding_window={window} < max_position_embeddings={seq_len}: windowed attention "
                                "is not implemented")
        theta, scaling = _rope(hf)
        n_head = need(hf, "num_attention_heads")
        return LlamaConfig(
            vocab_size=need(hf, "vocab_size"), seq_len=seq_len, n_layer=need(hf, "num_hidden_layers"),
            n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head, d_model=need(hf, "hidden_size"),
            d_ff=need(hf, "intermediate_size"), head_dim=hf.get("head_dim"), rope_theta=theta,
            rope_scaling=scaling, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qkv_bias=arch == "Qwen2ForCausalLM")

    @classmethod
    def config_to_hf(cls, config: LlamaConfig) -> tuple[str, dict]:
        arch = "Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"
        hf = {"architectures": [arch], "model_type": cls.hf_architectures[arch], "vocab_size": config.vocab_size,
              "max_position_embeddings": config.seq_len, "num_hidden_layers": config.n_layer,
              "num_attention_heads": config.n_head, "num_key_value_heads": config.n_kv_head,
              "hidden_size": config.d_model, "intermediate_size": config.d_ff, "head_dim": config.head_dim,
              "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_embeddings,
              "hidden_act": "silu", "rope_theta": config.rope_theta}
        if config.rope_scaling is not None:
            s = config.rope_scaling
            hf["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                  "high_freq_factor": s.high_freq_factor,
                                  "original_max_position_embeddings": s.original_max_position_embeddings}
        if arch == "Qwen2ForCausalLM":
            hf["use_sliding_window"] = False
        return arch, hf

    @classmethod
    def config_from_fields(cls, fields: dict) -> LlamaConfig:
        d_model = fields["d_model"]
        d_ff = fields.get("d_ff") or (4 * d_model if isinstance(d_model, int) else d_model)
        return LlamaConfig(vocab_size=fields["vocab_size"], seq_len=fields["seq_len"], n_layer=fields["n_layer"],
                           n_head=fields["n_head"], d_model=d_model, dropout=fields.get("dropout", 0.0),
                           tie_embeddings=fields.get("tie_embeddings", True), d_ff=d_ff,
                           n_kv_head=fields.get("n_kv_head"), rope_theta=fields.get("rope_theta", 10000.0),
                           rms_norm_eps=fields.get("rms_norm_eps", 1e-6), qkv_bias=fields.get("qkv_bias", False))

    @classmethod
    def width_problems(cls, config, tp: int) -> list[str]:
        problems = []
        if config.n_head % tp:
            problems.append(f"n_head={config.n_head} is not divisible by tp={tp}")
        problems += head_partition_problems(kv_heads(config), dim_per_head(config), tp=tp, what="n_kv_head")
        if config.d_ff % tp:
            problems.append(f"d_ff={config.d_ff} is not divisible by tp={tp}")
        if config.vocab_size < tp:
            problems.append(f"vocab_size={config.vocab_size} is smaller than tp={tp} (a rank would hold only "
                            f"padding rows)")
        return problems

    @classmethod
    def hf_table(cls, config) -> dict[str, Source]:
        """Every parameter name of the shardline model -> its Hugging Face source."""
        table = {"embedding.wte.weight": Source("model.embed_tokens.weight", TensorKind.VOCAB),
                 "head.ln_f.weight": Source("model.norm.weight")}
        # tied: a model built per rank holds a copy of the embedding as the last stage's head.weight
        table["head.weight"] = Source("model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight",
                                      TensorKind.VOCAB)
        for i in range(config.n_layer):
            ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
            table.update({
                ours + "attn_norm.weight": Source(theirs + "input_layernorm.weight"),
                ours + "mlp_norm.weight": Source(theirs + "post_attention_layernorm.weight"),
                ours + "o_proj.weight": Source(theirs + "self_attn.o_proj.weight"),
                ours + "gate_up.gate_weight": Source(theirs + "mlp.gate_proj.weight"),
                ours + "gate_up.up_weight": Source(theirs + "mlp.up_proj.weight"),
                ours + "down.weight": Source(theirs + "mlp.down_proj.weight")})
            for x in "qkv":
                table[ours + f"qkv.{x}_weight"] = Source(theirs + f"self_attn.{x}_proj.weight")
                if config.qkv_bias:
                    table[ours + f"qkv.{x}_bias"] = Source(theirs + f"self_attn.{x}_proj.bias")
        return table

    @classmethod
    def block_activation_bytes(cls, shape, g: MicroBatch) -> int:
        """RMSNorms (float32 input, 1/rms, the normalised value), the gathered input copied per projection under
        Megatron-SP with ``b > 1`` (3 for q/k/v, 2 for gate/up), attention, the MLP's four ``f/t`` activations,
        and K/V gathered whole where tp exceeds the KV heads."""
        d, e, b, hd, kv = shape.d_model, g.e, g.b, dim_per_head(shape), kv_heads(shape)
        copies = (3, 2) if g.megatron and b > 1 else (1, 1)
        norms = 2 * ((F32 + e) * b * g.sh * d + F32 * b * g.sh)
        gathered = 2 * kv * hd * (d + shape.qkv_bias) * e if g.t > kv else 0
        mlp = 4 * e * b * g.s * shape.d_ff // g.t
        return norms + sum(copies) * e * b * g.s * d + attention_activation_bytes(shape, g) + mlp + gathered

    @classmethod
    def elementwise_bytes(cls, shape, *, tokens: int, region: float, hidden: float, tp: int, e: int,
                          eager: bool) -> float:
        """Two RMSNorms (fused: read, write; shardline's eager float32 chain x.float, pow, mean, mul, cast,
        weight-mul: 36 bytes an element), SwiGLU (fused 3e; eager 10) and rotary on q and k (fused 2e; eager 20)."""
        rotary = tokens * (shape.n_head + kv_heads(shape)) * dim_per_head(shape) // tp
        norms = 2 * (36 if eager else 2 * e) * region
        return norms + (10 if eager else 3 * e) * hidden + (20 if eager else 2 * e) * rotary

    @classmethod
    def final_norm_activation_bytes(cls, shape, g: MicroBatch) -> int:
        return (F32 + g.e) * g.b * g.sh * shape.d_model + F32 * g.b * g.sh  # RMSNorm: fp32 input, 1/rms

    @classmethod
    def shared_activation_bytes(cls, shape, g: MicroBatch) -> int:
        """The rotary cos/sin tables, shared by every block of the stage."""
        return 2 * g.s * dim_per_head(shape) * g.e

    @classmethod
    def embedding_numels(cls, shape, *, vocab: int) -> tuple[int, ...]:
        return (vocab * shape.d_model,)

    @classmethod
    def head_numels(cls, shape, *, vocab: int) -> tuple[int, ...]:
        return (vocab * shape.d_model, shape.d_model)  # the vocabulary matrix, then the final RMSNorm

    @classmethod
    def block_numels(cls, shape, *, tp: int) -> tuple[int, ...]:
        """attn_norm, q/k/v (each weight, then its bias with qkv_bias), o_proj, mlp_norm, gate, up, down."""
        d, f, t, hd = shape.d_model, shape.d_ff, tp, dim_per_head(shape)
        q, kvd = shape.n_head * hd, kv_heads(shape) * hd
        qkv = (q * d // t, kvd * d // t, kvd * d // t)
        if shape.qkv_bias:
            qkv = (q * d // t, q // t, kvd * d // t, kvd // t, kvd * d // t, kvd // t)
        return (d, *qkv, d * q // t, d, f * d // t, f * d // t, d * f // t)


__all__ = ["LlamaConfig", "LlamaFamily", "RopeScaling"]
