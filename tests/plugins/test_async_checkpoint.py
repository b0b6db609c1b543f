"""``HybridParallelStrategy(async_checkpoint=True)``: a save inside ``fit`` returns once its pieces are copied, a
thread writes them, and the commit follows later; the checkpoints must be exactly the synchronous ones.

The writer thread is held (``_HeldWrites``) until the optimizer step after the save has run, which changes every
weight and moment in place: a save that wrote the live tensors instead of its copies would write the next step's
values, and its CRCs would differ from the synchronous run's. The kill and failure cases of an asynchronous save
are in ``test_atomic_save.py`` (parametrized over both modes).
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.checkpoint.files import (
    MANIFEST,
    POINTER,
    is_checkpoint,
    is_placeholder,
    is_state_file,
    resolve,
)
from shardline.plugins.checkpoint.reader import CheckpointReader
from shardline.plugins.errors import CheckpointError, ContractError
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.lit_gpt import GPTModule

SEQ, VOCAB, BATCH = 16, 64, 4
MODEL = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32, lr=3e-3, warmup_steps=3)


def _data() -> DataLoader:
    tokens = torch.randint(0, VOCAB, (BATCH * 2, SEQ + 1), generator=torch.Generator().manual_seed(9))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


class _HeldWrites(pl.Callback):
    """Holds every asynchronous save's writes until one more optimizer step has run (or the fit ends), and
    records, at each batch start while a save is pending, whether its folder exists yet and whether the folders
    it was asked to remove still hold complete checkpoints."""

    def __init__(self):
        self.losses, self.seen, self.ended = [], [], threading.Event()

    def on_train_start(self, trainer, module):
        from shardline.plugins.lightning import checkpointing

        original = checkpointing._write

        def held(*args):
            after, deadline = trainer.global_step + 1, time.monotonic() + 120
            while (threading.current_thread() is not threading.main_thread() and trainer.global_step < after
                   and not self.ended.is_set() and time.monotonic() < deadline):
                time.sleep(0.005)  # a synchronous save (the main thread's) is not held
            original(*args)

        checkpointing._write = held

    def on_train_batch_start(self, trainer, module, batch, batch_idx):  # runs before the strategy's poll
        pending = trainer.strategy.pending_save
        if pending is not None:
            final = pending.target.final  # rank 0 reserved the name at once; the commit has not happened
            self.seen.append((trainer.global_step, (is_checkpoint(final), is_placeholder(final)),
                              [(Path(p).name, (Path(p) / MANIFEST).is_file()) for p in pending.removals]))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, module):
        self.ended.set()

    def on_exception(self, trainer, module, exception):
        self.ended.set()


class _Boom(pl.Callback):
    """Fails the run at the first batch after the save after epoch 1, while that save is still pending (held)."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.current_epoch == 2 and trainer.strategy.pending_save is not None:
            raise RuntimeError(f"boom on rank {trainer.global_rank}")


def _fit(rank, world, root, layout, asynchronous, saver_kwargs, epochs):
    adopt_process_group_in_lightning()
    held = _HeldWrites()
    saver = ModelCheckpoint(dirpath=root, **{"every_n_epochs": 1, **saver_kwargs})
    strategy = HybridParallelStrategy(**layout, async_checkpoint=asynchronous)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[held, saver])
    trainer.fit(GPTModule(**MODEL), _data())
    pending_after_fit = strategy.pending_save is not None
    trainer.save_checkpoint(str(Path(root) / "after-fit.ckpt"))  # outside fit: synchronous
    committed_on_return = (Path(root) / "after-fit.ckpt" / MANIFEST).is_file()
    return held.losses, held.seen, pending_after_fit, committed_on_return


def _fail_while_pending(rank, world, root):
    adopt_process_group_in_lightning()
    saver = ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1, save_last="link")
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=HybridParallelStrategy(
        pp=2, zero_stage=1, async_checkpoint=True), max_epochs=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[_HeldWrites(), _Boom(), saver])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(GPTModule(**MODEL), _data())
        except RuntimeError as error:
            raised = str(error)
        else:
            raised = ""
    return raised, [str(w.message) for w in caught if "asynchronous save" in str(w.message)], \
        trainer.strategy.pending_save is None


