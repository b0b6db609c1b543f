"""The naming contract between what shardline's training side records and what the profiler reads.

This module is the only place these names are spelled. ``shardline.plugins`` calls the ``*_name`` functions
inside ``torch.profiler.record_function`` and when it creates process groups; ``shardline.profiling`` matches
the ``*_PATTERN`` regular expressions (named groups, usable with ``pandas.Series.str.extract``). It imports
nothing beyond the standard library so both sides can use it anywhere.

Names (``{}`` fields are integers unless said otherwise)::

    sl:pp:batch:{schedule}:p{p}:m{m}:v{v}     one pipeline batch on one rank (schedule: gpipe|1f1b|interleaved)
    sl:pp:{action}:s{stage}:m{microbatch}     one pipeline action; action is one of PP_ACTIONS
    sl:pp:wait:s{stage}:m{microbatch}         the blocking wait inside a recv (time spent idle for the peer)
    sl:comm:{dim}:{op}                        a collective issued by shardline on parallel dimension dim
    sl:{axis}                                 the description (``group_desc``) of a process group of the Grid

A pipeline bubble is, by definition, the time of a rank's ``sl:pp:batch`` window covered by no forward or
backward action: the ``wait`` spans locate it, the batch window bounds it.
"""

from __future__ import annotations

import re

PREFIX = "sl"

#: Pipeline actions, in the text form the schedule module uses (F/B are compute; the rest are p2p).
PP_ACTIONS = ("F", "B", "W", "send_act", "recv_act", "send_grad", "recv_grad", "wait")
#: Parallel dimensions a collective can belong to. ``ep`` (the token all-to-alls of an MoE layer) and ``edp`` (the
#: expert-data-parallel group that replicates each expert, over which expert gradients reduce) are the expert
#: axes of :class:`shardline.plugins.grid.ParallelDims`; its third expert axis, ``etp``, is the TP group itself
#: when it is not 1, so it has no name of its own.
DIMS = ("tp", "cp", "dp", "pp", "ep", "edp", "dp_cp", "mp", "embed", "world")
#: Collective operations named in ``sl:comm`` annotations (the profiler's communication categories).
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p_send", "p2p_recv",
            "barrier", "memcpy_h2d", "memcpy_d2h")


def pp_batch_name(schedule: str, *, p: int, m: int, v: int = 1) -> str:
    """Annotation of one pipeline batch on one rank."""
    return f"{PREFIX}:pp:batch:{schedule}:p{p}:m{m}:v{v}"


def pp_action_name(action: str, *, stage: int, microbatch: int) -> str:
    """Annotation of one pipeline action (``F``, ``B``, ``W``, a send/recv, or ``wait``)."""
    if action not in PP_ACTIONS:
        raise ValueError(f"unknown pipeline action {action!r}; expected one of {PP_ACTIONS}")
    return f"{PREFIX}:pp:{action}:s{stage}:m{microbatch}"


def comm_name(dim: str, op: str) -> str:
    """Annotation around a collective shardline issues on parallel dimension ``dim``."""
    if dim not in DIMS or op not in COMM_OPS:
        raise ValueError(f"unknown communication annotation dim={dim!r} op={op!r}; dims {DIMS}, ops {COMM_OPS}")
    return f"{PREFIX}:comm:{dim}:{op}"


def group_desc(axis: str) -> str:
    """Description given to a Grid process group (``torch.distributed.new_group(group_desc=...)``)."""
    if axis not in DIMS:
        raise ValueError(f"unknown grid axis {axis!r}; expected one of {DIMS}")
    return f"{PREFIX}:{axis}"


_ACTIONS_ALT = "|".join(PP_ACTIONS)
PP_BATCH_PATTERN = rf"^{PREFIX}:pp:batch:(?P<schedule>[a-z0-9_]+):p(?P<p>\d+):m(?P<m>\d+):v(?P<v>\d+)$"
PP_ACTION_PATTERN = rf"^{PREFIX}:pp:(?P<action>{_ACTIONS_ALT}):s(?P<stage>\d+):m(?P<microbatch>\d+)$"
COMM_PATTERN = rf"^{PREFIX}:comm:(?P<dim>[a-z_]+):(?P<op>[a-z0-9_]+)$"
GROUP_DESC_PATTERN = rf"^{PREFIX}:(?P<axis>{'|'.join(DIMS)})$"

PP_BATCH_RE = re.compile(PP_BATCH_PATTERN)
PP_ACTION_RE = re.compile(PP_ACTION_PATTERN)
COMM_RE = re.compile(COMM_PATTERN)
GROUP_DESC_RE = re.compile(GROUP_DESC_PATTERN)
