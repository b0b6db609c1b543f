"""An independent reference for the Llama family: tiny random models built by Hugging Face ``transformers`` itself
(``LlamaForCausalLM`` with GQA, one with Llama-3 rope scaling and tied embeddings, ``Qwen2ForCausalLM`` with its
q/k/v bias), their weights copied into the dense shardline :class:`Llama` through a small name table, and the
logits and loss compared with transformers' own forward in float64 (eager attention).

The sharded layouts are tied to this reference through the dense model (``test_llama.py``: every layout equals the
dense model up to summation order). Loading real checkpoints (safetensors, slices per rank) is not tested here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardline.plugins.models.llama import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")

F64 = torch.float64
DIMS = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, rms_norm_eps=1e-5)
SEQ = 16
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
CASES = {
    "llama-gqa": ("LlamaForCausalLM", dict(num_key_value_heads=2, rope_theta=500.0, tie_word_embeddings=False)),
    "llama3-scaling-tied": ("LlamaForCausalLM", dict(num_key_value_heads=1, rope_theta=10000.0,
                                                     rope_scaling=LLAMA3, tie_word_embeddings=True)),
    "qwen2-bias": ("Qwen2ForCausalLM", dict(num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True)),
}


def _hf_model(arch: str, options: dict):
    opts = dict(options)
    rope = {"rope_type": "default", "rope_theta": opts.pop("rope_theta")}
    rope.update(opts.pop("rope_scaling", None) or {})
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**DIMS, **opts, rope_parameters=rope, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(F64).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random everywhere, norms included (transformers initialises them to one)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=F64)
            p.copy_(1 + noise / 4 if name.endswith("norm.weight") else noise * 0.2)
    return model, rope


def _our_config(arch: str, hf_config, rope: dict) -> LlamaConfig:
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope["rope_type"] == "llama3" else None
    return LlamaConfig(vocab_size=hf_config.vocab_size, seq_len=hf_config.max_position_embeddings,
                       n_layer=hf_config.num_hidden_layers, n_head=hf_config.num_attention_heads,
                       n_kv_head=hf_config.num_key_value_heads, d_model=hf_config.hidden_size,
                       d_ff=hf_config.intermediate_size, rope_theta=rope["rope_theta"], rope_scaling=scaling,
                       rms_norm_eps=hf_config.rms_norm_eps, tie_embeddings=hf_config.tie_word_embeddings,
                       qkv_bias=arch == "Qwen2ForCausalLM")  # Qwen2: q/k/v bias, none on o_proj


# Test-local name table (ours <- transformers'); the real loader's table is a later task.
_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
          "o_proj.weight": "self_attn.o_proj.weight", "down.weight": "mlp.down_proj.weight",
          "gate_up.gate_weight": "mlp.gate_proj.weight", "gate_up.up_weight": "mlp.up_proj.weight",
          **{f"qkv.{x}_{kind}": f"self_attn.{x}_proj.{kind}" for x in "qkv" for kind in ("weight", "bias")}}


def _hf_name(ours: str) -> str:
    if ours == "embedding.wte.weight":
        return "model.embed_tokens.weight"
    if ours == "head.ln_f.weight":
        return "model.norm.weight"
    if ours == "head.weight":
        return "lm_head.weight"
    _, index, rest = ours.split(".", 2)
    return f"model.layers.{index}.{_BLOCK[rest]}"


def _load_into_ours(hf_model, config: LlamaConfig) -> Llama:
    ours = Llama(config, seed=0, dtype=F64)
    theirs = dict(hf_model.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():  # a tied head is the embedding: listed once
            p.copy_(theirs.pop(_hf_name(name)))
    if config.tie_embeddings:
        assert hf_model.lm_head.weight is hf_model.model.embed_tokens.weight
    assert not theirs, f"transformers parameters left unmapped: {sorted(theirs)}"
    return ours


@pytest.mark.parametrize("case", list(CASES))
def test_dense_llama_matches_transformers_forward_logits_and_loss(case):
    arch, options = CASES[case]
    hf_model, rope = _hf_model(arch, options)
    config = _our_config(arch, hf_model.config, rope)
    ours = _load_into_ours(hf_model, config)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=gen)
    labels = ids.clone()
    labels[1, 5:9] = -100
    with torch.no_grad():
        out = hf_model(input_ids=ids, labels=labels)
        logits = ours(ids)
        # transformers shifts the labels inside (token t predicts t+1); ours takes targets aligned with the tokens
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        loss = ours.loss(logits, targets)
    assert out.logits.dtype == F64 and logits.shape == out.logits.shape
    # transformers computes the rotary angles and cos/sin in float32 even in a float64 model (relative error
    # ~6e-8 per entry) and we in float64: logits of O(4) agree to ~1e-6 absolute (measured: at most 1.4e-6
    # over these cases). rtol/atol 2e-5 leaves margin; a wrong rotation pairing, frequency or GQA head map
    # gives O(1) differences (dropping the Llama-3 scaling alone: 1.3).
    torch.testing.assert_close(logits, out.logits, rtol=2e-5, atol=2e-5)
    # transformers upcasts logits to float32 for its loss: compare to float32 resolution (eps 1.2e-7, loss ~20).
    torch.testing.assert_close(loss.float(), out.loss.float(), rtol=1e-5, atol=1e-5)
    # and the float64 cross-entropy of transformers' own float64 logits, which carries only the rotary noise
    want = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
