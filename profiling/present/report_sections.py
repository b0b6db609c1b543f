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

import pandas as pd

from ..analyses.bubbles import pipeline_bubbles
from ..analyses.coverage import comm_coverage, comm_coverage_frame, coverage_note
from ..analyses.critical_path import critical_path, critical_path_summary, describe
from ..analyses.findings import DEFAULT_RULES, evaluate
from ..analyses.idle import launch_stats
from ..analyses.kernels import TOP_KERNELS, top_kernels
from ..analyses.traffic import bandwidth_rows, host_links, offload_traffic
from ..attribution.core import attribute, comm_by_dim
from ..attribution.idle import IDLE_CAUSES
from ..base.errors import AttributionError, ProfilingError, TraceWarning
from ..matching.bandwidth import LATENCY_BOUND_BYTES, bandwidth_summary
from ..matching.collectives import match_collectives, stragglers, wait_transfer
from ..matching.pipelines import MEASURED_METHODS


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

    return bandwidth_summary(pd.DataFrame())


def report_sections(source, *, progress: bool = False, top: int = TOP_KERNELS, traceset=None) -> ReportSections:
    """Every section's frame for ``source`` (a ``TraceSet``, an events table or an ``Attribution``).

    The one orchestrator of the analyses: each runs once on the source's attribution, and the sections are
    kept on it, so every output of one trace set (HTML, Markdown, TensorBoard) shows the same frames.
    ``traceset``: the ``TraceSet`` an ``Attribution`` source came from (a ``TraceSet`` source is its own): its
    files and metadata give the collectives' dtypes and the GPUs' names, hence the links and their limits;
    without one, sizes come from the events table only and every link is unknown."""

    attribution = attribute(source, caller="report_sections")
    if traceset is None and is_traceset(source):
        traceset = source
    return attribution.cached(("report_sections", int(top), traceset is not None),
                              lambda: _analyse(attribution, progress=progress, top=int(top), traceset=traceset))


def is_traceset(source) -> bool:
    return hasattr(source, "files") and hasattr(source, "metadata") and hasattr(source, "events")


def bandwidth_section(attribution, traceset, notes: dict) -> pd.DataFrame:
    """The bandwidth section's frame (``bandwidth_summary`` of ``bandwidth_rows``), its note in ``notes``."""
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
        bw = bandwidth_section(attribution, traceset, notes)
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

    started = time.perf_counter()
    found = findings(attribution, sections=sections)
    timings["findings"] = time.perf_counter() - started  # what-if included
    timings["idle_causes"] = attribution.timings.get("idle_causes", 0.0)  # inside breakdown
    if found.empty:
        notes[Section.FINDINGS] = "no rule found anything to change in this trace"
    return dataclasses.replace(sections, findings=found, timings=timings)


def findings(source, *, rules=DEFAULT_RULES, sections=None) -> pd.DataFrame:
    """The findings of ``source`` (a ``TraceSet``, an events table or an ``Attribution``), one row each
    (``analyses.findings.FINDING_COLUMNS``), the largest saving first and diagnostics last: the rules
    (``rules``, ``FindingRule`` objects) read the report's sections. ``sections``: the report's
    ``ReportSections`` when the caller has them (else computed)."""
    attribution = attribute(source, caller="findings")
    return evaluate(attribution, sections if sections is not None else report_sections(attribution), rules=rules)


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

    summary = critical_path_summary(critical_path(attribution))
    steps = sorted(set(summary["step"].tolist()))
    lines = [describe(summary, step) for step in steps[:DESCRIBED_STEPS]]
    if len(steps) > DESCRIBED_STEPS:
        lines.append(f"... {len(steps) - DESCRIBED_STEPS} more steps in the table")
    notes[Section.CRITICAL_PATH] = "; ".join(lines) if lines else "no step to walk"
    return summary


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


