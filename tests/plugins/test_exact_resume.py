"""A run killed mid-epoch (SIGKILL on every rank) and resumed on the same layout produces exactly the per-step
losses of an uninterrupted run: float32, dropout on (so every rank's RNG state matters), a shuffled
DistributedSampler (so the position inside the epoch matters), AdamW with warm-up (the optimizer's step and
the scheduled lr matter), ZeRO-2 partitioned moments, Lightning's ModelCheckpoint every 3 steps."""

from __future__ import annotations

import os
import signal

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

from shardline.plugins.errors import RankFailedError
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.data import ResumableDataLoader
from shardline.recipes.lit_lm import LanguageModule

SEQ, VOCAB, BATCH, STEPS_PER_EPOCH = 16, 64, 4, 5
MODEL = dict(architecture="gpt2", vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32, dropout=0.2,
             lr=3e-3, warmup_steps=4)
LAYOUT = dict(tp=2, zero_stage=2)  # world 4: tp2 x dp2


def _loader(dp: int) -> ResumableDataLoader:
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS_PER_EPOCH, SEQ + 1), generator=torch.Generator().manual_seed(4))
    return ResumableDataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH // dp, shuffle=True)


class _Steps(pl.Callback):
    """The global-batch loss of every step; SIGKILL on every rank after step ``kill_after``."""

    def __init__(self, kill_after: int | None, forget_rng: bool = False):
        self.losses, self.kill_after, self.forget_rng = [], kill_after, forget_rng

    def on_train_start(self, trainer, module):
        if self.forget_rng:  # the control: resume without the checkpoint's RNG states
            trainer.strategy.checkpointer.rng_state = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = torch.tensor([float(outputs["loss"])], dtype=torch.float64)
        dist.all_reduce(loss)
        self.losses.append((trainer.global_step, float(loss) / dist.get_world_size()))
        if trainer.global_step == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


def _run(rank, world, root, kill_after, resume, forget_rng=False):
    adopt_process_group_in_lightning()
    # One seed on every rank, as Lightning users seed: the TP ranks of a replica must draw the same dropout masks
    # on their replicated activations, and Lightning seeds the DistributedSampler's shuffle with it too.
    pl.seed_everything(7, workers=True)
    steps = _Steps(kill_after, forget_rng)
    saver = ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1)
    strategy = HybridParallelStrategy(**LAYOUT)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[steps, saver])
    trainer.fit(LanguageModule(**MODEL), _loader(strategy.layout_for(world).dp), ckpt_path=resume)
    return steps.losses


def test_killed_mid_epoch_and_resumed_is_bit_exact(tmp_path):
    full = run_ranks(_run, 4, str(tmp_path / "full"), None, None, timeout=300)[0]
    assert [s for s, _ in full] == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    root = str(tmp_path / "killed")
    with pytest.raises(RankFailedError, match="died|exit code|Connection|closed|reset"):
        run_ranks(_run, 4, root, 7, None, timeout=300)  # checkpoints after steps 3 and 6, killed after step 7
    # From the folder: its latest checkpoint (step 6, the second epoch's first batch).
    resumed = run_ranks(_run, 4, root, None, root, timeout=300)[0]
    assert resumed == full[6:]  # bit for bit: same RNG streams, same batches, same optimizer state
    # From the first epoch's middle (step 3): the rest of epoch 1, then all of epoch 2.
    early = run_ranks(_run, 4, str(tmp_path / "again"), None, os.path.join(root, "epoch=0-step=3.ckpt"),
                      timeout=300)[0]
    assert early == full[3:]
    # The control: the same resume without the RNG states differs (dropout draws other masks).
    forgot = run_ranks(_run, 4, str(tmp_path / "forgot"), None, os.path.join(root, "epoch=1-step=6.ckpt"), True,
                       timeout=300)[0]
    assert [s for s, _ in forgot] == [s for s, _ in full[6:]]
    assert all(a != b for (_, a), (_, b) in zip(forgot, full[6:], strict=True))


def _seeded_apart(rank, world):
    adopt_process_group_in_lightning()
    pl.seed_everything(100 + rank)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=HybridParallelStrategy(tp=2), max_steps=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    trainer.fit(LanguageModule(**MODEL), _loader(1))


def test_ranks_seeded_apart_are_refused():
    with pytest.raises(RankFailedError, match=r"ranks are seeded differently \(rank 0: 100, rank 1: 101\)"):
        run_ranks(_seeded_apart, 2, timeout=120)
