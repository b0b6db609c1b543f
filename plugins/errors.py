"""Exception types of the training side. Every message names the offending values.

:class:`ShardlineError` and the layout, schedule and contract errors are :mod:`shardline.job.errors`' (the pure
package below both halves raises them too), re-exported here unchanged."""

import contextlib
from dataclasses import dataclass
from pathlib import Path

from shardline.job.errors import ContractError, LayoutError, ScheduleError, ShardlineError


class CheckpointError(ShardlineError, ValueError):
    """A checkpoint (shardline's or a Hugging Face folder) that cannot be read or written as asked; the message
    names the file, the tensor and the numbers."""


class NonFiniteLossError(ShardlineError, FloatingPointError):
    """A training loss became NaN or infinite; names the step, the batch and the ranks with their losses."""


class RankFailedError(ShardlineError, RuntimeError):
    """A worker rank raised, hung or died; carries the rank and its traceback text."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        self.rank = rank
        self.remote_traceback = remote_traceback
        text = f"rank {rank}: {message}"
        if remote_traceback:
            text += f"\n--- traceback on rank {rank} ---\n{remote_traceback}"
        super().__init__(text)


class CollectiveError(ShardlineError, RuntimeError):
    """Collectives stopped because a rank died, hung or raised. The message names the rank(s), each process
    group concerned by layout axis and index with its ranks (``"tp group 1: ranks 2,3"``), the last collective
    every rank of those groups entered and completed as ``(op, seq)``, and where each rank dumped its record.
    ``kind`` is ``dead``, ``hung``, ``raised``, ``stuck`` or ``unknown``; ``culprits`` the ranks named."""

    def __init__(self, message: str, *, kind: str = "unknown", culprits: tuple[int, ...] = (),
                 dump_dir: str | None = None):
        self.kind = kind
        self.culprits = tuple(culprits)
        self.dump_dir = dump_dir
        super().__init__(message)


__all__ = ["CheckpointError", "CollectiveError", "ContractError", "LayoutError", "NonFiniteLossError",
           "RankFailedError", "ScheduleError", "ShardlineError"]


@dataclass(frozen=True)
class ErrorReport:
    """How a rank's error is told, decided where the ranks agreed on it (the watchdog's verdict): ``speaks``
    is whether this rank prints it for all (the rank whose own code raised, else the lowest rank not named as a
    culprit); every rank writes its full traceback to ``<log_dir>/rank<N>-error.txt``."""

    rank: int
    speaks: bool
    log_dir: str

    def traceback_path(self) -> Path:
        return Path(self.log_dir) / f"rank{self.rank}-error.txt"


def attach_report(error: BaseException, report: ErrorReport) -> None:
    """Carry ``report`` on ``error`` for whoever prints it (``shardline fit``); some exception types refuse
    attributes, and then nothing is carried."""
    with contextlib.suppress(AttributeError, TypeError):
        error.shardline_report = report


def report_of(error: BaseException) -> ErrorReport | None:
    """The :class:`ErrorReport` the strategy attached to ``error``, if any."""
    report = getattr(error, "shardline_report", None)
    return report if isinstance(report, ErrorReport) else None
