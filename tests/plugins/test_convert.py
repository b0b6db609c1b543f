"""``shardline convert``: a shardline checkpoint to a Hugging Face folder and to one consolidated state dict, in
one process (:mod:`shardline.plugins.checkpoint.convert`, :mod:`shardline.recipes.convert`).

Real checkpoints, made once per module by real 4-rank training runs of 2 AdamW steps:

- ``llama``: GQA (4 query heads, 2 KV heads), an untied head and a vocabulary of 61 that tp pads, at tp2 x pp2 x
  ZeRO-1;
- ``gpt2``: the head tied to the embedding across pipeline stages, at dp2 x pp2 x ZeRO-3;
- ``probed``: the Llama at tp2 x dp2 x ZeRO-2 in a LightningModule that also trains a parameter outside the
  decoder (``probe``);

and, for the memory test, a 34.6 MB Llama of 75 tensors at dp2 x ZeRO-1.

Each run also writes the trained model with :func:`hf.save_pretrained` (the gather over the run's own process
group): the independent reference a conversion must equal bit for bit. The consolidated state dict is checked
against the checkpoint's canonical tensors through :func:`~shardline.plugins.checkpoint.boxes.canonical_tensor`
(the save path's converter, the direction :func:`from_canonical` inverts), and logits against transformers' own forward.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins import hf
from shardline.plugins.checkpoint import files
from shardline.plugins.checkpoint.boxes import Placement, canonical_tensor, full
from shardline.plugins.checkpoint.convert import to_hf, to_state_dict
from shardline.plugins.checkpoint.reader import CheckpointReader
from shardline.plugins.hf import CheckpointError
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.cli import main
from shardline.recipes.lit_lm import LanguageModule

transformers = pytest.importorskip("transformers")

SEQ, BATCH, STEPS = 16, 8, 2
LLAMA = dict(architecture="llama", vocab_size=61, seq_len=SEQ, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
             tie_embeddings=False, lr=3e-3, warmup_steps=1)
GPT2 = dict(architecture="gpt2", vocab_size=64, seq_len=SEQ, n_layer=2, n_head=4, d_model=32, tie_embeddings=True,
            lr=3e-3, warmup_steps=1)
#: A model of many tensors for the memory test: 8 blocks, 75 tensors, 34.6 MB of float32 weights, largest 1 MiB.
BIG = (dict(architecture="llama", vocab_size=512, seq_len=SEQ, n_layer=8, n_head=4, d_model=256, d_ff=1024,
            tie_embeddings=False, lr=3e-3, warmup_steps=1), dict(zero_stage=1))
RUNS = {"llama": (LLAMA, dict(tp=2, pp=2, zero_stage=1)), "gpt2": (GPT2, dict(pp=2, zero_stage=3)),
        "probed": (LLAMA, dict(tp=2, zero_stage=2))}


class ProbedModule(LanguageModule):
    """The language model plus a parameter outside the decoder (a learned loss scale, trained with it)."""

    def configure_model(self) -> None:
        super().configure_model()
        if not hasattr(self, "probe"):
            self.probe = nn.Parameter(torch.ones(3))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * self.probe.mean()


def _dataset(vocab: int) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (BATCH * STEPS, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _train(rank, world, name, root):
    model, layout = RUNS.get(name) or BIG
    adopt_process_group_in_lightning()
    strategy = HybridParallelStrategy(**layout)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    module = (ProbedModule if name == "probed" else LanguageModule)(**model)
    dp = strategy.layout_for(world).dp
    trainer.fit(module, DataLoader(_dataset(model["vocab_size"]), batch_size=BATCH // dp))
    path = f"{root}/checkpoints/step{STEPS}"
    with _no_unpickling():  # the format's every file, written and read by every rank, without one unpickle
        trainer.save_checkpoint(path)
        loaded = strategy.load_checkpoint(path)
    assert loaded["global_step"] == STEPS and loaded["hyper_parameters"]["lr"] == model["lr"], loaded
    if name == "llama":
        _legacy_loads_only_when_trusted(rank, path, f"{root}/legacy", strategy)
    if name not in RUNS:
        return True
    network = module.network
    if layout.get("zero_stage") == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(network.parameters())):
            hf.save_pretrained(network, f"{root}/run_hf", grid=strategy.grid, max_shard_bytes=20_000)
    else:
        hf.save_pretrained(network, f"{root}/run_hf", grid=strategy.grid, max_shard_bytes=20_000)
    return True


class _Unpickled(AssertionError):
    pass


@contextlib.contextmanager
def _no_unpickling():
    """Every unpickler raises inside: pickle's ``Unpickler``, ``load`` and ``loads``, and ``torch.load``."""
    def refuse(*args, **kwargs):
        raise _Unpickled("something unpickled a file of the checkpoint format")

    class Refusing(pickle.Unpickler):
        def __init__(self, *args, **kwargs):
            refuse()

    saved = pickle.Unpickler, pickle.load, pickle.loads, torch.load, torch.serialization.load
    pickle.Unpickler, pickle.load, pickle.loads = Refusing, refuse, refuse
    torch.load = torch.serialization.load = refuse
    try:
        yield
    finally:
        pickle.Unpickler, pickle.load, pickle.loads, torch.load, torch.serialization.load = saved


