"""The report's sections, one row each (:data:`SECTIONS`): its name (a :class:`~.sections.Section`), its
title, its compute function (``compute``: the analyses it runs, into ``ReportSections`` fields) and its display
function (``section_displays``: the tables of display strings; the workload section's two are in
``workload_section``). ``report_sections`` computes the rows in order
(those that read the other sections, the findings, last), ``display.display_tables`` and the HTML, Markdown and
TensorBoard outputs show them in order. A new section is its ``Section`` member (its name and HTML anchor) and
a row here; the frames its compute function returns need no declaration (``ReportSections.extra``, read as
``sections.<name>``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import compute
from . import section_displays as show
from .sections import Inputs, ReportSections, Section
from .workload_section import workload_frames, workload_tables


@dataclass(frozen=True)
class SectionRow:
    """One section: ``section`` (its name, the HTML id), ``title``, ``compute`` (``Inputs`` -> the
    ``ReportSections`` fields it fills; timed as ``stage``), ``display`` ((sections, many ranks) -> its tables)
    and ``after_others``: computed once the other sections exist (it reads them, ``Inputs.sections``)."""

    section: Section
    title: str
    compute: Callable[[Inputs], dict]
    display: Callable[[ReportSections, bool], list]
    stage: str
    after_others: bool = False


SECTIONS: tuple[SectionRow, ...] = (
    SectionRow(Section.WORKLOAD, "Workload: what this trace records, detected from its names", workload_frames,
               workload_tables, "workload"),
    SectionRow(Section.FINDINGS, "Findings: what to change, by what it saves per step", compute.findings_frames,
               show.findings_tables, "findings", after_others=True),
    SectionRow(Section.BREAKDOWN, "Step time per rank and step (exclusive, ms)", compute.breakdown_frames,
               show.breakdown_tables, "breakdown"),
    SectionRow(Section.CRITICAL_PATH, "Critical path across ranks: what each step waited on (share of the path)",
               compute.critical_path_frames, show.critical_path_tables, "critical_path"),
    SectionRow(Section.IDLE, "Idle by cause, and how late the host launched GPU work", compute.idle_frames,
               show.idle_tables, "launch_stats"),
    SectionRow(Section.COMM_BY_DIM, "Communication per parallel dimension (ms)", compute.comm_by_dim_frames,
               show.comm_by_dim_tables, "comm_by_dim"),
    SectionRow(Section.COLLECTIVES, "Collectives: wait vs transfer, stragglers", compute.collectives_frames,
               show.collectives_tables, "collectives"),
    SectionRow(Section.BANDWIDTH, "Collective bandwidth vs the link's limit (nccl-tests bus bandwidth)",
               compute.bandwidth_frames, show.bandwidth_tables, "bandwidth"),
    SectionRow(Section.PIPELINE, "Pipeline timeline and bubble vs the (p-1)/(v·m+p-1) ideal",
               compute.pipeline_frames, show.pipeline_tables, "pipeline"),
    SectionRow(Section.TOP_KERNELS, "Top kernels per category", compute.top_kernels_frames, show.top_kernels_tables,
               "top_kernels"),
    SectionRow(Section.OFFLOAD, compute.OFFLOAD_TITLE, compute.offload_frames, show.offload_tables, "offload"),
    SectionRow(Section.COMM_COVERAGE, "Communication coverage: ops without a communication kernel, and the reverse",
               compute.comm_coverage_frames, show.comm_coverage_tables, "coverage"),
)

assert [row.section for row in SECTIONS] == list(Section), "one row per Section, in its order"

#: Each section's title (a report shows ``section_title``: the offload one names the detected PCIe generation).
TITLES = {row.section: row.title for row in SECTIONS}
#: The display of each section: ``(sections, many ranks) -> [(table id, table of display strings), ...]``.
DISPLAYS = {row.section: row.display for row in SECTIONS}


def section_title(sec: ReportSections, section: Section) -> str:
    """The heading a report shows: ``TITLES[section]``, or the sections' own (the offload title names the
    detected PCIe generation)."""
    return sec.titles.get(section, TITLES[section])
