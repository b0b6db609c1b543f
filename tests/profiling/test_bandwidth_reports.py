"""The collective-bandwidth section in every report (Markdown, HTML, terminal, TensorBoard), busbw in the merged
trace's args, and the offload check's PCIe generation from the device name.

The real multi-rank trace is param's DLRM (eight Tesla V100-SXM2 ranks, NCCL all-reduce and all-to-all); every
number shown must be ``bandwidth_summary(collective_bandwidth(ts))``'s, written to the table's decimals."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from shardline.profiling import collective_bandwidth
from shardline.profiling.analyses.traffic import HOST_LINK_COLUMNS
from shardline.profiling.attribution.tables import fixed
from shardline.profiling.matching.bandwidth import bandwidth_summary, link_table
from shardline.profiling.present.display import bandwidth_text
from shardline.profiling.present.merge import merged_trace
from shardline.profiling.present.report_html import render_html
from shardline.profiling.present.report_md import render_markdown
from shardline.profiling.present.report_sections import TITLES, Section, offload_title, section_title


@pytest.fixture(scope="module")
def dlrm(dlrm_report):
    """The shared DLRM report (``conftest.dlrm_report``) with its bandwidth rows and their summary."""
    ts, sections = dlrm_report
    rows = collective_bandwidth(ts)
    return ts, sections, rows, bandwidth_summary(rows)


def _expected(summary: pd.DataFrame) -> dict[str, list[str]]:
    """The summary's numbers as the table writes them (``tables.fixed``: rounding of the frame's values)."""
    return {"category": summary["category"].tolist(), "size": summary["size_bucket"].tolist(),
            "calls": summary["calls"].astype(str).tolist(),
            "bytes_median": fixed(summary["bytes_median"], 0),
            "busbw_GB/s": fixed(summary["busbw_gbps_median"], 3),
            "algbw_GB/s": fixed(summary["algbw_gbps_median"], 3),
            "link_GB/s": fixed(summary["link_gbps"], 2), "verdict": summary["verdict"].tolist()}


def _check(table: pd.DataFrame, summary: pd.DataFrame) -> None:
    for column, values in _expected(summary).items():
        assert table[column].tolist() == values, column
    latency = summary["latency_bound"].to_numpy(dtype=bool)
    assert latency.any() and (~latency).any()  # the trace has both kinds of bucket
    assert (table["verdict"][latency] == "latency-bound").all()
    assert table["verdict"][~latency].str.endswith("% of peak").all()


def _md_table(pages, text: str, first_column: str) -> pd.DataFrame:
    for table in pages.md_tables(text):
        if table[0][:3] == [first_column, "dtype", "size"]:
            return pages.frame(table)
    raise AssertionError("no bandwidth table in the text")


def test_section_is_the_summary(dlrm):
    _ts, sec, _rows, summary = dlrm
    pd.testing.assert_frame_equal(sec.bandwidth, summary)
    assert set(summary["link"]) == {"nvlink2"}  # V100 SXM2, one node of eight


def test_markdown_and_html_show_the_summary(dlrm, pages):
    ts, sec, _rows, summary = dlrm
    text = render_markdown(sec)
    assert f"## {TITLES[Section.BANDWIDTH]}" in text
    _check(_md_table(pages, text, "category"), summary)
    doc = render_html(sec, events=ts.events)
    assert f'<section id="{Section.BANDWIDTH.value}">' in doc
    _check(pages.frame(pages.parse_html(doc).tables["bandwidth-table"]), summary)


def test_terminal_shows_the_summary(dlrm):
    _ts, sec, _rows, summary = dlrm
    text = bandwidth_text(sec)
    lines = text.splitlines()
    assert lines[1] == TITLES[Section.BANDWIDTH]
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["category", "dtype", "size"])
    body = lines[header + 1:header + 1 + len(summary)]
    for line, busbw, verdict in zip(body, fixed(summary["busbw_gbps_median"], 3), summary["verdict"]):
        assert f" {busbw} " in line and line.rstrip().endswith(verdict)


def test_tensorboard_shows_the_summary(dlrm, tmp_path, pages):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shardline.profiling.present.tensorboard import BANDWIDTH_TAG, write_tensorboard

    ts, _sec, _rows, summary = dlrm
    logdir = write_tensorboard(ts, logdir=tmp_path / "tb")
    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    text = acc.Tensors(BANDWIDTH_TAG)[0].tensor_proto.string_val[0].decode()
    _check(_md_table(pages, text, "category"), summary)
    window = json.loads(next((logdir / "plugins" / "shardline").glob("window_*.json")).read_text())
    assert [r["busbw_gbps_median"] for r in window["bandwidth"]] == summary["busbw_gbps_median"].tolist()


def test_merged_trace_args_carry_busbw(dlrm, tmp_path):
    ts, _sec, rows, _summary = dlrm
    doc = json.loads(merged_trace(ts, path=tmp_path / "merged.json").read_text())
    base = doc.get("baseTimeNanoseconds", 0)
    shown = {}
    for event in doc["traceEvents"]:
        args = event.get("args", {})
        if "busbw_gbps" in args:
            start = base + round(event["ts"] * 1000)  # three decimals of µs: exact ns
            shown[(event["pid"], event["name"], start)] = args
    assert len(shown) == len(rows) > 0
    for row in rows.itertuples(index=False):
        args = shown[(row.rank, row.name, row.start_ns)]
        assert args["busbw_gbps"] == row.busbw_gbps and args["algbw_gbps"] == row.algbw_gbps  # round-trip text
        assert args["link"] == row.link and args["efficiency"] == row.efficiency


@pytest.mark.parametrize(("name", "link", "gbps", "known"), [
    ("Tesla V100-SXM2-32GB", "pcie-gen3", 15.75, True),
    ("Tesla V100-PCIE-16GB", "pcie-gen3", 15.75, True),
    ("NVIDIA A100-SXM4-80GB", "pcie-gen4", 31.5, True),
    ("NVIDIA A100-PCIE-40GB", "pcie-gen4", 31.5, True),
    ("NVIDIA H100 80GB HBM3", "pcie-gen5", 63.0, True),
    ("NVIDIA H100 PCIe", "pcie-gen5", 63.0, True),
    ("NVIDIA B200", "pcie-gen5", 63.0, True),
    ("AMD Radeon Graphics", "pcie-gen5", 63.0, False),
    ("", "pcie-gen5", 63.0, False),
])
def test_pcie_generation_per_device_name(name, link, gbps, known):
    got, rule = link_table().host_link(name)
    assert (got.name, got.gbps, rule) == (link, gbps, known)


def test_offload_uses_the_detected_generation(dlrm):
    _ts, sec, _rows, _summary = dlrm
    assert section_title(sec, Section.OFFLOAD) == "Offload traffic (H2D / D2H) vs the PCIe Gen3 x16 limit"
    assert "Tesla V100-SXM2-32GB" in sec.notes[Section.OFFLOAD]
    o = sec.offload
    assert (o["link"] == "pcie-gen3").all() and (o["link_gbps"] == 15.75).all()
    np.testing.assert_allclose(o["of_limit"], o["achieved_gbps"] / 15.75, rtol=1e-12)
    assert "## Offload traffic (H2D / D2H) vs the PCIe Gen3 x16 limit" in render_markdown(sec)


def test_unknown_device_assumes_gen5_and_says_so():
    links = pd.DataFrame([(0, "", "pcie-gen5", 63.0, False), (1, "Mystery GPU", "pcie-gen5", 63.0, False)],
                         columns=list(HOST_LINK_COLUMNS))
    title, note = offload_title(links)
    assert title == TITLES[Section.OFFLOAD] == "Offload traffic (H2D / D2H) vs the PCIe Gen5 x16 limit"
    assert "assumed" in note and "'Mystery GPU'" in note and "names no GPU" in note
    mixed = pd.DataFrame([(0, "NVIDIA A100-SXM4-80GB", "pcie-gen4", 31.5, True),
                          (1, "NVIDIA H100 80GB HBM3", "pcie-gen5", 63.0, True)], columns=list(HOST_LINK_COLUMNS))
    assert offload_title(mixed)[0] == "Offload traffic (H2D / D2H) vs the PCIe Gen4/PCIe Gen5 x16 limits"


def test_terminal_text_without_the_other_sections(dlrm):
    from shardline.profiling.present.display import bandwidth_terminal

    ts, sec, _rows, _summary = dlrm
    assert bandwidth_terminal(ts) == bandwidth_text(sec)