def _as_version_2(folder: Path, out: Path) -> None:
    """``folder`` as a format-version-2 checkpoint wrote it: its state files as ``torch.save`` pickles under the
    old names (``trainer.pt``, ``rank-00003.pt``), the manifest's sizes and CRCs to match."""
    shutil.copytree(folder, out)
    manifest = json.loads((out / files.MANIFEST).read_text())
    with CheckpointReader(out) as reader:
        for name in [n for n in manifest["files"] if files.is_state_file(n)]:
            buffer = io.BytesIO()
            torch.save(reader.state_file(name), buffer)
            old = files.legacy_name(name)
            (out / old).write_bytes(buffer.getvalue())
            (out / name).unlink()
            del manifest["files"][name]
            manifest["files"][old] = {"size": len(buffer.getvalue()), "crc32": reader.checksum.of(buffer.getvalue())}
    manifest["version"] = 2
    (out / files.MANIFEST).write_text(json.dumps(manifest))


def _legacy_loads_only_when_trusted(rank, path, legacy, strategy) -> None:
    """Lightning's ``weights_only`` reaches the load: None (its default) refuses a version-2 checkpoint's pickled
    state on every rank, naming the file; an explicit False unpickles it, with a warning, and loads the same."""
    import torch.distributed as dist

    if rank == 0:
        _as_version_2(Path(path), Path(legacy))
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"trainer.pt: a pickle .*shardline convert --migrate --trust"):
        strategy.load_checkpoint(legacy)
    with pytest.warns(UserWarning, match=r"unpickled its pickled state files \(format version 2\) because "
                                         r"weights_only=False"):
        trusted = strategy.load_checkpoint(legacy, weights_only=False)
    assert trusted["global_step"] == STEPS


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Each run's folder: ``checkpoints/`` (a folder of checkpoints, ``latest`` -> ``step2``) and ``run_hf``."""
    out = {}
    for name in RUNS:
        root = tmp_path_factory.mktemp(name)
        run_ranks(_train, 4, name, str(root), timeout=300)
        out[name] = root
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _dense_module(path: Path, cls=LanguageModule):
    """The trained model as a dense, strategy-free LightningModule, from the consolidated file."""
    return cls.load_from_checkpoint(path).eval()


