"""The display tables of a report's sections (the strings HTML, Markdown and the terminal show), from the
``ReportSections`` frames, by each section's display function (``registry.SECTIONS``): numbers are formatted
there, never recomputed."""

from __future__ import annotations

import pandas as pd

from ..analyses import rank_summary
from ..attribution.core import attribute
from .compute import bandwidth_section
from .registry import SECTIONS, TITLES
from .section_displays import bandwidth_table
from .sections import ReportSections, Section, is_traceset
from .workload_section import lead_line as _workload_line

__all__ = ["bandwidth_table", "bandwidth_terminal", "bandwidth_text", "display_tables", "lead_line"]


def lead_line(sec: ReportSections) -> str:
    """The report's first line: the detected workload and what it was detected from ("" without one)."""
    return _workload_line(sec.workload)


def display_tables(sec: ReportSections) -> dict[Section, list[tuple[str, pd.DataFrame]]]:
    """Per section, its (table id, table of display strings) pairs; empty list where the section has no data."""
    # Beyond a few dozen ranks a row per rank is unreadable: those tables become distributions over the ranks
    # (median, p90, max, the worst ranks by name); the per-rank tables stay in csv/parquet (``report``).
    many = bool(len(sec.breakdown) and sec.breakdown["rank"].nunique() > rank_summary.MANY_RANKS)
    return {row.section: row.display(sec, many) for row in SECTIONS}


def bandwidth_text(sec: ReportSections) -> str:
    """The bandwidth section for the terminal: its title, note and table (plain columns); "" without calls."""
    return _bandwidth_lines(sec.bandwidth, sec.notes.get(Section.BANDWIDTH))


def bandwidth_terminal(source, *, traceset=None) -> str:
    """``bandwidth_text`` of ``source`` (an ``Attribution``, ``TraceSet`` or events table) without the other
    sections: for the terminal report, which shows the breakdown. ``traceset`` as in ``report_sections``."""

    attribution = attribute(source, caller="bandwidth_terminal")
    if traceset is None and is_traceset(source):
        traceset = source
    notes: dict[Section, str] = {}
    return _bandwidth_lines(bandwidth_section(attribution, traceset, notes), notes.get(Section.BANDWIDTH))


def _bandwidth_lines(summary: pd.DataFrame, note: str | None) -> str:
    if summary.empty:
        return ""
    return "\n".join(["", TITLES[Section.BANDWIDTH], *([note] if note else []),
                      bandwidth_table(summary).to_string(index=False), ""])
