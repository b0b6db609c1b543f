"""The layout planner (:mod:`shardline.recipes.planning.search`) and ``shardline plan``.

The search is checked against an independent brute force: every layout of a small job enumerated here without
the planner's pruning (escalation, representative ranks, the CP tile floor), each estimated over all pipeline
ranks and priced, must give the same best step and the same fitting set. Every row is re-derived from
``memory.estimate`` and ``steptime.predict``; the hard rules hold on every row; the CLI's JSON has the issue's
keys; bad input is one error naming the value, a layout that does not fit a row naming its numbers.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re

import pytest

from shardline.recipes.cli import main
from shardline.recipes.planning import memory, search, steptime
from shardline.recipes.planning.catalog import PlanError, cluster, load_catalog
from shardline.recipes.planning.layout import PlanLayout
from shardline.recipes.planning.models import PACKAGED, from_hf_config, load_model, packaged
from shardline.recipes.schema import RecipeError

CATALOG = load_catalog()
H100 = CATALOG.cluster("dgx-h100")
A100_40 = CATALOG.cluster("dgx-a100-40gb")
ROW_KEYS = {"tp", "pp", "dp", "cp", "chunks", "sp", "zero_stage", "offload_optimizer", "offload_params", "recompute",
            "micro_batches", "micro_batch_size", "fits", "memory_gib", "max_memory_rank", "step_s",
            "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "time_s"}
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "buffers", "total"}


# --- --layout ------------------------------------------------------------------------------------------------

def test_parse_layout_reads_every_key_and_the_offload_words():
    got = search.parse_layout("tp=8, pp=4,dp=2,cp=2,chunks=2,zero=3,offload=cpu+params,recompute=full,"
                              "micro_batches=8,micro_batch_size=2,sp=ring,schedule=interleaved")
    assert got == dict(tp=8, pp=4, dp=2, cp=2, chunks=2, zero_stage=3, offload_optimizer="cpu", offload_params="cpu",
                       recompute="full", micro_batches=8, micro_batch_size=2, sp="ring", schedule="interleaved")
    PlanLayout(**got)  # a complete, valid layout
    assert search.parse_layout("offload=nvme") == {"offload_optimizer": "nvme", "offload_params": "none"}
    assert search.parse_layout("") == {}


@pytest.mark.parametrize("text, named", [("tq=2", "'tq'"), ("tp=two", "tp='two'"), ("tp", "'tp'"),
                                         ("offload=gpu", "offload='gpu'")])
def test_parse_layout_names_the_bad_item(text, named):
    with pytest.raises(RecipeError, match=named):
        search.parse_layout(text)


# --- the search against a brute force ------------------------------------------------------------------------

def _brute_force(model, cl, *, gpus, seq_len, global_batch, usable):
    """Every layout, no pruning: {layout: step_s} of those that fit (all pipeline ranks estimated)."""
    out = {}
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for tp, cp, pp in itertools.product(divisors, repeat=3):
        if gpus % (tp * cp * pp) or tp > cl.gpus_per_node:
            continue
        dp = gpus // (tp * cp * pp)
        if global_batch % dp:
            continue
        replica = global_batch // dp
        sps = (["none", "megatron"] if tp > 1 else ["none"]) if cp == 1 else ["ring", "ulysses"]
        scheds = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("gpipe", 1)] + [
            ("interleaved", v) for v in range(2, 1 + model.n_layer // pp)]
        for sp, (sched, v), mbs, z, (oo, op), rc in itertools.product(
                sps, scheds, [b for b in range(1, replica + 1) if replica % b == 0], range(4),
                [("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "none"), ("nvme", "nvme")],
                ["none", "full"]):
            try:
                lay = PlanLayout(tp=tp, pp=pp, dp=dp, cp=cp, chunks=v, sp=sp, schedule=sched, zero_stage=z,
                                 offload_optimizer=oo, offload_params=op, recompute=rc,
                                 micro_batches=replica // mbs, micro_batch_size=mbs)
                est = memory.estimate(model, lay, seq_len=seq_len)
                pred = steptime.predict(model, lay, cl, seq_len=seq_len)
            except (RecipeError, PlanError):
                continue
            if est.most_loaded.total <= usable:
                out[lay] = pred.step_s
    return out


@pytest.mark.parametrize("name, gpus, global_batch, seq", [("gpt2-350m", 8, 16, 1024), ("llama2-7b", 8, 8, 4096)])
def test_the_best_layout_is_the_brute_forces_best(name, gpus, global_batch, seq):
    model = packaged(name)
    cl = A100_40
    result = search.plan(model, cl, gpus=gpus, seq_len=seq, global_batch=global_batch)
    brute = _brute_force(model, cl, gpus=gpus, seq_len=seq, global_batch=global_batch, usable=result.usable_bytes)
    assert brute, "the brute force found nothing that fits: the case tests nothing"
    best = min(brute.values())
    assert result.best.step_s == pytest.approx(best, rel=1e-12)
    planned = {r.layout: r.step_s for r in result.fitting}
    assert set(planned) <= set(brute)  # nothing the planner calls fitting is not
    for lay, step in planned.items():
        assert step == pytest.approx(brute[lay], rel=1e-12)
    # what the planner skips is slower than its best, or a rule it states (gpipe, nvme, selective)
    faster_missing = [lay for lay, s in brute.items() if lay not in planned and s < result.best.step_s]
    assert not faster_missing


def test_every_row_obeys_the_hard_rules_and_is_recomputed_exactly():
    model, gpus, gb, seq = packaged("llama3-70b"), 64, 256, 8192
    result = search.plan(model, H100, gpus=gpus, seq_len=seq, global_batch=gb)
    assert len(result.fitting) > 100
    steps = [r.step_s for r in result.fitting]
    assert steps == sorted(steps)
    assert len({r.layout for r in result.rows}) == len(result.rows)
    for row in result.fitting[:: max(1, len(result.fitting) // 60)]:
        lay = row.layout
        assert lay.world == gpus and lay.global_batch == gb
        assert H100.gpus_per_node % lay.tp == 0 and model.n_head % lay.tp == 0 and model.d_ff % lay.tp == 0
        assert lay.cp == 1 or seq % (2 * lay.cp) == 0
        assert lay.schedule != "interleaved" or lay.micro_batches % lay.pp == 0
        full = memory.estimate(model, lay, seq_len=seq)  # every pipeline rank, not the planner's representatives
        assert full.most_loaded == row.memory.most_loaded
        assert full.most_loaded.total <= result.usable_bytes
        assert steptime.predict(model, lay, H100, seq_len=seq).step_s == row.step_s


def test_recompute_and_offload_only_when_the_lighter_level_does_not_fit():
    model = packaged("llama2-70b")
    result = search.plan(model, H100, gpus=8, seq_len=4096, global_batch=8)
    assert result.fitting
    for row in result.fitting:
        lay = row.layout
        if lay.recompute == "none" and lay.offload_optimizer == "none":
            continue
        lighter = dataclasses.replace(lay, recompute="none", offload_optimizer="none", offload_params="none")
        for z in range(4):
            try:
                est = memory.estimate(model, dataclasses.replace(lighter, zero_stage=z), seq_len=4096)
            except RecipeError:
                continue
            assert est.most_loaded.total > result.usable_bytes, (lay, z)


def test_offload_is_chosen_when_it_beats_recompute():
    # llama3-70b on 64 H100s: tp=1,cp=4 needs 88.8 GiB without recompute; full recompute fits at ZeRO-3 but
    # CPU offload of the optimizer (no recompute) is faster: both levels are priced, the faster one wins.
    model = packaged("llama3-70b")
    fixed = {"tp": 1, "pp": 1, "cp": 4, "sp": "ring", "micro_batch_size": 1, "zero_stage": 3}
    # headroom 5%: the offload row (74.5 GiB) is tight under the default 10% (test_choice.py covers that)
    result = search.plan(model, H100, gpus=64, seq_len=8192, global_batch=256, layout=fixed, headroom=0.05)
    levels = {(r.layout.recompute, r.layout.offload_optimizer, r.layout.offload_params): r.step_s
              for r in result.fitting}
    assert ("none", "none", "none") not in levels
    assert {("full", "none", "none"), ("none", "cpu", "none")} <= set(levels)
    assert result.best.step_s == min(levels.values())
    assert levels[("none", "cpu", "none")] < levels[("full", "none", "none")]
    # checked against the DGX H100's 2 TB (job/hardware.yaml), so no "not checked" note
    assert not [n for r in result.fitting for n in r.notes if "CPU RAM" in n]
    unknown = search.plan(model, dataclasses.replace(H100, cpu_ram_gib=None), gpus=64, seq_len=8192,
                          global_batch=256, layout=fixed)
    assert "GiB of CPU RAM per node (not checked" in " ".join(
        n for r in unknown.fitting if r.layout.offload_optimizer == "cpu" for n in r.notes)
    assert "GiB of CPU RAM per node (not checked" in search.format_table(unknown, top=0)


def test_offload_beyond_the_nodes_cpu_ram_does_not_fit_by_default():
    """llama3-405b on one DGX H100 with everything offloaded: its CPU states exceed the node's 2 TB (the
    catalog's, no --cpu-ram-gib given): a row that says so, never a silent "fits"."""
    model = packaged("llama3-405b")
    fixed = {"tp": 8, "pp": 1, "cp": 1, "zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu",
             "recompute": "full", "micro_batch_size": 1}
    result = search.plan(model, H100, gpus=8, seq_len=8192, global_batch=8, layout=fixed)
    assert not result.fitting
    row = result.rows[0]
    need = search._node_cpu_bytes(row.memory, H100) / search.GIB
    assert need > 2048
    assert f"does not fit: offload needs {need:.0f} GiB of CPU RAM per node > cpu_ram_gib=2048" in row.problems
    assert "CPU RAM per node > cpu_ram_gib=2048" in search.format_table(result, top=0)
    roomy = search.plan(model, H100, gpus=8, seq_len=8192, global_batch=8, layout=fixed, cpu_ram_gib=need + 1)
    assert not [p for p in roomy.rows[0].problems if "CPU RAM" in p], roomy.rows[0].problems