IDS = torch.randint(0, 61, (2, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", list(RUNS))
def test_hf_folder_is_the_runs_own_save_pretrained_bit_for_bit(name, runs, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the probed run's non-decoder parameter: its own test below
        done = to_hf(runs[name] / "checkpoints", tmp_path / "hf", max_shard_bytes=20_000)
    run_hf = runs[name] / "run_hf"
    assert len(list(run_hf.glob("*.safetensors"))) > 2  # several shards: the limit really cuts
    # The same files, names and bytes (config.json, index, every shard): the model the run gathered over its
    # own process group (float32 weights: ZeRO keeps the module's parameters equal to its fp32 master copy).
    assert _files(tmp_path / "hf") == _files(run_hf)
    assert done.out == tmp_path / "hf" and done.checkpoint.name == f"step{STEPS}"
    assert not list(tmp_path.glob(".*"))  # nothing left beside the output


@pytest.mark.parametrize("name", list(RUNS))
def test_transformers_loads_the_folder_with_the_trained_models_logits(name, runs, tmp_path):
    root = runs[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        to_hf(root / "checkpoints", tmp_path / "hf")
    to_state_dict(root / "checkpoints", tmp_path / "model.ckpt")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert theirs.dtype == torch.float32
    module = _dense_module(tmp_path / "model.ckpt", ProbedModule if name == "probed" else LanguageModule)
    ours = hf.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        want = module.network(IDS)
        logits = theirs(input_ids=IDS).logits
        again = ours(IDS)
    assert want.shape == logits.shape == (2, SEQ, RUNS[name][0]["vocab_size"])
    # The same weights through two implementations in float32 (transformers' eager attention and float32 rotary
    # tables, our SDPA and float64 ones): logits of O(0.5) agree to float32 rounding, measured <= 1.6e-7
    # absolute. A wrong name, orientation or q/k/v split gives O(0.1) differences.
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)
    # Our own loader over the converted folder and the consolidated state dict: the same tensors, the same code.
    assert torch.equal(again, want)


@pytest.mark.parametrize("name", list(RUNS))
def test_state_dict_is_the_checkpoint_consolidated_and_loads_into_the_dense_module(name, runs, tmp_path):
    model, _ = RUNS[name]
    folder = runs[name] / "checkpoints" / f"step{STEPS}"
    done = to_state_dict(runs[name] / "checkpoints", tmp_path / "model.ckpt", optimizer=True)
    saved = torch.load(tmp_path / "model.ckpt", weights_only=True)  # plain values only: safe to load
    with CheckpointReader(folder) as reader:
        trainer = reader.state_file(files.TRAINER_FILE)
    assert saved["global_step"] == trainer["global_step"] == STEPS and saved["epoch"] == trainer["epoch"]
    assert saved["hyper_parameters"] == trainer["hyper_parameters"]
    assert saved["pytorch-lightning_version"] == pl.__version__
    sd = saved["state_dict"]
    cls = ProbedModule if name == "probed" else LanguageModule
    dense = cls(**model)
    dense.configure_model()  # no trainer: the dense model
    expected = dense.state_dict()
    assert sorted(sd) == sorted(expected)  # every key (the module's own order is not the file's business)
    assert all(sd[k].shape == expected[k].shape and sd[k].dtype == torch.float32 for k in sd)
    dense.load_state_dict(sd)  # strict

    # Every tensor mapped back to its canonical layout by the save path's converter equals the checkpoint's.
    reader = CheckpointReader(folder)
    network = dense.network
    config = network.config
    table = network.family.hf_table(config)

    def canonical(key: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
        local = key.removeprefix("lm.")
        if key.startswith("lm.") and local in table:
            source = table[local]
            whole = Placement(source.kind, tuple(value.shape), full(value.shape), vocab=config.vocab_size,
                              n_head=config.n_head)
            return source.name, canonical_tensor(whole, value)
        return key, value

    for key, value in sd.items():
        cname, cvalue = canonical(key, value)
        assert torch.equal(cvalue, reader.read(cname)), key
    if config.tie_embeddings:  # one tensor under both names
        assert sd["lm.head.weight"].data_ptr() == sd["lm.embedding.wte.weight"].data_ptr()
    state = saved["shardline_optimizer"]
    assert state["state_keys"] == ["exp_avg", "exp_avg_sq"] and state["step"] == STEPS
    assert state["param_groups"][0]["lr"] == pytest.approx(model["lr"])  # warm-up over: the full lr
    params = dict(dense.named_parameters())
    assert sorted(state["state"]) == sorted(params)  # every parameter, a tied one once
    for key, moments in state["state"].items():
        for moment, value in moments.items():
            assert value.shape == params[key].shape
            cname, cvalue = canonical(key, value)
            assert torch.equal(cvalue, reader.read(f"optimizer.{moment}/{cname}")), (key, moment)
    assert done.tensors == len({v.data_ptr() for v in sd.values()})


def test_a_parameter_outside_the_decoder_is_named_and_kept_out_of_the_hf_folder(runs, tmp_path):
    with pytest.warns(UserWarning, match=r"1 tensors not written \(not weights of the decoder model at 'lm\.'\)"
                                         r": probe"):
        done = to_hf(runs["probed"] / "checkpoints", tmp_path / "hf")
    assert done.not_written == ("probe",)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "probe" not in index["weight_map"] and not any(n.startswith("optimizer.") for n in index["weight_map"])
    to_state_dict(runs["probed"] / "checkpoints", tmp_path / "model.ckpt")
    module = _dense_module(tmp_path / "model.ckpt", ProbedModule)
    reader = CheckpointReader(runs["probed"] / "checkpoints" / f"step{STEPS}")
    assert torch.equal(module.probe.detach(), reader.read("probe"))
    assert not torch.equal(module.probe.detach(), torch.ones(3))  # trained: the saved value, not the init


def test_bfloat16(runs, tmp_path):
    ckpt = runs["llama"] / "checkpoints"
    to_hf(ckpt, tmp_path / "f32")
    to_hf(ckpt, tmp_path / "bf16", dtype="bfloat16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    from safetensors.torch import load_file

    f32, bf16 = ({k: v for f in sorted((tmp_path / d).glob("*.safetensors")) for k, v in load_file(f).items()}
                 for d in ("f32", "bf16"))
    assert f32.keys() == bf16.keys()
    for name, value in f32.items():  # the float32 weight rounded to nearest-even: exactly torch's cast
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], value.to(torch.bfloat16)), name
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert theirs.dtype == torch.bfloat16

    to_state_dict(ckpt, tmp_path / "bf16.ckpt", dtype=torch.bfloat16, optimizer=True)
    saved = torch.load(tmp_path / "bf16.ckpt", weights_only=True)
    to_state_dict(ckpt, tmp_path / "f32.ckpt", optimizer=True)
    base = torch.load(tmp_path / "f32.ckpt", weights_only=True)
    for key, value in base["state_dict"].items():
        assert torch.equal(saved["state_dict"][key], value.to(torch.bfloat16)), key
    for key, moments in base["shardline_optimizer"]["state"].items():
        for moment, value in moments.items():
            assert torch.equal(saved["shardline_optimizer"]["state"][key][moment], value.to(torch.bfloat16))


# --- the command ------------------------------------------------------------------------------------------------

def test_command_writes_both_targets(runs, tmp_path, capsys):
    root = runs["gpt2"]
    # A folder of checkpoints: its ``latest``; 20KB is 20,000 bytes (Hugging Face's reading of a size).
    assert main(["convert", str(root / "checkpoints"), str(tmp_path / "hf"), "--to", "hf",
                 "--max-shard-size", "20KB"]) == 0
    assert _files(tmp_path / "hf") == _files(root / "run_hf")
    assert main(["convert", str(root / "checkpoints" / f"step{STEPS}"), str(tmp_path / "m.ckpt"),
                 "--to", "state_dict", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'hf'}" in out and f"wrote {tmp_path / 'm.ckpt'}" in out
    saved = torch.load(tmp_path / "m.ckpt", weights_only=True)
    assert {v.dtype for v in saved["state_dict"].values()} == {torch.bfloat16}
    assert "shardline_optimizer" not in saved


def test_command_errors_are_one_line_and_exit_2(runs, tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "readme.txt").write_text("not a checkpoint")
    ckpt = str(runs["llama"] / "checkpoints")
    cases = [
        (["convert", str(notes), str(tmp_path / "a"), "--to", "hf"], rf"{notes}: not a shardline checkpoint"),
        (["convert", ckpt, str(notes), "--to", "state_dict"], rf"{notes}: already exists"),
        (["convert", ckpt, str(tmp_path / "b"), "--to", "hf", "--max-shard-size", "lots"],
         r"--max-shard-size 'lots': not a size"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("shardline convert: error: "), err
        assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


class _Boom:
    """A malicious pickle's payload: unpickling it runs a shell command."""

    def __reduce__(self):
        return os.system, ("touch PWNED",)


def test_a_malicious_trainer_pt_is_refused_and_migrating_needs_trust(runs, tmp_path, capsys, monkeypatch):
    """The attack: a checkpoint whose ``trainer.pt`` pickle calls ``os.system`` and whose manifest's size and CRC
    match it. ``convert`` refuses it in one line naming the file, runs nothing, writes nothing; ``--migrate``
    needs ``--trust``. A trusted migration of an honest version-2 copy gives today's files back, byte for byte."""
    monkeypatch.chdir(tmp_path)
    folder = runs["llama"] / "checkpoints" / f"step{STEPS}"
    honest = tmp_path / "v2"
    _as_version_2(folder, honest)
    evil = tmp_path / "evil"
    shutil.copytree(honest, evil)
    buffer = io.BytesIO()
    torch.save({"global_step": _Boom()}, buffer)
    (evil / "trainer.pt").write_bytes(buffer.getvalue())
    manifest = json.loads((evil / files.MANIFEST).read_text())
    manifest["files"]["trainer.pt"] = {"size": len(buffer.getvalue()), "crc32": files.WRITTEN.of(buffer.getvalue())}
    (evil / files.MANIFEST).write_text(json.dumps(manifest))
    cases = [(["--to", "state_dict"], rf"{evil}/trainer.pt: a pickle .* shardline convert --migrate --trust"),
             (["--migrate"], r"--migrate without --trust: .* unpickling runs whatever code"),
             (["--to", "hf", "--trust"], r"--trust goes with --migrate")]
    for extra, message in cases:
        assert main(["convert", str(evil), str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(message, err[0]), err
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "out").exists()
    assert main(["convert", str(honest), str(tmp_path / "v3"), "--migrate", "--trust"]) == 0
    for name in [n for n in json.loads((folder / files.MANIFEST).read_text())["files"] if files.is_state_file(n)]:
        assert (tmp_path / "v3" / name).read_bytes() == (folder / name).read_bytes(), name
    with CheckpointReader(tmp_path / "v3") as reader:
        assert reader.version == files.VERSION and torch.equal(reader.read("model.norm.weight"),
                                                               CheckpointReader(folder).read("model.norm.weight"))
    assert main(["convert", str(tmp_path / "v3"), str(tmp_path / "v4"), "--migrate", "--trust"]) == 2
    assert "already format version 3, which holds no pickle: nothing to migrate" in capsys.readouterr().err


def test_a_full_disk_during_convert_is_one_line_and_leaves_nothing(runs, tmp_path, capsys, monkeypatch):
    """What safetensors and torch.save raise when the disk fills (their own exception types, the OS error inside)
    becomes one line naming OUT, and neither the output nor a partial of it is left."""
    import safetensors.torch

    def full_disk_safetensors(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                          "message: \"No space left on device\" })")

    def full_disk_torch_save(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 320 vs 214")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk_safetensors)
    monkeypatch.setattr(torch, "save", full_disk_torch_save)
    ckpt = str(runs["llama"] / "checkpoints")
    for target, out, said in (("hf", tmp_path / "hf", "SafetensorError: Error while serializing"),
                              ("state_dict", tmp_path / "m.ckpt", "RuntimeError: [enforce fail at inline_container")):
        assert main(["convert", ckpt, str(out), "--to", target]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{out}: could not be written ({said}" in err[0] and "nothing was written" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --- bad input --------------------------------------------------------------------------------------------------

def _edited(runs, tmp_path, edit) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(runs["llama"] / "checkpoints" / f"step{STEPS}", folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_bad_checkpoints_are_refused_before_anything_is_written(runs, tmp_path):
    out = tmp_path / "out"
    missing = _edited(runs, tmp_path, lambda m: m["tensors"].pop("model.layers.1.mlp.down_proj.weight"))
    for convert in (to_hf, to_state_dict):
        with pytest.raises(CheckpointError, match=rf"{missing}/manifest.json: no tensor "
                                                  r"'model.layers.1.mlp.down_proj.weight' \(the model's "
                                                  r"lm.blocks.1.down.weight\)"):
            convert(missing, out)
    shutil.rmtree(missing)

    def reshape(m):
        m["tensors"]["model.norm.weight"]["shape"] = [33]

    shaped = _edited(runs, tmp_path, reshape)
    with pytest.raises(CheckpointError, match=r"tensor 'model.norm.weight' has shape \[33\], the model's config "
                                              r"needs \[32\] for lm.head.ln_f.weight"):
        to_hf(shaped, out)
    shutil.rmtree(shaped)

    def no_models(m):
        m["models"] = []

    bare = _edited(runs, tmp_path, no_models)
    with pytest.raises(CheckpointError, match=r"manifest.json: the checkpoint holds no shardline decoder model "
                                              r"\(module 'shardline.recipes.lit_lm.LanguageModule'\)"):
        to_hf(bare, out)
    with pytest.raises(CheckpointError, match=r"dtype='bf16' is not supported"):
        to_hf(runs["llama"] / "checkpoints", out, dtype="bf16")
    with pytest.raises(CheckpointError, match=r"model_index=1, the checkpoint holds 1 decoder models"):
        to_hf(runs["llama"] / "checkpoints", out, model_index=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited"]  # no output, no partial folder


# --- streaming ----------------------------------------------------------------------------------------------

#: Run in a fresh interpreter (as the command runs): the peak anonymous memory above the start while to_hf
#: runs, sampled every 0.5 ms. Anonymous only: the reader maps the checkpoint's files, and those page-cache pages
#: are not memory the conversion holds. glibc's M_MMAP_THRESHOLD at 64 KiB mmaps every tensor-sized block, so a
#: freed tensor leaves RSS at once (the default dynamic threshold keeps freed blocks in the heap).
PEAK_SCRIPT = """
import ctypes, json, sys
from shardline.plugins.checkpoint.convert import to_hf
ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: big buffers go back to the kernel when freed
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
to_hf(sys.argv[1], sys.argv[2] + "-warm", max_shard_bytes=int(sys.argv[3]))  # every import and cache, once
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the kernel's peak RSS (VmHWM) to the RSS now: no sampling, nothing to miss
start = status("VmRSS")
done = to_hf(sys.argv[1], sys.argv[2], max_shard_bytes=int(sys.argv[3]))
print(json.dumps({"peak": status("VmHWM") - start, "nbytes": done.nbytes}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").is_file(), reason="reads the kernel's peak RSS (Linux)")
def test_to_hf_holds_about_one_shard_whatever_the_model_size(tmp_path):
    import subprocess
    import sys

    run_ranks(_train, 2, "big", str(tmp_path), timeout=300)
    peaks = {}
    for limit in (2 << 20, 16 << 20):
        proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "checkpoints"),
                               str(tmp_path / f"hf{limit}"), str(limit)], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
        peaks[limit], total = answer["peak"], answer["nbytes"]
    assert total == 34_620_416  # float32 weights of the whole model
    largest = 1024 * 256 * 4
    # The shard in the writer plus the tensor in hand (and its predecessor while Python drops it), plus 2 MiB
    # of interpreter and reader overhead. Measured on this machine (the kernel's peak RSS above the RSS before
    # the call): 3.1 MB at 2 MiB shards, 17.9 MB at 16 MiB, for a 34.6 MB model.
    assert peaks[2 << 20] <= (2 << 20) + 2 * largest + (2 << 20), peaks
    assert peaks[2 << 20] < total / 4, peaks
    # The measurement sees what the writer holds: 16 MiB shards cost about 14 MiB more than 2 MiB shards.
    assert peaks[16 << 20] - peaks[2 << 20] >= 10 << 20, peaks
