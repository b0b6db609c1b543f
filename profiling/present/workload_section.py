"""The report's workload section: what kind of job the trace records and from what (``table.workload``),
computed first so the report leads with it and the findings' advice fits it."""

from __future__ import annotations

import pandas as pd

from ..table.workload import detect_workload
from .sections import Inputs, ReportSections, Section


def workload_frames(inputs: Inputs) -> dict:
    """``detect_workload`` of the attribution's events; its one-line description as the section's note."""
    workload = detect_workload(inputs.attribution.events)
    inputs.notes[Section.WORKLOAD] = lead_line(workload)
    return {"workload": workload}


def lead_line(workload) -> str:
    """The workload in one line, with the all-to-all's use where the trace has any ("" without a workload)."""
    if workload is None:
        return ""
    extra = workload.all_to_all_text()
    return workload.describe() + (f"; {extra}" if extra else "")


def workload_tables(sec: ReportSections, _many: bool) -> list[tuple[str, pd.DataFrame]]:
    """One row per signal that matched: the kind it supports, how many events, the names (the first few)."""
    workload = sec.workload
    if workload is None or not workload.evidence:
        return []
    rows = [{"kind": workload.kind.value, "signal": e.label, "events": str(e.events), "names": ", ".join(e.names)}
            for e in workload.evidence]
    rows += [{"kind": "all-to-all", "signal": f"{use.value}", "events": str(n), "names": ""}
             for use, n in workload.all_to_all_calls]
    return [("workload-table", pd.DataFrame(rows, columns=["kind", "signal", "events", "names"]))]
