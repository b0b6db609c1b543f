"""Exception types of the training side. Every message names the offending values.

:class:`ShardlineError` and the layout, schedule and contract errors are :mod:`shardline.job.errors`' (the pure
package below both halves raises them too), re-exported here unchanged."""

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
