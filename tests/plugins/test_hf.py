"""Hugging Face checkpoints in and out (``shardline.plugins.hf``) against transformers itself: tiny random models
built and saved by ``transformers``, loaded by :func:`from_pretrained` dense and per rank (tp2, tp2 with GQA
below and above tp, pp2 x tp2), the loss compared with transformers' own forward on the same tokens; saved back by
:func:`save_pretrained` from dense and sharded layouts into a folder ``AutoModelForCausalLM`` loads with exactly
the original tensors; every kind of bad folder refused, naming the file and tensor."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shardline.plugins.grid import Grid, ParallelDims
from shardline.plugins.hf import CheckpointError, from_pretrained, save_pretrained
from shardline.plugins.testing import run_ranks

transformers = pytest.importorskip("transformers")

SEQ = 16
LLAMA = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 500.0}
CASES = {
    "llama-gqa2": ("LlamaForCausalLM", dict(LLAMA, num_key_value_heads=2)),
    "llama3-kv1-tied": ("LlamaForCausalLM", dict(LLAMA, num_key_value_heads=1, tie_word_embeddings=True,
                                                 rope_parameters=LLAMA3)),
    "qwen2-bias": ("Qwen2ForCausalLM", dict(LLAMA, num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral": ("MistralForCausalLM", dict(LLAMA, num_key_value_heads=2, sliding_window=None)),
    "llama-kv4": ("LlamaForCausalLM", dict(LLAMA, num_attention_heads=8, num_key_value_heads=4)),  # kv > tp
    "gpt2": ("GPT2LMHeadModel", dict(vocab_size=37, n_positions=64, n_embd=32, n_layer=2, n_head=4)),
}


def _save_hf(case: str, folder) -> None:
    arch, options = CASES[case]
    config = getattr(transformers, arch.replace("ForCausalLM", "Config").replace("LMHeadModel", "Config"))(
        **options)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random everywhere (transformers starts norms at one and biases at zero)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + noise / 4 if "norm" in name or "ln_" in name else noise * 0.2)
    model.save_pretrained(folder, max_shard_size="20KB")  # several shard files and an index


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (2, SEQ), generator=gen)
    return ids, ids.roll(-1, dims=1)


def _hf_loss(folder, ids, targets) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).item()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for case in CASES:
        folder = tmp_path_factory.mktemp(case)
        _save_hf(case, folder)
        out[case] = folder
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_dense_load_matches_transformers(case, folders):
    folder = folders[case]
    assert len(list(folder.glob("*.safetensors"))) > 1  # a sharded checkpoint with its index
    model = from_pretrained(folder)
    ids, targets = _batch(model.config.vocab_size)
    with torch.no_grad():
        ours = model(ids, targets).item()
    # float32 on both sides, different summation orders (and transformers' float32 rotary tables): rtol 1e-5.
    assert ours == pytest.approx(_hf_loss(folder, ids, targets), rel=1e-5)


def _sharded_loss(rank, world, folder, tp, pp, cp, sp):
    grid = Grid.build(ParallelDims(world, tp=tp, pp=pp, cp=cp, sp=sp))
    model = from_pretrained(folder, grid=grid)
    ids, targets = _batch(model.config.vocab_size)
    if pp == 1:
        with torch.no_grad():
            return model(*model.shard_batch(ids, targets)).item()  # cp: this rank's load-balanced tokens
    from shardline.job import placement
    from shardline.job.pipeline.schedule import build_schedule
    from shardline.plugins.pipeline import PipelineEngine
    from shardline.plugins.pipeline.partition import build_stages, partition_layers

    layers = model.pipeline_layers()
    stages = build_stages(layers, partition_layers(layers, pp, method="uniform"))
    mine = {s: stages[s] for s in placement.stages_of_rank(grid.rank("pp"), n_stages=pp, pp=pp)}
    engine = PipelineEngine(mine, schedule=build_schedule("forward_only", n_ranks=pp, n_microbatches=2),
                            pp_rank=grid.rank("pp"), loss_fn=model.loss, group=grid.group("pp"))
    with torch.no_grad():
        return float(engine.run_batch(ids, targets))


LAYOUTS = [  # (case, tp, pp, cp, sp)
    ("llama-gqa2", 2, 1, 1, "none"),         # n_kv_heads = tp: one KV head per rank
    ("llama3-kv1-tied", 2, 1, 1, "none"),    # n_kv_heads < tp: the head shared by both ranks
    ("llama-kv4", 2, 1, 1, "megatron"),      # n_kv_heads > tp, Megatron-SP
    ("llama3-kv1-tied", 1, 1, 2, "ring"),    # rotary positions follow CP's load-balanced layout
    ("qwen2-bias", 1, 1, 2, "ulysses"),
    ("mistral", 1, 2, 1, "none"),
    ("qwen2-bias", 2, 2, 1, "none"),
    ("gpt2", 2, 1, 1, "megatron"),
    ("gpt2", 2, 2, 1, "none"),
]


@pytest.mark.parametrize(("case", "tp", "pp", "cp", "sp"), LAYOUTS,
                         ids=[f"{c}-tp{t}-pp{p}-cp{k}-{s}" for c, t, p, k, s in LAYOUTS])
def test_each_rank_loads_its_slices_and_the_loss_matches_transformers(case, tp, pp, cp, sp, folders):
    folder = folders[case]
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ids, targets = _batch(vocab)
    expected = _hf_loss(folder, ids, targets)
    for loss in run_ranks(_sharded_loss, tp * pp * cp, str(folder), tp, pp, cp, sp, timeout=120):
        assert loss == pytest.approx(expected, rel=1e-5)  # float32, TP/CP/PP reductions: rtol 1e-5


def _tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.parametrize("case", ["llama-gqa2", "llama3-kv1-tied", "qwen2-bias", "gpt2"])
def test_dense_round_trip_is_exact_and_transformers_loads_it(case, folders, tmp_path):
    original = _tensors(folders[case])
    save_pretrained(from_pretrained(folders[case]), tmp_path, max_shard_bytes=30_000)
    saved = _tensors(tmp_path)
    kept = {k: v for k, v in original.items() if not (k == "lm_head.weight" and k not in saved)}
    assert saved.keys() == kept.keys()
    for name, tensor in kept.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, tensor in reloaded.state_dict().items():
        if name in kept:
            assert torch.equal(tensor, kept[name]), name


def _save_sharded(rank, world, folder, out, tp, pp):
    grid = Grid.build(ParallelDims(world, tp=tp, pp=pp))
    model = from_pretrained(folder, grid=grid)
    save_pretrained(model, out, grid=grid, max_shard_bytes=30_000)
    return True


@pytest.mark.parametrize(("case", "tp", "pp"), [("llama3-kv1-tied", 2, 1), ("qwen2-bias", 2, 2),
                                                ("gpt2", 2, 2)])
def test_sharded_save_streams_to_the_same_folder(case, tp, pp, folders, tmp_path):
    run_ranks(_save_sharded, tp * pp, str(folders[case]), str(tmp_path), tp, pp, timeout=120)
    original, saved = _tensors(folders[case]), _tensors(tmp_path)
    for name, tensor in saved.items():
        assert torch.equal(tensor, original[name]), name
    assert set(original) - set(saved) <= {"lm_head.weight"}  # a tied head is the embedding


# --- bad input -------------------------------------------------------------------------------------------------

def test_bad_folders_are_refused_naming_the_file_and_tensor(folders, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(CheckpointError, match=r"architectures=\['BertForMaskedLM'\] is not supported"):
        from_pretrained(tmp_path)

    import shutil

    def copy(name):
        target = tmp_path / name
        shutil.copytree(folders["llama-gqa2"], target)
        return target

    missing = copy("missing")
    index = json.loads((missing / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (missing / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['model.layers.1.mlp.down_proj"):
        from_pretrained(missing)

    damaged = copy("damaged")
    file = sorted(damaged.glob("*.safetensors"))[0]
    file.write_bytes(file.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=file.name):
        from_pretrained(damaged)

    shaped = copy("shaped")
    config = json.loads((shaped / "config.json").read_text())
    config["intermediate_size"] = 40
    (shaped / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[48, 32\]"):
        from_pretrained(shaped)

    extra = copy("extra")
    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.rotary_scale": torch.ones(3)}, str(extra / "extra.safetensors"))
    index = json.loads((extra / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.rotary_scale"] = "extra.safetensors"
    (extra / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"no place for: \['model.layers.0.self_attn.rotary_scale'\]"):
        from_pretrained(extra)

    # A layout the model cannot take, refused from the config before any tensor is read (a stand-in grid).
    with pytest.raises(CheckpointError, match="n_head=4 is not divisible by tp=8"):
        from_pretrained(folders["llama-gqa2"], grid=Grid.stand_in(ParallelDims(8, tp=8), rank=0))


def _with_tensor(folders, tmp_path, name: str, change) -> tuple:
    """A copy of the llama-gqa2 folder whose tensor ``name`` is ``change(tensor)``; (folder, the file holding it)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "changed"
    shutil.copytree(folders["llama-gqa2"], folder)
    file = folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(file))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(file), metadata={"format": "pt"})
    return folder, file


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn])
def test_integer_and_8bit_weights_are_refused_not_cast(folders, tmp_path, dtype):
    # Before: an int32 weight was cast to float (0/1 values: near-zero weights) and trained on without a word.
    name = "model.layers.1.mlp.up_proj.weight"
    folder, file = _with_tensor(folders, tmp_path, name, lambda t: t.to(dtype))
    stored = {torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
              torch.float8_e4m3fn: "F8_E4M3"}[dtype]
    with pytest.raises(CheckpointError) as info:
        from_pretrained(folder)
    assert str(info.value) == (
        f"{file}: tensor '{name}' [48, 32] is stored as {stored}, not a float dtype (F16, BF16, F32, F64): a "
        "quantized checkpoint's weights, which are not supported (cast to float they would be wrong weights); use "
        "the model's float16, bfloat16 or float32 weights")


def test_a_quantization_config_is_refused(folders, tmp_path):
    folder, _ = _with_tensor(folders, tmp_path, "model.norm.weight", lambda t: t)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(CheckpointError, match=r"config.json: quantization_config \(quant_method='gptq'\): quantized "
                                              r"checkpoints are not supported"):
        from_pretrained(folder)


def test_non_finite_weights_warn_once_naming_the_tensor(folders, tmp_path):
    name = "model.layers.0.self_attn.q_proj.weight"

    def poison(t):
        t = t.clone()
        t[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        return t

    folder, file = _with_tensor(folders, tmp_path, name, poison)
    with pytest.warns(RuntimeWarning) as caught:
        model = from_pretrained(folder)
    messages = [str(w.message) for w in caught if "NaN or infinite" in str(w.message)]
    assert messages == [f"{file}: tensor '{name}' holds 3 NaN or infinite values of 1024 in this rank's part "
                        "[32, 32] (as torch.float32); training from it gives a non-finite loss"]
    assert torch.isnan(dict(model.named_parameters())["blocks.0.qkv.q_weight"]).any()  # loaded as stored, warned
