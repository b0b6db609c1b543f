"""Two Lightning callbacks with the defaults a training run wants; the packaged recipes use both.

- :class:`RunCheckpoint`: Lightning's ``ModelCheckpoint`` saving every ``every_n_train_steps`` steps and once more
  at the run's last step (``max_steps`` reached, or the last epoch's end), unless that step was just saved; the
  newest one is also ``last`` (a link, ``save_last="link"``: no second copy), so ``--ckpt_path last`` resumes
  from it. Without a ``monitor``, ``save_top_k=1`` keeps only the newest periodic checkpoint. Under
  ``HybridParallelStrategy`` each save is the strategy's atomic, layout-independent checkpoint folder.
- :class:`WholeModelSummary`: Lightning's model summary (rich's when ``rich`` is installed, as Lightning picks),
  whose totals are the whole model's, where its table rows are rank 0's shard, with rank 0's share on a line of
  its own. A LightningModule returns it from ``configure_callbacks`` (the packaged ``LanguageModule`` does), which
  replaces Lightning's default summary.
- :class:`ProgressBar`: Lightning's tqdm bar, without the empty ``Training: 0/?`` and ``Validation: 0/?`` bars it
  draws before their length is known, and with the epoch's whole length as its total after a resume (the bar
  starts at the batch the run resumed at).

The protected members of ``ModelCheckpoint`` used here are checked to exist at import
(:func:`~shardline.plugins.lightning.lightning_compat.check_callbacks`).
"""

from __future__ import annotations

import sys
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint, ModelSummary, RichModelSummary, TQDMProgressBar
from pytorch_lightning.callbacks.progress.tqdm_progress import Tqdm, convert_inf
from pytorch_lightning.utilities.imports import _RICH_AVAILABLE
from pytorch_lightning.utilities.model_summary import get_human_readable_count
from pytorch_lightning.utilities.rank_zero import rank_zero_info

from shardline.plugins.errors import ContractError
from shardline.plugins.lightning.lightning_compat import check_callbacks

