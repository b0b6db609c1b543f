"""The sections of a post-hoc report, as DataFrames, and their display tables (shared by HTML and markdown).

``report_sections(traceset)`` is the one orchestrator of the analyses: on the trace set's ``Attribution`` it
runs each section's compute function of the registry (``registry.SECTIONS``: name, title, compute, display)
once -- ``detect_workload`` (-> ``workload``: the kind of job and its all-to-all's use, the report's first
line, which the findings' advice follows), ``breakdown`` (with idle by cause), ``critical_path`` (->
``critical_path_summary``, one line per step in the section's note), ``launch_stats``, ``comm_by_dim``,
``match_collectives`` (-> ``wait_transfer``, ``stragglers``), ``pipeline_bubbles``, ``collective_bandwidth``
(-> ``bandwidth_summary``) --
and two summaries of the attributed work rows that no analysis gives: the top kernels (or ops) per category and
the offload traffic. The sections are kept on the attribution; the renderers (HTML,
Markdown, TensorBoard) format these frames and never recompute them, so a number in a report is a number of a
frame here.

Offload traffic, per rank and direction (host->device, device->host), over the attributed work rows of the whole
trace::

    achieved GB/s = bytes / busy ns        (1 byte/ns = 1 GB/s; copies without a recorded size are left out)
    of_limit      = achieved / link_gbps   (the rank's host PCIe link, x16, per direction)

The host link is the PCIe generation the rank's GPU name implies (``links.LinkTable.host_link``: V100 Gen3
15.75, A100 Gen4 31.5, H100/B200 Gen5 63.0 GB/s); a name no rule knows (or no name) is taken as Gen5 and the
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

import time
import warnings

import pandas as pd

from ..analyses.findings import DEFAULT_RULES, ms_figures
from ..analyses.kernels import TOP_KERNELS
from ..attribution.core import attribute
from ..attribution.idle import IDLE_CAUSES
from ..base.errors import TraceWarning
from ..table.workload import WorkloadKind
from .compute import DESCRIBED_STEPS, bandwidth_section, offload_title
from .registry import SECTIONS, TITLES, section_title
from .scenarios import evaluate_findings
from .sections import Inputs, ReportSections, Section, is_traceset
from .workload_section import lead_line

__all__ = ["DESCRIBED_STEPS", "TITLES", "ReportSections", "Section", "bandwidth_section", "findings",
           "findings_terminal", "is_traceset", "offload_title", "report_sections", "section_title",
           "why_terminal"]


def report_sections(source, *, progress: bool = False, top: int = TOP_KERNELS, traceset=None) -> ReportSections:
    """Every section's frame for ``source`` (a ``TraceSet``, an events table or an ``Attribution``).

    The one orchestrator of the analyses: each section of the registry is computed once on the source's
    attribution, and the sections are kept on it, so every output of one trace set (HTML, Markdown,
    TensorBoard) shows the same frames. ``traceset``: the ``TraceSet`` an ``Attribution`` source came from (a
    ``TraceSet`` source is its own): its files and metadata give the collectives' dtypes and the GPUs' names,
    hence the links and their limits; without one, sizes come from the events table only and every link is
    unknown."""

    attribution = attribute(source, caller="report_sections")
    if traceset is None and is_traceset(source):
        traceset = source
    return attribution.derived(_sections, int(top), traceset is not None, progress=progress, traceset=traceset)


def _sections(attribution, top: int, _with_traceset: bool, *, progress: bool, traceset) -> ReportSections:
    """Every row of ``registry.SECTIONS`` computed in order, those that read the others last; kept once per
    (attribution, top, whether a trace set gives the files)."""

    inputs = Inputs(attribution=attribution, traceset=traceset, top=top)
    first = [row for row in SECTIONS if not row.after_others]
    bar = _bar(len(first), enabled=progress)
    timings: dict[str, float] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for row in first:
            started = time.perf_counter()
            inputs.frames.update(row.compute(inputs))
            timings[row.stage] = timings.get(row.stage, 0.0) + time.perf_counter() - started
            bar.update()
    bar.close()
    notes = inputs.notes
    if caught:
        notes.setdefault(Section.BREAKDOWN, "; ".join(sorted({str(w.message) for w in caught})))
    sections = ReportSections.of(inputs.frames, notes=notes, attribution=attribution, titles=inputs.titles,
                              warnings=tuple(sorted({str(w.message) for w in caught
                                                     if issubclass(w.category, TraceWarning)})))
    inputs.sections = sections
    later: dict = {}
    for row in SECTIONS:
        if row.after_others:
            started = time.perf_counter()
            later.update(row.compute(inputs))
            timings[row.stage] = time.perf_counter() - started  # the findings: what-if included
    timings["idle_causes"] = attribution.timings.get("idle_causes", 0.0)  # inside breakdown
    return sections.with_frames(later, timings=timings)


def findings(source, *, rules=DEFAULT_RULES, sections=None) -> pd.DataFrame:
    """The findings of ``source`` (a ``TraceSet``, an events table or an ``Attribution``), one row each
    (``analyses.findings.FINDING_COLUMNS``), the largest saving first and diagnostics last: the rules
    (``rules``, ``FindingRule`` objects) read the report's sections. ``sections``: the report's
    ``ReportSections`` when the caller has them (else computed)."""
    attribution = attribute(source, caller="findings")
    return evaluate_findings(attribution, sections if sections is not None else report_sections(attribution),
                             rules=rules)


def findings_terminal(sections: ReportSections, *, top: int = 5) -> str:
    """The terminal's first lines: the detected workload (``workload_section.lead_line``; only when a kind or an
    all-to-all's use was found: the Markdown/HTML reports say "unknown" too), then the ``top`` findings, largest
    saving first ("" when there is neither)."""
    workload = sections.workload
    known = workload is not None and (workload.kind is not WorkloadKind.UNKNOWN or workload.all_to_all_calls)
    lead = lead_line(workload) if known else ""
    found = sections.findings
    if found is None or found.empty:
        return f"{lead}\n\n" if lead else ""
    lines = [lead, ""] if lead else []
    lines += ["findings (what to change, by what it saves per step):"]
    minor = found["minor"].astype(bool) if "minor" in found else pd.Series(False, index=found.index)
    lines += [f"  {int(row.rank)}. {row.text}" for row in found[~minor].head(top).itertuples(index=False)]
    if (~minor).sum() > top:
        lines.append(f"  ... {int((~minor).sum()) - top} more in the Markdown/HTML report")
    if minor.any():  # savings below the steps' own spread: named, not ranked among the others
        lines.append("  minor (below the step-to-step spread): " + "; ".join(
            f"{row.rule} −{ms_figures(row.saves_ns)} ms/step" for row in found[minor].itertuples(index=False)))
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
        other = 100 * bd["idle_other"].sum() / bd["idle"].sum()
        lines += ["", f"idle by cause (all ranks, {bd['idle'].sum() / 1e6:.3f} ms): {parts} (other: {other:.1f}% "
                      "of idle, what no rule explains)"]
    return "\n".join(lines) + ("\n" if lines else "")


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


