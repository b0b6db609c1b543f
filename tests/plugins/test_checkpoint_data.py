"""A checkpoint is data, not code: its state files (:mod:`shardline.plugins.checkpoint.state`), what they hold and
refuse, file names confined to the checkpoint's folder, and a pickled (version 1-2) state file refused unless
trusted. The end-to-end proofs (a real 4-rank save and load under an unpickler that raises, the malicious
``trainer.pt`` through ``shardline convert``) are in ``test_convert.py``, beside its real checkpoints."""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import random
import shutil
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline.plugins.checkpoint import files, state
from shardline.plugins.checkpoint.reader import CheckpointReader
from shardline.plugins.errors import CheckpointError


def _lightning_like() -> dict:
    """The kinds of values Lightning 2.6's checkpoint dict and a rank's own state hold (seen in a real save)."""
    score = torch.tensor(2)
    return {"epoch": 0, "global_step": 2, "pytorch-lightning_version": "2.6.6",
            "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.batch_progress": {
                "total": {"ready": 2, "completed": 1}, "is_last_batch": True}}},
            "callbacks": {"ModelCheckpoint{'monitor': 'step', 'train_time_interval': None}": {
                "best_model_score": score, "best_k_models": {"/r/a.ckpt": torch.tensor(1), "/r/b.ckpt": score},
                "dirpath": "/r", "last_model_path": ""}},
            "lr_schedulers": [{"base_lrs": [0.003], "last_epoch": 2, "lr_lambdas": [None], "_last_lr": [0.003]}],
            "hyper_parameters": {"rope_theta": 1e4, "d_ff": None, "path": pathlib.Path("/data/x"), "lr": 3e-3},
            "param_groups": [{"betas": (0.9, 0.95), "fused": None, "eps": 1e-8}],
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            "odd": {3: "int key", (1, "a"): "tuple key", "nan": float("nan"), "inf": -float("inf"),
                    "bytes": b"\x00\xff", "set": {1, 2}, "np": np.float32(1.5), "i": np.int64(-7),
                    "size": torch.Size([2, 3]), "dtype": torch.bfloat16, "bf16": torch.ones(2, dtype=torch.bfloat16),
                    "view": score.view(1), "empty": torch.empty(0, 3)}}


