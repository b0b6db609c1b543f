"""Exception and warning types of the profiling toolkit (torch-free)."""


class ProfilingError(Exception):
    """Base of every error shardline.profiling raises on purpose."""


class TraceFormatError(ProfilingError, ValueError):
    """A trace, log or export that cannot be read; the message names the file and the problem."""


class MissingRankError(ProfilingError, ValueError):
    """A trace whose rank cannot be determined; the message says how to provide it."""


class TraceWarning(UserWarning):
    """Part of an input was unreadable; the readable part was returned."""


class ClassificationError(ProfilingError, ValueError):
    """Invalid classification input: a bad ``CommRule`` or ``layout``; the message names the offending value."""


class AttributionError(ProfilingError, ValueError):
    """An events table the attribution cannot partition (e.g. nothing to attribute); the message says why."""


class MixedJobsError(TraceFormatError):
    """Files of different jobs (world sizes, process groups, duplicate ranks) were loaded together; the
    message names the files that disagree."""
