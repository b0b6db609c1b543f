"""Bad checkpoints are refused before any weight is overwritten, with our error naming the file and the tensor:
another architecture, another shape, weights the model has no place for, a missing, truncated or damaged shard, a
manifest that does not match."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.checkpoint.files import MANIFEST
from shardline.plugins.checkpoint.reader import CheckpointReader
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.lit_lm import LanguageModule

SEQ, VOCAB, BATCH = 16, 64, 4
LLAMA = dict(architecture="llama", vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
             lr=3e-3, warmup_steps=2, tie_embeddings=False)


def _data() -> DataLoader:
    tokens = torch.randint(0, VOCAB, (BATCH * 2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH // 2)


def _fit(rank, world, model, save_to, resume_from):
    """Train (one epoch) from ``resume_from`` and save to ``save_to`` (either a list: each rank its own path); on
    failure return the error text and whether the weights are still the freshly built ones (nothing was
    overwritten)."""
    adopt_process_group_in_lightning()
    if isinstance(resume_from, list):
        resume_from = resume_from[rank]
    if isinstance(save_to, list):
        save_to = save_to[rank]
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=HybridParallelStrategy(zero_stage=1),
                         max_epochs=1 if resume_from is None else 2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    module = LanguageModule(**model)
    fresh = {}

    class Snapshot(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            pl_module.configure_model()
            fresh.update({k: v.detach().clone() for k, v in pl_module.named_parameters()})

    trainer.callbacks.append(Snapshot())
    try:
        trainer.fit(module, _data(), ckpt_path=resume_from)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        unchanged = all(torch.equal(fresh[k], v.detach()) for k, v in module.named_parameters())
        # while the error (and its traceback's frames) lives: no file of the refused checkpoint is still mapped
        mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(resume_from) in line]
        return type(error).__name__, str(error), unchanged and not mapped
    if save_to:
        trainer.save_checkpoint(save_to)
    return "ok", "", True


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("errors") / "good"
    assert run_ranks(_fit, 2, LLAMA, str(path), None, timeout=300)[0][0] == "ok"
    return path


def _copy(saved: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(saved, out)
    return out


def _refused(path: Path, model=LLAMA) -> tuple[str, str]:
    results = run_ranks(_fit, 2, model, None, str(path), timeout=300)
    for kind, message, unchanged in results:
        assert kind == "CheckpointError", message
        assert unchanged  # refused before any weight was overwritten, on every rank, no file left mapped
    return results[0][1], results[1][1]


def test_a_good_checkpoint_loads(saved, tmp_path):
    assert run_ranks(_fit, 2, LLAMA, None, str(_copy(saved, tmp_path)), timeout=300)[0][0] == "ok"


def test_another_architecture(saved, tmp_path):
    gpt = {**LLAMA, "architecture": "gpt2"}
    gpt.pop("n_kv_head")
    message, _ = _refused(_copy(saved, tmp_path), gpt)
    assert "ckpt: the checkpoint holds LlamaForCausalLM at 'lm.'; this module has GPT2LMHeadModel at 'lm.'" in message


def test_another_shape(saved, tmp_path):
    message, _ = _refused(_copy(saved, tmp_path), {**LLAMA, "d_model": 48})
    assert "tensor 'model.embed_tokens.weight' has shape [64, 32] in the checkpoint" in message
    assert "needs [64, 48]" in message


@pytest.mark.parametrize("words", [None, 0])
def test_checkpoint_weights_this_model_has_no_place_for(saved, tmp_path, monkeypatch, words):
    """A 2-layer checkpoint into a 1-layer model: the second layer's weights are named, nothing is loaded; also
    with none of the coverage mask in the agreement's first round (``AGREE_WORDS=0``: the second round a
    checkpoint of more than 2016 weights takes), so the ranks are forked with it."""
    if words is not None:
        from shardline.plugins.lightning import checkpointing

        monkeypatch.setattr(checkpointing, "AGREE_WORDS", words)
    message, other = _refused(_copy(saved, tmp_path), {**LLAMA, "n_layer": 1})
    assert message == other  # the same refusal on every rank
    assert "ckpt: checkpoint tensors this model has no place for: ['model.layers.1." in message
    assert "and " in message and "more; nothing was loaded" in message  # 9 tensors per layer: 8 listed


def test_ranks_that_found_different_checkpoints(saved, tmp_path):
    """Each rank given another (good) checkpoint: refused on both, naming each rank's folder."""
    paths = [str(shutil.copytree(saved, tmp_path / name)) for name in ("a", "b")]
    results = run_ranks(_fit, 2, LLAMA, None, paths, timeout=300)
    for kind, message, unchanged in results:
        assert kind == "CheckpointError", message
        assert unchanged
        assert "the ranks found different checkpoints" in message
        assert f"rank 0: {paths[0]}, rank 1: {paths[1]}; nothing was loaded" in message


