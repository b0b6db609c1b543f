"""The user's path, end to end: ``shardline fit --config tiny`` with a ModelCheckpoint every 3 steps, then
``--ckpt_path`` of the step-3 checkpoint on the same layout (the next losses are the uninterrupted run's,
exactly), and ``--ckpt_path last`` (step 6) on another layout (dp4 x ZeRO-3: the same within float32 summation
order), with Lightning's conventions: ``save_top_k`` keeps the best k, ``save_last`` keeps ``last.ckpt``,
``--ckpt_path last`` resumes from it; then dp4's step-7 checkpoint into dp2 (tp2 x ZeRO-1). The corpus is cut so
that its 4461 training windows give another loader length at dp4 (279 batches of 4) than at dp1 and dp2 (278 of
16 and of 8): the data position moves as global samples (the packaged data module, through ``shardline fit``). (A
checkpoint saved in dp4 x ZeRO-3 read back in tp2 x pp2: tests/plugins/test_reshard.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardline.plugins.checkpoint.files import MANIFEST, POINTER
from shardline.recipes.fit import RECIPES_DIR
from tests.recipes.test_fit import _command, _scalars

SMALL = ["--model.n_layer", "2", "--model.d_model", "64", "--model.seq_len", "64", "--data.max_bytes", "300576",
         "--trainer.limit_val_batches", "0", "--trainer.log_every_n_steps", "1", "--trainer.max_steps", "9",
         "--trainer.enable_checkpointing", "true"]


def _fit(tmp_path: Path, name: str, run_command, *extra: str) -> dict[int, float]:
    head, _ = _command()
    command = [*head, "fit", "--config", str(RECIPES_DIR / "tiny.yaml"), *SMALL,
               "--trainer.callbacks+=pytorch_lightning.callbacks.ModelCheckpoint",
               "--trainer.callbacks.dirpath", str(tmp_path / "ckpts"), "--trainer.callbacks.every_n_train_steps", "3",
               "--trainer.callbacks.save_top_k", "-1", "--trainer.callbacks.save_last", "true",
               "--trainer.logger.init_args.save_dir", str(tmp_path / name), *extra]
    result = run_command(command, cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "resuming the train loader at the start" not in result.stdout  # the position moved exactly
    OUTPUT[name] = result.stdout
    return dict(_scalars(tmp_path / name / "tiny")["train_loss"])


OUTPUT: dict[str, str] = {}  # each run's terminal output, by name


@pytest.mark.slow
def test_fit_resume_on_the_same_and_another_layout(tmp_path, run_command):
    full = _fit(tmp_path, "full", run_command)
    assert sorted(full) == list(range(9))
    ckpts = tmp_path / "ckpts"
    step3 = ckpts / "epoch=0-step=3.ckpt"
    assert (step3 / MANIFEST).is_file() and (ckpts / "epoch=0-step=6.ckpt" / MANIFEST).is_file()
    assert (ckpts / "last.ckpt" / MANIFEST).is_file() and (ckpts / POINTER).read_text().strip() == "last.ckpt"

    same = _fit(tmp_path, "same", run_command, "--ckpt_path", str(step3), "--trainer.max_steps", "6")
    assert sorted(same) == [3, 4, 5]
    # The same layout, the same batches (the loader's position inside the epoch), the same arithmetic: exact.
    assert [same[s] for s in (3, 4, 5)] == [full[s] for s in (3, 4, 5)]
    # The bar resumes at batch 3 of the epoch and keeps its total (Lightning's drops to "?" past max_steps - 3).
    assert "3/6" in OUTPUT["same"] and "6/6" in OUTPUT["same"] and "/?" not in OUTPUT["same"]

    # --ckpt_path last: Lightning takes the newest last*.ckpt in ckpts/ (the "same" run's last-v1.ckpt: step 6,
    # saved in the recipe's tp2 x pp2 x ZeRO-1) and goes on in dp4 x ZeRO-3; data.batch_size is per dp rank, so 4
    # keeps the global batch of 16.
    other = _fit(tmp_path, "other", run_command, "--ckpt_path", "last",
                 "--trainer.strategy.init_args.tp", "1", "--trainer.strategy.init_args.pp", "1",
                 "--trainer.strategy.init_args.zero_stage", "3", "--data.batch_size", "4", "--trainer.max_steps", "8",
                 "--trainer.callbacks.every_n_train_steps", "1")
    assert sorted(other) == [6, 7]  # two steps: the loaded weights (step 6), then the loaded Adam state (step 7)
    # Another summation order (no TP all-reduce, ZeRO-3 reduce-scatter): float32 rounding over 2 steps.
    assert [other[s] for s in (6, 7)] == pytest.approx([full[s] for s in (6, 7)], rel=1e-5)

    # dp4 -> dp2 (tp2 x ZeRO-1, batch 8 per dp rank: the global batch kept), from dp4's checkpoint at step 7
    fewer = _fit(tmp_path, "fewer", run_command, "--ckpt_path", str(ckpts / "epoch=0-step=7.ckpt"),
                 "--trainer.strategy.init_args.pp", "1", "--data.batch_size", "8")
    assert sorted(fewer) == [7, 8]
    assert [fewer[s] for s in (7, 8)] == pytest.approx([full[s] for s in (7, 8)], rel=1e-5)