def test_a_fixed_offload_does_not_bring_back_selective_recompute_under_flash():
    """selective equals none under flash attention (a standing rejected note): fixing the offload must not price
    it again as duplicate rows."""
    result = search.plan(packaged("llama3-70b"), H100, gpus=64, seq_len=8192, global_batch=256,
                         layout={"tp": 1, "pp": 1, "cp": 4, "sp": "ring", "micro_batch_size": 1,
                                 "offload_optimizer": "cpu"})
    assert result.rows and {r.layout.recompute for r in result.rows} <= {"none", "full"}
    assert "recompute=selective" in result.rejected
    keys = [search.describe(r.layout) for r in result.rows]
    assert len(keys) == len(set(keys))
    asked = search.plan(packaged("llama3-70b"), H100, gpus=64, seq_len=8192, global_batch=256,
                        layout={"tp": 1, "pp": 1, "cp": 4, "sp": "ring", "micro_batch_size": 1,
                                "offload_optimizer": "cpu", "recompute": "selective"})
    assert asked.rows and {r.layout.recompute for r in asked.rows} == {"selective"}


def test_usable_memory_is_binary_hbm_less_the_headroom():
    result = search.plan(packaged("gpt2-125m"), H100, gpus=8, seq_len=1024, global_batch=8, headroom=0.1)
    assert result.usable_bytes == 80 * 2**30 * 0.9


