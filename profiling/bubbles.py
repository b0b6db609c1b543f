"""Pipeline bubbles from the engine's annotations (``shardline.profiling.annotations``), else from p2p waits.

Definition (the annotation contract): on one rank, the bubble of a pipeline batch is the part of its
``sl:pp:batch`` window covered by no ``F`` / ``B`` / ``W`` action span::

    bubble = batch window \\ ∪(F, B, W spans)

Phases of one batch window on one stage (fill / steady / drain):

    warm-up   [batch start, start of the first B)       -- filling: forwards and the wait for the first grad
    steady    [start of the first B, end of the last F) -- 1F1B alternation
    cool-down [end of the last F, batch end)            -- draining: the remaining backwards

each bubble ns falls in exactly one phase, so warmup_ns + steady_ns + cooldown_ns == bubble_ns. The measured
fraction ``bubble_ns / batch_ns`` is compared with the equal-cost ideal (p-1)/(m+p-1) for the p and m the
annotation names -- (p-1)/(v·m+p-1) for an interleaved schedule with v chunks per stage, which is
(p-1)/(m+p-1) at v=1 (``m_seen`` counts the distinct forward micro-batches actually found).

A rank without ``sl:pp`` rows that carries torch.distributed.pipelining's names (``PP:0F1``, ``Forward i``)
is read through ``pipeline_adapters`` (compute spans net of their receive wait, p/m/v inferred) and measured
the same way, with ``method="torch_pipelining"``; that measurement is ``pipeline_bubbles``' only: the
breakdown's ``bubble`` column still comes from the ``sl:pp`` rows alone.

Without annotations the estimate is the exposed ``p2p_recv`` time of ``breakdown`` (the idle a stage spends
in receives), reported with ``method="p2p_recv_idle"``; phases and ideal are then unknown (NaN / -1).

The rows and lanes of each rank come from its ``attribution.RankAttribution`` (``pp_rows``, ``bubble``), so the
bubble set the breakdown's ``bubble`` column partitions and the one reported here are one computation.
"""

from __future__ import annotations

import enum

import numpy as np
import pandas as pd

import shardline.profiling.annotations as contract
from shardline.profiling import intervals as iv
from shardline.profiling.classify import Lane, match_names

_COMPUTE_ACTIONS = ("F", "B", "W")


class BubbleMethod(str, enum.Enum):
    ANNOTATIONS = "annotations"
    TORCH_PIPELINING = "torch_pipelining"  # torch.distributed.pipelining's names, via ``pipeline_adapters``
    P2P_RECV_IDLE = "p2p_recv_idle"


