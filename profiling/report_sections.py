"""The sections of a post-hoc report, as DataFrames, and their display tables (shared by HTML and markdown).

``report_sections(traceset)`` is the one orchestrator of the analyses: on the trace set's ``Attribution`` it
runs each once -- ``breakdown`` (with idle by cause), ``critical_path`` (-> ``critical_path_summary``, one
line per step in the section's note), ``launch_stats``, ``comm_by_dim``, ``match_collectives`` (->
``wait_transfer``, ``stragglers``), ``pipeline_bubbles``, ``collective_bandwidth`` (-> ``bandwidth_summary``) --
and two summaries of the attributed work rows that no analysis gives: the top kernels (or ops) per category and
the offload traffic. The sections are kept on the attribution; the renderers (HTML,
Markdown, TensorBoard) format these frames and never recompute them, so a number in a report is a number of a
frame here.

Offload traffic, per rank and direction (host->device, device->host), over the attributed work rows of the whole
trace::

    achieved GB/s = bytes / busy ns        (1 byte/ns = 1 GB/s; copies without a recorded size are left out)
    of_limit      = achieved / link_gbps   (the rank's host PCIe link, x16, per direction)

The host link is the PCIe generation the rank's GPU name implies (``links.LinkTable.host_link``: V100 Gen3
15.75, A100 Gen4 31.5, H100/B200 Gen5 64 GB/s); a name no rule knows (or no name) is taken as Gen5 and the
section's note says so. The section's title names the generation(s) (``section_title``).

Collective bandwidth: ``bandwidth_summary`` of ``collective_bandwidth`` (default links table), one row per
(category, dtype, size bucket, group, link); buckets whose calls are all under 1 MiB say "latency-bound" rather
than a fraction of the link's peak. The rows are kept on the attribution (``bandwidth_rows``) so the merged
trace's args carry the same numbers.

``exposed_ns`` is the sum of the breakdown's ``memcpy_h2d`` / ``memcpy_d2h`` column (inside step windows) and
``pageable_copies`` counts copies from/to pageable host memory (they stage through a bounce buffer and block).

Display numbers: durations are ms written exactly (``ms_text``: six decimals, so a value times 10^6 is the
frame's integer ns); ratios and bandwidths are rounded to the stated decimals (``tables``).
"""

from __future__ import annotations

import dataclasses
import enum
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from shardline.profiling.tables import REPORT, breakdown_table, fixed, ms_text

#: PCIe Gen5 x16 bandwidth per direction, GB/s (32 GT/s x 16 lanes, 128b/130b), the offload ceiling.
PCIE_GEN5_X16_GBPS = 64.0
TOP_KERNELS = 5


class Section(str, enum.Enum):
    """Report sections, in order; the value is the HTML id and the markdown anchor."""

    FINDINGS = "findings"
    BREAKDOWN = "breakdown"
    CRITICAL_PATH = "critical-path"
    IDLE = "idle"
    COMM_BY_DIM = "comm-by-dim"
    COLLECTIVES = "collectives"
    BANDWIDTH = "bandwidth"
    PIPELINE = "pipeline"
    TOP_KERNELS = "top-kernels"
    OFFLOAD = "offload"
    COMM_COVERAGE = "comm-coverage"


TITLES = {
    Section.BREAKDOWN: "Step time per rank and step (exclusive, ms)",
    Section.FINDINGS: "Findings: what to change, by what it saves per step",
    Section.CRITICAL_PATH: "Critical path across ranks: what each step waited on (share of the path)",
    Section.IDLE: "Idle by cause, and how late the host launched GPU work",
    Section.COMM_BY_DIM: "Communication per parallel dimension (ms)",
    Section.COLLECTIVES: "Collectives: wait vs transfer, stragglers",
    Section.BANDWIDTH: "Collective bandwidth vs the link's limit (nccl-tests bus bandwidth)",
    Section.PIPELINE: "Pipeline timeline and bubble vs the (p-1)/(v·m+p-1) ideal",
    Section.TOP_KERNELS: "Top kernels per category",
    Section.OFFLOAD: "Offload traffic (H2D / D2H) vs the PCIe Gen5 x16 limit",
    Section.COMM_COVERAGE: "Communication coverage: ops without a communication kernel, and the reverse",
}


@dataclass(frozen=True)
class ReportSections:
    """The frames a report shows; ``notes[section]`` says why a section is empty or how to read it.
    ``matched``: the matched collectives ``wait_transfer`` and ``stragglers`` summarise (empty when none);
    ``attribution``: the ``Attribution`` every frame was computed from."""

    breakdown: pd.DataFrame
    comm_by_dim: pd.DataFrame
    wait_transfer: pd.DataFrame
    stragglers: pd.DataFrame
    bubbles: pd.DataFrame
    top_kernels: pd.DataFrame
    offload: pd.DataFrame
    notes: dict[Section, str] = field(default_factory=dict)
    matched: pd.DataFrame = field(default_factory=pd.DataFrame)
    attribution: object = None
    comm_coverage: pd.DataFrame = field(default_factory=lambda: comm_coverage_frame([]))
    bandwidth: pd.DataFrame = field(default_factory=lambda: _empty_summary())
    titles: dict[Section, str] = field(default_factory=dict)
    critical_path: pd.DataFrame = field(default_factory=pd.DataFrame)  # critical_path_summary (rank, label, dim)
    launch: pd.DataFrame = field(default_factory=pd.DataFrame)  # idle.launch_stats
    findings: pd.DataFrame = field(default_factory=pd.DataFrame)  # findings.findings, ranked
    timings: dict = field(default_factory=dict)  # seconds per analysis (breakdown includes idle_causes)
    warnings: tuple[str, ...] = ()  # the analyses' warnings, each once (md/html: the breakdown's note)


