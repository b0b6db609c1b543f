"""The report's section registry: one row per section, and a section's frames need no declaration."""

from __future__ import annotations

import pandas as pd
import pytest

from shardline.profiling.present.registry import SECTIONS
from shardline.profiling.present.sections import ReportSections, Section

DECLARED = ("breakdown", "comm_by_dim", "wait_transfer", "stragglers", "bubbles", "top_kernels", "offload")


def test_every_section_has_one_row_in_order():
    assert [row.section for row in SECTIONS] == list(Section)
    assert len({row.stage for row in SECTIONS}) == len(SECTIONS)


def test_frames_a_section_does_not_declare_are_read_as_attributes():
    frames = {name: pd.DataFrame({"x": [i]}) for i, name in enumerate(DECLARED)}
    new = pd.DataFrame({"tokens_per_expert": [3, 5]})
    sections = ReportSections.of({**frames, "expert_load": new}, notes={Section.BREAKDOWN: "n"})
    assert sections.expert_load is new and sections.extra == {"expert_load": new}
    assert sections.breakdown is frames["breakdown"] and "breakdown" not in sections.extra
    later = sections.with_frames({"router_stats": new, "findings": new}, timings={"x": 1.0})
    assert later.router_stats is new and later.expert_load is new and later.findings is new
    assert later.timings == {"x": 1.0} and later.notes == {Section.BREAKDOWN: "n"}
    with pytest.raises(AttributeError, match="no frame 'missing'"):
        _ = later.missing
