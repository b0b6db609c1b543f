"""Self-contained HTML report: one file, inline CSS, figures inlined as base64 PNG, no script, no external URL.

Sections (``report_sections.Section``, each an ``<section id=...>`` with an ``<h2>``): the stacked breakdown per
rank and step, communication per parallel dimension, collective wait/transfer with stragglers, collective
bandwidth against the link's limit, the pipeline timeline with bubble vs ideal, the top kernels per category and
the offload traffic. Tables carry the display strings of ``report_sections.display_tables`` (each
``<table id=...>``), so the numbers are the frames'.
"""

from __future__ import annotations

import base64
import html

import pandas as pd

from . import plots
from .display import display_tables
from .registry import SECTIONS, section_title
from .sections import ReportSections, Section

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f3f3f3; } td.text { text-align: left; max-width: 50em; overflow-wrap: anywhere; }
.note { color: #666; font-style: italic; } img { max-width: 100%; }
"""


def html_table(table: pd.DataFrame, *, table_id: str) -> str:
    """An HTML table of display strings; numeric-looking cells are right-aligned, text left."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    rows = []
    for row in table.itertuples(index=False):
        cells = []
        for value in row:
            text = str(value)
            numeric = text.replace(".", "", 1).replace("-", "", 1).isdigit() or text == ""
            cells.append(f"<td>{html.escape(text)}</td>" if numeric else f'<td class="text">{html.escape(text)}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<table id="{html.escape(table_id)}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


def _img(png: bytes, *, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def _figures(sec: ReportSections, events) -> dict[Section, str]:
    figures = {Section.BREAKDOWN: _img(plots.breakdown_figure(sec.breakdown), alt="stacked breakdown")}
    if len(sec.comm_by_dim):
        figures[Section.COMM_BY_DIM] = _img(plots.comm_by_dim_figure(sec.comm_by_dim), alt="communication by dim")
    if events is not None and len(sec.bubbles):
        figures[Section.PIPELINE] = _img(plots.pipeline_timeline_figure(_timeline_source(sec, events)),
                                         alt="pipeline timeline")
    return figures


def _timeline_source(sec: ReportSections, events):
    """The sections' own attribution when ``events`` is its table (or its trace set): nothing is surveyed
    again; else ``events`` itself."""
    attribution = sec.attribution
    if attribution is not None and (events is attribution
                                    or getattr(events, "events", events) is attribution.events):
        return attribution
    return events


def render_html(sec: ReportSections, *, events=None, title: str = "shardline profile report",
                sources: tuple[str, ...] = ()) -> str:
    """The report as one HTML document. ``events`` (the table, trace set or attribution the sections came
    from) draws the pipeline timeline; ``sources`` lists the input files in the header."""
    tables = display_tables(sec)
    sections = [row.section for row in SECTIONS]
    figures = _figures(sec, events)
    body = [f"<h1>{html.escape(title)}</h1>"]
    if sources:
        body.append("<p>" + "<br>".join(html.escape(s) for s in sources) + "</p>")
    body.append("<nav><ul>" + "".join(f'<li><a href="#{s.value}">{html.escape(section_title(sec, s))}</a></li>'
                                      for s in sections) + "</ul></nav>")
    for section in sections:
        parts = [f'<section id="{section.value}"><h2>{html.escape(section_title(sec, section))}</h2>']
        if section in sec.notes:
            parts.append(f'<p class="note">{html.escape(sec.notes[section])}</p>')
        if section in figures:
            parts.append(figures[section])
        parts += [html_table(table, table_id=table_id) for table_id, table in tables[section]]
        parts.append("</section>")
        body.append("\n".join(parts))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")
