"""A quiet start: third-party start-up output that is expected on shardline's layouts, filtered at its source.

Every filter names the library's module (or logger) and the message it drops; nothing is silenced wholesale, so
a warning a user's own code raises (in ``training_step`` or anywhere else) still shows, whatever its text.

- :data:`EXPECTED_WARNINGS`: warnings a third-party module raises on every run of a supported version pair and that
  no user can act on (Lightning 2.6's own use of a torch ``_pytree`` name that torch 2.13 deprecates).
- :func:`quiet_duplicate_logs`: the per-rank copies of Lightning's start-up lines that say the same thing on every
  rank ("Seed set to 1234", "initializing deepspeed distributed: GLOBAL_RANK ..."): rank 0 keeps them, the others
  drop them (a rank whose line would differ, an error or a warning, is never filtered: only these INFO records).
- :func:`without_tips`: Lightning's advertisement for a hosted logger ("💡 Tip: ..."), which is not a fact about
  the run, and its note that the packaged model's summary replaced the default one.

DeepSpeed's own start-up lines are handled where DeepSpeed is driven: ``DS_ACCELERATOR`` set for a CPU run before
DeepSpeed is imported (``shardline fit``; the strategy's launcher for its workers), and the shared-memory
inference all-reduce op, which shardline never calls, not built on CPU
(:func:`~shardline.plugins.lightning.deepspeed_compat.without_shm_comm_op`).
"""

from __future__ import annotations

import logging
import os
import warnings

#: ``(message regex, module regex)`` of the warnings :func:`install_warning_filters` hides: each message only when
#: raised from that module (``warnings.filterwarnings`` matches ``module`` against the raising module's name).
EXPECTED_WARNINGS: tuple[tuple[str, str], ...] = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated",
     r"(pytorch_lightning|lightning\.pytorch)\.utilities\._pytree"),
)

#: Loggers whose INFO lines repeat on every rank, and the message prefixes dropped on ranks other than 0.
PER_RANK_LINES: dict[str, tuple[str, ...]] = {
    "lightning_fabric.utilities.seed": ("Seed set to", "[rank: "),
    "lightning.fabric.utilities.seed": ("Seed set to", "[rank: "),
    "pytorch_lightning.strategies.deepspeed": ("initializing deepspeed distributed",),
    "lightning.pytorch.strategies.deepspeed": ("initializing deepspeed distributed",),
}

#: Lightning's logger of rank-zero INFO lines, and the prefix of its hosted-logger advertisement.
TIP_LOGGERS = ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero")
TIP_PREFIX = "💡 Tip:"
#: Lightning's note when ``configure_callbacks`` returns a model summary (the packaged LanguageModule's
#: :class:`~shardline.plugins.lightning.callbacks.WholeModelSummary`), exactly as it words it.
SUMMARY_OVERRIDES = tuple(
    "The following callbacks returned in `LightningModule.configure_callbacks` will override existing callbacks "
    f"passed to Trainer: {name}" for name in ("RichModelSummary", "ModelSummary"))


def install_warning_filters() -> None:
    """Hide :data:`EXPECTED_WARNINGS` (each from its module only); idempotent."""
    for message, module in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)


class _DropInfo(logging.Filter):
    """Drops INFO (and lower) records whose message starts with one of ``prefixes`` or is one of ``exact``; keeps
    everything else."""

    def __init__(self, prefixes: tuple[str, ...], exact: tuple[str, ...] = ()) -> None:
        super().__init__(name="shardline.quiet")
        self.prefixes, self.exact = prefixes, exact

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        message = record.getMessage()
        return message not in self.exact and not any(message.startswith(p) for p in self.prefixes)


def _add_once(logger_name: str, prefixes: tuple[str, ...], exact: tuple[str, ...] = ()) -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _DropInfo) and (f.prefixes, f.exact) == (prefixes, exact) for f in logger.filters):
        logger.addFilter(_DropInfo(prefixes, exact))


def is_worker() -> bool:
    """Whether this process is a worker Lightning's launcher started (it sets ``LOCAL_RANK`` > 0 or
    ``NODE_RANK`` > 0 in their environment; the launching process has neither, or zeros)."""
    return any(os.environ.get(key, "0") not in ("", "0") for key in ("LOCAL_RANK", "NODE_RANK"))


def quiet_duplicate_logs(rank: int | None = None) -> None:
    """On a rank other than 0 (``rank``, else :func:`is_worker`), drop :data:`PER_RANK_LINES`."""
    if (rank if rank is not None else (1 if is_worker() else 0)) == 0:
        return
    for name, prefixes in PER_RANK_LINES.items():
        _add_once(name, prefixes)


def without_tips() -> None:
    """Drop Lightning's hosted-logger advertisement (an INFO record starting with :data:`TIP_PREFIX`) and its note
    that a LightningModule's summary replaces the default one (:data:`SUMMARY_OVERRIDES`, word for word: a note
    naming any other callback still shows)."""
    for name in TIP_LOGGERS:
        _add_once(name, (TIP_PREFIX,), SUMMARY_OVERRIDES)


__all__ = ["EXPECTED_WARNINGS", "PER_RANK_LINES", "install_warning_filters", "is_worker", "quiet_duplicate_logs",
           "without_tips"]
