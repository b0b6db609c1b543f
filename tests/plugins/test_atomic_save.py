"""A save killed (SIGKILL, every saving process) at each of its phases leaves the previous checkpoint loadable,
and the partial one is ignored with a warning.

The run saves with Lightning's ModelCheckpoint after every epoch (2 steps each); the save after epoch 2 is killed
at one phase (``files.kill_save_at``): before any shard, mid-shard (a shard file cut after its first tensor), before
the manifest, or before the ``latest`` pointer moves. Then a new run resumes from the checkpoint folder (its
``latest``): it must load the epoch-1 checkpoint and continue exactly as the uninterrupted run did.
"""

from __future__ import annotations

import errno
import re
import warnings

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.checkpoint.files import (
    MANIFEST,
    PHASES,
    POINTER,
    is_placeholder,
    kill_save_at,
    resolve,
)
from shardline.plugins.checkpoint.reader import CheckpointReader
from shardline.plugins.errors import RankFailedError
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.lit_gpt import GPTModule

SEQ, VOCAB, BATCH = 16, 64, 4
MODEL = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32, lr=3e-3, warmup_steps=3)
LAYOUT = dict(pp=2, zero_stage=2)  # world 2: two pipeline stages, each rank saves its own pieces


def _data() -> DataLoader:
    tokens = torch.randint(0, VOCAB, (BATCH * 2, SEQ + 1), generator=torch.Generator().manual_seed(9))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


class _Losses(pl.Callback):
    def __init__(self, kill_at: str | None):
        self.losses, self.kill_at = [], kill_at

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_epoch_end(self, trainer, module):
        # ModelCheckpoint saves after this hook: arm the kill for the second epoch's save only.
        if self.kill_at and trainer.current_epoch == 1:
            kill_save_at(self.kill_at)


def _run(rank, world, root, epochs, kill_at, resume, asynchronous=False):
    adopt_process_group_in_lightning()
    losses = _Losses(kill_at)
    saver = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, save_last=False)
    strategy = HybridParallelStrategy(**LAYOUT, async_checkpoint=asynchronous)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy,
                         max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[losses, saver])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(GPTModule(**MODEL), _data(), ckpt_path=root if resume else None)
    return losses.losses, [str(w.message) for w in caught if "partial checkpoint" in str(w.message)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("uninterrupted"))
    return run_ranks(_run, 2, root, 3, None, False, timeout=300)[0][0]  # the batch losses (equal on both stages)


@pytest.mark.parametrize(("phase", "asynchronous"), [(phase, False) for phase in PHASES] + [
    ("mid_shard", True), ("before_manifest", True)])  # async_checkpoint: killed in the writer thread / the commit
def test_a_save_killed_at_any_phase_leaves_the_previous_checkpoint(tmp_path, reference, phase, asynchronous):
    """With ``async_checkpoint`` the kill comes while the next epoch trains (the writer thread, or the commit at
    a later batch); the previous checkpoint and the resume are the same."""
    root = str(tmp_path / "ckpts")
    with pytest.raises(RankFailedError, match="died|exit code|Connection|closed|reset"):
        run_ranks(_run, 2, root, 3, phase, False, asynchronous, timeout=300)
    first = "epoch=0-step=2.ckpt"
    assert (tmp_path / "ckpts" / POINTER).read_text().strip() == first  # the pointer never moved
    partial = [p.name for p in (tmp_path / "ckpts").iterdir() if ".partial-" in p.name]
    if phase == "before_pointer":  # the new checkpoint is complete, only the pointer is old
        assert not partial and (tmp_path / "ckpts" / "epoch=1-step=4.ckpt" / MANIFEST).is_file()
    else:
        assert partial == [p for p in partial if p.startswith(".epoch=1-step=4.ckpt.partial-")] and partial
        second = tmp_path / "ckpts" / "epoch=1-step=4.ckpt"  # async: the placeholder that reserved the name
        assert is_placeholder(second) if asynchronous else not second.exists()
    losses, warned = run_ranks(_run, 2, root, 3, None, True, timeout=300)[0]  # rank 0 resolves and warns
    # Resumed from epoch 1 on the same layout: the same arithmetic as the uninterrupted run, exactly.
    assert losses == reference[2:]
    if phase != "before_pointer":
        assert len(warned) == 1 and ".epoch=1-step=4.ckpt.partial-" in warned[0]


