"""Markdown report: the same tables as the HTML report (``report_sections.display_tables``), no figures."""

from __future__ import annotations

import pandas as pd

from shardline.profiling.report_sections import TITLES, ReportSections, Section, display_tables


def markdown_table(table: pd.DataFrame) -> str:
    """A GitHub-flavoured pipe table of display strings (``|`` in a cell is escaped)."""
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in table.columns) + " |",
             "|" + "|".join("---" for _ in table.columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def render_markdown(sec: ReportSections, *, title: str = "shardline profile report") -> str:
    """Every section with its tables (or its note when it has none), in ``Section`` order."""
    tables = display_tables(sec)
    out = [f"# {title}", ""]
    for section in Section:
        out += [f"## {TITLES[section]}", ""]
        if section in sec.notes:
            out += [f"_{sec.notes[section]}_", ""]
        for _table_id, table in tables[section]:
            out += [markdown_table(table), ""]
    return "\n".join(out)