def section_title(sec: ReportSections, section: Section) -> str:
    """The heading a report shows: ``TITLES[section]``, or the sections' own (the offload title names the
    detected PCIe generation)."""
    return sec.titles.get(section, TITLES[section])


def _empty_summary() -> pd.DataFrame:
    from shardline.profiling.bandwidth import bandwidth_summary

    return bandwidth_summary(pd.DataFrame())


def report_sections(source, *, progress: bool = False, top: int = TOP_KERNELS, traceset=None) -> ReportSections:
    """Every section's frame for ``source`` (a ``TraceSet``, an events table or an ``Attribution``).

    The one orchestrator of the analyses: each runs once on the source's attribution, and the sections are
    kept on it, so every output of one trace set (HTML, Markdown, TensorBoard) shows the same frames.
    ``traceset``: the ``TraceSet`` an ``Attribution`` source came from (a ``TraceSet`` source is its own): its
    files and metadata give the collectives' dtypes and the GPUs' names, hence the links and their limits;
    without one, sizes come from the events table only and every link is unknown."""
    from shardline.profiling.attribution import attribute

    attribution = attribute(source, caller="report_sections")
    if traceset is None and _is_traceset(source):
        traceset = source
    return attribution.cached(("report_sections", int(top), traceset is not None),
                              lambda: _analyse(attribution, progress=progress, top=int(top), traceset=traceset))


def _is_traceset(source) -> bool:
    return hasattr(source, "files") and hasattr(source, "metadata") and hasattr(source, "events")


@dataclass(frozen=True)
class _TraceSetView:
    """A trace set's files and metadata with another layout's attribution: what ``collective_bandwidth`` reads,
    so it runs on the attribution the report shows (``attribute`` finds it in ``attributions``)."""

    events: pd.DataFrame
    files: dict
    metadata: dict
    layout: object
    attributions: dict


def bandwidth_rows(attribution, *, traceset=None) -> pd.DataFrame:
    """``collective_bandwidth`` of ``attribution`` (default links table), computed once per attribution and
    kept on it; ``traceset``: the ``TraceSet`` it came from (see ``report_sections``)."""
    from shardline.profiling.attribution import _layout_key, attribute
    from shardline.profiling.bandwidth import collective_bandwidth

    source = attribution
    if traceset is not None:
        source = traceset
        if attribute(traceset, caller="bandwidth_rows") is not attribution:
            source = _TraceSetView(events=attribution.events, files=traceset.files, metadata=traceset.metadata,
                                   layout=attribution.layout,
                                   attributions={_layout_key(attribution.layout): attribution})
    return attribution.cached(("bandwidth_rows", traceset is not None), lambda: collective_bandwidth(source))


def _bandwidth(attribution, traceset, notes: dict) -> pd.DataFrame:
    from shardline.profiling.bandwidth import LATENCY_BOUND_BYTES, bandwidth_summary
    from shardline.profiling.errors import ProfilingError

    try:
        rows = bandwidth_rows(attribution, traceset=traceset)
    except ProfilingError as exc:
        notes[Section.BANDWIDTH] = f"collective bandwidth not computed: {exc}"
        return _empty_summary()
    summary = bandwidth_summary(rows)
    if summary.empty:
        notes[Section.BANDWIDTH] = "no collective or point-to-point calls in this trace"
        return summary
    gpn = rows.attrs.get("gpus_per_node")
    text = (f"busbw = algbw x the nccl-tests factor of the collective, medians per bucket; links for "
            f"{gpn} GPUs per node ({rows.attrs.get('gpus_per_node_source')}); buckets whose calls are all under "
            f"{LATENCY_BOUND_BYTES // (1 << 20)} MiB are latency-bound; \"≥\" marks a lower bound (the kernel's whole "
            "duration, waiting included, where the group's calls were not all matched)")
    if (summary["link"] == "").all() and traceset is None:
        text += "; no trace set given, so no GPU names: links unknown"
    notes[Section.BANDWIDTH] = text
    return summary


