"""What every decoder-only model family states once, torch-free: the base of a family's room and the layout rules
all decoders share.

A family (:mod:`shardline.job.gpt`, :mod:`shardline.job.llama`) is one module holding its config dataclass, its
layout rules (:meth:`Family.layout_problems`), its Hugging Face names and ``config.json`` mapping
(:meth:`Family.config_from_hf`), the config from a recipe's fields (:meth:`Family.config_from_fields`) and its
parameter closed forms (per-TP-rank sizes of each pipeline layer, in the module's order), registered once in
:mod:`shardline.job.families`. The nn.Module classes (``shardline.plugins.models``), the Hugging Face loader
(``shardline.plugins.hf``), the checkpoint names, the planner and the Lightning module all read it.

A *shape* below is anything with the architecture fields (a family config, or the planner's ``ModelSpec``):
``vocab_size, seq_len, n_layer, n_head, d_model, d_ff`` and, where the family has them, ``n_kv_head``,
``head_dim``, ``qkv_bias``, ``tie_embeddings``. *dims* is anything with ``tp, cp, pp, sp`` (a ParallelDims, or
:class:`Degrees`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from shardline.job.errors import ContractError
from shardline.job.layout import SPMode

#: The architecture fields a *shape* may carry (above); a family's config has those of them it uses.
SHAPE_FIELDS = ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "head_dim",
                "tie_embeddings", "qkv_bias")


#: Bytes of a float32 value (statistics, softmax, log-sum-exp) in the activation closed forms.
F32 = 4


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on one rank, as the activation closed forms read it: ``b`` sequences, ``S`` tokens each,
    ``s = S/cp`` of them on this rank, ``sh`` hidden rows (``s/t`` under Megatron-SP, else ``s``), ``t`` = tp,
    ``e`` bytes per activation element, and the SP/CP modes in force."""

    b: int
    S: int
    s: int
    sh: int
    t: int
    e: int
    megatron: bool
    ulysses: bool


