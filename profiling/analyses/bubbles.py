"""Pipeline bubbles from the engine's annotations (``shardline.job.annotations``), else from p2p waits.

Definition (the annotation contract): on one rank, the bubble of a pipeline batch is the part of its
``sl:pp:batch`` window covered by no ``F`` / ``B`` / ``W`` action span::

    bubble = batch window \\ ∪(F, B, W spans)

Phases of one batch window on one stage (fill / steady / drain):

    warm-up   [batch start, start of the first B)       -- filling: forwards and the wait for the first grad
    steady    [start of the first B, end of the last F) -- 1F1B alternation
    cool-down [end of the last F, batch end)            -- draining: the remaining backwards

each bubble ns falls in exactly one phase, so warmup_ns + steady_ns + cooldown_ns == bubble_ns. The measured
fraction ``bubble_ns / batch_ns`` is compared with the equal-cost ideal of the schedule for the p, m and v the
annotation names (``ideal_fraction``, from the one place the closed forms live, ``shardline.job.pipeline.theory``:
(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) for an interleaved schedule with v chunks per stage; NaN for
a schedule without one, DualPipeV) (``m_seen`` counts the distinct forward micro-batches actually found).

A rank without ``sl:pp`` rows is measured by the first of these that applies (``rank_pipelines``), and the
breakdown's ``bubble`` column is that same set:

- torch.distributed.pipelining's names (``PP:0F1``, ``PP:(0F3;3B1)OVERLAP_F_B``, ``Forward i``), read through
  ``pipeline_adapters`` (compute spans net of their receive wait, p/m/v inferred), ``method="torch_pipelining"``;
- its receives matched with their peers' sends (``p2p.match_p2p``: Megatron, DeepSpeed, torch's
  ``Schedule1F1B`` or any loop of NCCL/gloo send/recv): the bubble is the part of each receive before the
  matched send started, and the stage's fill and drain (its idle before its first and after its last pipeline
  message in the step) up to the schedule's ideal share, after the host-blocking idle causes
  (``attribution.idle.pipeline_bubble``), ``method="p2p_matched"``, one row per step with p, m, v and the
  schedule inferred from the message counts and the phases from the first gradient's and the last
  activation's arrival -- or, where
  Megatron-core's NVTX phase ranges are in the trace (``pipeline_adapters.megatron_phases``, an Nsight
  export), the engine's own phases: its warmup / steady / cooldown loops moved onto the GPU through the work
  launched in them (a wait belongs to the loop that posted the receive), and the schedule its function's;
- one rank's trace: the same split with the transfer estimated from the message size and the link's bandwidth,
  ``method="p2p_estimated"``.

Without any of these the estimate is the exposed ``p2p_recv`` time of ``breakdown`` (the idle a stage spends
in receives), reported with ``method="p2p_recv_idle"``; phases and ideal are then unknown (NaN / -1).

The rows and lanes of each rank come from its ``attribution.RankAttribution`` (``pp_rows``, ``bubble``), so the
bubble set the breakdown's ``bubble`` column partitions and the one reported here are one computation.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pandas as pd

from ..attribution.core import attribute
from ..base import intervals as iv
from ..base.errors import TraceWarning
from ..matching import p2p
from ..matching.pipeline_adapters import MEGATRON_PHASE_PATTERN, megatron_phases
from ..matching.pipelines import BubbleMethod, RankPipeline, ideal_fraction, pipeline_shape, rank_pipelines
from ..table.names import match_names
from ..table.partition import LABELS
from ..table.pipeline_rows import COMPUTE_ACTIONS


def pipeline_bubbles(source) -> pd.DataFrame:
    """One row per (rank, pipeline batch): bubble split into phases and compared with the schedule's ideal.

    ``source``: a ``TraceSet``, an events table or an ``Attribution``. Each rank is measured by the first
    method ``rank_pipelines`` finds (``method`` says which); a rank measured from p2p alone has one row per
    step, whose ``bubble_ns`` is the breakdown's ``bubble`` column. Without any, the rows restate the
    breakdown's ``p2p_recv`` estimate (``method="p2p_recv_idle"``)."""

    attribution = attribute(source, caller="pipeline_bubbles")
    pipelines, notes = rank_pipelines(attribution)
    for note in notes:
        warnings.warn(note, TraceWarning, stacklevel=2)
    rows = []
    p2p_context = None
    for rank in attribution.ranks:
        measured = pipelines.get(rank.rank)
        if measured is None:
            continue
        if measured.method in (BubbleMethod.P2P_MATCHED, BubbleMethod.P2P_ESTIMATED):
            p2p_context = p2p_context or _P2PContext.of(attribution)
            rows += _p2p_rows(rank, measured, p2p_context)
            continue
        windows = rank.windows
        for batch in measured.batches.itertuples(index=False):  # one iteration per pipeline batch, not per event
            row = _batch_row(rank.rank, batch=batch, actions=measured.actions) | {"method": measured.method.value}
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


@dataclasses.dataclass
class _P2PContext:
    """What the p2p rows of every rank share: the matched messages and the pipelines, with per (pipeline,
    step) the p, m, v and schedule inferred from the message counts."""

    matched: pd.DataFrame
    pipelines: list
    shape: dict
    phases: dict  # rank -> Megatron's NVTX phase ranges (``pipeline_adapters.megatron_phases``), where present

    @classmethod
    def of(cls, attribution) -> _P2PContext:

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceWarning)  # given once, by rank_pipelines
            matched = p2p.match_p2p(attribution)
        pipelines = p2p.pipelines_of(attribution)
        shape = {}
        for k, pipe in enumerate(pipelines):
            for step, msgs in matched[matched["pipeline"] == k].groupby("step"):
                shape[(k, int(step))] = pipeline_shape(pipe.ranks, msgs)
        phases = {}
        events = attribution.events
        if match_names(events["name"], MEGATRON_PHASE_PATTERN).any():
            rank_of = events["rank"].to_numpy()
            for rank in attribution.working:
                found = megatron_phases(events[rank_of == rank.rank], rank.lanes)
                if len(found):
                    phases[rank.rank] = found
        return cls(matched, pipelines, shape, phases)