def test_ranks_given_different_folders_save_into_rank_0s(tmp_path):
    """A save whose ranks were given different folders writes one checkpoint, at rank 0's (the ranks learn that
    they differ from the digests in the save's first exchange, then take rank 0's folder), and it loads."""
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert [kind for kind, _, _ in run_ranks(_fit, 2, LLAMA, paths, None, timeout=300)] == ["ok", "ok"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "latest"]
    with CheckpointReader(tmp_path / "a") as reader:
        reader.verify()
        assert reader.manifest["world_size"] == 2
    assert [kind for kind, _, _ in run_ranks(_fit, 2, LLAMA, None, paths[0], timeout=300)] == ["ok", "ok"]


def test_a_token_with_leading_zeros_names_one_folder_on_every_rank(tmp_path, monkeypatch):
    """Rank 0's token travels as an int64 and every rank, rank 0 included, writes it back the same way, into the
    same temporary folder (a token of 8 hex digits starts with a zero in 1 save of 16; a rank whose text of it
    differed from rank 0's, e.g. without the zeros, would write its pieces elsewhere and rank 0's commit would
    miss its record: this fails then). The forked ranks inherit the patch."""
    from shardline.plugins.checkpoint.files import AtomicSave

    monkeypatch.setattr(AtomicSave, "new_token", staticmethod(lambda: "0000abcd"))
    assert [kind for kind, _, _ in run_ranks(_fit, 2, LLAMA, str(tmp_path / "ck"), None, timeout=300)] == ["ok"] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "latest"]
    with CheckpointReader(tmp_path / "ck") as reader:
        reader.verify()


def test_missing_shard(saved, tmp_path):
    path = _copy(saved, tmp_path)
    (path / "rank-00001-000.safetensors").unlink()
    message, _ = _refused(path)
    assert "rank-00001-000.safetensors: listed in the manifest but missing" in message


def test_truncated_shard(saved, tmp_path):
    path = _copy(saved, tmp_path)
    file = path / "rank-00000-000.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    message, _ = _refused(path)
    assert "rank-00000-000.safetensors" in message and "truncated" in message


def test_damaged_shard_names_the_tensor(saved, tmp_path):
    path = _copy(saved, tmp_path)
    file = path / "rank-00000-000.safetensors"
    reader = CheckpointReader(path)
    name, piece = next((n, p) for n, e in reader.tensors.items() for p in e["pieces"] if p[0] == file.name)
    with open(file, "rb") as f:  # where that piece's bytes are: after the 8-byte length and the header
        header_len = int.from_bytes(f.read(8), "little")
        start = json.loads(f.read(header_len))[piece[1]]["data_offsets"][0]
    data = bytearray(file.read_bytes())
    data[8 + header_len + start] ^= 0xFF  # one flipped byte: same size, different content
    file.write_bytes(bytes(data))
    messages = _refused(path)
    assert any(f"{file.name}: tensor {name!r}" in m and "damaged" in m for m in messages), messages


def test_manifest_that_does_not_match(saved, tmp_path):
    path = _copy(saved, tmp_path)
    manifest = json.loads((path / MANIFEST).read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    manifest["tensors"][name]["pieces"].pop()  # a piece the manifest no longer lists
    (path / MANIFEST).write_text(json.dumps(manifest))
    message, _ = _refused(path)
    assert f"tensor {name!r}" in message and "cover" in message


def test_incomplete_checkpoint_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    (path / MANIFEST).unlink()
    message, _ = _refused(path)
    assert "incomplete checkpoint (no manifest.json" in message