# --- layouts that cannot run ---------------------------------------------------------------------------------

def test_a_layout_that_does_not_fit_is_a_row_naming_its_numbers():
    fixed = search.parse_layout("tp=8,pp=1,cp=1,zero=0,recompute=none,micro_batch_size=1,offload=none,sp=none")
    result = search.plan(packaged("llama3-70b"), H100, gpus=8, seq_len=8192, global_batch=64, layout=fixed)
    (row,) = result.rows
    assert not row.fits and row.prediction is not None  # priced all the same
    total = row.memory.most_loaded.total / 2**30
    assert f"does not fit: {total:.1f} GiB on rank 0" in row.problems[0]
    assert f"> {result.usable_bytes / 2**30:.1f} GiB usable" in row.problems[0]
    with pytest.raises(PlanError, match="no layout of 'llama3-70b' fits 8 x h100-sxm"):
        _ = result.best


def test_a_layout_that_cannot_divide_names_the_numbers():
    result = search.plan(packaged("llama3-70b"), H100, gpus=24, seq_len=8192, global_batch=48, layout={"tp": 3})
    assert not result.rows
    assert result.rejected["tp=3"] == "n_head=64, d_ff=28672, n_kv_head=8 not divisible by tp=3"
    result = search.plan(packaged("llama3-8b"), H100, gpus=8, seq_len=8192, global_batch=6,
                         layout={"tp": 1, "pp": 1, "cp": 1})
    assert not result.rows
    assert result.rejected["tp=1,cp=1,pp=1"] == "dp=8 does not divide global_batch=6"
    # a fixed micro-batch count no layout can split the batch into: each structure says why
    result = search.plan(packaged("llama3-8b"), H100, gpus=8, seq_len=8192, global_batch=64,
                         layout={"micro_batches": 5})
    assert not result.rows
    assert result.rejected["tp=1,cp=1,pp=1,micro_batches=5"] == (
        "micro_batches=5 does not divide global_batch/dp = 64/8 = 8")
    result = search.plan(packaged("llama3-8b"), H100, gpus=8, seq_len=8192, global_batch=64,
                         layout={"micro_batches": 4, "micro_batch_size": 1})
    assert not result.rows
    assert result.rejected["tp=1,cp=1,pp=1,micro_batches=4"] == (
        "micro_batches=4 needs micro_batch_size = 8/4 = 2, not 1 (dp=8)")
    # interleaving needs m a multiple of pp: with 2 sequences per replica, pp=4 cannot interleave
    result = search.plan(packaged("llama3-8b"), H100, gpus=8, seq_len=8192, global_batch=4,
                         layout={"pp": 4, "dp": 2, "chunks": 2})
    assert not result.rows
    assert result.rejected["pp=4,interleaved"] == (
        "interleaved needs micro_batches a multiple of pp=4: global_batch/dp = 4/2 gives micro_batches [1, 2]")
    assert "offload=nvme" in result.rejected  # a standing note: never searched, priced when asked


