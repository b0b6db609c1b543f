"""Pipeline bubbles from the engine's annotations (``shardline.job.annotations``), else from p2p waits.

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

A rank without ``sl:pp`` rows is measured by the first of these that applies (``rank_pipelines``), and the
breakdown's ``bubble`` column is that same set:

- torch.distributed.pipelining's names (``PP:0F1``, ``PP:(0F3;3B1)OVERLAP_F_B``, ``Forward i``), read through
  ``pipeline_adapters`` (compute spans net of their receive wait, p/m/v inferred), ``method="torch_pipelining"``;
- its receives matched with their peers' sends (``p2p.match_p2p``: Megatron, DeepSpeed, torch's
  ``Schedule1F1B`` or any loop of NCCL/gloo send/recv): the bubble is the part of each receive before the
  matched send started, ``method="p2p_matched"``, one row per step with p, m, v and the schedule inferred from
  the message counts and the phases from the first gradient's and the last activation's arrival -- or, where
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
import enum
import warnings

import numpy as np
import pandas as pd

import shardline.job.annotations as contract
from shardline.profiling import intervals as iv
from shardline.profiling.classify import Lane, match_names
from shardline.profiling.errors import TraceWarning
from shardline.profiling.schema import P2P_CATEGORIES

_COMPUTE_ACTIONS = ("F", "B", "W")
#: The names ``pipeline_adapters`` reads (checked here first, so a trace without them never imports it).
THIRD_PARTY_PP_PATTERN = r"^(PP:\d|PP:\(|Forward \d|Backward \d)"


class BubbleMethod(str, enum.Enum):
    ANNOTATIONS = "annotations"
    TORCH_PIPELINING = "torch_pipelining"  # torch.distributed.pipelining's names, via ``pipeline_adapters``
    P2P_MATCHED = "p2p_matched"            # receives matched with their sends across ranks (``p2p``)
    P2P_ESTIMATED = "p2p_estimated"        # one rank's receives split by message size / link bandwidth
    P2P_RECV_IDLE = "p2p_recv_idle"        # nothing to measure with: the exposed receive time


#: The methods that measure a bubble (the last one only restates the breakdown's ``p2p_recv``).
MEASURED_METHODS = tuple(m.value for m in BubbleMethod if m is not BubbleMethod.P2P_RECV_IDLE)


@dataclasses.dataclass(frozen=True)
class RankPipeline:
    """How one rank's bubble is measured: ``method``, the (batches, actions) rows of the annotation methods
    (empty for the p2p ones) and ``bubble``, the interval set the breakdown's ``bubble`` label covers."""

    method: BubbleMethod
    batches: pd.DataFrame
    actions: pd.DataFrame
    bubble: iv.IntervalSet


def rank_pipelines(attribution) -> tuple[dict[int, RankPipeline], tuple[str, ...]]:
    """Per rank with a measurable pipeline, its :class:`RankPipeline`, first source that exists: ``sl:pp``
    annotations; torch.distributed.pipelining's names; receives matched with their sends (``p2p.match_p2p``);
    one rank's receives split by size and bandwidth. Plus the warnings the p2p inference gave. Computed once
    per attribution (the breakdown's ``bubble`` column reads it)."""
    return attribution.cached("bubbles.pipelines", lambda: _rank_pipelines(attribution))


def _rank_pipelines(attribution) -> tuple[dict[int, RankPipeline], tuple[str, ...]]:
    from shardline.profiling.survey import is_in

    out = annotated_pipelines(attribution)
    for number, (batches, actions) in _third_party_rows(attribution).items():
        if not batches.empty:
            out[number] = RankPipeline(BubbleMethod.TORCH_PIPELINING, batches, actions, bubble_set(batches, actions))
    rest = [rank.rank for rank in attribution.working if rank.rank not in out]
    if not rest or not is_in(attribution.events["category"], P2P_CATEGORIES).any():  # most traces: no p2p
        return out, ()
    from shardline.profiling import p2p

    if p2p.p2p_messages(attribution).empty:
        return out, ()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TraceWarning)
        matched = p2p.match_p2p(attribution)
    notes = tuple(str(w.message) for w in caught if issubclass(w.category, TraceWarning))
    receives = matched[(matched["kind"] == "recv") & matched["rank"].isin(rest)]
    for number, mine in receives.groupby("rank"):
        methods = set(mine["method"])
        in_pipeline = bool((mine["pipeline"] >= 0).any())
        if p2p.SplitMethod.MATCHED.value in methods and in_pipeline:
            method = BubbleMethod.P2P_MATCHED
        elif p2p.SplitMethod.ESTIMATED.value in methods:  # one rank's trace: its peers are not here to say
            method = BubbleMethod.P2P_ESTIMATED
        else:  # unmatched, or matched outside any pipeline (a one-way ring exchange): its receives stay p2p
            continue
        out[int(number)] = RankPipeline(method, _NO_BATCHES, _NO_ACTIONS, p2p.wait_set(matched, int(number)))
    return out, notes


