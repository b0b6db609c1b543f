"""``write_tensorboard``: event files read back with TensorBoard's own reader hold exactly the breakdown.

Synthetic traces with exact ground truth (``synthetic_traces``), written as Kineto files and loaded through
the real ``load``; tier 0 (no torch)."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2

from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, breakdown
from shardline.profiling.present.tensorboard import PLUGIN_NAME, TensorBoardError, write_tensorboard
from shardline.profiling.table.load import load

SIZE_GUIDANCE = {"scalars": 0, "images": 0, "tensors": 0}  # 0 = keep everything


def _accumulator(folder):
    acc = EventAccumulator(str(folder), size_guidance=SIZE_GUIDANCE)
    acc.Reload()
    return acc


@pytest.fixture
def zero_tp_traces(synth, tmp_path):
    """Two ranks of the ZeRO x TP x offload step, rank 1 shifted by 1 ms."""
    rows = []
    for rank in (0, 1):
        step_rows, truth = synth.zero_tp_offload(rank, t0=1_000_000 + rank * 1_000_000)
        rows += step_rows
    synth.write_kineto(rows, tmp_path / "traces")
    return load(tmp_path / "traces"), truth


def test_scalars_equal_the_breakdown_per_rank_and_step(zero_tp_traces, tmp_path):
    traceset, truth = zero_tp_traces
    logdir = write_tensorboard(traceset, logdir=tmp_path / "tb", step_offset=100)
    table = breakdown(traceset)
    for rank in (0, 1):
        acc = _accumulator(logdir / f"rank{rank}")
        tags = set(acc.Tags()["scalars"])
        shown = {c for c in EXCLUSIVE_COLUMNS if (table[c] != 0).any()}
        assert {f"step_time_ms/{c}" for c in shown} | {"step_time_ms/total"} <= tags
        assert not {f"step_time_ms/{c}" for c in set(EXCLUSIVE_COLUMNS) - shown} & tags
        row = table[table["rank"] == rank].iloc[0]
        for column in shown:
            (event,) = acc.Scalars(f"step_time_ms/{column}")
            assert event.step == 100 + 3  # ProfilerStep#3 + step_offset
            # float32 in the event file: relative 1e-7 of the ms value
            assert event.value == pytest.approx(row[column] / 1e6, rel=1e-6)
        assert acc.Scalars("step_time_ms/total")[0].value == pytest.approx(truth["step_ns"] / 1e6, rel=1e-6)
        # The paper truth of the scenario, through the event file: exposed and overlapped all-gather.
        assert acc.Scalars("exposed_ms/all_gather")[0].value == pytest.approx(truth["all_gather"] / 1e6, rel=1e-6)
        assert acc.Scalars("overlapped_ms/all_gather")[0].value == pytest.approx(
            truth["overlapped_all_gather"] / 1e6, rel=1e-6)
        assert acc.Scalars("overlap_ratio")[0].value == pytest.approx(
            truth["overlap_ratio_num"] / truth["comm_ns"], rel=1e-6)


def test_root_run_has_layout_table_hparams_and_spread(zero_tp_traces, tmp_path):
    traceset, truth = zero_tp_traces
    layout = {"tp": 2, "pp": 1, "dp": 1, "cp": 1, "sp": "none", "zero_stage": 2, "micro_batches": None}
    logdir = write_tensorboard(traceset, logdir=tmp_path / "tb", layout=layout)
    acc = _accumulator(logdir)
    tensors = set(acc.Tags()["tensors"])
    assert {"custom_scalars__config__", "breakdown/table"} <= tensors
    hparams = acc.PluginTagToContent("hparams")
    assert set(hparams) == {"_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info"}

    config = layout_pb2.Layout()
    config.ParseFromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = [chart for category in config.category for chart in category.chart]
    assert all(chart.WhichOneof("content") in ("multiline", "margin") for chart in charts)
    assert any(chart.WhichOneof("content") == "margin" for chart in charts)
    regexes = [t for chart in charts if chart.WhichOneof("content") == "multiline" for t in chart.multiline.tag]
    assert "^step_time_ms/" in regexes and "^exposed_ms/" in regexes

    markdown = acc.Tensors("breakdown/table")[0].tensor_proto.string_val[0].decode()
    assert markdown.count("\n| 0 |") == 1 and markdown.count("\n| 1 |") == 1
    assert f"| {truth['step_ns'] / 1e6:.6f} |" in markdown and "all_gather ms" in markdown  # 650 ns: 6 decimals

    start = plugin_data_pb2.HParamsPluginData.FromString(hparams["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["tp"].number_value == 2 and start.hparams["zero_stage"].number_value == 2
    assert start.hparams["sp"].string_value == "none"
    assert "micro_batches" not in start.hparams  # None values are left out, as add_hparams does
    assert start.hparams["world_size"].number_value == 2
    (metric,) = acc.Scalars("hparams/step_time_ms")
    assert metric.value == pytest.approx(truth["step_ns"] / 1e6, rel=1e-6)
    for stat in ("mean", "min", "max"):  # both ranks have the same step time here
        assert acc.Scalars(f"step_time_over_ranks_ms/{stat}")[0].value == pytest.approx(
            truth["step_ns"] / 1e6, rel=1e-6)


def test_plugin_data_lists_window_and_traces(zero_tp_traces, tmp_path):
    traceset, _ = zero_tp_traces
    logdir = write_tensorboard(traceset, logdir=tmp_path / "tb", step_offset=10)
    write_tensorboard(traceset, logdir=logdir, step_offset=20)  # a second window appends
    folder = logdir / "plugins" / PLUGIN_NAME
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [w["first_step"] for w in manifest["windows"]] == [13, 23]
    window = json.loads((folder / manifest["windows"][0]["data"]).read_text())
    table = breakdown(traceset)
    assert len(window["breakdown"]) == len(table)
    for record, (_, row) in zip(window["breakdown"], table.sort_values(["rank", "step"]).iterrows()):
        assert record["step"] == row["step"] + 10
        assert all(record[c] == row[c] for c in EXCLUSIVE_COLUMNS)  # integer ns, exact
        assert (record["overlap_ratio"] is None) == math.isnan(row["overlap_ratio"])
    merged = [t for t in manifest["windows"][0]["traces"] if t["kind"] == "merged"]
    assert len(merged) == 1 and json.loads(gzip.decompress((logdir / merged[0]["path"]).read_bytes()))["traceEvents"]
    raw = [t for t in manifest["windows"][0]["traces"] if t["kind"] == "raw"]
    assert sorted(t["label"] for t in raw) == ["rank 0", "rank 1"]
    for trace in raw:  # traces outside the logdir are copied in; the manifest path is logdir-relative
        assert (logdir / trace["path"]).is_file() and ".." not in trace["path"]


def test_pipeline_trace_records_pp_and_bubbles(synth, tmp_path):
    rows, truth = synth.one_f_one_b(2, 4, t0=1_000_000)
    synth.write_kineto(rows, tmp_path / "pp")
    logdir = write_tensorboard(load(tmp_path / "pp"), logdir=tmp_path / "tb")
    acc = _accumulator(logdir)
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert start.hparams["pp"].number_value == 2 and start.hparams["micro_batches"].number_value == 4
    manifest = json.loads((logdir / "plugins" / PLUGIN_NAME / "manifest.json").read_text())
    window = json.loads((logdir / "plugins" / PLUGIN_NAME / manifest["windows"][0]["data"]).read_text())
    assert [b["bubble_ns"] for b in window["bubbles"]] == [truth["bubble_ns"]] * 2
    assert window["bubbles"][0]["ideal_fraction"] == pytest.approx(truth["fraction"])
    bubble = _accumulator(logdir / "rank1").Scalars("step_time_ms/bubble")[0].value
    assert bubble == pytest.approx(truth["bubble_ns"] / 1e6, rel=1e-6)


def test_stacked_and_pipeline_images(zero_tp_traces, synth, tmp_path):
    traceset, _ = zero_tp_traces
    acc = _accumulator(write_tensorboard(traceset, logdir=tmp_path / "tb"))
    (image,) = acc.Images("breakdown/stacked")
    assert image.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n" and image.width > 100
    rows, _ = synth.one_f_one_b(2, 3, t0=1_000_000)
    synth.write_kineto(rows, tmp_path / "pp")
    acc = _accumulator(write_tensorboard(load(tmp_path / "pp"), logdir=tmp_path / "tb_pp"))
    assert len(acc.Images("breakdown/pipeline_timeline")) == 1


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"step_offset": 1.5}, "step_offset=1.5"),
    ({"layout": [2, 1]}, r"layout=\[2, 1\]"),
    ({"layout": {"tp": 0}}, r"layout\['tp'\]=0"),
    ({"layout": {"tp": 2, "odd": object}}, r"layout\['odd'\]"),
])
def test_bad_arguments_are_named(zero_tp_traces, tmp_path, kwargs, fragment):
    traceset, _ = zero_tp_traces
    with pytest.raises(TensorBoardError, match=fragment):
        write_tensorboard(traceset, logdir=tmp_path / "tb", **kwargs)


def test_not_a_traceset_is_named(tmp_path):
    with pytest.raises(TensorBoardError, match="got ndarray"):
        write_tensorboard(np.zeros(3), logdir=tmp_path)


def test_module_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import shardline.profiling.present.tensorboard as t; "
            "import shardline.profiling.present.tb_plugin; "
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m]]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
