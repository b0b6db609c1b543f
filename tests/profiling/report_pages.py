"""Reading a rendered report back for the report tests: the tables of an HTML page (by ``id``, as header and rows of
cell texts) and of a Markdown text. Loaded by path from conftest (the tests run in importlib mode) and handed out as
the ``pages`` fixture."""

from __future__ import annotations

from html.parser import HTMLParser

import pandas as pd


class Tables(HTMLParser):
    """Collects every <table id=...> as a header list and rows of cell texts, plus section ids and URLs."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.sections: list[str] = []
        self.urls: list[str] = []
        self.tags: set[str] = set()
        self._table = None
        self._cell = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.add(tag)
        self.urls += [v for k, v in attrs.items() if k in ("src", "href") and v]
        if tag == "section":
            self.sections.append(attrs.get("id"))
        elif tag == "table":
            self._table = self.tables.setdefault(attrs["id"], [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._table[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def parse_html(text: str) -> Tables:
    parser = Tables()
    parser.feed(text)
    return parser


def frame(rows: list[list[str]]) -> pd.DataFrame:
    """A table's rows (header first) as a frame of texts."""
    return pd.DataFrame(rows[1:], columns=rows[0])


def md_tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table of ``text`` (a block of ``| `` lines), as rows of cell texts, header first."""
    blocks = [b for b in text.split("\n\n") if b.startswith("| ")]
    return [[[c.strip() for c in line.strip("|").split(" | ")] for line in b.splitlines()
             if not line.startswith("|---")] for b in blocks]
