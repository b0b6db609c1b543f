"""Many ranks at a glance: per-rank tables turned into distributions.

Beyond a few dozen ranks a table with a row per rank is unreadable. :func:`category_distribution` gives, per
breakdown column (compute, each collective, bubble, idle and its causes ...), the distribution over the ranks of
each rank's mean step time in it: median, p90, max, its share of the median step, and the worst ranks by name;
:func:`collective_distribution` the same per communication group (its parallel dimension and category) for the
time ranks wait in matched collectives and the time they transfer. ``render`` writes them as text, Markdown or
HTML; the full per-rank tables stay what ``breakdown`` gives (csv / parquet through the CLI).

Quantiles are numpy's linear interpolation over the ranks (``np.percentile``); a rank's value is its mean over
its steps, so ranks with different step counts weigh alike.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd

from ..attribution.idle import IDLE_CAUSES
from ..base.errors import ProfilingError
from ..table.partition import LABELS

#: Ranks above which the reports show distributions instead of a row per rank.
MANY_RANKS = 32
#: Worst ranks named per row.
WORST = 3
#: The breakdown columns summarised (the exclusive partition, then the idle causes).
SUMMARY_COLUMNS = ("step_ns", *LABELS, *IDLE_CAUSES)
DISTRIBUTION_COLUMNS = ("column", "ranks", "median_ns", "p90_ns", "max_ns", "share_of_step", "worst_ranks")
COLLECTIVE_COLUMNS = ("group", "dim", "category", "ranks", "calls_per_rank", "wait_median_ns", "wait_p90_ns",
                      "wait_max_ns", "transfer_median_ns", "transfer_p90_ns", "transfer_max_ns", "worst_ranks")


def rank_means(breakdown: pd.DataFrame, columns=SUMMARY_COLUMNS) -> pd.DataFrame:
    """One row per rank: the mean over its steps of each of ``columns`` (float ns), indexed by rank."""
    missing = [c for c in ("rank", *columns) if c not in breakdown.columns]
    if missing:
        raise ProfilingError(f"rank_means: the breakdown has no column(s) {missing}")
    return breakdown.groupby("rank")[list(columns)].mean()


def category_distribution(breakdown: pd.DataFrame, *, worst: int = WORST) -> pd.DataFrame:
    """Per breakdown column with time on some rank: the distribution over ranks of the per-rank mean step time
    in it (``DISTRIBUTION_COLUMNS``); ``worst_ranks`` names the ``worst`` ranks with the most, most first
    ("r7 (12.3 ms)"). ``share_of_step``: median / the median step time."""
    means = rank_means(breakdown)
    if means.empty:
        return pd.DataFrame(columns=list(DISTRIBUTION_COLUMNS))
    step_median = float(np.median(means["step_ns"]))
    rows = []
    for column in SUMMARY_COLUMNS:
        values = means[column].to_numpy(dtype=float)
        if column != "step_ns" and not (values > 0).any():
            continue
        rows.append((column, len(values), *_quantiles(values),
                     float(np.median(values)) / step_median if step_median > 0 else np.nan,
                     _worst(means.index.to_numpy(), values, worst)))
    return pd.DataFrame(rows, columns=list(DISTRIBUTION_COLUMNS))


def collective_distribution(matched: pd.DataFrame, *, worst: int = WORST) -> pd.DataFrame:
    """Per (group, dim, category) of ``collectives.match_collectives``' rows: calls per rank and the distribution
    over the group's ranks of each rank's total wait and transfer (``COLLECTIVE_COLUMNS``); ``worst_ranks``:
    the ranks that waited longest (a late rank waits least: the ones named here waited for it)."""
    need = ("rank", "group", "category", "wait_ns", "transfer_ns")
    missing = [c for c in need if c not in matched.columns]
    if missing:
        raise ProfilingError(f"collective_distribution: the matched calls have no column(s) {missing}")
    if matched.empty:
        return pd.DataFrame(columns=list(COLLECTIVE_COLUMNS))
    frame = matched.assign(dim=matched["dim"].astype(str) if "dim" in matched.columns else "")
    rows = []
    for (group, category), calls in frame.groupby(["group", "category"], sort=True):
        per_rank = calls.groupby("rank").agg(calls=("wait_ns", "size"), wait=("wait_ns", "sum"),
                                             transfer=("transfer_ns", "sum"))
        dims = sorted(set(calls["dim"]) - {""})
        rows.append((group, ",".join(dims), category, len(per_rank), float(per_rank["calls"].mean()),
                     *_quantiles(per_rank["wait"].to_numpy(dtype=float)),
                     *_quantiles(per_rank["transfer"].to_numpy(dtype=float)),
                     _worst(per_rank.index.to_numpy(), per_rank["wait"].to_numpy(dtype=float), worst)))
    out = pd.DataFrame(rows, columns=list(COLLECTIVE_COLUMNS))
    return out.sort_values("wait_max_ns", ascending=False, kind="stable").reset_index(drop=True)


DIM_COLUMNS = ("dim", "ranks", "comm_median_ns", "comm_p90_ns", "comm_max_ns", "exposed_median_ns",
               "exposed_p90_ns", "exposed_max_ns", "worst_ranks")


def dim_distribution(comm_by_dim: pd.DataFrame, *, worst: int = WORST) -> pd.DataFrame:
    """Per parallel dimension of ``attribution.comm_by_dim``'s rows: the distribution over ranks of each rank's
    mean step time in that dimension's communication and in its exposed part (``DIM_COLUMNS``); ``worst_ranks``:
    the most exposed."""
    need = ("rank", "dim", "comm_ns", "exposed_ns")
    missing = [c for c in need if c not in comm_by_dim.columns]
    if missing:
        raise ProfilingError(f"dim_distribution: the table has no column(s) {missing}")
    rows = []
    for dim, mine in comm_by_dim.groupby("dim", sort=True):
        per_rank = mine.groupby("rank")[["comm_ns", "exposed_ns"]].mean()
        rows.append((dim, len(per_rank), *_quantiles(per_rank["comm_ns"].to_numpy(dtype=float)),
                     *_quantiles(per_rank["exposed_ns"].to_numpy(dtype=float)),
                     _worst(per_rank.index.to_numpy(), per_rank["exposed_ns"].to_numpy(dtype=float), worst)))
    return pd.DataFrame(rows, columns=list(DIM_COLUMNS))


NUMERIC_COLUMNS = ("column", "ranks", "median", "p90", "max", "worst_ranks")


def numeric_distribution(table: pd.DataFrame, columns: dict[str, str], *, by: tuple[str, ...] = (),
                         worst: int = WORST) -> pd.DataFrame:
    """Any per-rank table as distributions over the ranks: for each group of ``by`` (e.g. the copy direction)
    and each of ``columns`` (column -> its unit: "ns", "%" for a fraction, or "" for a count), each rank's mean
    value in it, then median, p90, max and the ``worst`` ranks with the most; NaN values (a rank without such
    calls) are left out. Values are display strings (``NUMERIC_COLUMNS`` after the ``by`` columns)."""
    missing = [c for c in ("rank", *by, *columns) if c not in table.columns]
    if missing:
        raise ProfilingError(f"numeric_distribution: the table has no column(s) {missing}")
    rows = []
    groups = table.groupby(list(by), sort=True) if by else [((), table)]
    for key, mine in groups:
        key = key if isinstance(key, tuple) else (key,)
        per_rank = mine.groupby("rank")[list(columns)].mean()
        for column, unit in columns.items():
            values = per_rank[column].dropna()
            if values.empty:
                continue
            numbers = values.to_numpy(dtype=float)
            show = _ms if unit == "ns" else (lambda v: f"{v:.1%}") if unit == "%" else (lambda v: f"{v:.4g}")
            rows.append((*key, column, len(values), *(show(v) for v in _quantiles(numbers)),
                         _worst(values.index.to_numpy(), numbers, worst, show=show, positive_only=False)))
    return pd.DataFrame(rows, columns=[*by, *NUMERIC_COLUMNS])


def display(table: pd.DataFrame) -> pd.DataFrame:
    """A distribution table of this module as display strings (ms/µs, %), with readable headings."""
    head = {c: _HEADINGS.get(c, c) for c in table.columns}
    return _shown(table, head)


def summary(breakdown: pd.DataFrame, matched: pd.DataFrame | None, *, fmt: str = "text", title: str = "") -> str:
    """``render`` of the breakdown's category distribution and, when there are matched collectives
    (``collectives.match_collectives``' rows; None or empty: none), their per-group distribution."""
    collectives = collective_distribution(matched) if matched is not None and len(matched) else None
    return render(category_distribution(breakdown), collectives, fmt=fmt, title=title)


def _quantiles(values: np.ndarray) -> tuple[float, float, float]:
    median, p90 = np.percentile(values, [50, 90])
    return float(median), float(p90), float(values.max())


def _worst(ranks: np.ndarray, values: np.ndarray, count: int, *, show=None, positive_only: bool = True) -> str:
    """The ``count`` ranks with the largest values, most first (ties: the lower rank), as "r7 (12.3 ms)";
    ``show`` formats a value (default ms/µs); ``positive_only`` leaves out ranks at 0."""
    show = _ms if show is None else show
    order = np.lexsort((ranks, -values))[:count]
    return ", ".join(f"r{int(ranks[i])} ({show(values[i])})" for i in order if values[i] > 0 or not positive_only)


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3g} ms" if ns >= 1e5 else f"{ns / 1e3:.3g} µs"