def test_a_run_that_fails_while_a_save_is_pending_leaves_it_uncommitted(tmp_path):
    """No collective can be trusted after a failure: the pending save's writes end, it is not committed (warned),
    and the checkpoint directory has no committed checkpoint newer than the last one committed before it."""
    root = tmp_path / "ckpts"
    for rank, (raised, warned, cleared) in enumerate(run_ranks(_fail_while_pending, 2, str(root), timeout=300)):
        assert raised == f"boom on rank {rank}" and cleared
        assert len(warned) == 1 and "epoch=1-step=4.ckpt" in warned[0] and "not committed" in warned[0], warned
    first, second = root / "epoch=0-step=2.ckpt", root / "epoch=1-step=4.ckpt"
    assert is_placeholder(second) and not is_checkpoint(second)
    assert (root / POINTER).read_text().strip() == first.name  # committed by the epoch-1 save's settle
    assert (root / "last.ckpt").resolve() == second  # Lightning linked it when the save returned
    partial = [p.name for p in root.iterdir() if ".partial-" in p.name]
    assert len(partial) == 1 and partial[0].startswith(".epoch=1-step=4.ckpt.partial-"), partial
    with pytest.warns(UserWarning, match="partial"):
        folder = resolve(root)
    assert folder == first
    # ckpt_path="last" (or the placeholder's name): refused, naming the newest complete checkpoint beside it
    for named in (root / "last.ckpt", second):
        with pytest.raises(CheckpointError, match=rf"an incomplete checkpoint \(an asynchronous save that was never "
                                                  rf"committed.*the newest complete checkpoint beside it is {first}"):
            resolve(named)
    with CheckpointReader(folder) as reader:
        for name in reader.tensors:
            reader.read(name)
    # The next run in that folder: the placeholder goes at its start, so its save of step 4 takes the name (no
    # -v1); the partial folder goes at its first commit.
    # Their times set a minute back: left by an earlier run (the clean-up gives a just-written folder 2 s of slack).
    import os

    for path in root.iterdir():
        os.utime(path, (time.time() - 60, time.time() - 60), follow_symlinks=False)
    run_ranks(_fit_again, 2, str(root), timeout=300)
    names = sorted(p.name for p in root.iterdir())
    assert is_checkpoint(second) and "epoch=1-step=4-v1.ckpt" not in names, names
    assert not [n for n in names if ".partial-" in n or ".old-" in n], names


def _fit_again(rank, world, root):
    adopt_process_group_in_lightning()
    saver = ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=HybridParallelStrategy(
        pp=2, zero_stage=1, async_checkpoint=True), max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[saver])
    trainer.fit(GPTModule(**MODEL), _data())


def _tensors(folder: Path) -> dict:
    manifest = json.loads((folder / MANIFEST).read_text())
    shards = {name: info["crc32"] for name, info in manifest["files"].items()
              if name.endswith(".safetensors") and not is_state_file(name)}  # state files: RNG states differ
    return {"tensors": manifest["tensors"], "shards": shards, "chunks": manifest.get("chunk_crc32")}


@pytest.mark.parametrize("layout", [dict(pp=2, zero_stage=2), dict(zero_stage=3)], ids=["pp2_zero2", "dp2_zero3"])
def test_async_saves_are_the_synchronous_saves(tmp_path, layout):
    every = dict(save_top_k=-1, save_last=False)
    sync = run_ranks(_fit, 2, str(tmp_path / "sync"), layout, False, every, 3, timeout=300)
    asyn = run_ranks(_fit, 2, str(tmp_path / "async"), layout, True, every, 3, timeout=300)
    per_epoch = 2 if layout.get("pp") else 1  # dp2 splits each epoch's 2 batches between the ranks
    assert asyn[0][0] == sync[0][0] and len(sync[0][0]) == 3 * per_epoch  # training is not changed by it
    names = [f"epoch={e}-step={per_epoch * (e + 1)}.ckpt" for e in range(3)] + ["after-fit.ckpt"]
    assert sorted(p.name for p in (tmp_path / "sync").iterdir() if p.name.endswith(".ckpt")) == sorted(names)
    for name in names:
        assert _tensors(tmp_path / "async" / name) == _tensors(tmp_path / "sync" / name), name
    for _, seen, pending_after_fit, committed_on_return in asyn:
        # The saves after epochs 0 and 1 were still being written at the next batch (held): not committed then.
        assert {step for step, _, _ in seen} >= {per_epoch, 2 * per_epoch}, seen
        assert {state for _, state, _ in seen} == {(False, True)}, seen  # a placeholder (on the shared disk)
        assert not pending_after_fit and committed_on_return  # the fit's last save committed by its teardown
    for _, seen, _, committed_on_return in sync:
        assert not seen and committed_on_return
    root = tmp_path / "async"
    assert (root / POINTER).read_text().strip() == "after-fit.ckpt"
    assert not [p.name for p in root.iterdir() if ".partial-" in p.name]


