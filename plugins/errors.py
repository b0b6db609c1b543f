"""Exception types of the training side. Every message names the offending values."""


class ShardlineError(Exception):
    """Base of every error shardline.plugins raises on purpose."""


class LayoutError(ShardlineError, ValueError):
    """A parallel layout (degrees, world size, node size, shapes vs degrees) that cannot work."""


class ScheduleError(ShardlineError, ValueError):
    """A pipeline schedule that is malformed or would deadlock."""


class ContractError(ShardlineError, TypeError):
    """A user's module or config does not meet the contract a strategy needs."""


class RankFailedError(ShardlineError, RuntimeError):
    """A worker rank raised, hung or died; carries the rank and its traceback text."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        self.rank = rank
        self.remote_traceback = remote_traceback
        text = f"rank {rank}: {message}"
        if remote_traceback:
            text += f"\n--- traceback on rank {rank} ---\n{remote_traceback}"
        super().__init__(text)
