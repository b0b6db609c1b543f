"""How each rank's pipeline bubble is measured (``rank_pipelines``): the first source that exists of ``sl:pp``
annotations, torch.distributed.pipelining's names (``pipeline_adapters``), receives matched with their sends
(``p2p.match_p2p``), or one rank's receives split by size and link bandwidth. The breakdown's ``bubble`` label
covers the set measured here; ``analyses.bubbles`` reports it per batch (the definitions are in its docstring).
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

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
        out[int(number)] = RankPipeline(method, NO_BATCHES, NO_ACTIONS, p2p.wait_set(matched, int(number)))
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