def _p2p_rows(rank, measured: RankPipeline, context: _P2PContext) -> list[dict]:
    """One row per step of a rank measured from p2p: the breakdown's bubble set (the receive waits and, on a
    matched pipeline, the stage's fill and drain, less every label above ``bubble``) per step, its phases and
    the inferred pipeline shape."""

    sets = rank.label_sets
    higher = iv.merge(*[sets[label] for label in LABELS[:LABELS.index("bubble")] if label in sets])
    bubble = iv.subtract(rank.bubble, higher)
    mine = context.matched[context.matched["rank"] == rank.rank]
    k = int(mine["pipeline"].max()) if len(mine) else -1
    ranks = context.pipelines[k].ranks if k >= 0 else ()
    stage = ranks.index(rank.rank) if rank.rank in ranks else -1
    rows = []
    for window in rank.attributed_windows.itertuples(index=False):  # one iteration per step
        lo, hi = int(window.start_ns), int(window.end_ns)
        shape = context.shape.get((k, int(window.step)), {"p": -1, "m": -1, "v": -1, "schedule": ""})
        msgs = mine[(mine["start_ns"] >= lo) & (mine["start_ns"] < hi)]
        first_b, last_f = _p2p_phase_bounds(msgs, ranks, stage, lo=lo, hi=hi)
        named = context.phases.get(rank.rank)
        if named is not None:  # the engine's own phase ranges win over the inference from messages
            first_b, last_f, schedule = _named_phase_bounds(named, lo=lo, hi=hi, default=(first_b, last_f))
            shape = {**shape, "schedule": schedule or shape["schedule"]}
        in_window = iv.intersect(bubble, iv.union([lo], [hi]))
        phase = {name: iv.total(iv.intersect(in_window, iv.union([a], [b])))
                 for name, a, b in (("warmup_ns", lo, first_b), ("steady_ns", first_b, last_f),
                                    ("cooldown_ns", last_f, hi))}
        p, m, v = shape["p"], shape["m"], shape["v"]
        batch_ns, bubble_ns = hi - lo, iv.total(in_window)
        rows.append({"rank": rank.rank, "step": int(window.step), "method": measured.method.value, "stage": stage,
                     "schedule": shape["schedule"], "p": p, "m": m, "v": v, "m_seen": m, "batch_ns": batch_ns,
                     "bubble_ns": bubble_ns, **phase,
                     "bubble_fraction": bubble_ns / batch_ns if batch_ns > 0 else np.nan,
                     "ideal_fraction": ideal_fraction(shape["schedule"], p=p, m=m, v=v)})
    return rows


def _named_phase_bounds(phases: pd.DataFrame, *, lo: int, hi: int, default) -> tuple[int, int, str]:
    """(steady start, cool-down start, schedule) of Megatron's phase ranges starting in [lo, hi)."""
    inside = phases[(phases["start_ns"] >= lo) & (phases["start_ns"] < hi)]
    if inside.empty:
        return (*default, "")
    steady = inside.loc[inside["phase"] == "steady", "start_ns"]
    cool = inside.loc[inside["phase"] == "cooldown", "start_ns"]
    last_f = int(cool.min()) if len(cool) else hi
    first_b = int(steady.min()) if len(steady) else last_f  # m <= p-1: no steady phase
    return first_b, max(first_b, last_f), str(inside["schedule"].iloc[0])


def _p2p_phase_bounds(msgs: pd.DataFrame, ranks, stage: int, *, lo: int, hi: int) -> tuple[int, int]:
    """(start of the first backward, end of the last forward) of a stage as its messages show them: the first
    gradient's arrival (the last stage: its first gradient send) and the last activation's arrival (the first
    stage: its last activation send)."""
    if stage < 0 or len(ranks) < 2:
        return hi, hi
    prev = ranks[stage - 1] if stage > 0 else None
    nxt = ranks[stage + 1] if stage < len(ranks) - 1 else None
    recv, send = msgs[msgs["kind"] == "recv"], msgs[msgs["kind"] == "send"]
    if nxt is not None:
        grads = recv[recv["peer"] == nxt]["end_ns"]
    else:
        grads = send[send["peer"] == prev]["start_ns"]
    if prev is not None:
        acts = recv[recv["peer"] == prev]["end_ns"]
    else:
        acts = send[send["peer"] == nxt]["start_ns"]
    first_b = int(grads.min()) if len(grads) else hi
    last_f = int(acts.max()) if len(acts) else lo
    return first_b, max(last_f, first_b)


def _batch_row(rank: int, *, batch, actions: pd.DataFrame) -> dict:
    inside = actions[(actions["rank"] == rank) & (actions["start_ns"] >= batch.start_ns)
                     & (actions["end_ns"] <= batch.end_ns)]
    busy = inside[inside["action"].isin(COMPUTE_ACTIONS)]
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
            "ideal_fraction": ideal_fraction(str(batch.schedule), p=int(batch.p), m=int(batch.m), v=int(batch.v))}