def annotated_pipelines(attribution) -> dict[int, RankPipeline]:
    """``rank_pipelines``' first source alone: the ranks whose own ``sl:pp`` annotations measure their bubble
    (each rank by itself, unlike the other sources, which need the other ranks' rows)."""
    out: dict[int, RankPipeline] = {}
    for rank in attribution.ranks:
        if len(rank.pipeline_positions):
            batches, actions = rank.pp_rows
            if not batches.empty:
                out[rank.rank] = RankPipeline(BubbleMethod.ANNOTATIONS, batches, actions, bubble_set(batches, actions))
    return out


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
    """One row per (rank, pipeline batch): bubble split into phases and compared with (p-1)/(v·m+p-1).

    ``source``: a ``TraceSet``, an events table or an ``Attribution``. Each rank is measured by the first
    method ``rank_pipelines`` finds (``method`` says which); a rank measured from p2p alone has one row per
    step, whose ``bubble_ns`` is the breakdown's ``bubble`` column. Without any, the rows restate the
    breakdown's ``p2p_recv`` estimate (``method="p2p_recv_idle"``)."""
    from shardline.profiling.attribution import attribute  # attribution imports this module

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
        from shardline.profiling import p2p
        from shardline.profiling.pipeline_adapters import MEGATRON_PHASE_PATTERN, megatron_phases

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceWarning)  # given once, by rank_pipelines
            matched = p2p.match_p2p(attribution)
        pipelines = p2p.pipelines_of(attribution)
        shape = {}
        for k, pipe in enumerate(pipelines):
            for step, msgs in matched[matched["pipeline"] == k].groupby("step"):
                shape[(k, int(step))] = _pipeline_shape(pipe.ranks, msgs)
        phases = {}
        events = attribution.events
        if match_names(events["name"], MEGATRON_PHASE_PATTERN).any():
            rank_of = events["rank"].to_numpy()
            for rank in attribution.working:
                found = megatron_phases(events[rank_of == rank.rank], rank.lanes)
                if len(found):
                    phases[rank.rank] = found
        return cls(matched, pipelines, shape, phases)


def _pipeline_shape(ranks: tuple[int, ...], msgs: pd.DataFrame) -> dict:
    """p, m, v and the schedule of one pipeline in one step, from its receive counts (``p2p`` docstring):
    the last stage receives v·m activations from the one before it; with p > 2 the first stage receives
    (v-1)·m from the last (the ring an interleaved schedule closes); p = 2 cannot tell a ring from a line
    and gives v = 1. Under GPipe the last stage receives all m activations before it sends its first
    gradient; under 1F1B it sends that gradient after the first one."""
    p = len(ranks)
    recv = msgs[msgs["kind"] == "recv"]
    first, last = ranks[0], ranks[-1]
    vm = int(((recv["rank"] == last) & (recv["peer"] == ranks[-2])).sum()) if p >= 2 else 0
    wrap = int(((recv["rank"] == first) & (recv["peer"] == last)).sum()) if p >= 3 else 0
    m = vm - wrap
    v = vm // m if m > 0 and vm % m == 0 else 1
    m = m if m > 0 else vm
    # The last stage tells the schedules apart (the first one cannot when m <= p-1: it runs every forward
    # first in both): under GPipe all m activations arrive before its first gradient leaves, under 1F1B one.
    acts = recv[(recv["rank"] == last) & (recv["peer"] == ranks[-2])] if p >= 2 else recv.iloc[:0]
    grads_out = msgs[(msgs["kind"] == "send") & (msgs["rank"] == last) & (msgs["peer"] == ranks[-2])] if p >= 2 \
        else msgs.iloc[:0]
    if v > 1:
        schedule = "interleaved"
    elif len(acts) and len(grads_out):
        early = int((acts["end_ns"] <= grads_out["start_ns"].min()).sum())
        schedule = "gpipe" if early >= m else "1f1b"
    else:
        schedule = ""
    return {"p": p, "m": m, "v": v, "schedule": schedule}


def _p2p_rows(rank, measured: RankPipeline, context: _P2PContext) -> list[dict]:
    """One row per step of a rank measured from p2p: the breakdown's bubble set (the receive waits less every
    label above ``bubble``) per step, its phases and the inferred pipeline shape."""
    from shardline.profiling.partition import LABELS

    sets = rank.label_sets
    higher = iv.merge(*[sets[label] for label in LABELS[:LABELS.index("bubble")] if label in sets])
    bubble = iv.subtract(measured.bubble, higher)
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
                     "ideal_fraction": (p - 1) / (v * m + p - 1) if p > 0 and m > 0 else np.nan})
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


def _third_party_rows(attribution) -> dict[int, tuple[pd.DataFrame, pd.DataFrame]]:
    """``pipeline_adapters.torch_pipelining_rows`` of every rank without ``sl:pp`` batches that carries
    torch.distributed.pipelining names. A single-stage schedule's names carry no stage and a CPU/gloo trace no
    process group: the pipeline is then taken to be these ranks, in rank order (stage = position, p = count)."""
    events = attribution.events
    named = match_names(events["name"], THIRD_PARTY_PP_PATTERN)
    if not named.any():  # most traces: no third-party pipeline names
        return {}
    from shardline.profiling import pipeline_adapters as adapters

    candidates = {rank.rank: rank for rank in attribution.ranks if rank.pp_rows[0].empty}
    if not candidates:
        return {}
    rank_of = events["rank"].to_numpy()
    found = sorted(set(np.unique(rank_of[named]).tolist()) & set(candidates))
    # The adapter reads only the pipeline spans and the p2p rows of a rank.
    rows = events[named | events["category"].isin(P2P_CATEGORIES).to_numpy()]
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
            "ideal_fraction": (np.nan if batch.schedule == "dualpipev" or batch.p <= 0
                               else (batch.p - 1) / (batch.v * batch.m + batch.p - 1))}