def test_tp_beyond_a_node_is_searched_never_but_priced_when_asked():
    result = search.plan(packaged("llama3-70b"), H100, gpus=32, seq_len=4096, global_batch=32)
    assert max(r.layout.tp for r in result.rows) <= 8
    asked = search.plan(packaged("llama3-70b"), H100, gpus=32, seq_len=4096, global_batch=32, layout={"tp": 16})
    assert asked.rows and all(r.layout.tp == 16 for r in asked.rows)
    assert "TP crosses the NICs" in asked.rows[0].notes[0]
    # tp=16 > n_kv_head=8: K/V heads replicated in pairs, priced (not refused) and fitting
    wide = search.plan(packaged("llama3-8b"), H100, gpus=16, seq_len=4096, global_batch=16,
                       layout={"tp": 16, "pp": 1, "cp": 1})
    assert wide.fitting and all(r.prediction is not None for r in wide.fitting)


@pytest.mark.parametrize("kwargs, named", [
    (dict(gpus=12), "gpus=12 is not a whole number of 8-GPU nodes"),
    (dict(gpus=3), "gpus=3 (one partial node) must divide gpus_per_node=8"),
    (dict(seq_len=9000), "seq_len=9000 exceeds the model's seq_len=8192"),
    (dict(global_batch=0), "global_batch=0 must be an integer >= 1"),
    (dict(layout={"tp": 8, "pp": 2, "cp": 1, "dp": 2}), "= 32 != gpus=8"),
    (dict(layout={"sp": "zigzag"}), "sp='zigzag' must be one of"),
    (dict(layout={"zero": 1}), "unknown field"),
    (dict(layout={"pp": 3}), "layout: pp=3 does not divide gpus=8"),
    (dict(layout={"pp": 0}), "pp=0 must be an integer >= 1"),
    (dict(layout={"tp": 2, "cp": 0}), "cp=0 must be an integer >= 1"),
    (dict(layout={"zero_stage": 5}), "zero_stage=5 must be 0, 1, 2 or 3"),
    (dict(layout={"pp": 1, "chunks": 3}), "pp=1 has no pipeline schedule (chunks=3"),
    (dict(layout={"sp": "ring", "cp": 1}), "sp='ring' needs cp > 1 (cp=1)"),
    (dict(layout={"pp": 4, "chunks": 16}), "pp*chunks = 4*16 > n_layer=32"),
    (dict(headroom=1.5), "headroom=1.5 must be a share of HBM in [0, 1)"),
    (dict(layout={"tp": 1, "pp": 1, "cp": 1, "micro_batches": 3, "micro_batch_size": 2}),
     "micro_batches*micro_batch_size*dp = 3*2*8 = 48 != global_batch=64"),
])
def test_bad_requests_are_one_error_naming_the_value(kwargs, named):
    args = dict(gpus=8, seq_len=8192, global_batch=64) | kwargs
    with pytest.raises(PlanError, match=re.escape(named)):
        search.plan(packaged("llama3-8b"), H100, **args)


