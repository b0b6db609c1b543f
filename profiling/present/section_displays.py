"""Each report section's display function (``registry.SECTIONS`` names them): ``(sections, many ranks) ->
[(table id, table of display strings), ...]``, from the ``ReportSections`` frames (the strings HTML, Markdown
and the terminal show): numbers are formatted here, never recomputed."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..analyses import rank_summary
from ..attribution.idle import IDLE_CAUSES
from ..attribution.tables import REPORT, breakdown_table, fixed, ms_text
from .sections import ReportSections


def findings_tables(sec: ReportSections, many: bool) -> list:
    """The findings above the steps' noise, then the minor ones (a saving below it) in a short list."""
    if not len(sec.findings):
        return []
    f = sec.findings
    minor = f["minor"].astype(bool).to_numpy() if "minor" in f else np.zeros(len(f), dtype=bool)
    saves = pd.Series(["" if np.isnan(v) else str(ms_text([int(round(v))])[0]) for v in f["saves_ns"]],
                      index=f.index)
    out = []
    if (~minor).any():
        major = f[~minor]
        out.append(("findings-table", pd.DataFrame({
            "#": major["rank"].astype(str), "saves_ms_per_step": saves[~minor], "method": major["method"].astype(str),
            "finding": major["text"].astype(str), "measured": major["measured"].astype(str)})))
    if minor.any():
        small = f[minor]
        out.append(("findings-minor-table", pd.DataFrame({
            "#": small["rank"].astype(str), "saves_ms_per_step": saves[minor], "rule": small["rule"].astype(str),
            "minor (below the step-to-step spread)": small["text"].astype(str)})))
    return out


def breakdown_tables(sec: ReportSections, many: bool) -> list:
    if many:
        return [("breakdown-distribution-table", rank_summary.display(
            rank_summary.category_distribution(sec.breakdown)))]
    return [("breakdown-table", breakdown_table(sec.breakdown, style=REPORT))] if len(sec.breakdown) else []


def critical_path_tables(sec: ReportSections, many: bool) -> list:
    if not len(sec.critical_path):
        return []
    c = sec.critical_path
    return [("critical-path-table", pd.DataFrame({
        "step": c["step"].astype(str), "rank": c["rank"].astype(str), "label": c["label"].astype(str),
        "dim": c["dim"].astype(str), "path_ms": ms_text(c["dur_ns"]), "share_%": fixed(100 * c["share"], 2)}))]


def idle_tables(sec: ReportSections, many: bool) -> list:
    out = []
    bd = sec.breakdown
    if len(bd) and "idle_other" in bd and not many:  # many ranks: the idle causes are rows of the distribution
        table = {"rank": bd["rank"].astype(str), "step": bd["step"].astype(str), "idle_ms": ms_text(bd["idle"])}
        table.update({f"{c.removeprefix('idle_')}_ms": ms_text(bd[c]) for c in IDLE_CAUSES})
        # The share of the idle no rule explains; blank where the step has no idle.
        table["other_%_of_idle"] = fixed(100 * bd["idle_other"] / bd["idle"].where(bd["idle"] > 0), 1)
        out.append(("idle-table", pd.DataFrame(table)))
    culprits = getattr(sec, "extra", {}).get("idle_culprits")
    if culprits is not None and len(culprits) and len(bd):
        out.append(("idle-culprits-table", _culprits_display(culprits, bd.groupby("rank")["step"].nunique(),
                                                             many=many)))
    if len(sec.launch) and many:
        out.append(("launch-distribution-table", rank_summary.display(rank_summary.numeric_distribution(
            sec.launch, {"launches": "", "launch_delay_median_ns": "ns", "launch_delay_p90_ns": "ns",
                         "kernels": "", "short_kernels": "", "short_kernel_share": "%"}))))
    elif len(sec.launch):
        lt = sec.launch
        out.append(("launch-table", pd.DataFrame({
            "rank": lt["rank"].astype(str), "launches": lt["launches"].astype(str),
            "delay_median_us": fixed(lt["launch_delay_median_ns"] / 1e3, 1),
            "delay_p90_us": fixed(lt["launch_delay_p90_ns"] / 1e3, 1),
            "delay_max_us": fixed(lt["launch_delay_max_ns"].where(lt["launch_delay_max_ns"] >= 0) / 1e3, 1),
            "kernels": lt["kernels"].astype(str), "short_kernels": lt["short_kernels"].astype(str),
            "short_%_of_busy": fixed(100 * lt["short_kernel_share"], 2)})))
    return out


