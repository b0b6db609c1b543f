"""``shardline fit --config recipes/tiny.yaml`` end to end, as a user runs it: a real subprocess that launches
its own 4 workers (Lightning re-runs the command line), tp=2 x pp=2 (1F1B) with real DeepSpeed ZeRO-1 on gloo,
a TensorBoard event file read back."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from pytorch_lightning.utilities.model_summary import get_human_readable_count

from shardline.plugins.checkpoint.files import MANIFEST
from shardline.recipes.fit import RECIPES_DIR
from shardline.recipes.lit_lm import LanguageModule
from shardline.recipes.planning.models import ModelSpec

STEPS = 3


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(run_dir.rglob("events.out.tfevents.*"))
    assert len(events) == 1, f"expected one event file under {run_dir}, found {events}"
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _command() -> tuple[list[str], str]:
    """The installed console script when there is one (the documented main job), else ``python -m``."""
    script = shutil.which("shardline")
    if script is not None:
        return [script], "console script"
    return [sys.executable, "-m", "shardline.recipes.cli"], "python -m"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tiny", "llama_tiny"])
def test_shardline_fit_tiny_end_to_end(tmp_path, recipe, run_command):
    head, _ = _command()
    command = [*head, "fit", "--config", str(RECIPES_DIR / f"{recipe}.yaml"),
               "--trainer.max_steps", str(STEPS), "--trainer.limit_val_batches", "1",
               "--trainer.val_check_interval", str(STEPS), "--trainer.log_every_n_steps", "1",
               "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    result = run_command(command, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:]
    out = result.stdout
    # The progress bar was shown, with its length from the start (no empty "Training: 0/?" bar).
    assert f"{STEPS}/{STEPS}" in out and "train_loss=" in out and "Training:" not in out and "0/?" not in out
    # A quiet start: one line per fact, from rank 0 (rank 1-3's copies and the third-party noise filtered).
    assert out.count("GLOBAL_RANK: 0, MEMBER: 1/4") == 1 and "MEMBER: 2/4" not in out and "[rank: 1]" not in out
    for noise in ("Setting accelerator to CPU", "built successfully", "LeafSpec", "💡 Tip", "override existing"):
        assert noise not in out, noise
    # The summary counts the whole model (Lightning's own counted rank 0's shard) and says what rank 0 holds.
    whole = ModelSpec.from_config(LanguageModule(**yaml.safe_load((RECIPES_DIR / f"{recipe}.yaml").read_text())
                                                 ["model"]).config, name=recipe).params()
    assert f"Total params: {get_human_readable_count(whole).strip()}" in out
    assert "the table lists rank 0's shard" in out and "(tp2 x pp2 x dp1, ZeRO-1)" in out
    # Checkpoints are on: the run's last step, saved into the recipe's folder, and `last` names it.
    ckpts = tmp_path / "runs" / recipe / "checkpoints"
    assert (ckpts / f"epoch=0-step={STEPS}.ckpt" / MANIFEST).is_file()
    assert (ckpts / "last.ckpt").resolve() == (ckpts / f"epoch=0-step={STEPS}.ckpt").resolve()

    scalars = _scalars(tmp_path / "runs" / recipe)
    train = scalars["train_loss"]
    assert [step for step, _ in train] == list(range(STEPS))
    losses = [value for _, value in train]
    # A byte-level model at initialisation predicts ~uniformly over 256 bytes: loss ~ ln 256 = 5.55.
    assert all(math.isfinite(v) for v in losses) and abs(losses[0] - math.log(256)) < 0.5
    assert losses[-1] < losses[0]  # it learns (AdamW, warm-up; seeded, so this is deterministic)
    assert len(scalars["val_loss"]) == 1 and math.isfinite(scalars["val_loss"][0][1])

    # The saved configuration is the recipe plus the command-line overrides.
    saved = yaml.safe_load(next((tmp_path / "runs" / recipe).rglob("config.yaml")).read_text())
    layout = saved["trainer"]["strategy"]["init_args"]
    assert saved["trainer"]["max_steps"] == STEPS and (layout["tp"], layout["pp"], layout["zero_stage"]) == (2, 2, 1)
    assert "seq_len" not in saved["data"] and saved["model"]["seq_len"] == 128  # data.seq_len follows the model
