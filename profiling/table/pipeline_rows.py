"""One rank's ``sl:pp:*`` annotation rows (the engine's pipeline contract, ``shardline.job.annotations``) read
into batch and action rows, and the bubble set they define: a batch window less its ``F``/``B``/``W`` spans.
Also the name pattern of torch.distributed.pipelining's spans (``matching.pipeline_adapters`` reads them)."""

from __future__ import annotations

import numpy as np
import pandas as pd

import shardline.job.annotations as contract

from ..base import intervals as iv
from .kinds import Lane
from .names import match_names

COMPUTE_ACTIONS = ("F", "B", "W")
#: The names ``matching.pipeline_adapters`` reads (checked first: most traces have none).
THIRD_PARTY_PP_PATTERN = r"^(PP:\d|PP:\(|Forward \d|Backward \d)"


def pp_rows(events: pd.DataFrame, lanes: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(batch rows with p/m/schedule, action rows with action/stage/microbatch) of one rank's ``sl:pp:*`` rows,
    on the lanes to use: ``lanes``, and on a GPU rank the host threads when its GPU lanes carry none."""
    is_pp = match_names(events["name"], f"{contract.PREFIX}:pp:")
    if not is_pp.any():  # no pipeline annotations (most traces): nothing to extract
        return NO_BATCHES.copy(), NO_ACTIONS.copy()
    lane = events["lane"].astype(str).to_numpy()
    cpu = Lane.CPU.value  # a GPU rank may carry the annotations only on its host threads
    for kind in ((lanes, cpu) if lanes == Lane.GPU.value else (lanes,)):
        sel = is_pp & (lane == kind)
        if sel.any():
            break
    sub = events[sel]
    sub_names = sub["name"].astype(str)  # only the pipeline annotations
    batch = sub_names.str.extract(contract.PP_BATCH_PATTERN)
    action = sub_names.str.extract(contract.PP_ACTION_PATTERN)
    start = sub["start_ns"].to_numpy()
    end = start + sub["dur_ns"].to_numpy()
    b = batch["p"].notna().to_numpy()
    batches = pd.DataFrame({"rank": sub["rank"].to_numpy()[b], "start_ns": start[b], "end_ns": end[b],
                            "schedule": batch["schedule"][b].to_numpy(),
                            "p": batch["p"][b].astype(int).to_numpy(), "m": batch["m"][b].astype(int).to_numpy(),
                            "v": batch["v"][b].astype(int).to_numpy()})
    a = action["action"].notna().to_numpy()
    actions = pd.DataFrame({"rank": sub["rank"].to_numpy()[a], "start_ns": start[a], "end_ns": end[a],
                            "action": action["action"][a].to_numpy(),
                            "stage": action["stage"][a].astype(int).to_numpy(),
                            "microbatch": action["microbatch"][a].astype(int).to_numpy()})
    return batches, actions


NO_BATCHES = pd.DataFrame({"rank": np.empty(0, np.int32), "start_ns": np.empty(0, np.int64),
                            "end_ns": np.empty(0, np.int64), "schedule": np.empty(0, object),
                            "p": np.empty(0, np.int64), "m": np.empty(0, np.int64), "v": np.empty(0, np.int64)})
NO_ACTIONS = pd.DataFrame({"rank": np.empty(0, np.int32), "start_ns": np.empty(0, np.int64),
                            "end_ns": np.empty(0, np.int64), "action": np.empty(0, object),
                            "stage": np.empty(0, np.int64), "microbatch": np.empty(0, np.int64)})


def bubble_set(batches: pd.DataFrame, actions: pd.DataFrame) -> iv.IntervalSet:
    """Bubble interval set of one rank's ``pp_rows``: batch windows minus F/B/W spans (empty without batches).

    On a GPU rank the GPU copies of the annotations are used; a trace that has them only on the CPU falls
    back to those, whose times are the host's issue times and only approximate the GPU's.
    """
    if batches.empty:
        return iv.EMPTY
    busy = actions[actions["action"].isin(COMPUTE_ACTIONS)]
    return iv.subtract(iv.union(batches["start_ns"], batches["end_ns"]),
                       iv.union(busy["start_ns"], busy["end_ns"]))