#: Culprit rows shown (the largest by idle over all steps); the frame has them all.
CULPRIT_ROWS = 12


def _culprits_display(culprits: pd.DataFrame, steps_of_rank: pd.Series, *, many: bool) -> pd.DataFrame:
    """The host calls behind the host-blocked idle, per step of their rank (its steps in the breakdown), the
    largest first; ``steps``: in how many of them the call cost idle. Many ranks: one row per call over all
    ranks (``ranks``: how many; per step: over every (rank, step) of the breakdown)."""
    keys = ["cause", "annotation", "op", "call", "pageable"] if many else ["rank", "cause", "annotation", "op",
                                                                          "call", "pageable"]
    top = culprits.groupby(keys, sort=False).agg(idle_ns=("idle_ns", "sum"), steps=("step", "nunique"),
                                                 ranks=("rank", "nunique"), gaps=("gaps", "sum")).reset_index()
    if many:
        top["per_step"] = top["idle_ns"] / max(int(steps_of_rank.sum()), 1)
    else:
        top["per_step"] = top["idle_ns"] / top["rank"].map(steps_of_rank).fillna(1).clip(lower=1)
    top = top.sort_values("per_step", ascending=False, kind="stable").head(CULPRIT_ROWS)
    call = top["call"].astype(str) + np.where(top["pageable"].astype(bool), " (pageable copy)", "")
    who = {"ranks": top["ranks"].astype(str)} if many else {"rank": top["rank"].astype(str)}
    return pd.DataFrame({**who, "cause": top["cause"].str.removeprefix("idle_"),
                         "annotation": top["annotation"].astype(str), "op": top["op"].astype(str), "call": call,
                         "idle_ms_per_step": ms_text(top["per_step"].round().astype("int64")),
                         "steps": top["steps"].astype(str), "gaps": top["gaps"].astype(str)})


def comm_by_dim_tables(sec: ReportSections, many: bool) -> list:
    if not len(sec.comm_by_dim):
        return []
    if many:
        return [("comm-by-dim-distribution-table", rank_summary.display(
            rank_summary.dim_distribution(sec.comm_by_dim)))]
    c = sec.comm_by_dim
    return [("comm-by-dim-table", pd.DataFrame({
        "rank": c["rank"].astype(str), "step": c["step"].astype(str), "dim": c["dim"].astype(str),
        "comm_ms": ms_text(c["comm_ns"]), "exposed_ms": ms_text(c["exposed_ns"]),
        "overlapped_ms": ms_text(c["overlapped_ns"])}))]


def collectives_tables(sec: ReportSections, many: bool) -> list:
    out = []
    if many and len(sec.matched):
        out.append(("collective-distribution-table", rank_summary.display(
            rank_summary.collective_distribution(sec.matched))))
    if len(sec.wait_transfer) and not many:
        w = sec.wait_transfer
        out.append(("wait-transfer-table", pd.DataFrame({
            "rank": w["rank"].astype(str), "category": w["category"].astype(str), "calls": w["calls"].astype(str),
            "time_ms": ms_text(w["dur_ns"]), "wait_ms": ms_text(w["wait_ns"]),
            "transfer_ms": ms_text(w["transfer_ns"]), "wait_%": fixed(100 * w["wait_fraction"], 2)})))
    if len(sec.stragglers):
        s = sec.stragglers
        out.append(("stragglers-table", pd.DataFrame({
            "step": s["step"].astype(str), "straggler_rank": s["straggler_rank"].astype(str),
            "caused_wait_ms": ms_text(s["caused_wait_ns"]), "times_last": s["times_last"].astype(str)})))
    return out


def bandwidth_tables(sec: ReportSections, many: bool) -> list:
    return [("bandwidth-table", bandwidth_table(sec.bandwidth))] if len(sec.bandwidth) else []


