"""The architecture numbers the planner needs, for packaged model names and for a user's model.

A :class:`ModelSpec` is torch-free: one shape record over the model families, whose rooms
(:mod:`shardline.job.gpt`, :mod:`shardline.job.llama`, registered in :mod:`shardline.job.families`) hold the
parameter closed forms, the layout rules and the Hugging Face ``config.json`` mapping it uses. The shardline
model class of each family (``gpt2`` -> :class:`~shardline.plugins.models.gpt.GPT`, ``llama`` ->
:class:`~shardline.plugins.models.llama.Llama`), built per rank on the meta device, is the exact reference for
those counts.

Packaged sizes (public configurations): GPT-2 (Radford et al. 2019), GPT-3 (Brown et al. 2020, Table 2.1),
Llama 2 (Touvron et al. 2023) and Llama 3 / 3.1 (Meta's released ``config.json`` files).
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass

from shardline.job.errors import ShardlineError
from shardline.job.families import FAMILIES, HF_ARCHITECTURES, config_from_hf, family_of_config
from shardline.job.family import Family
from shardline.recipes.schema import RecipeError


def shape_problems(fields: dict) -> list[str]:
    """Every problem of a spec's fields (a dict; an absent field is not checked), each naming its value."""

    def integer(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    def has(*names) -> bool:
        return all(k in fields for k in names)

    problems = [f"{k}={fields[k]!r} must be an integer >= 1" for k in
                ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff") if has(k) and not integer(fields[k])]
    problems += [f"{k}={fields[k]!r} must be an integer >= 1 or unset" for k in ("n_kv_head", "head_dim")
                 if fields.get(k) is not None and not integer(fields[k])]
    problems += [f"{k}={fields[k]!r} must be true or false" for k in ("tie_embeddings", "qkv_bias")
                 if has(k) and not isinstance(fields[k], bool)]
    if has("architecture") and fields["architecture"] not in FAMILIES:
        problems.append(f"architecture={fields['architecture']!r} must be {' or '.join(map(repr, FAMILIES))}")
    if problems or not has("n_head", "d_model"):
        return problems
    if fields["d_model"] % fields["n_head"] and fields.get("head_dim") is None:
        problems.append(f"d_model={fields['d_model']} is not a multiple of n_head={fields['n_head']}")
    kv_heads = fields.get("n_kv_head") or fields["n_head"]
    if not problems and fields["n_head"] % kv_heads:
        problems.append(f"n_kv_head={fields.get('n_kv_head')!r} must divide n_head={fields['n_head']}")
    return problems


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
        problems = shape_problems({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if problems:
            raise RecipeError(f"model {self.name!r}: " + "; ".join(problems))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    @property
    def family(self) -> type[Family]:
        """The model family's room: its layout rules and parameter closed forms (:mod:`shardline.job.families`)."""
        return FAMILIES[self.architecture]

    def block_params(self) -> int:
        """Parameters of one transformer block."""
        return sum(self.family.block_numels(self, tp=1))

    def embedding_params(self) -> int:
        return sum(self.family.embedding_numels(self, vocab=self.vocab_size))

    def head_params(self) -> int:
        head = sum(self.family.head_numels(self, vocab=self.vocab_size))
        return head - (self.vocab_size * self.d_model if self.tie_embeddings else 0)

    def params(self) -> int:
        """All parameters (a tied head counted once), unpadded."""
        return self.embedding_params() + self.n_layer * self.block_params() + self.head_params()

    def shardline_config(self):
        """The shardline model config of this spec (its family's config dataclass; torch-free)."""
        return self.family.config_from_shape(self)

    @classmethod
    def from_config(cls, config, *, name: str) -> ModelSpec:
        """The spec of a registered family's config; ``head_dim`` is kept only where it is not
        ``d_model / n_head``."""
        fam = family_of_config(config)
        return cls(name=name, architecture=fam.name, **fam.shape_fields(config))

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


SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ModelSpec))


def from_hf_config(hf: dict, *, name: str = "hf", source: str = "config.json") -> ModelSpec:
    """The spec of a Hugging Face ``config.json`` (as a dict), without torch: the family's own mapping (the one
    :func:`shardline.plugins.hf.from_pretrained` loads with). RecipeError naming ``source`` and the missing or
    unsupported field."""
    try:
        _, config = config_from_hf(hf)
    except ShardlineError as error:
        raise RecipeError(f"model {source}: {error}") from None
    return ModelSpec.from_config(config, name=name)


def from_mapping(fields: dict, *, name: str, source: str) -> ModelSpec:
    """A spec from architecture fields (``ModelSpec``'s names; a ``shardline fit`` recipe's ``model`` section is
    accepted as is: its training fields such as ``lr`` are ignored). ``architecture`` defaults to ``gpt2`` as in
    the recipes; ``n_kv_head`` only applies to ``llama``."""
    arch = fields.get("architecture", "gpt2")
    wanted = {k: v for k, v in fields.items() if k in SPEC_FIELDS and k not in ("name", "architecture")}
    wanted = {k: v for k, v in wanted.items() if v is not None}
    name = fields.get("name", name)
    problems = shape_problems({"architecture": arch, **wanted})
    if problems:
        raise RecipeError(f"model {name!r}: " + "; ".join(problems))
    config_type = FAMILIES[arch].config_type
    defaulted = {f.name for f in dataclasses.fields(config_type) if f.default is not dataclasses.MISSING}
    required = [f.name for f in dataclasses.fields(ModelSpec) if f.default is dataclasses.MISSING]
    missing = [k for k in required if k not in ("name", "architecture") and k not in wanted and k not in defaulted]
    if missing:
        raise RecipeError(f"model {source}: missing {', '.join(missing)} (the architecture fields are "
                          f"{', '.join(SPEC_FIELDS[1:])})")
    try:  # the family's own defaults (GPT-2: d_ff = 4 d_model, tied embeddings) and its own validation
        config = FAMILIES[arch].config_from_shape(types.SimpleNamespace(**wanted))
    except ShardlineError as error:
        raise RecipeError(f"model {source}: {error}") from None
    return ModelSpec.from_config(config, name=name)


def load_model(what: str) -> ModelSpec:
    """A packaged name, a Hugging Face ``config.json`` (or the folder holding one), or a YAML file of
    architecture fields (a recipe's ``model`` section works). RecipeError naming the argument otherwise."""
    import json
    from pathlib import Path

    if what in PACKAGED:
        return PACKAGED[what]
    path = Path(what)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise RecipeError(f"model {what!r} is neither a packaged model ({', '.join(PACKAGED)}) nor a file")
    try:
        text = path.read_text()
    except OSError as error:
        raise RecipeError(f"model {path}: cannot be read ({error.strerror})") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as error:
            raise RecipeError(f"model {path}: not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise RecipeError(f"model {path}: a config.json must be a JSON object")
        return from_hf_config(data, name=path.parent.name or path.stem, source=str(path))
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise RecipeError(f"model {path}: not valid YAML ({error})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"model {path}: must be a mapping of architecture fields")
    if isinstance(data.get("model"), dict):  # a shardline fit recipe
        data = data["model"]
    return from_mapping(data, name=path.stem, source=str(path))


__all__ = ["HF_ARCHITECTURES", "PACKAGED", "ModelSpec", "from_hf_config", "from_mapping", "load_model", "packaged"]