class _FailSave(pl.Callback):
    """Arms one failure for the second epoch's save, on one rank: an OSError where that rank fsyncs its files
    (``write``: a full disk), where rank 0 commits (``commit``), or in the commit once the folder is renamed into
    place (``pointer``: before ``latest`` moves)."""

    def __init__(self, where: str):
        self.where = where

    def on_train_epoch_end(self, trainer, module):
        if trainer.current_epoch != 1:
            return
        from shardline.plugins.checkpoint import files
        from shardline.plugins.lightning import checkpointing

        rank = trainer.global_rank
        if self.where == "write" and rank == 1:
            def full(paths):
                raise OSError(errno.ENOSPC, "No space left on device", str(paths[0]))
            checkpointing.fsync_all = full
        elif self.where == "commit" and rank == 0:
            def broken(self, manifest, *, rank):
                raise OSError(errno.EIO, "Input/output error")
            files.AtomicSave.commit = broken
        elif self.where == "pointer" and rank == 0:
            def at(name, rank):
                if name == "before_pointer":
                    raise OSError(errno.EIO, "Input/output error")
            files.phase = at


def _fail(rank, world, root, where, asynchronous):
    adopt_process_group_in_lightning()
    saver = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, save_last=False)
    strategy = HybridParallelStrategy(**LAYOUT, async_checkpoint=asynchronous)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy,
                         max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[_FailSave(where), saver])
    try:
        trainer.fit(GPTModule(**MODEL), _data())
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return type(error).__name__, str(error), trainer.current_epoch
    return "ok", "", trainer.current_epoch


_WRITE = r"while writing \(rank 1: OSError: \[Errno 28\] No space left on device: .*rank-00001-000"


@pytest.mark.parametrize(("where", "said", "asynchronous"), [
    ("write", _WRITE, False),
    ("write", _WRITE, True),  # async_checkpoint: the writer thread's failure, raised where the save is settled
    ("commit", r"rank 0 could not commit the save \(OSError: \[Errno 5\] Input/output error\); nothing was committed",
     False),
    ("commit", r"rank 0 could not commit the save \(OSError: \[Errno 5\] Input/output error\); nothing was committed",
     True),
    ("pointer", r"rank 0 could not commit the save \(OSError: \[Errno 5\] Input/output error\); the folder is "
                r"complete and in place, but 'latest' may still name the previous checkpoint", False),
])
def test_a_save_that_fails_on_one_rank_raises_on_every_rank(tmp_path, where, said, asynchronous):
    """Not a wait in a barrier until the collective timeout (10 min: run_ranks' 300 s would fail the test): one
    CheckpointError on both ranks, naming the rank and its error, at the failing save; no partial folder left;
    the pointer still names the epoch-1 checkpoint, which still loads."""
    root = tmp_path / "ckpts"
    results = run_ranks(_fail, 2, str(root), where, asynchronous, timeout=300)
    for kind, message, epoch in results:
        assert kind == "CheckpointError", message
        assert re.search(said, message), message
        assert "epoch=1-step=4.ckpt" in message and epoch == (2 if asynchronous else 1)
    assert results[0][1] == results[1][1]
    first, second = root / "epoch=0-step=2.ckpt", root / "epoch=1-step=4.ckpt"
    assert (root / POINTER).read_text().strip() == first.name
    assert not [p.name for p in root.iterdir() if ".partial-" in p.name]
    assert (second / MANIFEST).is_file() == (where == "pointer")
    with CheckpointReader(resolve(root)) as reader:  # the pointer's checkpoint, whole
        assert reader.folder == first
        for name in reader.tensors:
            reader.read(name)