def pipeline_tables(sec: ReportSections, many: bool) -> list:
    if not len(sec.bubbles):
        return []
    if many:
        distribution = rank_summary.numeric_distribution(
            sec.bubbles, {"batch_ns": "ns", "bubble_ns": "ns", "bubble_fraction": "%", "ideal_fraction": "%"},
            by=("method", "stage"))
        return [("bubbles-distribution-table", rank_summary.display(distribution))]
    b = sec.bubbles
    return [("bubbles-table", pd.DataFrame({
        "rank": b["rank"].astype(str), "step": b["step"].astype(str), "method": b["method"].astype(str),
        "stage": b["stage"].astype(str), "schedule": b["schedule"].astype(str),
        "p": b["p"].astype(str), "m": b["m"].astype(str), "v": b["v"].astype(str),
        "batch_ms": ms_text(b["batch_ns"]),
        "bubble_ms": ms_text(b["bubble_ns"]), "bubble_%": fixed(100 * b["bubble_fraction"], 2),
        "ideal_%": fixed(100 * b["ideal_fraction"], 2)}))]


def top_kernels_tables(sec: ReportSections, many: bool) -> list:
    if not len(sec.top_kernels):
        return []
    k = sec.top_kernels
    return [("top-kernels-table", pd.DataFrame({
        "category": k["category"], "name": k["name"], "calls": k["calls"].astype(str),
        "total_ms": ms_text(k["total_ns"]), "share_%": fixed(100 * k["share"], 2)}))]


def offload_tables(sec: ReportSections, many: bool) -> list:
    if not len(sec.offload):
        return []
    if many:
        distribution = rank_summary.numeric_distribution(
            sec.offload, {"copies": "", "bytes": "", "busy_ns": "ns", "achieved_gbps": "", "of_limit": "%",
                          "pageable_copies": "", "exposed_ns": "ns"}, by=("direction",))
        return [("offload-distribution-table", rank_summary.display(distribution))]
    o = sec.offload
    return [("offload-table", pd.DataFrame({
        "rank": o["rank"].astype(str), "direction": o["direction"], "copies": o["copies"].astype(str),
        "bytes": o["bytes"].astype(str), "busy_ms": ms_text(o["busy_ns"]),
        "achieved_GB/s": fixed(o["achieved_gbps"], 3), "link": o["link"].astype(str),
        "link_GB/s": fixed(o["link_gbps"], 2), "of_link_%": fixed(100 * o["of_limit"], 2),
        "pageable_copies": o["pageable_copies"].astype(str), "exposed_ms": ms_text(o["exposed_ns"])}))]


def comm_coverage_tables(sec: ReportSections, many: bool) -> list:
    if not len(sec.comm_coverage):
        return []
    c = sec.comm_coverage
    return [("comm-coverage-table", pd.DataFrame({
        "finding": c["finding"], "name": c["name"], "category": c["category"], "ranks": c["ranks"],
        "count": c["count"].astype(str), "launched": c["launched"]}))]


def bandwidth_table(summary: pd.DataFrame) -> pd.DataFrame:
    """``bandwidth_summary`` as display strings: sizes in bytes, the median time in ms, bandwidths in GB/s
    (three decimals) and the verdict ("latency-bound", "x % of peak", or "no verdict: ... inconsistent"); where
    any bucket has calls whose bytes over time exceed the link's limit, or a note, a ``check`` column says which
    input and gives the values (``inconsistent_calls`` of ``calls`` first)."""
    table = pd.DataFrame({
        "category": summary["category"].astype(str), "dtype": summary["dtype"].astype(str),
        "size": summary["size_bucket"].astype(str), "group": summary["group"].astype(str),
        "n": summary["group_size"].astype(str), "link": summary["link"].astype(str),
        "link_GB/s": fixed(summary["link_gbps"], 2), "calls": summary["calls"].astype(str),
        "ranks": summary["ranks"].astype(str), "bytes_median": fixed(summary["bytes_median"], 0),
        "time_ms_median": fixed(summary["time_ns_median"] / 1e6, 6),
        "algbw_GB/s": fixed(summary["algbw_gbps_median"], 3), "busbw_GB/s": fixed(summary["busbw_gbps_median"], 3),
        "busbw_max_GB/s": fixed(summary["busbw_gbps_max"], 3), "basis": summary["time_basis"].astype(str),
        "verdict": summary["verdict"].astype(str)}).reset_index(drop=True)
    check = summary["check"].astype(str).to_numpy() if "check" in summary else np.array([], dtype=str)
    if (check != "").any():
        bad = summary["inconsistent_calls"].to_numpy()
        calls = summary["calls"].to_numpy()
        table["check"] = [f"{b} of {c} calls: {text}" if b else text for b, c, text in zip(bad, calls, check)]
    return table
