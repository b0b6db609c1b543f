"""Every protected member of Lightning that shardline overrides, calls or imports, in one file, checked once.

Lightning does not promise these names; the package pins ``pytorch-lightning>=2.6.6,<2.7`` for them. A release
that renamed one would make an override silently never run (the strategy's launcher swap, its model setup) or an
import fail deep inside a run, so :func:`check_strategy` looks for each when the strategy's module loads and
raises :class:`LightningPrivateMissing` naming it and the version.

- overridden on ``DeepSpeedStrategy`` by ``HybridParallelStrategy``: :data:`OVERRIDDEN`;
- called or read on it: :data:`CALLED` (and the ``_launcher`` attribute every Lightning strategy sets);
- the subprocess launcher and the thread-count helper it calls, which :mod:`.launcher` subclasses and calls:
  :data:`SubprocessScriptLauncher`, :func:`set_num_threads_if_needed`;
- ``ModelCheckpoint``'s save steps and ``TQDMProgressBar``'s bar attribute, which :mod:`.callbacks` calls and sets:
  :data:`CHECKPOINT_METHODS`, :data:`PROGRESS_ATTRIBUTES` (:func:`check_callbacks`).
"""

from __future__ import annotations

from lightning_fabric.utilities.distributed import _set_num_threads_if_needed as set_num_threads_if_needed
from pytorch_lightning import __version__ as LIGHTNING_VERSION
from pytorch_lightning.strategies import DeepSpeedStrategy
from pytorch_lightning.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)

from shardline.plugins.errors import ShardlineError

OVERRIDDEN = ("_configure_launcher", "_initialize_deepspeed_inference", "_setup_model_and_optimizer")
CALLED = ("_init_config_if_needed", "_init_deepspeed_distributed")
#: The methods :class:`~.launcher.ShardlineLauncher` calls or replaces in the launcher it subclasses.
LAUNCHER_METHODS = ("_call_children_scripts", "launch", "kill")
#: The protected methods of ModelCheckpoint that :class:`~.callbacks.RunCheckpoint` calls at the end of training.
CHECKPOINT_METHODS = ("_should_skip_saving_checkpoint", "_monitor_candidates", "_save_topk_checkpoint",
                      "_save_last_checkpoint")
#: TQDMProgressBar's protected attribute :class:`~.callbacks.ProgressBar` reads (whether each epoch gets a new bar).
PROGRESS_ATTRIBUTES = ("_leave",)


class LightningPrivateMissing(ShardlineError, RuntimeError):
    """The installed Lightning lacks a protected member shardline overrides or calls; names it and the version."""


def check_strategy(base: type = DeepSpeedStrategy) -> None:
    """Every member of :data:`OVERRIDDEN` and :data:`CALLED` is a method of ``base``, and the subprocess launcher
    has :data:`LAUNCHER_METHODS`; :class:`LightningPrivateMissing` naming the first that is not."""
    needed = [(base, name, "HybridParallelStrategy overrides it") for name in OVERRIDDEN]
    needed += [(base, name, "HybridParallelStrategy calls it") for name in CALLED]
    needed += [(SubprocessScriptLauncher, name, "shardline's launcher relies on it") for name in LAUNCHER_METHODS]
    for owner, name, why in needed:
        if not callable(getattr(owner, name, None)):
            raise LightningPrivateMissing(f"pytorch_lightning {LIGHTNING_VERSION}: {owner.__name__}.{name} is gone; "
                                          f"{why} (shardline supports pytorch-lightning >=2.6.6,<2.7)")


def check_callbacks() -> None:
    """ModelCheckpoint has :data:`CHECKPOINT_METHODS` and a fresh TQDMProgressBar :data:`PROGRESS_ATTRIBUTES`;
    :class:`LightningPrivateMissing` naming the first that is missing."""
    from pytorch_lightning.callbacks import ModelCheckpoint, TQDMProgressBar

    for name in CHECKPOINT_METHODS:
        if not callable(getattr(ModelCheckpoint, name, None)):
            raise LightningPrivateMissing(f"pytorch_lightning {LIGHTNING_VERSION}: ModelCheckpoint.{name} is gone; "
                                          "RunCheckpoint calls it (shardline supports pytorch-lightning >=2.6.6,<2.7)")
    bar = TQDMProgressBar()
    for name in PROGRESS_ATTRIBUTES:
        if not hasattr(bar, name):
            raise LightningPrivateMissing(f"pytorch_lightning {LIGHTNING_VERSION}: TQDMProgressBar.{name} is gone; "
                                          "ProgressBar reads it (shardline supports pytorch-lightning >=2.6.6,<2.7)")


__all__ = ["CALLED", "CHECKPOINT_METHODS", "LAUNCHER_METHODS", "OVERRIDDEN", "PROGRESS_ATTRIBUTES",
           "LightningPrivateMissing", "SubprocessScriptLauncher", "check_callbacks", "check_strategy",
           "set_num_threads_if_needed"]