def _same(a, b) -> bool:
    """Equal values and types, recursively (tensors bitwise, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def test_state_round_trips_every_kind_lightning_saves_and_restores_the_rng_streams():
    value = _lightning_like()
    data = state.encode(value, where="the trainer's state")
    back = state.decode(data, path="t")
    assert _same(back, value)
    # the file is plain safetensors: its tensors read with the library alone, its state is JSON in the header
    from safetensors.torch import load

    assert len(load(data)) == 8
    meta = state.header(data, "t")["__metadata__"]
    assert meta["format"] == "shardline-state" and json.loads(meta["value"])["dict"]["epoch"] == 0
    # the RNG states restore to the same streams
    np.random.set_state(back["rng"]["numpy"])
    random.setstate(back["rng"]["python"])
    torch.set_rng_state(back["rng"]["torch"])
    drawn = (np.random.rand(), random.random(), torch.rand(1).item())
    np.random.set_state(value["rng"]["numpy"])
    random.setstate(value["rng"]["python"])
    torch.set_rng_state(value["rng"]["torch"])
    assert drawn == (np.random.rand(), random.random(), torch.rand(1).item())


class _Opaque:
    pass


@pytest.mark.parametrize(("value", "where"), [
    ({"callbacks": {"EMA": {"shadow": _Opaque()}}}, r"the trainer's state\['callbacks'\]\['EMA'\]\['shadow'\]: a "
                                                    r".*_Opaque cannot be stored"),
    ({"fn": print}, r"\['fn'\]: a builtins.builtin_function_or_method cannot be stored"),
    ({"a": [np.array(["x"], dtype=object)]}, r"\['a'\]\[0\]: a numpy.ndarray cannot be stored"),
    ({"s": torch.eye(2).to_sparse()}, r"\['s'\]: a torch.Tensor cannot be stored .*sparse"),
    ({"k": {frozenset({1}): 1, torch.ones(1): 2}},
     r"\['k'\] key tensor\(\[1.\]\): a torch.Tensor cannot be stored in a checkpoint as a dict key"),
])
def test_a_value_that_only_code_can_rebuild_is_refused_at_save_time_by_its_key(value, where):
    with pytest.raises(CheckpointError, match=where):
        state.encode(value, where="the trainer's state")


def test_a_value_that_contains_itself_is_refused_not_a_recursion_error():
    loop: list = []
    loop.append(loop)
    with pytest.raises(CheckpointError, match=r"nested deeper than 64 levels \(or contains itself\)"):
        state.encode({"x": loop})


def _file(meta_value: str, *, tensors=None, version="1") -> bytes:
    from safetensors.torch import save

    return save(tensors or {}, metadata={"format": "shardline-state", "version": version, "value": meta_value})


@pytest.mark.parametrize(("data", "match"), [
    (b"\x01", r"not a state file \(1 bytes"),
    (struct.pack("<Q", 1 << 40) + b"{}", r"its header claims 1099511627776 bytes; the file has 2"),
    (struct.pack("<Q", 4) + b"[1]\x20", r"its header is a list"),
    (_file('{"dict": {"x": {"pickle": "gASV"}}}'), r"an unknown node 'pickle'"),
    (_file('{"tensor": "t9"}'), r"refers to a tensor 't9' it does not hold"),
    (_file('{"numpy": "object", "value": 1}'), r"a numpy scalar 'object'"),
    (_file('{"dtype": "load"}'), r"an unknown node 'dtype'"),
    (_file('{"items": [[[1], 2]]}'), r"an unhashable dict key"),
    (_file("[" * 100 + "]" * 100), r"nested deeper than 64 levels"),
    (_file("[" * 200_000 + "]" * 200_000), r"not a valid state file"),
    (_file("1", version="2"), r"not a shardline-state file of version 1"),
])
def test_decode_refuses_what_is_not_a_state_file_naming_it(data, match):
    with pytest.raises(CheckpointError, match=rf"^f\.bin: .*{match}"):
        state.decode(data, path="f.bin")


def _checkpoint(root: pathlib.Path, *, trainer: bytes | None = None, legacy: bytes | None = None,
                version: int | None = None) -> pathlib.Path:
    """A committed one-tensor checkpoint ``root/ck``; ``trainer``: a state file's bytes; ``legacy``: a
    ``trainer.pt`` with its manifest set to ``version`` (the size and CRC made to match, as whoever writes the
    file can)."""
    target = files.AtomicSave(root / "ck", files.AtomicSave.new_token())
    target.create()
    writer = files.ShardWriter(target.tmp, rank=0)
    writer.add("w", (2, 3), ((0, 2), (0, 3)), torch.arange(6.0).reshape(2, 3))
    writer.flush()
    crcs = {}
    for name, data in ((files.TRAINER_FILE, trainer), (files.LEGACY_TRAINER_FILE, legacy)):
        if data is not None:
            crcs[name] = files.write_small(data, target.tmp / name)
    manifest = files.build_manifest([writer.records], files.describe_files(target.tmp, writer.written + list(crcs),
                                                                           crcs), {"world_size": 1})
    if version is not None:
        manifest["version"] = version
    target.commit(manifest, rank=0)
    return root / "ck"


class _Boom:
    """What a malicious pickle carries: unpickling it calls ``os.system``."""

    def __reduce__(self):
        return os.system, ("touch PWNED",)


def test_a_pickled_trainer_file_never_runs_its_code_unless_trusted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    buffer = io.BytesIO()
    torch.save({"epoch": _Boom()}, buffer)  # what an attacker writes: a torch.save file whose pickle calls os.system
    evil = buffer.getvalue()
    for version in (2, 3):  # a version-2 manifest names it; a version-3 one's reader never looks at .pt files
        folder = _checkpoint(tmp_path / f"v{version}", legacy=evil, version=version,
                             trainer=state.encode({"epoch": 1}) if version == 3 else None)
        with CheckpointReader(folder) as reader:
            if version == 2:
                with pytest.raises(CheckpointError, match=rf"{folder}/trainer.pt: a pickle .* --migrate --trust"):
                    reader.state_file(files.TRAINER_FILE)
            else:
                assert reader.state_file(files.TRAINER_FILE) == {"epoch": 1}
            assert torch.equal(reader.read("w"), torch.arange(6.0).reshape(2, 3))
    assert not (tmp_path / "PWNED").exists()
    with CheckpointReader(tmp_path / "v2" / "ck") as reader:  # trust is what runs it: the test's pickle is live
        reader.state_file(files.TRAINER_FILE, trust_pickle=True)
    assert (tmp_path / "PWNED").exists()


def _rewrite(folder: pathlib.Path, change) -> None:
    manifest = json.loads((folder / files.MANIFEST).read_text())
    change(manifest)
    (folder / files.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../../../x.safetensors", "/etc/passwd", "sub/../rank-00000-000.safetensors", "..",
                                  "link.safetensors"])
def test_a_manifest_names_only_files_of_its_own_folder(tmp_path, name):
    folder = _checkpoint(tmp_path)
    outside = tmp_path / "x.safetensors"
    outside.write_bytes(b"secret")
    os.symlink(outside, folder / "link.safetensors")

    def point(manifest):
        manifest["files"][name] = {"size": 6, "crc32": None}
        manifest["tensors"]["w"]["pieces"][0][0] = name

    _rewrite(folder, point)
    with pytest.raises(CheckpointError, match=rf"'files' names '{name}', which is not a file of this folder"):
        CheckpointReader(folder)


def test_a_piece_in_an_unlisted_file_and_a_pointer_out_of_the_folder_are_refused(tmp_path):
    folder = _checkpoint(tmp_path)
    _rewrite(folder, lambda m: m["tensors"]["w"]["pieces"][0].__setitem__(0, "rank-00007-000.safetensors"))
    with CheckpointReader(folder) as reader, pytest.raises(
            CheckpointError, match=r"a piece names the file 'rank-00007-000.safetensors', which its 'files' do not"):
        reader.read("w")
    (tmp_path / files.POINTER).write_text("../../etc")
    with pytest.raises(CheckpointError, match=r"the pointer 'latest' names '../../etc', which is not a file of"):
        files.resolve(tmp_path)


@pytest.mark.parametrize(("change", "match"), [
    (lambda m: m.pop("tensors"), r"manifest.json: no 'tensors' table"),
    (lambda m: m.__setitem__("files", []), r"manifest.json: no 'files' table"),
    (lambda m: m["files"].__setitem__(next(iter(m["files"])), {"crc32": 1}), r"has no size"),
])
def test_a_misshapen_manifest_is_one_error_naming_it(tmp_path, change, match):
    folder = _checkpoint(tmp_path)
    _rewrite(folder, change)
    with pytest.raises(CheckpointError, match=match):
        CheckpointReader(folder)


def test_a_deep_manifest_and_a_lying_shard_header_are_errors_not_crashes(tmp_path):
    folder = _checkpoint(tmp_path)
    shard = next(folder.glob("rank-*-000.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 50)
    shard.write_bytes(bytes(raw))
    with CheckpointReader(folder) as reader, pytest.raises(
            CheckpointError, match=rf"{shard.name}: not a readable safetensors file \(its header length field says"):
        reader.read("w")
    (folder / files.MANIFEST).write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError, match=r"manifest.json: not a readable manifest"):
        CheckpointReader(folder)


def test_other_formats_named_as_a_checkpoint_are_refused_unread(tmp_path):
    lightning = tmp_path / "model.ckpt"
    lightning.write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match=r"model.ckpt: a file, not a shardline checkpoint folder"):
        files.resolve(lightning)
    native = tmp_path / "ds"
    (native / "global_step3").mkdir(parents=True)
    (native / "latest").write_text("global_step3")
    (native / "global_step3" / "mp_rank_00_model_states.pt").write_bytes(pickle.dumps(_Boom()))
    for path in (native, native / "global_step3"):
        with pytest.raises(CheckpointError, match=r"a DeepSpeed checkpoint .* never loads"):
            files.resolve(path)


def test_a_hugging_face_folder_of_pickled_weights_is_refused_and_its_auto_map_never_runs(tmp_path):
    """``.bin`` weights are ``torch.save`` pickles: refused, named; ``auto_map`` (remote code) is not imported."""
    from shardline.plugins import hf

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "auto_map": {"AutoModelForCausalLM": "pwned_module.Model"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match=r"its weights are \['pytorch_model.bin'\], torch.save pickles, which "
                                              r"shardline never loads"):
        hf.from_pretrained(tmp_path)
    import sys

    assert "pwned_module" not in sys.modules


def test_a_commit_removes_what_interrupted_saves_left_before_it_and_nothing_else(tmp_path):
    import time

    old_partial = tmp_path / ".ck-1.partial-0000aaaa"
    old_partial.mkdir()
    (old_partial / "rank-00000-000.safetensors").write_bytes(b"x" * 1000)
    placeholder = tmp_path / "ck-1"
    placeholder.mkdir()
    (placeholder / files.PENDING).write_text(old_partial.name + "\n")
    past = time.time() - 60
    for path in (old_partial, placeholder):
        os.utime(path, (past, past))
    other = tmp_path / "notes"  # not a save's: kept
    other.mkdir()
    os.utime(other, (past, past))
    target = files.AtomicSave(tmp_path / "ck-2", files.AtomicSave.new_token())
    newer = tmp_path / ".ck-3.partial-0000bbbb"  # begun after this save: another save's, still being written
    newer.mkdir()
    target.create()
    writer = files.ShardWriter(target.tmp, rank=0)
    writer.add("w", (1,), ((0, 1),), torch.ones(1))
    writer.flush()
    target.commit(files.build_manifest([writer.records], files.describe_files(target.tmp, writer.written),
                                       {"world_size": 1}), rank=0)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".ck-3.partial-0000bbbb", "ck-2", "latest", "notes"], names
    assert files.remove_leftovers(tmp_path, before=time.time() + 10) == [".ck-3.partial-0000bbbb"]


# --- fuzzing: a damaged or hostile checkpoint gives CheckpointError, never another exception ------------------

_ODD = [None, 0, -1, 1 << 62, 1.5, "x", "../x", "/etc/passwd", [], {}, [[0, 1]], [1, 2, 3], {"a": 1}, True, "F32",
        "I32", "\u00b2", [[0, 1 << 40]], [-1, 2]]


def _mutate(value, rng, depth=0):
    """One random change somewhere inside ``value`` (a replaced, removed or nested-changed item)."""
    if not isinstance(value, dict | list) or not value:
        return
    slot = rng.choice(sorted(value, key=str)) if isinstance(value, dict) else rng.randrange(len(value))
    roll = rng.random()
    if roll < 0.3 or depth > 6:
        value[slot] = rng.choice(_ODD)
    elif roll < 0.45:
        del value[slot]
    else:
        _mutate(value[slot], rng, depth + 1)


def _read_all(folder: pathlib.Path) -> None:
    with CheckpointReader(folder) as reader:
        for name in sorted(reader.tensors)[:4]:
            reader.read(name)
            shape = reader.shape(name)
            reader.read(name, tuple((min(1, n), n) for n in shape))
        if reader.has_state(files.TRAINER_FILE):
            reader.state_file(files.TRAINER_FILE)


@pytest.fixture(scope="module")
def _fuzz_base(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("fuzz")
    target = files.AtomicSave(root / "ck", files.AtomicSave.new_token())
    target.create()
    writer = files.ShardWriter(target.tmp, rank=0)
    for rows in ((0, 2), (2, 4)):
        writer.add("w", (4, 3), (rows, (0, 3)), torch.arange(6.0).reshape(2, 3))
    writer.add("b", (3,), ((0, 3),), torch.ones(3, dtype=torch.bfloat16))
    writer.flush()
    data = state.encode({"epoch": 1, "loops": {"x": [1, 2.5, None]}, "rng": torch.arange(4, dtype=torch.uint8)})
    crc = files.write_small(data, target.tmp / files.TRAINER_FILE)
    target.commit(files.build_manifest([writer.records], files.describe_files(
        target.tmp, writer.written + [files.TRAINER_FILE], {files.TRAINER_FILE: crc}), {"world_size": 1}), rank=0)
    _read_all(root / "ck")  # the undamaged checkpoint reads
    return root / "ck"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), changes=st.integers(1, 3), target=st.sampled_from(["manifest", "state",
                                                                                              "shard"]))
def test_fuzzed_checkpoints_give_only_checkpoint_errors_in_bounded_memory(_fuzz_base, tmp_path_factory, seed,
                                                                           changes, target):
    """Random changes to the manifest's values, to the state file's typed JSON (its CRC made to match, as an
    attacker would) or to a shard file's header bytes: reading is a clean read or a CheckpointError, and never
    allocates more than a few MB whatever a length field claims."""
    import random
    import tracemalloc

    rng = random.Random(seed)
    folder = tmp_path_factory.mktemp("case") / "ck"
    shutil.copytree(_fuzz_base, folder)
    manifest = json.loads((folder / files.MANIFEST).read_text())
    if target == "manifest":
        for _ in range(changes):
            _mutate(manifest, rng)
    elif target == "state":
        raw = (folder / files.TRAINER_FILE).read_bytes()
        found = state.header(raw, "t")
        value = json.loads(found["__metadata__"]["value"])
        for _ in range(changes):
            _mutate(value, rng)
        found["__metadata__"]["value"] = json.dumps(value)
        head = json.dumps(found).encode()
        head += b" " * (-len(head) % 8)
        offset = 8 + struct.unpack("<Q", raw[:8])[0]
        raw = struct.pack("<Q", len(head)) + head + raw[offset:]
        (folder / files.TRAINER_FILE).write_bytes(raw)
        manifest["files"][files.TRAINER_FILE] = {"size": len(raw), "crc32": files.WRITTEN.of(raw)}
    else:
        shard = next(folder.glob("rank-*-000.safetensors"))
        raw = bytearray(shard.read_bytes())
        for _ in range(changes):
            raw[rng.randrange(min(len(raw), 160))] = rng.randrange(256)
        shard.write_bytes(bytes(raw))
    (folder / files.MANIFEST).write_text(json.dumps(manifest))
    tracemalloc.start()
    try:
        _read_all(folder)
    except CheckpointError as error:
        assert "\n" not in str(error) and len(str(error)) < 2000, str(error)[:300]
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 16 << 20, peak