def attention_activation_bytes(shape, g: MicroBatch) -> int:
    """What every decoder's attention saves per block: q, k, v and the output (``4 q`` columns over ``t``), the
    float32 log-sum-exp per head, and under Ulysses the re-laid-out output and the balanced indexes."""
    q = shape.n_head * dim_per_head(shape)
    attention = g.e * g.b * g.s * 4 * q // g.t + F32 * shape.n_head * g.b * g.s // g.t
    ulysses = (g.e * g.b * g.s * q // g.t + 2 * 8 * g.S) if g.ulysses else 0
    return attention + ulysses


class Degrees(NamedTuple):
    """The degrees the layout rules read, for callers without a world (the planner)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    sp: SPMode = SPMode.NONE


def head_partition_problems(heads: int, head_dim: int, *, tp: int, what: str) -> list[str]:
    """Why ``heads`` heads of ``head_dim`` cannot be spread over ``tp`` ranks (empty when they can): every rank
    holds whole heads (``tp`` divides ``heads``), or each head is split over ``tp/heads`` ranks by rows."""
    if heads % tp == 0:
        return []
    if tp % heads:
        return [f"{what}={heads} and tp={tp}: neither divides the other"]
    rep = tp // heads
    if head_dim % rep:
        return [f"{what}={heads} < tp={tp} replicates each head on tp/{what}={rep} ranks, which needs head_dim="
                f"{head_dim} divisible by {rep}"]
    return []


def decoder_layout_problems(dims, *, n_head: int, seq_len: int, n_layer: int) -> list[str]:
    """What any decoder of ``n_head`` heads, ``seq_len`` tokens and ``n_layer`` blocks needs from a layout (the
    sequence, attention and pipeline rules; a family adds its own widths)."""
    tp, cp = dims.tp, dims.cp
    sp = SPMode(dims.sp)
    problems = []
    if n_layer + 2 < dims.pp:
        problems.append(f"n_layer={n_layer} gives {n_layer + 2} pipeline layers (embedding, blocks, head), fewer "
                        f"than pp={dims.pp} stages")
    if cp > 1 and sp not in (SPMode.RING, SPMode.ULYSSES):
        problems.append(f"cp={cp} needs sp='ring' or 'ulysses' (sp={sp.value!r})")
    if sp is SPMode.ULYSSES and n_head % tp == 0 and (n_head // tp) % cp:
        problems.append(f"ulysses: heads per TP rank n_head/tp={n_head // tp} is not divisible by cp={cp}")
    if cp > 1 and seq_len % (2 * cp):
        problems.append(f"seq_len={seq_len} is not divisible by 2*cp={2 * cp}")
    if sp is SPMode.MEGATRON and (seq_len // cp) % tp:
        problems.append(f"megatron-SP: seq_len/cp={seq_len // cp} is not divisible by tp={tp}")
    return problems


def need(hf: dict, key: str) -> Any:
    """``hf[key]``, or ContractError naming the missing key."""
    if key not in hf:
        raise ContractError(f"{key!r} is missing")
    return hf[key]


class TensorKind(str, enum.Enum):
    """How a shardline tensor is laid out in its canonical (Hugging Face) tensor: the one vocabulary of the
    Hugging Face tables, the checkpoint's placements and their transforms
    (:mod:`shardline.plugins.checkpoint.boxes`)."""

    #: The same layout.
    PLAIN = "plain"
    #: Rows are the vocabulary: shardline's are zero-padded to a multiple of tp, the canonical tensor's are not.
    VOCAB = "vocab"
    #: GPT-2's Conv1D weight: stored transposed (``[in, out]``).
    CONV1D = "conv1d"
    #: GPT-2's ``c_attn`` weight: transposed, q|k|v as three column blocks (shardline interleaves them per head).
    GPT2_QKV = "gpt2_qkv"
    #: Its bias: q|k|v as three blocks.
    GPT2_QKV_BIAS = "gpt2_qkv_bias"


@dataclass(frozen=True)
class Source:
    """Where one shardline parameter comes from: ``name`` in the checkpoint and how it is laid out there
    (``kind``)."""

    name: str
    kind: TensorKind = TensorKind.PLAIN



class Family:
    """One decoder family's room (subclassed once per family, never instantiated)."""

    #: The name recipes and the planner use (``architecture: gpt2``).
    name: ClassVar[str]
    #: The shardline model class's name (messages).
    model_name: ClassVar[str]
    #: The config dataclass.
    config_type: ClassVar[type]
    #: Hugging Face ``architectures`` entries this family loads, each with its ``model_type``.
    hf_architectures: ClassVar[dict[str, str]]
    #: Weight matrices of the MLP (GELU: up and down; SwiGLU: gate, up and down).
    mlp_matrices: ClassVar[int]
    #: Whether positions are a learned table of ``seq_len`` rows (then the training window is the model's length).
    learned_positions: ClassVar[bool] = False

    @classmethod
    def config_from_hf(cls, arch: str, hf: dict):
        """The config of a Hugging Face ``config.json`` (as a dict) of architecture ``arch``; ContractError naming
        the unsupported option or missing field."""
        raise NotImplementedError

    @classmethod
    def config_to_hf(cls, config) -> tuple[str, dict]:
        """``(architecture, config.json as a dict)`` of ``config`` (the inverse of :meth:`config_from_hf`)."""
        raise NotImplementedError

    @classmethod
    def config_from_fields(cls, fields: dict):
        """The config of a recipe's ``model`` section (LanguageModule's fields; absent ones at its defaults)."""
        raise NotImplementedError

    @classmethod
    def config_from_shape(cls, shape):
        """The family's config of a shape record (the planner's ``ModelSpec``): every :data:`SHAPE_FIELDS` field
        the config type declares and the shape sets (not None); the rest at the config's defaults."""
        declared = {field.name for field in dataclasses.fields(cls.config_type)}
        return cls.config_type(**{name: getattr(shape, name) for name in SHAPE_FIELDS
                                  if name in declared and getattr(shape, name, None) is not None})

    @classmethod
    def shape_fields(cls, config) -> dict[str, Any]:
        """The inverse of :meth:`config_from_shape`: the config's :data:`SHAPE_FIELDS` values that the config type
        declares, ``head_dim`` only where it is not ``d_model / n_head``."""
        declared = {field.name for field in dataclasses.fields(cls.config_type)}
        fields = {name: getattr(config, name) for name in SHAPE_FIELDS if name in declared}
        if fields.get("head_dim") is not None and fields["head_dim"] * config.n_head == config.d_model:
            fields["head_dim"] = None
        return fields

    @classmethod
    def width_problems(cls, config, tp: int) -> list[str]:
        """Why the family's widths cannot be split over ``tp`` ranks."""
        raise NotImplementedError

    @classmethod
    def layout_problems(cls, config, dims) -> list[str]:
        """Every reason ``dims`` cannot take ``config`` (each naming its numbers): the family's widths, then the
        decoder's sequence, attention and pipeline rules."""
        return cls.width_problems(config, dims.tp) + decoder_layout_problems(
            dims, n_head=config.n_head, seq_len=config.seq_len, n_layer=config.n_layer)

    @classmethod
    def hf_table(cls, config) -> dict[str, Source]:
        """Every parameter name of the shardline model of ``config`` -> where it comes from in a Hugging Face
        checkpoint (the one name table, read by loading, saving and the checkpoint converter)."""
        raise NotImplementedError

    # --- closed forms: activation bytes autograd saves per micro-batch (the planner's memory model) -------------

    @classmethod
    def block_activation_bytes(cls, shape, g: MicroBatch) -> int:
        """Bytes one block saves for backward (:mod:`shardline.recipes.planning.memory` states the formulas)."""
        raise NotImplementedError

    @classmethod
    def embedding_activation_bytes(cls, shape, g: MicroBatch) -> int:
        """Bytes the embedding saves: under TP the local ids (int64) and the outside-vocabulary mask."""
        return 9 * g.b * g.s if g.t > 1 else 0

    @classmethod
    def final_norm_activation_bytes(cls, shape, g: MicroBatch) -> int:
        """Bytes the head's final norm saves."""
        raise NotImplementedError

    @classmethod
    def shared_activation_bytes(cls, shape, g: MicroBatch) -> int:
        """Bytes a stage holding blocks saves once for all of them (none unless the family says so)."""
        return 0

    # --- closed forms: HBM traffic of the memory-bound kernels (the planner's step-time model) -----------------

    @classmethod
    def elementwise_bytes(cls, shape, *, tokens: int, region: float, hidden: float, tp: int, e: int,
                          eager: bool) -> float:
        """HBM bytes one block's memory-bound forward kernels move on one rank, besides the residual adds: its two
        norms over ``region`` elements (``tokens x d_model``, ``/tp`` under Megatron-SP), its MLP activation over
        ``hidden`` (``tokens x d_ff / tp``) and anything of its own; ``e`` bytes per element, ``eager``: shardline's
        unfused kernels rather than fused ones (:mod:`shardline.recipes.planning.steptime` states the counts)."""
        raise NotImplementedError

    # --- closed forms: per-TP-rank parameter sizes of each pipeline layer, in the module's order ---------------

    @classmethod
    def embedding_numels(cls, shape, *, vocab: int) -> tuple[int, ...]:
        """The embedding's parameters on one rank holding ``vocab`` rows of the (padded) vocabulary."""
        raise NotImplementedError

    @classmethod
    def head_numels(cls, shape, *, vocab: int) -> tuple[int, ...]:
        """The head's parameters: the vocabulary matrix (``vocab`` rows; listed even when tied), then the norm."""
        raise NotImplementedError

    @classmethod
    def block_numels(cls, shape, *, tp: int) -> tuple[int, ...]:
        """One block's parameters on one of ``tp`` ranks."""
        raise NotImplementedError


def kv_heads(shape) -> int:
    return getattr(shape, "n_kv_head", None) or shape.n_head


def dim_per_head(shape) -> int:
    return getattr(shape, "head_dim", None) or shape.d_model // shape.n_head


__all__ = ["F32", "SHAPE_FIELDS", "Degrees", "Family", "MicroBatch", "Source", "TensorKind",
           "attention_activation_bytes", "decoder_layout_problems", "dim_per_head", "head_partition_problems",
           "kv_heads", "need"]
