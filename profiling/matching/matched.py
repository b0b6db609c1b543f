"""The matching of one trace set as one typed value (:class:`Matching`): the p2p messages, their match across
ranks, the clock offsets the matched collectives give, the link bandwidth of the calls, the op args and each
rank's pipeline, each computed once by the module that owns it (``messages``, ``p2p``, ``bandwidth``,
``pipelines``) and kept here. A survey holds one (``matching_of``); an ``Attribution`` holds the survey's or
one given to it (``scale``: pipelines measured elsewhere).
"""

from __future__ import annotations

import dataclasses
import enum

import pandas as pd

from ..base import intervals as iv
from ..table.survey import Survey, surveyed


class BubbleMethod(str, enum.Enum):
    ANNOTATIONS = "annotations"
    TORCH_PIPELINING = "torch_pipelining"  # torch.distributed.pipelining's names, via ``pipeline_adapters``
    P2P_MATCHED = "p2p_matched"            # receives matched with their sends across ranks (``p2p``)
    P2P_ESTIMATED = "p2p_estimated"        # one rank's receives split by message size / link bandwidth
    P2P_RECV_IDLE = "p2p_recv_idle"        # nothing to measure with: the exposed receive time


@dataclasses.dataclass(frozen=True)
class RankPipeline:
    """How one rank's bubble is measured: ``method``, the (batches, actions) rows of the annotation methods
    (empty for the p2p ones) and ``bubble``, the interval set the breakdown's ``bubble`` label covers."""

    method: BubbleMethod
    batches: pd.DataFrame
    actions: pd.DataFrame
    bubble: iv.IntervalSet


@dataclasses.dataclass(frozen=True)
class MatchedP2P:
    """What the p2p matching computes once per trace set: the messages with their split (``match_p2p``'s table),
    the pipelines they form (``pipelines_of``, ``messages.Pipeline`` each) and the inference's warnings (issued
    on every ``match_p2p``)."""

    table: pd.DataFrame
    pipelines: tuple
    notes: tuple[str, ...]


@dataclasses.dataclass
class Matching:
    """One survey's matching across ranks. Each field is None until the module that owns it computes it (on
    first use), then kept: ``messages`` (``messages.p2p_messages``), ``p2p`` (``p2p.match_p2p``),
    ``clock_offsets`` (rank -> ns, from ``collectives.match_collectives``; empty without collectives),
    ``p2p_bandwidth`` (``bandwidth.collective_bandwidth`` with the default links, for the p2p estimate),
    ``op_args`` (``load.read_op_args`` of the trace set, what the bandwidth sizes read) and ``pipelines``
    (``pipelines.rank_pipelines``: rank -> its :class:`RankPipeline`, and the p2p inference's warnings).
    ``Matching(pipelines=...)``: pipelines measured elsewhere (``scale``), held by the ``Attribution`` given it."""

    messages: pd.DataFrame | None = None
    p2p: MatchedP2P | None = None
    clock_offsets: dict[int, int] | None = None
    p2p_bandwidth: pd.DataFrame | None = None
    op_args: pd.DataFrame | None = None
    pipelines: tuple[dict[int, RankPipeline], tuple[str, ...]] | None = None


def matching_of(source, *, caller: str) -> tuple[Survey, Matching]:
    """The survey of ``source`` (``table.survey.surveyed``) and the :class:`Matching` that goes with it: the one
    ``source`` holds (an ``Attribution``), else the survey's own, made on first use."""
    survey = surveyed(source, caller=caller)
    held = getattr(source, "matching", None)
    if isinstance(held, Matching):
        return survey, held
    if survey.matching is None:
        survey.matching = Matching()
    return survey, survey.matching
