"""Exception types of :mod:`shardline.job`, which ``shardline.plugins.errors`` re-exports as its own. Every
message names the offending values."""


class ShardlineError(Exception):
    """Base of every error shardline.job and shardline.plugins raise on purpose."""


class LayoutError(ShardlineError, ValueError):
    """A parallel layout (degrees, world size, node size, shapes vs degrees) that cannot work."""


class ScheduleError(ShardlineError, ValueError):
    """A pipeline schedule that is malformed or would deadlock."""


class ContractError(ShardlineError, TypeError):
    """A user's module or config does not meet the contract a strategy needs."""


__all__ = ["ContractError", "LayoutError", "ScheduleError", "ShardlineError"]
