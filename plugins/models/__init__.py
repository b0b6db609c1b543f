"""Models built from shardline's layers on one decoder skeleton (``decoder``): ``gpt`` (GPT-2 style: LayerNorm,
GELU, learned positions) and ``llama`` (the Llama family: RMSNorm, SwiGLU, rotary positions with Llama-3 scaling,
grouped-query attention, optional Qwen2 q/k/v bias).

Each family's config, layout rules, Hugging Face names and parameter counts live torch-free in its room under
``shardline.job`` (:mod:`shardline.job.families`); the nn.Module of each family is registered in :func:`model_class`."""

from __future__ import annotations


def model_class(family: str):
    """The nn.Module class of the family called ``family`` (``gpt2`` -> GPT, ``llama`` -> Llama); imported when
    first asked for, so that ``shardline.job.families`` users that never build a model never import torch."""
    if family == "gpt2":
        from shardline.plugins.models.gpt import GPT

        return GPT
    if family == "llama":
        from shardline.plugins.models.llama import Llama

        return Llama
    raise KeyError(family)
