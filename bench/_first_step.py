"""The callback ``bench_first_step.py`` adds to both sides: rank 0's wall-clock marks, written as JSON to
``$SHARDLINE_BENCH_MARKS`` when training ends."""

from __future__ import annotations

import json
import os
import time

import psutil
import pytorch_lightning as pl


class FirstStep(pl.Callback):
    def __init__(self) -> None:
        self.marks = {"process created": psutil.Process().create_time(), "imports and CLI parsed": time.time()}
        self.steps = 0

    def _mark(self, trainer, name: str) -> None:
        if trainer.is_global_zero and name not in self.marks:
            self.marks[name] = time.time()

    def setup(self, trainer, pl_module, stage) -> None:
        self._mark(trainer, "ranks launched, process group up")

    def on_fit_start(self, trainer, pl_module) -> None:
        self._mark(trainer, "model built, engine initialised")

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        self.steps += 1
        self._mark(trainer, "first_step_end")

    def on_train_end(self, trainer, pl_module) -> None:
        self._mark(trainer, "last_step_end")
        if trainer.is_global_zero:
            with open(os.environ["SHARDLINE_BENCH_MARKS"], "w") as handle:
                json.dump(self.marks, handle)
