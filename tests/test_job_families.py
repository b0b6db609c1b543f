"""The model families' torch-free rooms (shardline.job.gpt, .llama, registered in .families) and the pipeline's cut
(shardline.job.stages): one statement each, read by the models, Hugging Face loading, the planner and the
Lightning module."""

from __future__ import annotations

import pytest

from shardline.job import stages
from shardline.job.errors import ContractError
from shardline.job.families import FAMILIES, HF_ARCHITECTURES, MODEL_TYPES, config_from_hf, family_of_config
from shardline.job.family import Degrees
from shardline.job.gpt import GPTConfig
from shardline.job.layout import SPMode
from shardline.job.llama import LlamaConfig, RopeScaling

LLAMA3 = LlamaConfig(vocab_size=1000, seq_len=512, n_layer=3, n_head=8, n_kv_head=2, d_model=256, d_ff=688,
                     rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192})


@pytest.mark.parametrize("config", [
    GPTConfig(vocab_size=1000, seq_len=512, n_layer=3, n_head=8, d_model=256),
    GPTConfig(vocab_size=1000, seq_len=512, n_layer=3, n_head=8, d_model=256, d_ff=512, tie_embeddings=False),
    LLAMA3,
    LlamaConfig(vocab_size=1000, seq_len=512, n_layer=3, n_head=8, d_model=256, d_ff=688, qkv_bias=True,
                tie_embeddings=True),
], ids=["gpt2", "gpt2-untied", "llama3", "qwen2"])
def test_config_json_round_trips_through_the_family(config):
    family = family_of_config(config)
    arch, hf = family.config_to_hf(config)
    assert HF_ARCHITECTURES[arch] == family.name and hf["model_type"] == MODEL_TYPES[arch]
    assert config_from_hf(hf) == (arch, config)
    assert isinstance(LLAMA3.rope_scaling, RopeScaling)


def test_unsupported_configs_name_the_field():
    with pytest.raises(ContractError, match=r"architectures=\['BertModel'\] is not supported"):
        config_from_hf({"architectures": ["BertModel"]})
    with pytest.raises(ContractError, match="'num_hidden_layers' is missing"):
        config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "max_position_embeddings": 8,
                        "num_attention_heads": 2, "hidden_size": 8, "intermediate_size": 16})
    with pytest.raises(ContractError, match="attention_bias=True is not supported"):
        config_from_hf({"architectures": ["MistralForCausalLM"], "attention_bias": True})


def test_closed_forms_count_the_published_sizes():
    from shardline.recipes.planning.models import PACKAGED

    # GPT-2 small (tied): 124,439,808; Llama 2 7B: 6,738,415,616; Llama 3 8B: 8,030,261,248
    assert PACKAGED["gpt2-125m"].params() == 124_439_808
    assert PACKAGED["llama2-7b"].params() == 6_738_415_616
    assert PACKAGED["llama3-8b"].params() == 8_030_261_248
    for spec in PACKAGED.values():
        family = FAMILIES[spec.architecture]
        assert spec.block_params() == sum(family.block_numels(spec, tp=1))


def test_layout_rules_are_the_familys_for_configs_and_planner_shapes_alike():
    from shardline.recipes.planning.models import PACKAGED

    spec = PACKAGED["llama2-70b"]
    config = spec.shardline_config()
    for dims in (Degrees(tp=3), Degrees(tp=16), Degrees(tp=2, cp=2, sp=SPMode.ULYSSES), Degrees(tp=8)):
        assert FAMILIES["llama"].layout_problems(spec, dims) == FAMILIES["llama"].layout_problems(config, dims)
    assert FAMILIES["llama"].layout_problems(config, Degrees(tp=8)) == []
    assert FAMILIES["gpt2"].layout_problems(PACKAGED["gpt2-125m"], Degrees(tp=5)) == [
        "n_head=12 is not divisible by tp=5", "d_ff=3072 is not divisible by tp=5"]


@pytest.mark.parametrize(("n", "pp", "chunks"), [(34, 4, 1), (10, 2, 2), (6, 1, 1), (50, 8, 3)])
def test_the_cut_is_the_pipelines(n, pp, chunks):
    from shardline.plugins.pipeline.partition import partition_layers

    if pp > 1:
        assert stages.uniform_bounds(n, pp * chunks) == list(partition_layers(n, pp * chunks).bounds)
    hosted = [stages.hosted_stages(n, pp=pp, chunks=chunks, pp_rank=r) for r in range(pp)]
    assert sorted(i for h in hosted for r in h.values() for i in r) == list(range(n))
    assert all(s % pp == r for r, h in enumerate(hosted) for s in h)
