"""The DDP side of ``bench_first_step.py``: ``recipes/tiny.yaml``'s model and data under Lightning's own DDP
strategy on 4 CPU processes (Lightning re-runs this script for ranks 1-3). Argument: the number of steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytorch_lightning as pl
import yaml
from _first_step import FirstStep

from shardline.recipes.data import TextDataModule
from shardline.recipes.lit_lm import LanguageModule

RECIPE = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml").read_text())

if __name__ == "__main__":
    pl.seed_everything(RECIPE["seed_everything"])
    model = LanguageModule(**RECIPE["model"])
    # the recipe's global batch (16 windows at dp=1) split over DDP's 4 replicas
    data = TextDataModule(**{**RECIPE["data"], "seq_len": RECIPE["model"]["seq_len"],
                             "batch_size": RECIPE["data"]["batch_size"] // 4})
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy="ddp", precision=RECIPE["trainer"]["precision"],
                         max_steps=int(sys.argv[1]), limit_val_batches=0, logger=False,
                         enable_checkpointing=False, gradient_clip_val=RECIPE["trainer"]["gradient_clip_val"],
                         callbacks=[FirstStep()])
    trainer.fit(model, data)