def _analyse(attribution, *, progress: bool, top: int, traceset=None) -> ReportSections:
    from shardline.profiling.attribution import comm_by_dim
    from shardline.profiling.bubbles import MEASURED_METHODS, pipeline_bubbles
    from shardline.profiling.collectives import match_collectives, stragglers, wait_transfer
    from shardline.profiling.errors import AttributionError, TraceWarning
    from shardline.profiling.idle import launch_stats

    notes: dict[Section, str] = {}
    bar = _bar(10, enabled=progress)
    timings: dict[str, float] = {}
    clock = [time.perf_counter()]

    def done(stage: str) -> None:  # one stage of the report finished: time it, advance the bar
        now = time.perf_counter()
        timings[stage] = timings.get(stage, 0.0) + now - clock[0]
        clock[0] = now
        bar.update()

    matched = pd.DataFrame()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bd = attribution.breakdown
        done("breakdown")
        cbd = comm_by_dim(attribution)
        done("comm_by_dim")
        try:
            matched = match_collectives(attribution)
            wt, sg = wait_transfer(matched), stragglers(matched)
        except AttributionError as exc:
            wt, sg = pd.DataFrame(), pd.DataFrame()
            notes[Section.COLLECTIVES] = str(exc)
        done("collectives")
        # Without a measurable pipeline (annotations of shardline or torch.distributed.pipelining, or
        # receives matched with sends) pipeline_bubbles restates the breakdown's p2p_recv; the section
        # points there instead.
        bubbles = pipeline_bubbles(attribution)
        if not bubbles["method"].isin(MEASURED_METHODS).any():
            bubbles = pd.DataFrame()
            notes[Section.PIPELINE] = ("no pipeline found in this trace (no sl:pp:* or torch.distributed."
                                       "pipelining annotations, no receive matched with a send); the time ranks "
                                       "spent in receives is the breakdown's p2p_recv column")
        done("pipeline")
        kernels = top_kernels(attribution, top=top)
        done("top_kernels")
        links = host_links(attribution, getattr(traceset, "metadata", None) or {})
        offload = offload_traffic(attribution, bd, links=links)
        done("offload")
        coverage = comm_coverage(attribution)
        done("coverage")
        bw = _bandwidth(attribution, traceset, notes)
        done("bandwidth")
        path = _critical_path(attribution, notes)
        done("critical_path")
        launch = launch_stats(attribution)
        done("launch_stats")
    bar.close()
    _note_findings(notes, caught=caught, cbd=cbd, offload=offload)
    title, link_note = offload_title(links)
    notes[Section.OFFLOAD] = "; ".join(n for n in (notes.get(Section.OFFLOAD), link_note) if n)
    notes[Section.COMM_COVERAGE] = coverage_note(coverage)
    sections = ReportSections(breakdown=bd, comm_by_dim=cbd, wait_transfer=wt, stragglers=sg, bubbles=bubbles,
                              top_kernels=kernels, offload=offload, notes=notes, matched=matched,
                              attribution=attribution, comm_coverage=coverage, bandwidth=bw,
                              titles={Section.OFFLOAD: title}, critical_path=path, launch=launch,
                              warnings=tuple(sorted({str(w.message) for w in caught
                                                     if issubclass(w.category, TraceWarning)})))
    from shardline.profiling.findings import findings  # the rules read the sections above

    started = time.perf_counter()
    found = findings(attribution, sections=sections)
    timings["findings"] = time.perf_counter() - started  # what-if included
    timings["idle_causes"] = attribution.timings.get("idle_causes", 0.0)  # inside breakdown
    if found.empty:
        notes[Section.FINDINGS] = "no rule found anything to change in this trace"
    return dataclasses.replace(sections, findings=found, timings=timings)


def findings_terminal(sections: ReportSections, *, top: int = 5) -> str:
    """The terminal's first lines: the ``top`` findings, largest saving first ("" when there are none)."""
    found = sections.findings
    if found is None or found.empty:
        return ""
    lines = ["findings (what to change, by what it saves per step):"]
    lines += [f"  {int(row.rank)}. {row.text}" for row in found.head(top).itertuples(index=False)]
    if len(found) > top:
        lines.append(f"  ... {len(found) - top} more in the Markdown/HTML report")
    return "\n".join(lines) + "\n\n"


def why_terminal(sections: ReportSections) -> str:
    """The terminal's lines on what the steps waited on: the critical path of the first steps in words, and
    the idle of all ranks by cause (ms)."""
    from shardline.profiling.idle import IDLE_CAUSES

    lines = []
    note = sections.notes.get(Section.CRITICAL_PATH, "")
    if len(sections.critical_path):
        lines += ["", "critical path:"] + [f"  {part}" for part in note.split("; ")]
    bd = sections.breakdown
    if len(bd) and "idle_other" in bd and int(bd["idle"].sum()) > 0:
        parts = ", ".join(f"{c.removeprefix('idle_').replace('_', '-')} {bd[c].sum() / 1e6:.3f} ms"
                          for c in IDLE_CAUSES if int(bd[c].sum()))
        lines += ["", f"idle by cause (all ranks, {bd['idle'].sum() / 1e6:.3f} ms): {parts}"]
    return "\n".join(lines) + ("\n" if lines else "")


#: Steps whose critical path a report describes in words (the table holds every step).
DESCRIBED_STEPS = 5


def _critical_path(attribution, notes: dict) -> pd.DataFrame:
    """``critical_path_summary`` of the trace set's chain (per step, rank, label, dim), and in ``notes`` one
    line per step (the first ``DESCRIBED_STEPS``) saying what the step waited on."""
    from shardline.profiling.critical_path import critical_path, critical_path_summary, describe

    summary = critical_path_summary(critical_path(attribution))
    steps = sorted(set(summary["step"].tolist()))
    lines = [describe(summary, step) for step in steps[:DESCRIBED_STEPS]]
    if len(steps) > DESCRIBED_STEPS:
        lines.append(f"... {len(steps) - DESCRIBED_STEPS} more steps in the table")
    notes[Section.CRITICAL_PATH] = "; ".join(lines) if lines else "no step to walk"
    return summary


#: A rank's host link: (rank, device name, link name, GB/s per direction, whether a device rule knew the name).
HOST_LINK_COLUMNS = ("rank", "device_name", "link", "link_gbps", "known")


