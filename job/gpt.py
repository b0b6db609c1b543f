"""The GPT-2 family's room (torch-free): :class:`GPTConfig`, its layout rules, its Hugging Face names and
``config.json`` mapping, and its parameter closed forms (see :mod:`shardline.job.family`).

GPT-2 (Radford et al. 2019): pre-LayerNorm blocks with biases, a GELU MLP of ``d_ff``, learned positions, fused
q|k|v with ``n_head`` heads of ``d_model / n_head``; the output projection tied to the token embedding by default.
The nn.Module is :class:`shardline.plugins.models.gpt.GPT`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.job.errors import ContractError
from shardline.job.family import F32, Family, MicroBatch, Source, TensorKind, attention_activation_bytes, need


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


class GPT2(Family):
    name = "gpt2"
    model_name = "GPT"
    config_type = GPTConfig
    hf_architectures = {"GPT2LMHeadModel": "gpt2"}
    mlp_matrices = 2
    learned_positions = True

    @classmethod
    def config_from_hf(cls, arch: str, hf: dict) -> GPTConfig:
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ContractError(f"activation_function={act!r} is not supported (GPT-2's tanh GELU only)")
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            raise ContractError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
        return GPTConfig(vocab_size=need(hf, "vocab_size"), seq_len=need(hf, "n_positions"),
                         n_layer=need(hf, "n_layer"), n_head=need(hf, "n_head"), d_model=need(hf, "n_embd"),
                         d_ff=hf.get("n_inner"), layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                         tie_embeddings=bool(hf.get("tie_word_embeddings", True)))

    @classmethod
    def config_to_hf(cls, config: GPTConfig) -> tuple[str, dict]:
        hf = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
              "n_positions": config.seq_len, "n_layer": config.n_layer, "n_head": config.n_head,
              "n_embd": config.d_model, "n_inner": config.d_ff, "layer_norm_epsilon": config.layer_norm_eps,
              "activation_function": "gelu_new", "tie_word_embeddings": config.tie_embeddings}
        return "GPT2LMHeadModel", hf

    @classmethod
    def config_from_fields(cls, fields: dict) -> GPTConfig:
        return GPTConfig(vocab_size=fields["vocab_size"], seq_len=fields["seq_len"], n_layer=fields["n_layer"],
                         n_head=fields["n_head"], d_model=fields["d_model"], dropout=fields.get("dropout", 0.0),
                         tie_embeddings=fields.get("tie_embeddings", True), d_ff=fields.get("d_ff"))

    @classmethod
    def width_problems(cls, config, tp: int) -> list[str]:
        return [f"{what}={value} is not divisible by tp={tp}"
                for what, value in (("n_head", config.n_head), ("d_ff", config.d_ff)) if value % tp]

    @classmethod
    def hf_table(cls, config) -> dict[str, Source]:
        """Every parameter name of the shardline model -> its Hugging Face source."""
        table = {"embedding.wte.weight": Source("transformer.wte.weight", TensorKind.VOCAB),
                 "embedding.wpe": Source("transformer.wpe.weight"),
                 "head.ln_f.weight": Source("transformer.ln_f.weight"),
                 "head.ln_f.bias": Source("transformer.ln_f.bias"),
                 # tied: the last stage's copy, per rank; untied: its own tensor
                 "head.weight": Source("transformer.wte.weight" if config.tie_embeddings else "lm_head.weight",
                                       TensorKind.VOCAB)}
        for i in range(config.n_layer):
            ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
            table.update({
                ours + "ln1.weight": Source(theirs + "ln_1.weight"), ours + "ln1.bias": Source(theirs + "ln_1.bias"),
                ours + "ln2.weight": Source(theirs + "ln_2.weight"), ours + "ln2.bias": Source(theirs + "ln_2.bias"),
                ours + "qkv.weight": Source(theirs + "attn.c_attn.weight", TensorKind.GPT2_QKV),
                ours + "qkv.bias": Source(theirs + "attn.c_attn.bias", TensorKind.GPT2_QKV_BIAS),
                ours + "proj.weight": Source(theirs + "attn.c_proj.weight", TensorKind.CONV1D),
                ours + "proj.bias": Source(theirs + "attn.c_proj.bias"),
                ours + "fc1.weight": Source(theirs + "mlp.c_fc.weight", TensorKind.CONV1D),
                ours + "fc1.bias": Source(theirs + "mlp.c_fc.bias"),
                ours + "fc2.weight": Source(theirs + "mlp.c_proj.weight", TensorKind.CONV1D),
                ours + "fc2.bias": Source(theirs + "mlp.c_proj.bias")})
        return table

    @classmethod
    def block_activation_bytes(cls, shape, g: MicroBatch) -> int:
        """LayerNorm inputs and their float32 mean/rstd, the two gathered inputs of the projections, attention,
        and the MLP's two ``f/t`` activations (GELU's input and output)."""
        d, e, b = shape.d_model, g.e, g.b
        norms = 2 * e * b * g.sh * d + 4 * F32 * b * g.sh
        return norms + 2 * e * b * g.s * d + attention_activation_bytes(shape, g) + 2 * e * b * g.s * shape.d_ff // g.t

    @classmethod
    def elementwise_bytes(cls, shape, *, tokens: int, region: float, hidden: float, tp: int, e: int,
                          eager: bool) -> float:
        """Two LayerNorms (read, write: one kernel each, fused or not) and GELU (read, write)."""
        return 2 * 2 * e * region + 2 * e * hidden

    @classmethod
    def embedding_activation_bytes(cls, shape, g: MicroBatch) -> int:
        """The position index (int64; under SP a view of all ``s``) besides the shared TP terms."""
        return 8 * g.s + super().embedding_activation_bytes(shape, g)

    @classmethod
    def final_norm_activation_bytes(cls, shape, g: MicroBatch) -> int:
        return g.e * g.b * g.sh * shape.d_model + 2 * F32 * g.b * g.sh  # LayerNorm input, mean and rstd

    @classmethod
    def embedding_numels(cls, shape, *, vocab: int) -> tuple[int, ...]:
        return (shape.seq_len * shape.d_model, vocab * shape.d_model)  # positions, then tokens

    @classmethod
    def head_numels(cls, shape, *, vocab: int) -> tuple[int, ...]:
        d = shape.d_model
        return (vocab * d, d, d)  # the vocabulary matrix, then the final LayerNorm's weight and bias

    @classmethod
    def block_numels(cls, shape, *, tp: int) -> tuple[int, ...]:
        """ln1, qkv, proj, ln2, fc1, fc2 (weights and biases)."""
        d, f, t = shape.d_model, shape.d_ff, tp
        q = shape.n_head * (getattr(shape, "head_dim", None) or d // shape.n_head)
        return (d, d, 3 * q * d // t, 3 * q // t, d * q // t, d, d, d, f * d // t, f // t, d * f // t, d)


__all__ = ["GPT2", "GPTConfig"]