def pp_rows(events: pd.DataFrame, lanes: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(batch rows with p/m/schedule, action rows with action/stage/microbatch) of one rank's ``sl:pp:*`` rows,
    on the lanes to use: ``lanes``, and on a GPU rank the host threads when its GPU lanes carry none."""
    is_pp = match_names(events["name"], f"{contract.PREFIX}:pp:")
    if not is_pp.any():  # no pipeline annotations (most traces): nothing to extract
        return _NO_BATCHES.copy(), _NO_ACTIONS.copy()
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


_NO_BATCHES = pd.DataFrame({"rank": np.empty(0, np.int32), "start_ns": np.empty(0, np.int64),
                            "end_ns": np.empty(0, np.int64), "schedule": np.empty(0, object),
                            "p": np.empty(0, np.int64), "m": np.empty(0, np.int64), "v": np.empty(0, np.int64)})
_NO_ACTIONS = pd.DataFrame({"rank": np.empty(0, np.int32), "start_ns": np.empty(0, np.int64),
                            "end_ns": np.empty(0, np.int64), "action": np.empty(0, object),
                            "stage": np.empty(0, np.int64), "microbatch": np.empty(0, np.int64)})


def bubble_set(batches: pd.DataFrame, actions: pd.DataFrame) -> iv.IntervalSet:
    """Bubble interval set of one rank's ``pp_rows``: batch windows minus F/B/W spans (empty without batches).

    On a GPU rank the GPU copies of the annotations are used; a trace that has them only on the CPU falls
    back to those, whose times are the host's issue times and only approximate the GPU's.
    """
    if batches.empty:
        return iv.EMPTY
    busy = actions[actions["action"].isin(_COMPUTE_ACTIONS)]
    return iv.subtract(iv.union(batches["start_ns"], batches["end_ns"]),
                       iv.union(busy["start_ns"], busy["end_ns"]))


def pipeline_bubbles(source) -> pd.DataFrame:
    """One row per (rank, pipeline batch): bubble split into phases and compared with (p-1)/(m+p-1).

    ``source``: a ``TraceSet``, an events table or an ``Attribution``; without annotations, the breakdown's
    ``p2p_recv`` estimate of that same attribution (computed once per trace set)."""
    from shardline.profiling.attribution import attribute  # attribution imports this module

    attribution = attribute(source, caller="pipeline_bubbles")
    rows = []
    third_party = _third_party_rows(attribution)
    for rank in attribution.ranks:
        batches, actions = rank.pp_rows
        method = BubbleMethod.ANNOTATIONS
        if batches.empty and rank.rank in third_party:
            (batches, actions), method = third_party[rank.rank], BubbleMethod.TORCH_PIPELINING
        windows = rank.windows
        for batch in batches.itertuples(index=False):  # one iteration per pipeline batch, not per event
            row = _batch_row(rank.rank, batch=batch, actions=actions) | {"method": method.value}
            # The step whose window holds the batch start (batches nest in ProfilerStep windows).
            holds = windows[(windows["start_ns"] <= batch.start_ns) & (windows["end_ns"] > batch.start_ns)]
            row["step"] = int(holds["step"].iloc[0]) if len(holds) else -1
            rows.append(row)
    if rows:
        return pd.DataFrame(rows)
    table = attribution.breakdown
    return pd.DataFrame({
        "rank": table["rank"], "step": table["step"], "method": BubbleMethod.P2P_RECV_IDLE.value,
        "stage": -1, "schedule": "", "p": -1, "m": -1, "v": -1, "m_seen": -1, "batch_ns": table["step_ns"],
        "bubble_ns": table["p2p_recv"], "warmup_ns": -1, "steady_ns": -1, "cooldown_ns": -1,
        "bubble_fraction": table["p2p_recv"] / table["step_ns"].where(table["step_ns"] > 0),
        "ideal_fraction": np.nan})


def _third_party_rows(attribution) -> dict[int, tuple[pd.DataFrame, pd.DataFrame]]:
    """``pipeline_adapters.torch_pipelining_rows`` of every rank without ``sl:pp`` batches that carries
    torch.distributed.pipelining names. A single-stage schedule's names carry no stage and a CPU/gloo trace no
    process group: the pipeline is then taken to be these ranks, in rank order (stage = position, p = count)."""
    from shardline.profiling import pipeline_adapters as adapters

    candidates = {rank.rank: rank for rank in attribution.ranks if rank.pp_rows[0].empty}
    events = attribution.events
    named = match_names(events["name"], adapters.THIRD_PARTY_PP_PATTERN)
    if not candidates or not named.any():  # most traces: no third-party pipeline names
        return {}
    rank_of = events["rank"].to_numpy()
    found = sorted(set(np.unique(rank_of[named]).tolist()) & set(candidates))
    # The adapter reads only the pipeline spans and the p2p rows of a rank.
    rows = events[named | events["category"].isin(adapters.P2P_CATEGORIES).to_numpy()]
    rows_rank = rows["rank"].to_numpy()
    return {rank: adapters.torch_pipelining_rows(rows[rows_rank == rank], candidates[rank].lanes,
                                                 p_default=len(found), stage_default=position)
            for position, rank in enumerate(found)}


def _batch_row(rank: int, *, batch, actions: pd.DataFrame) -> dict:
    inside = actions[(actions["rank"] == rank) & (actions["start_ns"] >= batch.start_ns)
                     & (actions["end_ns"] <= batch.end_ns)]
    busy = inside[inside["action"].isin(_COMPUTE_ACTIONS)]
    window = iv.union([batch.start_ns], [batch.end_ns])
    bubble = iv.subtract(window, iv.union(busy["start_ns"], busy["end_ns"]))
    fwd = inside[inside["action"] == "F"]
    bwd = inside[inside["action"] == "B"]
    first_b = int(bwd["start_ns"].min()) if len(bwd) else batch.end_ns
    last_f = int(fwd["end_ns"].max()) if len(fwd) else batch.start_ns
    last_f = max(last_f, first_b)  # GPipe: all F end before the first B; its steady phase is empty
    phase = {name: iv.total(iv.intersect(bubble, iv.union([lo], [hi])))
             for name, lo, hi in (("warmup_ns", batch.start_ns, first_b), ("steady_ns", first_b, last_f),
                                  ("cooldown_ns", last_f, batch.end_ns))}
    stages = inside["stage"].unique()
    batch_ns = int(batch.end_ns - batch.start_ns)
    bubble_ns = iv.total(bubble)
    return {"rank": rank, "step": -1, "method": BubbleMethod.ANNOTATIONS.value,
            "stage": int(stages[0]) if len(stages) == 1 else -1, "schedule": batch.schedule,
            "p": int(batch.p), "m": int(batch.m), "v": int(batch.v), "m_seen": int(fwd["microbatch"].nunique()),
            "batch_ns": batch_ns, "bubble_ns": bubble_ns, **phase,
            "bubble_fraction": bubble_ns / batch_ns if batch_ns > 0 else np.nan,
            "ideal_fraction": (batch.p - 1) / (batch.v * batch.m + batch.p - 1)}
