"""How each rank's pipeline bubble is measured (``rank_pipelines``): the first source that exists of ``sl:pp``
annotations, torch.distributed.pipelining's names (``pipeline_adapters``), receives matched with their sends
(``p2p.match_p2p``), or one rank's receives split by size and link bandwidth. The breakdown's ``bubble`` label
covers the set measured here; ``analyses.bubbles`` reports it per batch (the definitions are in its docstring).

A rank measured from matched p2p (:class:`P2PPipeline`) also carries, per step, the span of its pipeline
messages (first start to last end) and the pipeline's shape in that step (``pipeline_shape``: p, m, v, the
schedule) with the schedule's ideal bubble fraction (``shardline.job.pipeline.theory``, the one place the closed
forms live): the attribution counts the idle before the first and after the last of those messages -- the
stage's fill and drain -- as bubble, up to that share (``attribution.idle.pipeline_bubble``).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pandas as pd

from shardline.job.pipeline import theory

from ..base.errors import TraceWarning
from ..base.schema import P2P_CATEGORIES
from ..table.names import match_names
from ..table.pipeline_rows import NO_ACTIONS, NO_BATCHES, THIRD_PARTY_PP_PATTERN, bubble_set
from ..table.rows import is_in
from . import p2p
from . import pipeline_adapters as adapters
from .matched import BubbleMethod, RankPipeline, matching_of
from .messages import p2p_messages

#: The methods that measure a bubble (the last one only restates the breakdown's ``p2p_recv``).
MEASURED_METHODS = tuple(m.value for m in BubbleMethod if m is not BubbleMethod.P2P_RECV_IDLE)
#: Columns of :attr:`P2PPipeline.steps`.
STEP_COLUMNS = ("rank", "step", "start_ns", "end_ns", "schedule", "p", "m", "v", "ideal_fraction")
NO_STEPS = pd.DataFrame({"rank": np.empty(0, np.int64), "step": np.empty(0, np.int64),
                         "start_ns": np.empty(0, np.int64), "end_ns": np.empty(0, np.int64),
                         "schedule": np.empty(0, object), "p": np.empty(0, np.int64), "m": np.empty(0, np.int64),
                         "v": np.empty(0, np.int64), "ideal_fraction": np.empty(0, float)})


@dataclasses.dataclass(frozen=True)
class P2PPipeline(RankPipeline):
    """A rank measured from receives matched with their sends: ``bubble`` is its receive waits; ``steps`` has a
    row per step with pipeline messages (``STEP_COLUMNS``): ``[start_ns, end_ns)`` from the first message's
    start to the last one's end (the stage's fill lies before, its drain after), the pipeline's shape in the
    step (``pipeline_shape``) and ``ideal_fraction``, the schedule's bubble share (``theory.bubble_fraction``;
    NaN where the shape is unknown)."""

    steps: pd.DataFrame = dataclasses.field(default_factory=NO_STEPS.copy)


#: The looped (several chunks per rank) form of each one-chunk schedule.
_LOOPED = {"1f1b": "interleaved", "gpipe": "looped_bfs"}


def ideal_fraction(schedule: str, *, p: int, m: int, v: int) -> float:
    """The closed-form bubble share of ``schedule`` (``theory.bubble_fraction``) at p, m, v; an unnamed schedule
    is 1F1B (v = 1) or interleaved (v > 1), a one-chunk one at v > 1 its looped form; NaN where the shape is
    unknown (p, m or v < 1) or the schedule has no closed form there (DualPipeV)."""
    schedule = schedule or ("interleaved" if v > 1 else "1f1b")
    if v > 1:  # a one-chunk name on a rank that ran several chunks (an annotation's v): its looped form
        schedule = _LOOPED.get(schedule, schedule)
    if p < 1 or m < 1 or v < 1 or not theory.has_closed_form(schedule, v=int(v)):
        return float("nan")
    return theory.bubble_fraction(schedule, p=int(p), m=int(m), v=int(v))


def pipeline_shape(ranks: tuple[int, ...], msgs: pd.DataFrame) -> dict:
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


def _p2p_steps(matched: pd.DataFrame, pipelines, rank: int) -> pd.DataFrame:
    """:attr:`P2PPipeline.steps` of ``rank``: per step its pipeline messages' span and the pipeline's shape."""
    mine = matched[(matched["rank"] == rank) & (matched["pipeline"] >= 0) & (matched["step"] >= 0)]
    if mine.empty:
        return NO_STEPS.copy()
    k = int(mine["pipeline"].max())
    mine = mine[mine["pipeline"] == k]
    ranks = pipelines[k].ranks
    rows = []
    for step, msgs in mine.groupby("step", sort=True):  # one iteration per step
        shape = pipeline_shape(ranks, matched[(matched["pipeline"] == k) & (matched["step"] == step)])
        rows.append({"rank": rank, "step": int(step), "start_ns": int(msgs["start_ns"].min()),
                     "end_ns": int(msgs["end_ns"].max()), **shape,
                     "ideal_fraction": ideal_fraction(shape["schedule"], p=shape["p"], m=shape["m"], v=shape["v"])})
    return pd.DataFrame(rows, columns=list(STEP_COLUMNS)).astype(NO_STEPS.dtypes.to_dict())


def rank_pipelines(attribution) -> tuple[dict[int, RankPipeline], tuple[str, ...]]:
    """Per rank with a measurable pipeline, its :class:`RankPipeline`, first source that exists: ``sl:pp``
    annotations; torch.distributed.pipelining's names; receives matched with their sends (``p2p.match_p2p``);
    one rank's receives split by size and bandwidth. Plus the warnings the p2p inference gave. Computed once
    per trace set and kept in its ``Matching`` (the breakdown's ``bubble`` column reads it)."""
    survey, matching = matching_of(attribution, caller="rank_pipelines")
    if matching.pipelines is None:
        matching.pipelines = _rank_pipelines(survey)
    return matching.pipelines


def _rank_pipelines(attribution) -> tuple[dict[int, RankPipeline], tuple[str, ...]]:

    out = annotated_pipelines(attribution)
    for number, (batches, actions) in _third_party_rows(attribution).items():
        if not batches.empty:
            out[number] = RankPipeline(BubbleMethod.TORCH_PIPELINING, batches, actions, bubble_set(batches, actions))
    rest = [rank.rank for rank in attribution.working if rank.rank not in out]
    if not rest or not is_in(attribution.events["category"], P2P_CATEGORIES).any():  # most traces: no p2p
        return out, ()

    if p2p_messages(attribution).empty:
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
        waits = p2p.wait_set(matched, int(number))
        if method is BubbleMethod.P2P_MATCHED:
            steps = _p2p_steps(matched, p2p.pipelines_of(attribution), int(number))
            out[int(number)] = P2PPipeline(method, NO_BATCHES, NO_ACTIONS, waits, steps)
        else:
            out[int(number)] = RankPipeline(method, NO_BATCHES, NO_ACTIONS, waits)
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


def _third_party_rows(attribution) -> dict[int, tuple[pd.DataFrame, pd.DataFrame]]:
    """``pipeline_adapters.torch_pipelining_rows`` of every rank without ``sl:pp`` batches that carries
    torch.distributed.pipelining names. A single-stage schedule's names carry no stage and a CPU/gloo trace no
    process group: the pipeline is then taken to be these ranks, in rank order (stage = position, p = count)."""
    events = attribution.events
    named = match_names(events["name"], THIRD_PARTY_PP_PATTERN)
    if not named.any():  # most traces: no third-party pipeline names
        return {}

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