#: Seconds tqdm waits before drawing a new validation bar (any positive delay: the bar's reset at its first batch,
#: once its length is known, draws it).
VALIDATION_BAR_DELAY = 1e-3
#: Steps between two saves when a recipe does not say.
DEFAULT_EVERY = 100


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` every ``every_n_train_steps`` steps and at the end of training (see the module
    docstring); every other argument is ``ModelCheckpoint``'s."""

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int = DEFAULT_EVERY, save_top_k: int = 1,
                 save_last: bool | str | None = "link", **kwargs: Any) -> None:
        if isinstance(every_n_train_steps, bool) or not isinstance(every_n_train_steps, int) \
                or every_n_train_steps < 1:
            raise ContractError(f"RunCheckpoint(every_n_train_steps={every_n_train_steps!r}): must be an integer "
                                ">= 1 (to save nothing, leave the callback out: shardline fit --ckpt-every 0)")
        super().__init__(dirpath=dirpath, every_n_train_steps=every_n_train_steps, save_top_k=save_top_k,
                         save_last=save_last, **kwargs)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any,
                           **kwargs: Any) -> None:
        """Lightning's periodic save, then the final step's when ``max_steps`` ends the run here: at the same point
        of the loop as a periodic save, so a resume from it is as exact (a save in ``on_train_end`` would record
        the loops after they closed the epoch, and the run resumed from it would start another)."""
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if 0 < trainer.max_steps <= trainer.global_step:
            self._save_final(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lightning's epoch-end save (when configured), then the last epoch's when ``max_epochs`` ends the run."""
        super().on_train_epoch_end(trainer, pl_module)
        last_epoch = trainer.max_epochs is not None and 0 < trainer.max_epochs <= trainer.current_epoch + 1
        if last_epoch:
            self._save_final(trainer)

    def _save_final(self, trainer: pl.Trainer) -> None:
        """Save unless this step was just saved (every rank calls this: the save is collective)."""
        if self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)


class ProgressBar(TQDMProgressBar):
    """Lightning's ``TQDMProgressBar`` (see the module docstring); its arguments are the same."""

    def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
        # Lightning draws a "Training" bar of unknown length here; ours knows its epoch's span already. A run
        # resumed mid-epoch gets no on_train_epoch_start for that epoch: this bar is the one it shows.
        self.train_progress_bar = self._bar(trainer)
        self._unused = True

    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if getattr(self, "_unused", False):  # the bar on_train_start drew is this epoch's
            self._unused = False
            return
        if self._leave:
            self.train_progress_bar = self._bar(trainer)
            return
        start, total = self.epoch_span(trainer)
        bar = self.train_progress_bar
        bar.reset(total=total)
        bar.initial = bar.n = start
        bar.set_description(f"Epoch {trainer.current_epoch}")

    def _bar(self, trainer: pl.Trainer) -> Tqdm:
        start, total = self.epoch_span(trainer)
        return Tqdm(desc=f"Epoch {trainer.current_epoch}", total=total, initial=start,
                    position=2 * self.process_position, disable=self.is_disabled, leave=True, dynamic_ncols=True,
                    file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT)

    def init_validation_tqdm(self) -> Tqdm:
        """Lightning's validation bar, drawn first when its length is known (at its first batch: ``delay`` keeps
        tqdm from drawing it while it is still ``0/?``)."""
        has_main_bar = self.trainer.state.fn != "validate"
        return Tqdm(desc=self.validation_description, position=2 * self.process_position + has_main_bar,
                    disable=self.is_disabled, leave=not has_main_bar, dynamic_ncols=True, file=sys.stdout,
                    bar_format=self.BAR_FORMAT, delay=VALIDATION_BAR_DELAY)

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        """Lightning's, with the length given to the bar's reset (Lightning resets it first, drawing ``0/?``)."""
        if not self.has_dataloader_changed(dataloader_idx):
            return
        bar = self.val_progress_bar
        desc = self.sanity_check_description if trainer.sanity_checking else self.validation_description
        bar.set_description(f"{desc} DataLoader {dataloader_idx}", refresh=False)
        bar.reset(total=convert_inf(self.total_val_batches_current_dataloader))
        bar.initial = 0

    @staticmethod
    def epoch_span(trainer: pl.Trainer) -> tuple[int, int | float]:
        """``(start, total)`` of this epoch's bar: the batches it already ran (a run resumed mid-epoch restores
        them, and Lightning numbers the next batch after them) and the batch it will stop at: the epoch's length,
        or where ``max_steps`` ends it. (Lightning's own total is the remaining steps alone, which a resumed bar,
        counting from ``start``, overruns.)"""
        start = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        total = trainer.num_training_batches
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            total = min(total, start + trainer.max_steps - trainer.global_step)
        return start, convert_inf(total)


class WholeModelSummary(RichModelSummary if _RICH_AVAILABLE else ModelSummary):
    """The model summary with the whole model's totals: ``whole_parameters`` (all ranks together, a tied matrix
    once, the vocabulary unpadded) and ``layout`` (how the model is cut, for the share line); the other arguments
    are Lightning's."""

    def __init__(self, whole_parameters: int, *, layout: str = "", max_depth: int = 1, **kwargs: Any) -> None:
        super().__init__(max_depth=max_depth, **kwargs)
        self.whole_parameters, self.layout = whole_parameters, layout

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.layout:
            self.layout = describe_layout(trainer.strategy)
        super().on_fit_start(trainer, pl_module)

    def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops=0, **kwargs: Any) -> None:  # Lightning's is a staticmethod; called on the instance
        """Lightning's summary, its totals scaled from rank 0's shard to the whole model, then rank 0's share."""
        whole = self.whole_parameters
        scale = whole / total_parameters if total_parameters else 1.0
        super().summarize(summary_data, whole, round(trainable_parameters * scale), model_size * scale,
                          total_training_modes, total_flops, **kwargs)
        if total_parameters != whole:
            cut = f" ({self.layout})" if self.layout else ""
            rank_zero_info(f"the table lists rank 0's shard: {get_human_readable_count(total_parameters).strip()} of "
                           f"the model's {get_human_readable_count(whole).strip()} parameters{cut}")


def describe_layout(strategy) -> str:
    """``"tp2 x pp2 x dp1, ZeRO-1"`` for a shardline strategy (the degrees above 1, dp always); "" otherwise."""
    dims = getattr(strategy, "dims", None)
    if dims is None:
        return ""
    cut = [f"{name}{size}" for name, size in (("tp", dims.tp), ("cp", dims.cp), ("pp", dims.pp)) if size > 1]
    zero = getattr(strategy, "zero_stage", None)
    return " x ".join([*cut, f"dp{dims.dp}"]) + (f", ZeRO-{zero}" if zero is not None else "")


check_callbacks()

__all__ = ["DEFAULT_EVERY", "ProgressBar", "RunCheckpoint", "WholeModelSummary", "describe_layout"]
