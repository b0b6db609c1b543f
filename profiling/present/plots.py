"""Figures of the breakdown, the per-dimension communication and the pipeline timeline, as PNG bytes.

Shared by the HTML report and the TensorBoard writer. Presentation only: every figure draws the numbers it is
given (a ``breakdown`` / ``comm_by_dim`` DataFrame, or the attribution for the timeline) and recomputes none.
Matplotlib is driven through ``Figure`` + the Agg canvas directly, never ``pyplot``, so no global figure
registry or backend switch leaks into the caller (a Lightning run, a TensorBoard server, a notebook).
An empty input gives a figure that says so, never an exception: a report must render for any trace.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..analyses.rank_summary import MANY_RANKS
from ..attribution.core import EXCLUSIVE_COLUMNS, attribute
from ..base import intervals as iv
from ..base.schema import COMM_CATEGORIES
from ..matching.pipelines import rank_pipelines

#: One colour per exclusive column (and per timeline kind), fixed so every figure and report agrees.
COLOURS = {
    "compute": "#4c72b0", "all_reduce": "#dd8452", "all_gather": "#c44e52", "reduce_scatter": "#8172b3",
    "all_to_all": "#937860", "broadcast": "#da8bc3", "barrier": "#8c8c8c", "other_comm": "#ccb974",
    "memcpy_h2d": "#64b5cd", "memcpy_d2h": "#55a868", "memcpy_d2d": "#a1c9f4", "memset": "#b0b0b0",
    "bubble": "#f0e442", "p2p_send": "#e377c2", "p2p_recv": "#ff9da7", "sync": "#7f7f7f", "idle": "#eeeeee",
    # pipeline timeline kinds
    "forward": "#4c72b0", "backward": "#55a868", "communication": "#dd8452",
}
TIMELINE_KINDS = ("forward", "backward", "bubble", "communication")
_DPI = 100


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    # No Software/date metadata: the same numbers give the same bytes.
    fig.savefig(buffer, format="png", dpi=_DPI, metadata={"Software": None})
    return buffer.getvalue()


def _empty(message: str, *, title: str) -> bytes:
    fig = Figure(figsize=(6, 2))
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=11, wrap=True)
    if title:
        ax.set_title(title)
    return _png(fig)


def _ranks_sorted_figure(bd: pd.DataFrame, parts: list[str], *, title: str) -> bytes:
    """Many ranks: each rank's mean step, its exclusive parts stacked, the ranks sorted by step time along x
    (a bar per rank and step would be unreadable); the slowest rank is named."""
    means = bd.groupby("rank")[["step_ns", *parts]].mean().sort_values("step_ns", kind="stable")
    x = np.arange(len(means))
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    ax = fig.add_subplot()
    colours = [COLOURS.get(c) for c in parts]
    ax.stackplot(x, *[means[c].to_numpy(dtype=float) / 1e6 for c in parts], labels=parts,
                 colors=colours if all(colours) else None, step="mid")
    slowest = int(means.index[-1])
    ax.annotate(f"slowest: rank {slowest}", xy=(x[-1], means["step_ns"].iloc[-1] / 1e6), xytext=(-8, 4),
                textcoords="offset points", ha="right", fontsize=8)
    ax.set_xlim(0, max(len(means) - 1, 1))
    ax.set_ylabel("ms (mean step)")
    ax.set_xlabel(f"{len(means)} ranks, sorted by step time")
    ax.set_title(title or "step time by exclusive category, per rank")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return _png(fig)


def breakdown_figure(bd: pd.DataFrame, *, title: str = "") -> bytes:
    """PNG of the stacked exclusive breakdown: one bar per (rank, step), ms, one segment per non-zero column.

    The segments of a bar are the ``EXCLUSIVE_COLUMNS`` of that row, so a bar's height is its ``step_ns``.
    """

    if bd is None or bd.empty:
        return _empty("no work events to attribute", title=title)
    parts = [c for c in EXCLUSIVE_COLUMNS if (bd[c] != 0).any()]
    if not parts:  # e.g. an NCCL log: instantaneous lines, every step 0 ns long
        return _empty("every attributed step is 0 ns long", title=title)

    if bd["rank"].nunique() > MANY_RANKS:
        return _ranks_sorted_figure(bd, parts, title=title)
    labels = [f"r{r} s{s}" for r, s in zip(bd["rank"], bd["step"])]
    x = np.arange(len(bd))
    fig = Figure(figsize=(min(4 + 0.35 * len(bd), 24), 4.5), layout="constrained")
    ax = fig.add_subplot()
    bottom = np.zeros(len(bd))
    for column in parts:
        ms = bd[column].to_numpy(dtype=float) / 1e6
        ax.bar(x, ms, bottom=bottom, color=COLOURS.get(column), label=column, width=0.8)
        bottom += ms
    ax.set_xticks(x, labels, rotation=90 if len(bd) > 12 else 0, fontsize=8)
    ax.set_ylabel("ms")
    ax.set_xlabel("rank, step")
    ax.set_title(title or "step time by exclusive category")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return _png(fig)


def comm_by_dim_figure(cbd: pd.DataFrame, *, title: str = "") -> bytes:
    """PNG of ``comm_by_dim``: per rank and dim (summed over steps), exposed and overlapped ms, stacked."""
    if cbd is None or cbd.empty:
        return _empty("no communication in this trace", title=title)
    per = cbd.groupby(["rank", "dim"], as_index=False)[["exposed_ns", "overlapped_ns"]].sum()
    labels = [f"r{r} {d}" for r, d in zip(per["rank"], per["dim"])]
    x = np.arange(len(per))
    exposed = per["exposed_ns"].to_numpy(dtype=float) / 1e6
    overlapped = per["overlapped_ns"].to_numpy(dtype=float) / 1e6
    fig = Figure(figsize=(min(4 + 0.4 * len(per), 24), 4), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(x, exposed, color="#c44e52", label="exposed")
    ax.bar(x, overlapped, bottom=exposed, color="#a1c9f4", label="overlapped with compute")
    ax.set_xticks(x, labels, rotation=90 if len(per) > 12 else 0, fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title(title or "communication per parallel dimension")
    ax.legend(fontsize=8, frameon=False)
    return _png(fig)


def timeline_spans(source) -> pd.DataFrame:
    """Spans of the pipeline timeline, one row per (rank, kind, start_ns, end_ns), from the pipeline
    annotations (shardline's ``sl:pp`` or torch.distributed.pipelining's, see ``bubbles.rank_pipelines``):
    ``F`` -> forward, ``B``/``W`` -> backward, the bubble set -> bubble, and the rank's communication work
    inside its batch windows -> communication. Empty when there are no annotations.
    ``source``: an ``Attribution``, a ``TraceSet`` or an events table (attributed first)."""

    frames = []
    attribution = attribute(source, caller="timeline_spans")
    pipelines = rank_pipelines(attribution)[0]
    for rank in attribution.ranks:
        measured = pipelines.get(rank.rank)
        if measured is None or measured.batches.empty:  # p2p-measured ranks have no F/B spans to draw
            continue
        batches, actions = measured.batches, measured.actions
        kinds = np.where(actions["action"] == "F", "forward",
                         np.where(actions["action"].isin(["B", "W"]), "backward", ""))
        busy = actions.assign(kind=kinds)[kinds != ""]
        window = iv.union(batches["start_ns"], batches["end_ns"])
        comm = rank.work(["start_ns", "dur_ns"], categories=COMM_CATEGORIES)
        comm_set = iv.intersect(iv.union(comm["start_ns"], comm["start_ns"] + comm["dur_ns"]), window)
        frames.append(pd.DataFrame({"rank": rank.rank, "kind": busy["kind"].to_numpy(),
                                    "start_ns": busy["start_ns"].to_numpy(), "end_ns": busy["end_ns"].to_numpy()}))
        for kind, (s, e) in (("bubble", rank.bubble), ("communication", comm_set)):
            frames.append(pd.DataFrame({"rank": rank.rank, "kind": kind, "start_ns": s, "end_ns": e}))
    if not frames:
        return pd.DataFrame({"rank": pd.Series(dtype="int64"), "kind": pd.Series(dtype="str"),
                             "start_ns": pd.Series(dtype="int64"), "end_ns": pd.Series(dtype="int64")})
    return pd.concat(frames, ignore_index=True)


def pipeline_timeline_figure(source, *, title: str = "") -> bytes:
    """PNG of the pipeline as executed: one row per rank, time (ms from the first batch start) across,
    forward / backward / bubble spans, communication as a thin band under each row. Needs pipeline
    annotations (``timeline_spans``); without them the figure says so. ``source`` as for
    ``timeline_spans``."""
    spans = timeline_spans(source)
    if spans.empty:
        return _empty("no pipeline annotations (sl:pp:* or torch.distributed.pipelining's) in this trace",
                      title=title)
    origin = int(spans["start_ns"].min())
    ranks = sorted(spans["rank"].unique())
    fig = Figure(figsize=(10, 1 + 0.5 * len(ranks)), layout="constrained")
    ax = fig.add_subplot()
    labelled: set[str] = set()
    for row, rank in enumerate(ranks):
        mine = spans[spans["rank"] == rank]
        for kind in TIMELINE_KINDS:
            sel = mine[mine["kind"] == kind]
            if sel.empty:
                continue
            bars = list(zip((sel["start_ns"] - origin) / 1e6, (sel["end_ns"] - sel["start_ns"]) / 1e6))
            y = (row - 0.45, 0.2) if kind == "communication" else (row - 0.25, 0.6)
            ax.broken_barh(bars, y, facecolors=COLOURS[kind], edgecolor="white", linewidth=0.3,
                           label=None if kind in labelled else kind)
            labelled.add(kind)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the first pipeline batch")
    ax.set_title(title or "pipeline timeline as executed")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    return _png(fig)