def render(categories: pd.DataFrame, collectives: pd.DataFrame | None = None, *, fmt: str = "text",
           title: str = "") -> str:
    """The two distributions as ``text`` (the terminal), ``md`` or ``html`` (a fragment: two tables)."""
    if fmt not in ("text", "md", "html"):
        raise ProfilingError(f"render: fmt={fmt!r}, expected text, md or html")
    tables = [("Per category: each rank's mean step time", _shown(categories, _CATEGORY_HEAD))]
    if collectives is not None and len(collectives):
        tables.append(("Per communication group: each rank's wait and transfer in matched calls",
                       _shown(collectives, _COLLECTIVE_HEAD)))
    parts = [title] if title and fmt == "text" else [f"## {title}"] if title and fmt == "md" else \
        [f"<h2>{html.escape(title)}</h2>"] if title else []
    for caption, table in tables:
        if fmt == "text":
            parts += [caption, table.to_string(index=False), ""]
        elif fmt == "md":
            parts += [f"**{caption}**", "", _markdown(table), ""]
        else:
            parts += [f"<h3>{html.escape(caption)}</h3>", table.to_html(index=False, escape=True, border=0)]
    return "\n".join(parts)


_CATEGORY_HEAD = {"column": "column", "ranks": "ranks", "median_ns": "median", "p90_ns": "p90", "max_ns": "max",
                  "share_of_step": "share of step", "worst_ranks": "worst ranks"}
