"""The one breakdown table renderer and the text helpers every output shares (terminal, Markdown, HTML,
TensorBoard's text tab, the ``StepProfiler`` report).

``breakdown_table(bd, style=...)`` chooses the columns a breakdown table shows -- rank, step, the step time,
every exclusive part that is non-zero somewhere (they sum to the step time), then the overlap ratio -- and
writes each number as its ``TableStyle`` says; the outputs differ only in that style and in the frame around
the table (``pipe_table`` for Markdown, ``DataFrame.to_string`` for a terminal, ``<table>`` for HTML).

Display numbers: ``ms_text`` writes integer ns as ms exactly (six decimals, so a value times 10^6 is the
frame's integer ns); ``fixed`` rounds to the stated decimals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..table.partition import EXCLUSIVE_COLUMNS


def ms_text(ns) -> np.ndarray:
    """Integer ns -> ms as exact decimal text with six decimals (``1234567`` -> ``"1.234567"``)."""
    ns = np.asarray(ns, dtype=np.int64)
    sign = np.where(ns < 0, "-", "").astype(object)
    mag = np.abs(ns)
    frac = pd.Series((mag % 1_000_000).astype(str)).str.zfill(6).to_numpy(dtype=object)
    return sign + (mag // 1_000_000).astype(str).astype(object) + "." + frac


def fixed(values, digits: int, *, nan: str = "") -> list[str]:
    """Each value with ``digits`` decimals; ``nan`` for a missing one."""
    return [nan if pd.isna(v) else f"{v:.{digits}f}" for v in values]


def rounded_ms(digits: int) -> Callable[[pd.Series], list[str]]:
    """A ``TableStyle.ms`` that writes ns as ms rounded to ``digits`` decimals."""
    return lambda ns: fixed(np.asarray(ns) / 1e6, digits)


@dataclass(frozen=True)
class TableStyle:
    """How a breakdown table writes its cells: ``ms`` turns an ns column into texts (or into float ms, for a
    frame that ``DataFrame.to_string`` formats: then ``text=False`` keeps rank and step numbers too),
    ``unit`` follows each time column's name (``"_ms"`` / ``" ms"``), ``overlap`` names the overlap column
    (in %, ``overlap_digits`` decimals, ``nan`` where a step has no communication); ``lanes`` and ``comm``
    add those columns."""

    ms: Callable[[pd.Series], list]
    text: bool = True
    unit: str = "_ms"
    overlap: str = "overlap_%"
    overlap_digits: int = 1
    nan: str = ""
    lanes: bool = False
    comm: bool = False


#: The report's table (HTML and Markdown): exact ms, the lanes and the union of communication.
REPORT = TableStyle(ms=ms_text, overlap_digits=2, lanes=True, comm=True)
#: The terminal's table (``shardline profile report``, the ``StepProfiler`` report): float ms, which
#: ``to_string`` writes to the µs (``TERMINAL_FLOAT``), numbers aligned as pandas aligns them.
TERMINAL = TableStyle(ms=lambda ns: np.asarray(ns) / 1e6, text=False, nan="nan", lanes=True)
TERMINAL_FLOAT = "{:.3f}".format


def tensorboard_style(digits: int) -> TableStyle:
    """TensorBoard's text tab: ms to ``digits`` decimals, headers with a space before the unit."""
    return TableStyle(ms=rounded_ms(digits), unit=" ms", overlap="overlap %")


def shown_parts(bd: pd.DataFrame) -> list[str]:
    """The exclusive columns that are non-zero in some row (the parts a table or chart shows)."""
    return [c for c in EXCLUSIVE_COLUMNS if (bd[c] != 0).any()]


def breakdown_table(bd: pd.DataFrame, *, style: TableStyle) -> pd.DataFrame:
    """The breakdown ``bd`` as display strings, one row per (rank, step) in its order (see the module doc)."""
    rank, step = bd["rank"].astype(np.int64).to_numpy(), bd["step"].astype(np.int64).to_numpy()
    table = pd.DataFrame({"rank": rank.astype(str) if style.text else rank,
                          "step": step.astype(str) if style.text else step})
    if style.lanes:
        table["lanes"] = bd["lanes"].astype(str).to_numpy()
    table[f"step{style.unit}"] = style.ms(bd["step_ns"])
    for column in shown_parts(bd):
        table[f"{column}{style.unit}"] = style.ms(bd[column])
    if style.comm:
        table[f"comm{style.unit}"] = style.ms(bd["comm_ns"])
    table[style.overlap] = fixed(100 * bd["overlap_ratio"].to_numpy(), style.overlap_digits, nan=style.nan)
    return table


def pipe_table(table: pd.DataFrame, *, right_aligned: bool = False) -> str:
    """A GitHub-flavoured pipe table of display strings (``|`` in a cell is escaped); ``right_aligned``
    marks every column right-aligned (``---:``)."""
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    rule = "---:" if right_aligned else "---"
    lines = ["| " + " | ".join(cell(c) for c in table.columns) + " |",
             "|" + "|".join(rule for _ in table.columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)