# --- models from a Hugging Face config -------------------------------------------------------------------------

def _hf_count(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied parameters counted once


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gpt2"])
def test_a_hugging_face_config_counts_what_transformers_builds(kind, tmp_path):
    import transformers

    small = dict(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    config = {"llama": lambda: transformers.LlamaConfig(**small),
              "mistral": lambda: transformers.MistralConfig(**small),
              "qwen2": lambda: transformers.Qwen2Config(**small, tie_word_embeddings=True),
              "gpt2": lambda: transformers.GPT2Config(vocab_size=1000, n_positions=512, n_embd=256, n_layer=3,
                                                      n_head=8)}[kind]()
    config.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}[kind]]
    (tmp_path / "config.json").write_text(config.to_json_string())
    spec = load_model(str(tmp_path))
    assert spec.params() == _hf_count(config)


def test_model_files_and_their_errors(tmp_path):
    yaml_file = tmp_path / "m.yaml"
    yaml_file.write_text("architecture: llama\nvocab_size: 256\nseq_len: 128\nn_layer: 2\nn_head: 4\n"
                         "n_kv_head: 2\nd_model: 128\nd_ff: 344\nlr: 0.003\n")
    assert load_model(str(yaml_file)).n_kv_head == 2
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  vocab_size: 256\n  seq_len: 64\n  n_layer: 2\n  n_head: 4\n  d_model: 64\n")
    assert load_model(str(recipe)).architecture == "gpt2" and load_model(str(recipe)).d_ff == 256
    (tmp_path / "bad.yaml").write_text("architecture: llama\nn_layer: 2\n")
    with pytest.raises(RecipeError, match="missing vocab_size, seq_len, n_head, d_model, d_ff"):
        load_model(str(tmp_path / "bad.yaml"))
    with pytest.raises(RecipeError, match="architectures=\\['BertModel'\\] is not supported"):
        from_hf_config({"architectures": ["BertModel"]}, source="x/config.json")
    with pytest.raises(RecipeError, match="'num_hidden_layers' is missing"):
        from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "max_position_embeddings": 8,
                        "num_attention_heads": 2, "hidden_size": 8, "intermediate_size": 16})
    with pytest.raises(RecipeError, match="attention_bias=True is not supported"):
        from_hf_config({"architectures": ["LlamaForCausalLM"], "attention_bias": True})
    for bad, named in (("n_head: '4'", "n_head='4' must be an integer"), ("tie_embeddings: 'no'",
                                                                          "tie_embeddings='no' must be true"),
                       ("head_dim: 0", "head_dim=0 must be an integer >= 1 or unset"),
                       ("n_layer: true", "n_layer=True must be an integer")):
        text = yaml_file.read_text().replace("n_head: 4", "n_head: 4" if "n_head" not in bad else bad)
        text = text.replace("n_layer: 2", bad if bad.startswith("n_layer") else "n_layer: 2")
        if not bad.startswith(("n_head", "n_layer")):
            text += bad + "\n"
        (tmp_path / "typed.yaml").write_text(text)
        with pytest.raises(RecipeError, match=re.escape(named)):
            load_model(str(tmp_path / "typed.yaml"))
    with pytest.raises(RecipeError, match="'nope' is neither a packaged model"):
        load_model("nope")