def test_top_k_rotation_and_last_link_wait_for_the_commit(tmp_path):
    """save_top_k=2 by step, save_last="link": a checkpoint that falls out of the top 2 is removed only once the
    save replacing it is committed, so there are never fewer than 2 complete ones on disk."""
    root = tmp_path / "ckpts"
    kwargs = dict(monitor="step", mode="max", save_top_k=2, save_last="link")
    results = run_ranks(_fit, 2, str(root), dict(pp=2, zero_stage=1), True, kwargs, 4, timeout=300)
    for _, seen, pending_after_fit, _ in results:
        removals = [r for _, _, removed in seen for r in removed]
        # epoch 0's checkpoint fell out while epoch 2's save was pending (held for a step): still complete then.
        # (Epoch 1's falls out at the last save, which the fit's teardown commits: no batch sees it pending.)
        assert {name for name, _ in removals} == {"epoch=0-step=2.ckpt"}, seen
        assert all(complete for _, complete in removals), seen
        assert not pending_after_fit
    kept = sorted(p.name for p in root.iterdir() if p.name.endswith(".ckpt"))
    assert kept == ["after-fit.ckpt", "epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"]
    assert (root / "last.ckpt").is_symlink() and (root / "last.ckpt").resolve() == (root / "epoch=3-step=8.ckpt")
    assert not [p.name for p in root.iterdir() if ".partial-" in p.name]
    with CheckpointReader(resolve(root / "last.ckpt")) as reader:
        for name in reader.tensors:
            reader.read(name)


def test_names_taken_by_pending_saves_are_versioned_as_in_a_synchronous_run(tmp_path):
    """A save after every step under one file name, top 3 by step: Lightning gives a name that exists ``-v1``,
    ``-v2``. The previous save is still pending at the next one's name check (held: the poll never finds it
    done), so only the placeholder, which takes the name at once, keeps the names (and what each holds) those of
    a synchronous run instead of the next save overwriting the pending one."""
    kwargs = dict(filename="same", save_top_k=3, monitor="step", mode="max", every_n_epochs=None,
                  every_n_train_steps=1)
    layout = dict(pp=2, zero_stage=1)

    def saved(root):
        names = sorted(p.name for p in root.iterdir() if p.name.endswith(".ckpt") and p.name != "after-fit.ckpt")
        assert all(is_checkpoint(root / name) for name in names), names
        return {name: json.loads((root / name / MANIFEST).read_text())["global_step"] for name in names}

    run_ranks(_fit, 2, str(tmp_path / "sync"), layout, False, kwargs, 3, timeout=300)
    run_ranks(_fit, 2, str(tmp_path / "async"), layout, True, kwargs, 3, timeout=300)
    sync = saved(tmp_path / "sync")
    assert sorted(sync.values()) == [4, 5, 6] and len(sync) == 3 and "same-v1.ckpt" in sync, sync
    assert saved(tmp_path / "async") == sync
    assert not [p.name for p in (tmp_path / "async").iterdir() if ".partial-" in p.name]


def test_async_checkpoint_must_be_a_bool():
    with pytest.raises(ContractError, match=r"async_checkpoint='yes' must be True or False"):
        HybridParallelStrategy(async_checkpoint="yes")
