"""Markdown report: the same tables as the HTML report (``display.display_tables``), the sections as the registry
(``registry.SECTIONS``) lists them, no figures."""

from __future__ import annotations

from ..attribution.tables import pipe_table
from .display import display_tables, lead_line
from .registry import SECTIONS, section_title
from .sections import ReportSections


def render_markdown(sec: ReportSections, *, title: str = "shardline profile report") -> str:
    """The detected workload's line, then every section with its tables (or its note when it has none), in the
    registry's order."""
    tables = display_tables(sec)
    out = [f"# {title}", ""]
    if lead := lead_line(sec):
        out += [f"**{lead}**", ""]
    for section in (row.section for row in SECTIONS):
        out += [f"## {section_title(sec, section)}", ""]
        if section in sec.notes:
            out += [f"_{sec.notes[section]}_", ""]
        for _table_id, table in tables[section]:
            out += [pipe_table(table), ""]
    return "\n".join(out)
