"""The survey of a trace set (:class:`Survey`, from :func:`surveyed`): its events table checked and classified
once, and each rank surveyed once (:class:`RankSurvey`: its lane kind, work rows, step windows and pipeline
annotation rows), kept on the trace set per layout. The matching and the attribution read it; nothing derives
these again from the raw table.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import numpy as np
import pandas as pd

from ..base.errors import AttributionError
from ..base.schema import (
    check_events,
    codes_or_end,
)
from .classify import assign_dims, classify_events
from .dims import check_layout
from .pipeline_rows import pp_rows
from .rows import Rows, in_table, is_in, rank_selections, rank_windows


def surveyed(source, *, layout: Mapping[str, int] | None = None, caller: str = "attribute") -> Survey:
    """The :class:`Survey` of ``source`` (a ``TraceSet``, an events table, a ``Survey`` or an object holding
    one as ``survey``, e.g. ``breakdown.Attribution``).

    ``layout`` (``dict(tp=, cp=, dp=, pp=)``) names the parallel dims of groups whose description does not;
    without it the layout the trace set was loaded with applies. A trace set keeps one survey per layout (in
    ``attributions``), so asking again costs nothing. The table is classified once when it is not yet (every
    ``category`` empty); a classified table given another layout has only its ``dim`` column derived again. A
    bad table raises ``AttributionError`` naming ``caller``, a bad layout ``ClassificationError`` naming its
    entries.
    """
    if layout is not None:
        check_layout(layout)  # ClassificationError naming the bad entries
    inner = getattr(source, "survey", None)
    if isinstance(inner, Survey):
        source = inner
    if isinstance(source, Survey):
        if layout is None or layout_key(layout) == layout_key(source.layout):
            return source
        source = source.events
    events = getattr(source, "events", source)
    if not isinstance(events, pd.DataFrame):
        raise AttributionError(f"{caller} expects a TraceSet or an events DataFrame, got {type(events).__name__}")
    loaded_with = getattr(source, "layout", None)
    chosen = loaded_with if layout is None else layout
    cache = getattr(source, "attributions", None)
    key = layout_key(chosen)
    if cache is not None and key in cache:
        return cache[key]
    _check(events, caller=caller)
    if len(events) and is_in(events["category"], ("",)).all():
        events = classify_events(events, layout=chosen)
    elif layout_key(chosen) != layout_key(loaded_with):
        events = assign_dims(events, layout=chosen)
    survey = Survey(events, layout=chosen, files=_files_of(source), metadata=getattr(source, "metadata", None))
    if cache is not None:
        cache[key] = survey
    return survey


def _files_of(source) -> dict[int, str]:
    """Rank -> the name(s) of the file(s) its rows came from (a ``TraceSet``'s ``files``), for warnings."""
    names: dict[int, list[str]] = {}
    for path, ranks in (getattr(source, "files", None) or {}).items():
        for rank in ranks:
            names.setdefault(int(rank), []).append(str(path))
    return {rank: ", ".join(sorted(paths)) for rank, paths in names.items()}


def layout_key(layout: Mapping[str, int] | None):
    return None if layout is None else tuple(sorted((str(k), int(v)) for k, v in layout.items()))


def _check(events: pd.DataFrame, *, caller: str) -> None:
    try:
        check_events(events)
    except ValueError as exc:
        raise AttributionError(f"{caller}: {exc}") from None
    negative = events["dur_ns"] < 0
    if negative.any():
        names = events.loc[negative, "name"].astype(str).unique()[:5].tolist()
        raise AttributionError(f"{caller}: {int(negative.sum())} events have a negative duration (e.g. {names})")


class Survey:
    """One trace set's events, classified, surveyed rank by rank (``ranks``: a :class:`RankSurvey` each, in
    rank order; ``working``: those with work to attribute): what the matching and the breakdown read. Build it
    with :func:`surveyed`; ``events`` is the classified table (not to be modified), ``layout`` the dims it was
    classified with (or None), ``files`` rank -> its file name(s), ``metadata`` the trace set's per-rank
    metadata. ``contexts``: rank -> :class:`RankContext` (lanes and windows from the rank's whole trace, for a
    table holding only some of its rows). ``attribution``: the ``breakdown.Attribution`` over this survey, set
    once by it (one per trace set and layout); ``matching``: its ``matching.matched.Matching``, made by the
    matching on first use.
    """

    def __init__(self, events: pd.DataFrame, *, layout: Mapping[str, int] | None = None,
                 files: Mapping[int, str] | None = None, metadata: Mapping | None = None,
                 contexts: Mapping | None = None) -> None:
        self.events = events
        self.contexts = dict(contexts or {})
        self.layout = None if layout is None else dict(layout)
        self.files = dict(files or {})
        self.metadata = dict(metadata or {})  # the trace set's per-rank metadata (device names, layout ...)
        self.timings: dict[str, float] = {}  # seconds some analyses took (``idle_causes``; reports add theirs)
        self.attribution = None
        self.matching = None

    def __repr__(self) -> str:
        return f"Survey({len(self.events)} events, ranks={[r.rank for r in self.ranks]}, layout={self.layout})"

    @functools.cached_property
    def ranks(self) -> tuple[RankSurvey, ...]:
        # The table's columns read once (views and category codes), shared by the ranks.
        table = Rows.of(self.events)
        return tuple(RankSurvey(self.events, table, rank=rank, selection=selection,
                                source=self.files.get(rank, f"rank {rank}"), context=self.contexts.get(rank))
                     for rank, selection in rank_selections(self.events))

    @property
    def working(self) -> tuple[RankSurvey, ...]:
        return tuple(r for r in self.ranks if r.has_work)

    def rank(self, rank: int) -> RankSurvey:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise AttributionError(f"rank {rank} is not in this trace set (ranks {[r.rank for r in self.ranks]})")


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What one rank's whole trace says that a part of its rows alone could not (``scale``'s compact rows): the
    lane kind its work is attributed on, its step windows and the windows its breakdown partitions
    (``RankSurvey.context``; a :class:`Survey` given it surveys the rank's rows with these)."""

    lanes: str
    windows: tuple  # (step, start_ns, end_ns) arrays
    attributed: tuple
    window_note: str | None
    has_work: bool


class RankSurvey:
    """One rank of a :class:`Survey`, surveyed once: its lane kind, its work rows (as positions in the events
    table, in table order), its step windows and its pipeline annotation rows (``pp_rows``, on first use).

    ``lanes``: ``Lane.GPU``/``Lane.CPU`` value (a rank without work: ``cpu``). ``windows``: the windows its
    markers (or its GPU work's steps) give, possibly none; ``attributed_windows``: the windows ``breakdown``
    partitions (``windows``, else ``[first work start, last work end)`` with step -1). ``window_note``: why
    the GPU step annotations were replaced by windows from the launched work (naming ``source``), or None.
    """

    def __init__(self, events: pd.DataFrame, table: Rows, *, rank: int, selection, source: str = "",
                 context=None) -> None:
        self._events = events
        self.table = table  # the table's columns, shared by the ranks (``Rows``)
        self.rank = rank
        rows = table.take(selection)
        if context is None:
            mask, self.lanes = rows.work()
        else:  # the rank's whole trace said (``RankContext``): its rows here are a part of it
            self.lanes = context.lanes
            mask = rows.work_on(self.lanes)
        self.work_positions = _positions(selection, mask)
        self.pipeline_positions = _positions(selection, rows.pipeline)
        if context is not None:
            self.has_work = bool(context.has_work)
            self._windows, self._attributed = context.windows, context.attributed
            self.window_note = context.window_note
            return
        self.has_work = bool(len(self.work_positions))
        work = rows.take(mask, ("start", "dur", "step", "correlation"))
        self._windows, note = rank_windows(rows, lanes=self.lanes, work=work)
        self.window_note = None if note is None else f"{source or f'rank {rank}'}: {note}"
        if len(self._windows[0]) or not self.has_work:
            self._attributed = self._windows
        else:
            self._attributed = (np.array([-1], dtype=np.int64), np.array([work.start.min()]),
                                np.array([work.end.max()]))

    def __repr__(self) -> str:
        return (f"RankSurvey(rank={self.rank}, lanes={self.lanes!r}, work rows={len(self.work_positions)}, "
                f"windows={len(self._attributed[0])})")

    def work(self, columns=None, *, categories=None) -> pd.DataFrame:
        """The rank's attributed work rows (all columns, or ``columns``), in table order; ``categories``: only
        the rows of these categories."""
        positions = self.work_positions
        if categories is not None:
            category = self._events["category"]
            positions = positions[in_table(category, categories)[codes_or_end(category)[positions]]]
        if columns is None:
            return self._events.iloc[positions]
        return self._events.iloc[positions, [self._events.columns.get_loc(c) for c in columns]]

    @property
    def context(self) -> RankContext:
        """What this survey of the rank's rows found, for a survey of a part of them (``scale``)."""
        return RankContext(self.lanes, self._windows, self._attributed, self.window_note, self.has_work)

    @functools.cached_property
    def windows(self) -> pd.DataFrame:
        steps, starts, ends = self._windows
        return pd.DataFrame({"step": steps, "start_ns": starts, "end_ns": ends})

    @functools.cached_property
    def attributed_windows(self) -> pd.DataFrame:
        steps, starts, ends = self._attributed
        return pd.DataFrame({"step": steps, "start_ns": starts, "end_ns": ends})

    @property
    def window_bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(step, start_ns, end_ns)`` of ``attributed_windows`` as arrays (not to be modified)."""
        return self._attributed

    @property
    def pipeline(self) -> pd.DataFrame:
        """The rank's ``sl:pp:*`` annotation rows, in table order."""
        return self._events.iloc[self.pipeline_positions]

    @functools.cached_property
    def pp_rows(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """``pipeline_rows.pp_rows`` of the rank: (batches, actions) on the lanes it is attributed on."""
        return pp_rows(self.pipeline, self.lanes)


def _positions(selection, mask: np.ndarray) -> np.ndarray:
    """Table positions of the rows ``mask`` picks among those of ``selection`` (a slice or positions)."""
    if isinstance(selection, slice):
        return np.flatnonzero(mask) + selection.start
    return selection[mask]
