"""Join NCCL_DEBUG log rows to the NCCL kernels of the same rank's Kineto trace.

The log gives every collective's order (``opCount``) and size; the trace gives its time. When a rank has
both, its NCCL kernels (``ncclKernel_<Op>_…``, ``ncclDevKernel_<Op>_…``) are matched to its log lines of
the same operation in order — kernels by start time, log lines by opCount, one communicator only — and the
kernel takes the line's ``seq`` (and ``msg_bytes``/``pg_size`` where the trace had none). Only when the two
sides hold the same number of that operation on that rank: otherwise nothing is filled and a warning says
how many each side has (a partial capture window on either side makes order matching unsafe). Send/Recv
are left alone: one ``SendRecv`` kernel can carry several log lines.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

_KERNEL_OP = r"^nccl(?:Dev)?Kernel_([A-Za-z]+?)_"
_JOINABLE = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "AllToAll")


def join_nccl_log(events: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Events with log ``seq``/sizes copied onto matching trace kernels (see the module docstring)."""
    log = events[(events["source"] == "nccl_log") & (events["rank"] >= 0)]
    if log.empty:
        return events, []
    kernels = events[(events["source"] == "kineto") & (events["lane"] == "gpu")]
    ops = kernels["name"].astype(str).str.extract(_KERNEL_OP)[0]
    kernels = kernels[ops.notna().to_numpy()].assign(op=ops.dropna())
    warnings: list[str] = []
    seq = events["seq"].to_numpy().copy()
    msg = events["msg_bytes"].to_numpy().copy()
    size = events["pg_size"].to_numpy().copy()
    position = pd.Series(np.arange(len(events)), index=events.index)
    for (rank, op), lines in log.groupby(["rank", "name"], observed=True):
        if op not in _JOINABLE:
            continue
        mine = kernels[(kernels["rank"] == rank) & (kernels["op"] == op)].sort_values("start_ns", kind="stable")
        if mine.empty:
            continue
        if lines["pg_name"].nunique() > 1:
            warnings.append(f"rank {rank}: {op} lines of several NCCL communicators; their interleaving is "
                            "unknown, so they are not joined to kernels by order")
            continue
        lines = lines.sort_values("seq", kind="stable")
        if len(mine) != len(lines):
            warnings.append(f"rank {rank}: {len(lines)} {op} lines in the NCCL log but {len(mine)} {op} kernels "
                            "in the trace; not joined")
            continue
        at = position[mine.index].to_numpy()
        seq[at] = np.where(seq[at] < 0, lines["seq"].to_numpy(), seq[at])
        msg[at] = np.where(msg[at] < 0, lines["msg_bytes"].to_numpy(), msg[at])
        size[at] = np.where(size[at] < 0, lines["pg_size"].to_numpy(), size[at])
    out = events.copy()
    out["seq"], out["msg_bytes"], out["pg_size"] = seq, msg, size.astype(np.int32)
    return out, warnings