_COLLECTIVE_HEAD = {"group": "group", "dim": "dim", "category": "category", "ranks": "ranks",
                    "calls_per_rank": "calls/rank", "wait_median_ns": "wait median", "wait_p90_ns": "wait p90",
                    "wait_max_ns": "wait max", "transfer_median_ns": "transfer median",
                    "transfer_p90_ns": "transfer p90", "transfer_max_ns": "transfer max",
                    "worst_ranks": "waited longest"}


_HEADINGS = {**_CATEGORY_HEAD, **_COLLECTIVE_HEAD,
             **{c: c.removesuffix("_ns").replace("_", " ") for c in DIM_COLUMNS if c.endswith("_ns")},
             "worst_ranks": "worst ranks"}


def _shown(table: pd.DataFrame, head: dict) -> pd.DataFrame:
    out = table[list(head)].rename(columns=head).copy()
    for column, name in head.items():
        if column.endswith("_ns"):
            out[name] = [_ms(v) for v in table[column]]
        elif column == "share_of_step":
            out[name] = [f"{v:.1%}" if np.isfinite(v) else "" for v in table[column]]
        elif column == "calls_per_rank":
            out[name] = [f"{v:.4g}" for v in table[column]]
    return out


def _markdown(table: pd.DataFrame) -> str:
    def cell(value) -> str:
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(c) for c in table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)
