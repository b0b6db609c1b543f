"""The one registration of the model families (:mod:`shardline.job.family`): adding an architecture is its own
room (a torch-free module here, its nn.Module in ``shardline.plugins.models``) plus one row below."""

from __future__ import annotations

from shardline.job.errors import ContractError
from shardline.job.family import Family
from shardline.job.gpt import GPT2
from shardline.job.llama import LlamaFamily

#: Every family by the name recipes and the planner use (``architecture: gpt2``).
FAMILIES: dict[str, type[Family]] = {family.name: family for family in (GPT2, LlamaFamily)}
#: Hugging Face ``architectures`` entries -> family name; and -> ``model_type``.
HF_ARCHITECTURES = {arch: family.name for family in FAMILIES.values() for arch in family.hf_architectures}
MODEL_TYPES = {arch: model_type for family in FAMILIES.values()
               for arch, model_type in family.hf_architectures.items()}


def family(name: str) -> type[Family]:
    """The family called ``name``; ContractError naming the known ones."""
    if name not in FAMILIES:
        raise ContractError(f"architecture={name!r} must be one of {' or '.join(map(repr, FAMILIES))}")
    return FAMILIES[name]


def family_of_config(config) -> type[Family]:
    """The family whose config type ``config`` is."""
    for fam in FAMILIES.values():
        if isinstance(config, fam.config_type):
            return fam
    raise ContractError(f"{type(config).__name__} is not the config of a registered family")


def hf_architecture(hf: dict) -> str:
    """The first of a Hugging Face ``config.json``'s ``architectures`` that a family loads; ContractError naming
    them otherwise."""
    archs = hf.get("architectures") or []
    supported = [a for a in archs if a in HF_ARCHITECTURES]
    if not supported:
        raise ContractError(f"architectures={archs} is not supported (supported: {sorted(HF_ARCHITECTURES)})")
    return supported[0]


def config_from_hf(hf: dict):
    """``(architecture, config)`` of a Hugging Face ``config.json`` (as a dict), without torch; ContractError
    naming the unsupported architecture or option or the missing field."""
    arch = hf_architecture(hf)
    return arch, FAMILIES[HF_ARCHITECTURES[arch]].config_from_hf(arch, hf)


__all__ = ["FAMILIES", "HF_ARCHITECTURES", "MODEL_TYPES", "config_from_hf", "family", "family_of_config",
           "hf_architecture"]
