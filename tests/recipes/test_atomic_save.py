"""A save killed (SIGKILL, every saving process) at each of its phases leaves the previous checkpoint loadable,
and the partial one is ignored with a warning.

The run saves with Lightning's ModelCheckpoint after every epoch (2 steps each); the save after epoch 2 is killed
at one phase (``files.KILL_ENV``): before any shard, mid-shard (a shard file cut after its first tensor), before
the manifest, or before the ``latest`` pointer moves. Then a new run resumes from the checkpoint folder (its
``latest``): it must load the epoch-1 checkpoint and continue exactly as the uninterrupted run did.
"""

from __future__ import annotations

import os
import warnings

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.checkpoint.files import KILL_ENV, MANIFEST, PHASES, POINTER
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
            os.environ[KILL_ENV] = self.kill_at


def _run(rank, world, root, epochs, kill_at, resume):
    adopt_process_group_in_lightning()
    losses = _Losses(kill_at)
    saver = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, save_last=False)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=HybridParallelStrategy(**LAYOUT),
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


@pytest.mark.parametrize("phase", PHASES)
def test_a_save_killed_at_any_phase_leaves_the_previous_checkpoint(tmp_path, reference, phase):
    root = str(tmp_path / "ckpts")
    with pytest.raises(RankFailedError, match="died|exit code|Connection|closed|reset"):
        run_ranks(_run, 2, root, 3, phase, False, timeout=300)
    first = "epoch=0-step=2.ckpt"
    assert (tmp_path / "ckpts" / POINTER).read_text().strip() == first  # the pointer never moved
    partial = [p.name for p in (tmp_path / "ckpts").iterdir() if ".partial-" in p.name]
    if phase == "before_pointer":  # the new checkpoint is complete, only the pointer is old
        assert not partial and (tmp_path / "ckpts" / "epoch=1-step=4.ckpt" / MANIFEST).is_file()
    else:
        assert partial == [p for p in partial if p.startswith(".epoch=1-step=4.ckpt.partial-")] and partial
        assert not (tmp_path / "ckpts" / "epoch=1-step=4.ckpt").exists()
    losses, warned = run_ranks(_run, 2, root, 3, None, True, timeout=300)[0]  # rank 0 resolves and warns
    # Resumed from epoch 1 on the same layout: the same arithmetic as the uninterrupted run, exactly.
    assert losses == reference[2:]
    if phase != "before_pointer":
        assert len(warned) == 1 and ".epoch=1-step=4.ckpt.partial-" in warned[0]
