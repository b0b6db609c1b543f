"""Lightning's ModelCheckpoint with the strategy's checkpoint folders, as Lightning documents it: ``save_top_k``
keeps the k best by the monitored value and removes the others, ``save_last`` keeps ``last.ckpt`` (rewritten
atomically each time), and ``best_model_path`` loads."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.checkpoint.files import MANIFEST, POINTER
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.lit_gpt import GPTModule

SEQ, VOCAB, BATCH = 16, 64, 4
MODEL = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32, lr=1e-2, warmup_steps=1)


def _run(rank, world, root):
    adopt_process_group_in_lightning()
    tokens = torch.randint(0, VOCAB, (BATCH * 6, SEQ + 1), generator=torch.Generator().manual_seed(2))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH // 2)
    saver = ModelCheckpoint(dirpath=root, monitor="train_loss", mode="min", save_top_k=2, every_n_train_steps=1,
                            save_last=True, filename="{step}")
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=HybridParallelStrategy(zero_stage=3),
                         max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, callbacks=[saver])
    module = GPTModule(**MODEL)
    trainer.fit(module, data)
    best = {str(path): float(score) for path, score in saver.best_k_models.items()}
    validated = {path: trainer.validate(module, data, ckpt_path=path, verbose=False)[0]["val_loss"]
                 for path in best}
    return best, saver.best_model_path, validated


def test_top_k_and_last(tmp_path):
    root = tmp_path / "ckpts"
    best, best_path, validated = run_ranks(_run, 2, str(root), timeout=300)[0]
    kept = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert kept == sorted([*(p.split("/")[-1] for p in best), "last.ckpt"]) and len(best) == 2
    assert all((root / name / MANIFEST).is_file() for name in kept)  # every kept folder is complete
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no partial or replaced folder is left
    assert (root / POINTER).read_text().strip() == "last.ckpt"  # written after step 6's top-k candidate
    assert best_path == min(best, key=best.get)
    # Each kept checkpoint loads for validation (weights only), and its own weights are used: they differ.
    first, second = validated.values()
    assert first != second and all(0 < v < 10 for v in validated.values())