def host_links(source, metadata) -> pd.DataFrame:
    """The host PCIe link of each rank of ``source`` (``links.LinkTable.host_link`` of the first GPU name
    its trace's ``deviceProperties`` give; "" and Gen5 where none)."""
    from shardline.profiling.attribution import attribute
    from shardline.profiling.links import link_table

    table = link_table()
    rows = []
    for rank in attribute(source, caller="report_sections").ranks:
        props = [p for p in (metadata.get(rank.rank, {}).get("deviceProperties") or []) if isinstance(p, dict)]
        name = str(props[0].get("name", "")) if props else ""
        link, known = table.host_link(name)
        rows.append((int(rank.rank), name, link.name, link.gbps, bool(known and name)))
    return pd.DataFrame(rows, columns=list(HOST_LINK_COLUMNS)).astype({"rank": np.int64, "link_gbps": np.float64,
                                                                        "known": bool})


def _pcie_text(link: str) -> str:
    return link.replace("pcie-gen", "PCIe Gen")


def offload_title(links: pd.DataFrame) -> tuple[str, str]:
    """The offload section's title (the PCIe generation(s) of the ranks' host links) and a note on where the
    generation came from."""
    if links.empty:
        return TITLES[Section.OFFLOAD], f"no GPU name: {_pcie_text('pcie-gen5')} x16 assumed"
    found = links.drop_duplicates(["link"]).sort_values("link_gbps")
    gens = "/".join(_pcie_text(g) for g in found["link"])
    title = f"Offload traffic (H2D / D2H) vs the {gens} x16 limit" + ("s" if len(found) > 1 else "")
    parts = []
    for (name, link, gbps), part in links.groupby(["device_name", "link", "link_gbps"], sort=True):
        ranks = sorted(part["rank"].tolist())
        known = bool(part["known"].all())
        what = f"{_pcie_text(link)} x16 ({gbps:g} GB/s per direction)"
        parts.append(f"{what} from the device name {name!r} on ranks {ranks}" if known else
                     f"{what} assumed on ranks {ranks}: " + (f"no rule knows the device name {name!r}" if name
                                                              else "the trace names no GPU"))
    return title, "host link " + "; ".join(parts)


def _note_findings(notes: dict, *, caught, cbd: pd.DataFrame, offload: pd.DataFrame) -> None:
    if caught:
        notes.setdefault(Section.BREAKDOWN, "; ".join(sorted({str(w.message) for w in caught})))
    if cbd.empty:
        notes[Section.COMM_BY_DIM] = "no communication in this trace"
    if offload.empty:
        notes[Section.OFFLOAD] = "no host<->device copies in this trace"
    elif offload["pageable_copies"].sum() > 0:
        flagged = offload[offload["pageable_copies"] > 0]
        notes[Section.OFFLOAD] = (f"pageable host memory in {int(flagged['pageable_copies'].sum())} copies on ranks "
                                  f"{sorted(set(flagged['rank'].tolist()))}: they stage through a bounce buffer and "
                                  "block the host; pin the offload buffers")


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, *, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="analysing", unit="section", leave=False)


def _per_rank_work(source, keep, *, columns, categories=None):
    """``keep(work)`` of each rank's attributed work rows (only ``columns``; only ``categories`` when given),
    concatenated: one rank's rows are materialised at a time, so a large trace set costs its events table plus
    one rank, never a second copy of everything."""
    from shardline.profiling.attribution import attribute

    frames = [keep(rank.work(columns, categories=categories))
              for rank in attribute(source, caller="report_sections").working]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else None


def _kernel_totals(work: pd.DataFrame) -> pd.DataFrame:
    work = work[work["category"].astype(str) != ""]
    per = work.groupby([work["category"].astype(str).rename("category"), work["name"].astype(str).rename("name")])
    return per["dur_ns"].agg(["size", "sum"]).reset_index()


def top_kernels(source, *, top: int = TOP_KERNELS) -> pd.DataFrame:
    """The ``top`` names by total time in each category, over the attributed work rows of all ranks: category,
    name, calls, total_ns, mean_ns, share (of the category's total)."""
    per_rank = _per_rank_work(source, _kernel_totals, columns=("category", "name", "dur_ns"))
    if per_rank is None or per_rank.empty:
        return pd.DataFrame(columns=["category", "name", "calls", "total_ns", "mean_ns", "share"])
    per = per_rank.groupby(["category", "name"], as_index=False)[["size", "sum"]].sum()
    per.columns = ["category", "name", "calls", "total_ns"]
    per["mean_ns"] = per["total_ns"] / per["calls"]
    per["share"] = per["total_ns"] / per.groupby("category")["total_ns"].transform("sum").where(
        lambda s: s > 0)
    per = per.sort_values(["category", "total_ns", "name"], ascending=[True, False, True])
    return per.groupby("category").head(top).reset_index(drop=True)


