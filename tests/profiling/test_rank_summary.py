"""Many-rank distributions (``shardline.profiling.analyses.rank_summary``) against values computed by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest


def _breakdown(values: dict[int, list[int]], *, column: str = "all_reduce") -> pd.DataFrame:
    """A breakdown-shaped table: rank r has one row per step with ``column`` = values[r][k], step time 1 ms
    more than it, the rest zero."""
    from shardline.profiling.attribution.core import empty_breakdown

    rows = []
    for rank, per_step in values.items():
        for step, v in enumerate(per_step):
            rows.append({"rank": rank, "step": step, column: v, "compute": 1_000_000, "step_ns": v + 1_000_000})
    frame = pd.DataFrame(rows)
    for c in empty_breakdown().columns:
        if c not in frame:
            frame[c] = 0
    return frame


def test_category_distribution_is_the_quantiles_of_per_rank_means():
    from shardline.profiling.analyses.rank_summary import category_distribution

    # 40 ranks; rank r's all_reduce steps are (r, 3r) µs -> mean 2r µs; rank 39 the worst, then 38, 37.
    table = _breakdown({r: [1000 * r, 3000 * r] for r in range(40)})
    got = category_distribution(table).set_index("column")
    means = 2000.0 * np.arange(40)
    row = got.loc["all_reduce"]
    assert row["ranks"] == 40
    assert row["median_ns"] == pytest.approx(np.percentile(means, 50)) == pytest.approx(39_000)
    assert row["p90_ns"] == pytest.approx(0.9 * 39 * 2000)  # linear interpolation over 40 sorted values
    assert row["max_ns"] == 78_000
    assert row["worst_ranks"] == "r39 (78 µs), r38 (76 µs), r37 (74 µs)"
    step_median = np.median(means + 1_000_000)
    assert row["share_of_step"] == pytest.approx(39_000 / step_median)
    assert "idle" not in got.index  # no time on any rank: no row
    assert got.loc["compute", "median_ns"] == 1_000_000


def test_collective_distribution_groups_and_names_who_waited():
    from shardline.profiling.analyses.rank_summary import collective_distribution

    matched = pd.DataFrame({
        "rank": [0, 1, 2, 0, 1, 2, 0, 1],
        "group": ["tp0"] * 6 + ["dp"] * 2,
        "category": ["all_reduce"] * 6 + ["reduce_scatter"] * 2,
        "dim": ["tp"] * 6 + ["dp"] * 2,
        "wait_ns": [500, 0, 100, 700, 0, 100, 5_000, 0],
        "transfer_ns": [10, 10, 10, 20, 20, 20, 300, 300]})
    got = collective_distribution(matched)
    assert list(got["group"]) == ["dp", "tp0"]  # the longest wait first
    tp = got.set_index("group").loc["tp0"]
    waits = np.array([1200.0, 0.0, 200.0])  # per rank, summed over its calls
    assert tp["calls_per_rank"] == 2 and tp["ranks"] == 3 and tp["dim"] == "tp"
    assert tp["wait_median_ns"] == 200 and tp["wait_max_ns"] == 1200
    assert tp["wait_p90_ns"] == pytest.approx(np.percentile(waits, 90))
    assert tp["transfer_median_ns"] == 30
    assert tp["worst_ranks"] == "r0 (1.2 µs), r2 (0.2 µs)"  # rank 1 never waited: the late one


@pytest.mark.parametrize("fmt, marker", [("text", "Per category"), ("md", "| column |"), ("html", "<table")])
def test_render_every_format(fmt, marker):
    from shardline.profiling.analyses.rank_summary import (
        category_distribution,
        collective_distribution,
        render,
    )

    table = _breakdown({r: [1000 * r] for r in range(5)})
    matched = pd.DataFrame({"rank": [0, 1], "group": ["g|1", "g|1"], "category": ["all_reduce"] * 2,
                            "wait_ns": [5, 0], "transfer_ns": [1, 1]})
    text = render(category_distribution(table), collective_distribution(matched), fmt=fmt, title="job <x>")
    assert marker in text and "all_reduce" in text and "r4 (4 µs)" in text
    if fmt == "md":
        assert "g\\|1" in text  # a pipe in a group name does not break the table
    if fmt == "html":
        assert "job &lt;x&gt;" in text


def test_bad_tables_are_our_errors():
    from shardline.profiling.analyses.rank_summary import (
        category_distribution,
        collective_distribution,
        render,
    )
    from shardline.profiling.base.errors import ProfilingError

    with pytest.raises(ProfilingError, match="no column"):
        category_distribution(pd.DataFrame({"rank": [0]}))
    with pytest.raises(ProfilingError, match="wait_ns"):
        collective_distribution(pd.DataFrame({"rank": [0], "group": ["g"], "category": ["x"]}))
    with pytest.raises(ProfilingError, match="fmt='pdf'"):
        render(pd.DataFrame(), fmt="pdf")


def test_reports_of_many_ranks_show_distributions_in_every_format(jobs, tmp_path, capsys):
    # 40 ranks (tp2 x pp4 x dp5): past MANY_RANKS, the terminal, Markdown and HTML reports give distributions
    # over the ranks instead of a row per rank and step; csv keeps every rank's rows. One set of report
    # sections renders all three (as the CLI does per format).
    from shardline.profiling import load
    from shardline.profiling.analyses.rank_summary import MANY_RANKS
    from shardline.profiling.attribution.core import attribute
    from shardline.profiling.present.cli import _per_rank_or_distribution, main
    from shardline.profiling.present.report_html import render_html
    from shardline.profiling.present.report_md import render_markdown
    from shardline.profiling.present.report_sections import report_sections

    folder = tmp_path / "job"
    truth = jobs.write_job(folder, tp=2, pp=4, dp=5, steps=1, micro_batches=2, layers_per_stage=1)
    assert truth["world"] == 40 > MANY_RANKS
    ts = load(folder)
    attribution = attribute(ts)
    sections = report_sections(attribution, traceset=ts)
    md = render_markdown(sections)
    assert "| column | ranks | median | p90 | max | share of step | worst ranks |" in md
    assert "| compute | 40 |" in md
    assert "| group | dim | category | ranks |" in md  # per communication group
    assert "| dim | ranks | comm median |" in md  # per parallel dimension
    assert "| method | stage | column | ranks |" in md  # the pipeline bubbles, per stage
    assert "| launch_delay_median_ns | 40 |" in md  # the launch statistics
    assert "\n| rank |" not in md  # no table with a row per rank
    page = render_html(sections, events=attribution)
    assert "breakdown-distribution-table" in page and "collective-distribution-table" in page
    assert "breakdown-table" not in page.replace("breakdown-distribution-table", "")
    from shardline.profiling.present import plots

    png = plots.breakdown_figure(attribution.breakdown)  # the ranks sorted by step time, not a bar per row
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 10 * plots._DPI
    text = _per_rank_or_distribution(attribution.breakdown, sections)
    assert "40 ranks: distributions over the ranks" in text and "Per communication group" in text
    assert main(["profile", "report", str(folder), "-o", str(tmp_path / "b.csv")]) == 0
    assert len(pd.read_csv(tmp_path / "b.csv")) == 40  # one step: a row per rank