# --- the command line ----------------------------------------------------------------------------------------

def test_cli_json_has_the_issues_shape(capsys):
    rc = main(["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100-sxm", "--seq", "4096",
               "--global-batch", "64", "--json", "--top", "3"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["model"]["params"] == PACKAGED["llama3-8b"].params() == 8_030_261_248
    assert out["cluster"]["gpus"] == 16 and out["cluster"]["nodes"] == 2 and out["cluster"]["gpu"] == "h100-sxm"
    assert len(out["layouts"]) == 3
    for row in out["layouts"]:
        assert ROW_KEYS <= set(row) and set(row["memory_gib"]) == MEMORY_KEYS and row["fits"]
        assert {"compute", "all_reduce", "all_gather", "reduce_scatter", "p2p", "bubble", "offload",
                "exposed_comm"} <= set(row["time_s"])
        assert row["tp"] * row["pp"] * row["dp"] * row["cp"] == 16
        assert math.isclose(sum(row["memory_gib"][k] for k in MEMORY_KEYS - {"total"}), row["memory_gib"]["total"])
    steps = [r["step_s"] for r in out["layouts"]]
    assert steps == sorted(steps)


def test_cli_follows_the_runs_deepspeed_config(capsys, tmp_path):
    """--deepspeed-config: the NVMe offload's CPU RAM and drive bytes follow its buffers and max_in_cpu (the
    estimate's own numbers for those settings), a buffer DeepSpeed would refuse is a row's named problem, a bad file
    one error naming it; --emit carries the config into the recipe."""
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--seq", "4096", "--global-batch",
            "8", "--layout", "tp=1,pp=1,cp=1,zero=3,offload=nvme+params,recompute=full,micro_batch_size=1", "--json"]
    config = {"zero_optimization": {"offload_param": {"max_in_cpu": 1e8, "buffer_count": 6}}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    assert main(base) == 0
    default = json.loads(capsys.readouterr().out)["layouts"][0]
    assert main(base + ["--deepspeed-config", str(tmp_path / "ds.json"), "--emit", str(tmp_path / "r.yaml")]) == 0
    row = json.loads(capsys.readouterr().out)["layouts"][0]
    lay = PlanLayout(dp=8, zero_stage=3, offload_optimizer="nvme", offload_params="nvme", recompute="full")
    for got, zero in ((default, memory.DEFAULT_ZERO), (row, memory.ZeroSettings.from_deepspeed(config))):
        rank = memory.estimate(PACKAGED["llama3-8b"], lay, seq_len=4096, zero=zero).ranks[0]
        assert math.isclose(got["cpu_gib_per_gpu"], rank.cpu / 2**30) and math.isclose(got["nvme_gib_per_gpu"],
                                                                                         rank.nvme / 2**30)
    assert row["cpu_gib_per_gpu"] < default["cpu_gib_per_gpu"]  # 1e8 of 1e9 partition elements kept in CPU RAM
    assert any("GiB per GPU on the drive" in note for note in row["notes"])
    assert "deepspeed_config: " + str(tmp_path / "ds.json") in (tmp_path / "r.yaml").read_text()
    (tmp_path / "small.json").write_text(json.dumps({"zero_optimization": {"offload_param": {"buffer_size": 5e7}}}))
    assert main(base + ["--deepspeed-config", str(tmp_path / "small.json")]) == 1
    refused = json.loads(capsys.readouterr().out)["layouts"][0]
    assert not refused["fits"] and any("exceeds offload_param.buffer_size=50000000" in p for p in refused["problems"])
    (tmp_path / "bad.json").write_text('{"zero_optimization": {"sub_group_size": "big"}}')
    assert main(base + ["--deepspeed-config", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "sub_group_size='big'" in err
    (tmp_path / "ds.yaml").write_text("zero_optimization:\n  sub_group_size: 1e9\n")  # fit reads JSON only
    assert main(base + ["--deepspeed-config", str(tmp_path / "ds.yaml")]) == 2
    assert "ds.yaml: not valid JSON: line 1" in capsys.readouterr().err


def test_cli_table_and_errors(capsys):
    assert main(["plan", "--model", "gpt2-125m", "--gpus", "8", "--cluster", "dgx-a100-80gb",
                 "--global-batch", "32", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "gpt2-125m (0.12B params) on 8 x a100-80gb" in out and "\n1  " in out and "\n2  " in out
    assert main(["plan", "--model", "gpt2-125m", "--gpus", "8", "--gpu", "h101", "--global-batch", "8"]) == 2
    assert "unknown gpu 'h101' (known: a100-40gb" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt2-125m", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch", "8",
                 "--layout", "tp=x"]) == 2
    assert "--layout tp='x' must be an integer" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt2-125m", "--gpu", "h100-sxm"]) == 2
    assert "give --gpus and --global-batch" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-70b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch", "64",
                 "--layout", "tp=8,pp=1,cp=1,zero=0,recompute=none,micro_batch_size=1,offload=none,sp=none"]) == 1
    assert "does not fit: " in capsys.readouterr().out


def test_cli_overrides_the_node(capsys):
    assert main(["plan", "--model", "gpt2-125m", "--gpus", "8", "--gpu", "h100-sxm", "--gpus-per-node", "4",
                 "--interconnect", "roce", "--nics-per-node", "2", "--global-batch", "8", "--json", "--top", "1"]) == 0
    got = json.loads(capsys.readouterr().out)["cluster"]
    assert (got["gpus_per_node"], got["inter_node"], got["nics_per_node"], got["nodes"]) == (4, "roce", 2, 2)
    assert got["name"] == "4xh100-sxm"


def test_cli_calibrates_from_a_real_profile(traces_dir, capsys):
    candidates = sorted(traces_dir.rglob("*.json*"))
    b200 = [p for p in candidates if "b200" in str(p).lower()]
    if not b200:
        pytest.skip(f"no B200 trace under {traces_dir}")
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--cluster", "dgx-b200", "--global-batch", "64",
            "--json", "--top", "1", "--layout", "tp=8,pp=1,cp=1,zero=1,recompute=none,micro_batch_size=1,"
                                                "offload=none,sp=none"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)["layouts"][0]["time_s"]["compute"]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(base + ["--calibrate", str(b200[0])]) == 0
    captured = capsys.readouterr()
    calibrated = json.loads(captured.out)["layouts"][0]["time_s"]["compute"]
    assert "matmul_fraction_bf16" in captured.err
    assert calibrated != plain  # the measured GEMM rate replaced the catalog's


def test_a_cluster_from_names_matches_the_packaged_node():
    assert cluster(CATALOG, gpu="h100-sxm", gpus_per_node=8, inter_node="ib-ndr", nics_per_node=8,
                   name="dgx-h100", cpu_ram_gib=2048) == H100
    # a node built from names has no CPU RAM unless given: offload's CPU RAM is then noted as unchecked
    assert cluster(CATALOG, gpu="h100-sxm", gpus_per_node=8, inter_node="ib-ndr", nics_per_node=8).cpu_ram_gib is None


def test_cli_compares_a_real_profile_with_its_layout(traces_dir, capsys, tmp_path):
    profile = traces_dir / "param" / "dlrm_kineto"
    if not profile.is_dir():
        pytest.skip(f"{profile} is not in the trace corpus")
    base = ["plan", "--model", "gpt2-125m", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "8",
            "--compare", str(profile)]
    assert main(base) == 2
    assert "--compare needs the run's layout" in capsys.readouterr().err
    assert main(base + ["--layout", "tp=1,pp=1,cp=1,zero=1,micro_batch_size=1", "--format", "json",
                        "-o", str(tmp_path / "c.json")]) == 0
    got = json.loads((tmp_path / "c.json").read_text())
    assert "wrote" in capsys.readouterr().err
    assert got["layout"]["dp"] == 8 and got["layout"]["zero_stage"] == 1  # dp filled in from --gpus
    assert {r["rank"] for r in got["rows"]} == set(range(8)) | {-1}
    assert main(base[:4] + ["4"] + base[5:] + ["--layout", "tp=1,pp=1,cp=1"]) == 2
    assert "world size 8 but the layout has world 4" in capsys.readouterr().err


def test_cli_compare_writes_parquet_and_tensorboard(traces_dir, capsys, tmp_path):
    """The profiler's other report formats: parquet (the table itself) and TensorBoard (predicted and measured
    runs overlaid rank by rank; the all-ranks means; the markdown report), each needing -o."""
    import pandas as pd
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    profile = traces_dir / "param" / "dlrm_kineto"
    if not profile.is_dir():
        pytest.skip(f"{profile} is not in the trace corpus")
    base = ["plan", "--model", "gpt2-125m", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "8",
            "--compare", str(profile), "--layout", "tp=1,pp=1,cp=1,zero=1,micro_batch_size=1"]
    assert main(base + ["--format", "json", "-o", str(tmp_path / "c.json")]) == 0
    rows = pd.DataFrame(json.loads((tmp_path / "c.json").read_text())["rows"])
    assert main(base + ["--format", "parquet"]) == 2
    assert "--format parquet needs -o FILE" in capsys.readouterr().err
    assert main(base + ["--format", "parquet", "-o", str(tmp_path / "c.parquet")]) == 0
    table = pd.read_parquet(tmp_path / "c.parquet")
    assert list(table.columns) == list(rows.columns) and len(table) == len(rows)
    assert table["measured_ns"].tolist() == rows["measured_ns"].tolist()
    assert main(base + ["--format", "tensorboard", "-o", str(tmp_path / "tb")]) == 0
    step = rows[rows["category"] == "step"].set_index("rank")
    for side, column in (("predicted", "predicted_s"), ("measured", "measured_s")):
        acc = EventAccumulator(str(tmp_path / "tb" / side))
        acc.Reload()
        got = {e.step: e.value for e in acc.Scalars("compare_ms/step")}
        assert got == pytest.approx({r: 1e3 * step.loc[r, column] for r in range(8)}, rel=1e-6)  # float32
        (mean,) = acc.Scalars("compare_ms_all_ranks/step")
        assert mean.value == pytest.approx(1e3 * step.loc[-1, column], rel=1e-6)
    root = EventAccumulator(str(tmp_path / "tb"))
    root.Reload()
    assert "compare/report" in root.Tags()["tensors"]