def offload_traffic(source, bd: pd.DataFrame, *, links: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per (rank, direction): copies, bytes, busy_ns, achieved_gbps, link, link_gbps, of_limit,
    pageable_copies, exposed_ns. ``links``: ``host_links`` (PCIe Gen5 x16 for a rank it lacks)."""
    copies = _per_rank_work(source, lambda w: w, columns=("rank", "category", "msg_bytes", "dur_ns", "memory_kind"),
                            categories=("memcpy_h2d", "memcpy_d2h"))
    if copies is None or copies.empty:
        return pd.DataFrame(columns=["rank", "direction", "copies", "bytes", "busy_ns", "achieved_gbps", "link",
                                     "link_gbps", "of_limit", "pageable_copies", "exposed_ns"])
    sized = copies["msg_bytes"].to_numpy() >= 0
    frame = pd.DataFrame({"rank": copies["rank"].to_numpy().astype(np.int64),
                          "direction": copies["category"].astype(str).to_numpy(),
                          "bytes": np.where(sized, copies["msg_bytes"].to_numpy(), 0),
                          "sized_ns": np.where(sized, copies["dur_ns"].to_numpy(), 0),
                          "busy_ns": copies["dur_ns"].to_numpy(),
                          "pageable": (copies["memory_kind"].astype(str) == "Pageable").to_numpy()})
    out = frame.groupby(["rank", "direction"], as_index=False).agg(
        copies=("busy_ns", "size"), bytes=("bytes", "sum"), busy_ns=("busy_ns", "sum"),
        sized_ns=("sized_ns", "sum"), pageable_copies=("pageable", "sum"))
    out["achieved_gbps"] = out["bytes"] / out["sized_ns"].where(out["sized_ns"] > 0)
    by_rank = (links if links is not None else pd.DataFrame(columns=list(HOST_LINK_COLUMNS))).set_index("rank")
    out["link"] = by_rank["link"].reindex(out["rank"]).fillna("pcie-gen5").to_numpy(dtype=object)
    out["link_gbps"] = by_rank["link_gbps"].reindex(out["rank"]).fillna(PCIE_GEN5_X16_GBPS).to_numpy(dtype=float)
    out["of_limit"] = out["achieved_gbps"] / out["link_gbps"]
    exposed = bd.groupby("rank")[["memcpy_h2d", "memcpy_d2h"]].sum() if len(bd) else None
    out["exposed_ns"] = [int(exposed.loc[r, d]) if exposed is not None and r in exposed.index else 0
                         for r, d in zip(out["rank"], out["direction"])]  # one per (rank, direction)
    out["direction"] = out["direction"].map({"memcpy_h2d": "H2D", "memcpy_d2h": "D2H"})
    return out[["rank", "direction", "copies", "bytes", "busy_ns", "achieved_gbps", "link", "link_gbps",
                "of_limit", "pageable_copies", "exposed_ns"]]


# --- display tables ---------------------------------------------------------------------------------------------

def display_tables(sec: ReportSections) -> dict[Section, list[tuple[str, pd.DataFrame]]]:
    """Per section, its (table id, table of display strings) pairs; empty list where the section has no data."""
    out: dict[Section, list[tuple[str, pd.DataFrame]]] = {s: [] for s in Section}
    if len(sec.findings):
        f = sec.findings
        saves = ["" if np.isnan(v) else str(ms_text([int(round(v))])[0]) for v in f["saves_ns"]]
        out[Section.FINDINGS].append(("findings-table", pd.DataFrame({
            "#": f["rank"].astype(str), "saves_ms_per_step": saves, "method": f["method"].astype(str),
            "finding": f["text"].astype(str), "measured": f["measured"].astype(str)})))
    from shardline.profiling import rank_summary

    # Beyond a few dozen ranks a row per rank is unreadable: those tables become distributions over the ranks
    # (median, p90, max, the worst ranks by name); the per-rank tables stay in csv/parquet (``report``).
    many = len(sec.breakdown) and sec.breakdown["rank"].nunique() > rank_summary.MANY_RANKS
    if many:
        out[Section.BREAKDOWN].append(("breakdown-distribution-table", rank_summary.display(
            rank_summary.category_distribution(sec.breakdown))))
        if len(sec.comm_by_dim):
            out[Section.COMM_BY_DIM].append(("comm-by-dim-distribution-table", rank_summary.display(
                rank_summary.dim_distribution(sec.comm_by_dim))))
        if len(sec.matched):
            out[Section.COLLECTIVES].append(("collective-distribution-table", rank_summary.display(
                rank_summary.collective_distribution(sec.matched))))
    elif len(sec.breakdown):
        out[Section.BREAKDOWN].append(("breakdown-table", breakdown_table(sec.breakdown, style=REPORT)))
    if len(sec.comm_by_dim) and not many:
        c = sec.comm_by_dim
        out[Section.COMM_BY_DIM].append(("comm-by-dim-table", pd.DataFrame({
            "rank": c["rank"].astype(str), "step": c["step"].astype(str), "dim": c["dim"].astype(str),
            "comm_ms": ms_text(c["comm_ns"]), "exposed_ms": ms_text(c["exposed_ns"]),
            "overlapped_ms": ms_text(c["overlapped_ns"])})))
    if len(sec.wait_transfer) and not many:
        w = sec.wait_transfer
        out[Section.COLLECTIVES].append(("wait-transfer-table", pd.DataFrame({
            "rank": w["rank"].astype(str), "category": w["category"].astype(str), "calls": w["calls"].astype(str),
            "time_ms": ms_text(w["dur_ns"]), "wait_ms": ms_text(w["wait_ns"]),
            "transfer_ms": ms_text(w["transfer_ns"]), "wait_%": fixed(100 * w["wait_fraction"], 2)})))
    if len(sec.stragglers):
        s = sec.stragglers
        out[Section.COLLECTIVES].append(("stragglers-table", pd.DataFrame({
            "step": s["step"].astype(str), "straggler_rank": s["straggler_rank"].astype(str),
            "caused_wait_ms": ms_text(s["caused_wait_ns"]), "times_last": s["times_last"].astype(str)})))
    if len(sec.bubbles) and many:
        distribution = rank_summary.numeric_distribution(
            sec.bubbles, {"batch_ns": "ns", "bubble_ns": "ns", "bubble_fraction": "%", "ideal_fraction": "%"},
            by=("method", "stage"))
        out[Section.PIPELINE].append(("bubbles-distribution-table", rank_summary.display(distribution)))
    elif len(sec.bubbles):
        b = sec.bubbles
        out[Section.PIPELINE].append(("bubbles-table", pd.DataFrame({
            "rank": b["rank"].astype(str), "step": b["step"].astype(str), "method": b["method"].astype(str),
            "stage": b["stage"].astype(str), "schedule": b["schedule"].astype(str),
            "p": b["p"].astype(str), "m": b["m"].astype(str), "v": b["v"].astype(str),
            "batch_ms": ms_text(b["batch_ns"]),
            "bubble_ms": ms_text(b["bubble_ns"]), "bubble_%": fixed(100 * b["bubble_fraction"], 2),
            "ideal_%": fixed(100 * b["ideal_fraction"], 2)})))
    if len(sec.critical_path):
        c = sec.critical_path
        out[Section.CRITICAL_PATH].append(("critical-path-table", pd.DataFrame({
            "step": c["step"].astype(str), "rank": c["rank"].astype(str), "label": c["label"].astype(str),
            "dim": c["dim"].astype(str), "path_ms": ms_text(c["dur_ns"]), "share_%": fixed(100 * c["share"], 2)})))
    bd = sec.breakdown
    if len(bd) and "idle_other" in bd and not many:  # many ranks: the idle causes are rows of the distribution
        from shardline.profiling.idle import IDLE_CAUSES

        table = {"rank": bd["rank"].astype(str), "step": bd["step"].astype(str), "idle_ms": ms_text(bd["idle"])}
        table.update({f"{c.removeprefix('idle_')}_ms": ms_text(bd[c]) for c in IDLE_CAUSES})
        out[Section.IDLE].append(("idle-table", pd.DataFrame(table)))
    if len(sec.launch) and many:
        out[Section.IDLE].append(("launch-distribution-table", rank_summary.display(rank_summary.numeric_distribution(
            sec.launch, {"launches": "", "launch_delay_median_ns": "ns", "launch_delay_p90_ns": "ns",
                         "kernels": "", "short_kernels": "", "short_kernel_share": "%"}))))
    elif len(sec.launch):
        lt = sec.launch
        out[Section.IDLE].append(("launch-table", pd.DataFrame({
            "rank": lt["rank"].astype(str), "launches": lt["launches"].astype(str),
            "delay_median_us": fixed(lt["launch_delay_median_ns"] / 1e3, 1),
            "delay_p90_us": fixed(lt["launch_delay_p90_ns"] / 1e3, 1),
            "delay_max_us": fixed(lt["launch_delay_max_ns"].where(lt["launch_delay_max_ns"] >= 0) / 1e3, 1),
            "kernels": lt["kernels"].astype(str), "short_kernels": lt["short_kernels"].astype(str),
            "short_%_of_busy": fixed(100 * lt["short_kernel_share"], 2)})))
    if len(sec.top_kernels):
        k = sec.top_kernels
        out[Section.TOP_KERNELS].append(("top-kernels-table", pd.DataFrame({
            "category": k["category"], "name": k["name"], "calls": k["calls"].astype(str),
            "total_ms": ms_text(k["total_ns"]), "share_%": fixed(100 * k["share"], 2)})))
    if len(sec.offload) and many:
        distribution = rank_summary.numeric_distribution(
            sec.offload, {"copies": "", "bytes": "", "busy_ns": "ns", "achieved_gbps": "", "of_limit": "%",
                          "pageable_copies": "", "exposed_ns": "ns"}, by=("direction",))
        out[Section.OFFLOAD].append(("offload-distribution-table", rank_summary.display(distribution)))
    elif len(sec.offload):
        o = sec.offload
        out[Section.OFFLOAD].append(("offload-table", pd.DataFrame({
            "rank": o["rank"].astype(str), "direction": o["direction"], "copies": o["copies"].astype(str),
            "bytes": o["bytes"].astype(str), "busy_ms": ms_text(o["busy_ns"]),
            "achieved_GB/s": fixed(o["achieved_gbps"], 3), "link": o["link"].astype(str),
            "link_GB/s": fixed(o["link_gbps"], 2), "of_link_%": fixed(100 * o["of_limit"], 2),
            "pageable_copies": o["pageable_copies"].astype(str), "exposed_ms": ms_text(o["exposed_ns"])})))
    if len(sec.bandwidth):
        out[Section.BANDWIDTH].append(("bandwidth-table", bandwidth_table(sec.bandwidth)))
    if len(sec.comm_coverage):
        c = sec.comm_coverage
        out[Section.COMM_COVERAGE].append(("comm-coverage-table", pd.DataFrame({
            "finding": c["finding"], "name": c["name"], "category": c["category"], "ranks": c["ranks"],
            "count": c["count"].astype(str), "launched": c["launched"]})))
    return out


def bandwidth_table(summary: pd.DataFrame) -> pd.DataFrame:
    """``bandwidth_summary`` as display strings: sizes in bytes, the median time in ms, bandwidths in GB/s
    (three decimals) and the verdict ("latency-bound" or "x % of peak")."""
    return pd.DataFrame({
        "category": summary["category"].astype(str), "dtype": summary["dtype"].astype(str),
        "size": summary["size_bucket"].astype(str), "group": summary["group"].astype(str),
        "n": summary["group_size"].astype(str), "link": summary["link"].astype(str),
        "link_GB/s": fixed(summary["link_gbps"], 2), "calls": summary["calls"].astype(str),
        "ranks": summary["ranks"].astype(str), "bytes_median": fixed(summary["bytes_median"], 0),
        "time_ms_median": fixed(summary["time_ns_median"] / 1e6, 6),
        "algbw_GB/s": fixed(summary["algbw_gbps_median"], 3), "busbw_GB/s": fixed(summary["busbw_gbps_median"], 3),
        "busbw_max_GB/s": fixed(summary["busbw_gbps_max"], 3), "basis": summary["time_basis"].astype(str),
        "verdict": summary["verdict"].astype(str)}).reset_index(drop=True)


def bandwidth_text(sec: ReportSections) -> str:
    """The bandwidth section for the terminal: its title, note and table (plain columns); "" without calls."""
    return _bandwidth_lines(sec.bandwidth, sec.notes.get(Section.BANDWIDTH))


def bandwidth_terminal(source, *, traceset=None) -> str:
    """``bandwidth_text`` of ``source`` (an ``Attribution``, ``TraceSet`` or events table) without the other
    sections: for the terminal report, which shows the breakdown. ``traceset`` as in ``report_sections``."""
    from shardline.profiling.attribution import attribute

    attribution = attribute(source, caller="bandwidth_terminal")
    if traceset is None and _is_traceset(source):
        traceset = source
    notes: dict[Section, str] = {}
    return _bandwidth_lines(_bandwidth(attribution, traceset, notes), notes.get(Section.BANDWIDTH))


def _bandwidth_lines(summary: pd.DataFrame, note: str | None) -> str:
    if summary.empty:
        return ""
    return "\n".join(["", TITLES[Section.BANDWIDTH], *([note] if note else []),
                      bandwidth_table(summary).to_string(index=False), ""])


# --- communication coverage -------------------------------------------------------------------------------------

class Finding(str, enum.Enum):
    """What ``comm_coverage`` reports; the value is the text every report shows."""

    OP_WITHOUT_KERNEL = "communication op with no communication kernel"
    KERNEL_WITHOUT_OP = "communication kernel with no communication op"


COVERAGE_COLUMNS = ("finding", "name", "category", "ranks", "count", "launched")
#: CPU-only backends: their ops launch no GPU kernel by design.
_HOST_BACKENDS = r"^(gloo|mpi|ucc):"


def comm_coverage_frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(COVERAGE_COLUMNS)).astype({"count": np.int64})


def comm_coverage(source) -> pd.DataFrame:
    """How the next unknown communication library shows itself: per (finding, name), on ranks whose trace
    records kernel launches (CPU rows with a correlation id) and GPU rows --

    - ``communication op with no communication kernel``: a CPU communication op (``c10d::*``, ``nccl:*``,
      ``record_param_comms``, ``sl:comm:*``; not the host-only ``gloo:*``/``mpi:*``/``ucc:*``) inside whose
      span GPU work but no communication kernel was launched (kernel.correlation == launch.correlation, launch
      inside the op on the same thread) and that is no communication kernel's op (``classify.launching_op``:
      by its launch or its External id). ``launched``: the kernels those ops did launch (most frequent first,
      three at most) -- the names a new ``CommRule`` should match;
    - ``communication kernel with no communication op``: a GPU communication kernel that has no
      ``launching_op`` among those ops: its launch lies in none, and no op's External id names it (DeepEP and
      symmetric-memory kernels run so).

    Columns: finding, name, category, ranks (comma-separated), count (occurrences over those ranks), launched.
    Vectorised over the events table; one small loop per (rank, thread) holding communication ops."""
    from shardline.profiling.attribution import attribute

    events = source if isinstance(source, pd.DataFrame) else attribute(source, caller="comm_coverage").events
    if not len(events):
        return comm_coverage_frame([])
    return _coverage(events)


def _coverage(ev: pd.DataFrame) -> pd.DataFrame:
    from shardline.profiling.classify import launch_rows, launching_op, match_table
    from shardline.profiling.schema import COMM_CATEGORIES, category_texts, codes_or_end

    cat_codes = codes_or_end(ev["category"])
    cat_texts = np.array([*category_texts(ev["category"].cat.categories), ""], dtype=object)
    comm = np.isin(cat_texts, list(COMM_CATEGORIES))[cat_codes]
    cpu = (ev["lane"] == "cpu").to_numpy()
    gpu = (ev["lane"] == "gpu").to_numpy()
    rank, stream = ev["rank"].to_numpy(), ev["stream"].to_numpy()
    corr = ev["correlation"].to_numpy()
    start = ev["start_ns"].to_numpy()
    end = start + ev["dur_ns"].to_numpy()
    ranks = np.intersect1d(np.unique(rank[cpu & (corr >= 0)]), np.unique(rank[gpu]))
    if not len(ranks):
        return comm_coverage_frame([])
    considered = np.isin(rank, ranks)
    name_codes = codes_or_end(ev["name"])
    ops = np.flatnonzero(cpu & comm & considered & ~match_table(ev["name"], _HOST_BACKENDS)[name_codes])
    kernels = np.flatnonzero(gpu & considered & (corr >= 0))
    launch = launch_rows(ev, kernels)
    kernels, launch = kernels[launch >= 0], launch[launch >= 0]
    is_comm_kernel = comm[kernels]
    comm_rows = np.flatnonzero(gpu & comm & considered)
    op_of = launching_op(ev, ops=ops, rows=comm_rows)  # each communication kernel's op, -1 for none
    covered_ops, has_gpu_work, inside = _launches_inside(ops, launch, rank=rank, stream=stream, start=start, end=end,
                                           comm_launch=is_comm_kernel)
    # An op that launched no GPU work at all (work.wait()'s record_param_comms, a coalesced send whose kernel the
    # group end launches) is not evidence of a kernel nobody recognises.
    uncovered = ops[has_gpu_work & ~(covered_ops | np.isin(ops, op_of))]
    texts = np.array([*category_texts(ev["name"].cat.categories), ""], dtype=object)
    labels = dict(rank=rank, name_codes=name_codes, texts=texts, categories=cat_texts[cat_codes])
    rows = _op_rows(uncovered, kernels, launch, inside, **labels)
    # The reverse: comm kernels (with a launch) that are no op's.
    comm_k = kernels[is_comm_kernel]
    orphans = comm_k[op_of[np.searchsorted(comm_rows, comm_k)] < 0]
    rows += _grouped(orphans, Finding.KERNEL_WITHOUT_OP, launched={}, **labels)
    return comm_coverage_frame(rows)


def _groups(rows: np.ndarray, *, rank, stream):
    """(rank, thread) -> rows there, for ``rows``."""
    if not len(rows):
        return {}
    keys = pd.MultiIndex.from_arrays([rank[rows], stream[rows]])
    codes, uniques = pd.factorize(keys)
    order = np.argsort(codes, kind="stable")
    bounds = np.searchsorted(codes[order], np.arange(len(uniques) + 1))
    return {tuple(uniques[i]): rows[order[bounds[i]:bounds[i + 1]]] for i in range(len(uniques))}


def _launches_inside(ops, launch, *, rank, stream, start, end, comm_launch):
    """Per op: was a communication kernel launched inside it, was any GPU work; and per (rank, thread) the
    [lo, hi) range of the launches (sorted by start) inside each op, as (ops, launches, lo, hi), to name them."""
    covered = np.zeros(len(ops), dtype=bool)
    launched = np.zeros(len(ops), dtype=bool)
    inside = {}
    op_groups = _groups(ops, rank=rank, stream=stream)
    launch_pos = _groups(np.arange(len(launch)), rank=rank[launch], stream=stream[launch])
    for key, group in op_groups.items():
        mine = launch_pos.get(key)
        if mine is None:
            continue
        mine = mine[np.argsort(start[launch[mine]], kind="stable")]
        t = start[launch[mine]]
        lo = np.searchsorted(t, start[group], side="left")
        hi = np.searchsorted(t, end[group], side="right")
        comm_count = np.concatenate([[0], np.cumsum(comm_launch[mine])])
        idx = np.searchsorted(ops, group)  # ops ascend (flatnonzero)
        covered[idx] = comm_count[hi] > comm_count[lo]
        launched[idx] = hi > lo
        inside[key] = (group, mine, lo, hi)
    return covered, launched, inside


def _op_rows(uncovered, kernels, launch, inside, *, rank, name_codes, texts, categories) -> list[dict]:
    """Rows for ops without a communication kernel, with the kernels they did launch."""
    if not len(uncovered):
        return []
    flagged = np.zeros(len(name_codes), dtype=bool)
    flagged[uncovered] = True
    op_names, kernel_names = [], []
    for group, mine, lo, hi in inside.values():
        keep = flagged[group]
        if not keep.any():
            continue
        lo, hi, group = lo[keep], hi[keep], group[keep]
        counts = hi - lo
        if not counts.sum():
            continue
        # every (op, launch inside it) pair, without a loop over ops
        offsets = np.repeat(lo - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        picked = mine[np.arange(counts.sum()) + offsets]
        op_names.append(name_codes[np.repeat(group, counts)])
        kernel_names.append(name_codes[kernels[picked]])
    launched: dict[str, str] = {}
    if op_names:
        pairs = pd.DataFrame({"op": np.concatenate(op_names), "kernel": np.concatenate(kernel_names)})
        counted = pairs.value_counts().reset_index(name="n").sort_values(["op", "n", "kernel"],
                                                                         ascending=[True, False, True])
        for op, part in counted.groupby("op", sort=False):
            launched[texts[op]] = "; ".join(f"{texts[k]} ×{n}" for k, n in zip(part["kernel"][:3], part["n"][:3]))
    return _grouped(uncovered, Finding.OP_WITHOUT_KERNEL, launched=launched, rank=rank, name_codes=name_codes,
                    texts=texts, categories=categories)


def _grouped(rows, finding: Finding, *, launched: dict, rank, name_codes, texts, categories) -> list[dict]:
    if not len(rows):
        return []
    frame = pd.DataFrame({"name": texts[name_codes[rows]], "category": categories[rows], "rank": rank[rows]})
    out = []
    for (name, category), part in frame.groupby(["name", "category"], sort=True):
        out.append(dict(finding=finding.value, name=name, category=category,
                        ranks=",".join(str(int(r)) for r in sorted(set(part["rank"].tolist()))),
                        count=len(part), launched=launched.get(name, "")))
    return out


def coverage_note(coverage: pd.DataFrame) -> str:
    """One line for the reports (and the terminal) summarising ``comm_coverage``."""
    if coverage.empty:
        return ("every communication op launched a communication kernel and every communication kernel has its "
                "op (or the trace records no kernel launches)")
    counts = coverage.groupby("finding")["count"].sum()
    parts = [f"{int(counts[f.value])} × {f.value}" for f in Finding if f.value in counts.index]
    return ("; ".join(parts) + ": a kernel no rule knows shows up here -- name it with a CommRule "
            "(--rules FILE)")
