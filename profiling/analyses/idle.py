"""Per-(rank, step) idle split by cause, the host calls behind it, and per-rank launch statistics, from the
breakdown's idle causes (``attribution.idle``, whose docstring has the rules)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from ..attribution.core import attribute
from ..attribution.idle import (
    IDLE_CAUSES,
    LAUNCH_STATS_COLUMNS,
    empty_culprits,
    idle_causes,
    idle_culprits,
    idle_sets,
    rank_launch_stats,
)
from ..base import intervals as iv

__all__ = ["culprits", "idle_breakdown", "launch_stats", "other_share"]


def idle_breakdown(source, *, layout: Mapping[str, int] | None = None) -> pd.DataFrame:
    """One row per (rank, step) of ``breakdown`` (same order): ``rank``, ``step``, ``start_ns``, ``end_ns``,
    ``idle`` and the :data:`IDLE_CAUSES` columns, which sum to ``idle``. ``source`` as for ``breakdown``."""

    attribution = attribute(source, layout=layout, caller="idle_breakdown")
    frames = []
    for rank in attribution.working:
        windows = rank.attributed_windows
        lo, hi = windows["start_ns"].to_numpy(), windows["end_ns"].to_numpy()
        idle = iv.window_totals(idle_sets(attribution, rank)["idle"], lo=lo, hi=hi)
        frames.append(pd.DataFrame({"rank": np.full(len(windows), rank.rank, dtype=np.int64),
                                    "step": windows["step"].to_numpy(), "start_ns": lo, "end_ns": hi, "idle": idle,
                                    **idle_causes(attribution, rank, idle=idle)}))
    if not frames:
        return pd.DataFrame({c: np.empty(0, dtype=np.int64)
                             for c in ("rank", "step", "start_ns", "end_ns", "idle", *IDLE_CAUSES)})
    return pd.concat(frames, ignore_index=True)


def launch_stats(source, *, layout: Mapping[str, int] | None = None) -> pd.DataFrame:
    """One row per rank with work: launch-delay statistics and short-kernel counts (module docstring), columns
    :data:`LAUNCH_STATS_COLUMNS`. ``source`` as for ``breakdown``."""

    attribution = attribute(source, layout=layout, caller="launch_stats")
    rows = [rank_launch_stats(attribution, rank) for rank in attribution.working]
    frame = pd.DataFrame(rows, columns=list(LAUNCH_STATS_COLUMNS))
    return frame.astype({"rank": "int64", "lanes": "str", "launches": "int64", "launch_delay_median_ns": "float64",
                         "launch_delay_p90_ns": "float64", "launch_delay_max_ns": "int64", "kernels": "int64",
                         "short_kernels": "int64", "short_kernel_ns": "int64", "busy_ns": "int64",
                         "short_kernel_share": "float64"})


def culprits(source, *, layout: Mapping[str, int] | None = None) -> pd.DataFrame:
    """The host calls behind the host-blocked idle of every rank with work (``attribution.idle.idle_culprits``,
    columns ``CULPRIT_COLUMNS``): per (rank, step, cause, call, op, annotation) the idle ns it cost the GPU,
    largest first within a (rank, step). ``source`` as for ``breakdown``."""
    attribution = attribute(source, layout=layout, caller="idle_culprits")
    frames = [idle_culprits(attribution, rank) for rank in attribution.working]
    frames = [f for f in frames if len(f)]
    if not frames:
        return empty_culprits()
    return pd.concat(frames, ignore_index=True)


def other_share(breakdown: pd.DataFrame) -> float:
    """``idle_other`` / ``idle`` over all (rank, step) rows of a breakdown (or an ``idle_breakdown``): the share
    of the idle no rule explains; NaN without idle."""
    idle = float(breakdown["idle"].sum()) if len(breakdown) else 0.0
    return float(breakdown["idle_other"].sum()) / idle if idle > 0 else float("nan")
