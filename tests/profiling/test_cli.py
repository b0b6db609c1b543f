"""`shardline profile report`: formats carry breakdown's numbers unchanged; errors are one line and status 2."""

from __future__ import annotations

import io
import json

import pandas as pd
import pytest

from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, breakdown
from shardline.profiling.present.cli import main


@pytest.fixture(scope="module")
def trace_folder(tmp_path_factory, synth):
    a, _ = synth.zero_tp_offload(rank=0)
    b, _ = synth.zero_tp_offload(rank=1, t0=2_000_000)
    folder = tmp_path_factory.mktemp("run")
    synth.write_kineto(a + b, folder, world=2)
    return folder


def test_csv_is_the_breakdown_in_integer_ns(trace_folder, capsys):
    assert main(["profile", "report", str(trace_folder), "--format", "csv"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert table["rank"].tolist() == [0, 1]
    # The hand-worked truth of zero_tp_offload, through file writing, loading, classifying and attributing.
    assert table[["compute", "all_gather", "reduce_scatter", "memcpy_h2d", "idle"]].values.tolist() == \
        [[350, 50, 60, 60, 50]] * 2
    assert (table[list(EXCLUSIVE_COLUMNS)].sum(axis=1) == table["step_ns"]).all()


def test_json_to_file_and_table_on_terminal(trace_folder, tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["profile", "report", str(trace_folder), "--format", "json", "-o", str(out)]) == 0
    assert capsys.readouterr().out == ""
    records = json.loads(out.read_text())
    assert [r["step_ns"] for r in records] == [650, 650]
    assert records[0]["overlap_ratio"] == pytest.approx(70 / 220, abs=1e-12)

    assert main(["profile", "report", str(trace_folder)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert "compute_ms" in lines[1] and "all_gather_ms" in lines[1] and "broadcast_ms" not in lines[1]
    assert lines[2].split()[:5] == ["0", "3", "gpu", "0.001", "0.000"]  # 650 ns = 0.00065 ms -> "0.001"
    assert lines[2].split()[-1] == f"{100 * 70 / 220:.1f}"


def test_missing_path_is_one_error_line_and_status_2(tmp_path, capsys):
    assert main(["profile", "report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardline profile report: error:") and "nope" in err and len(err.splitlines()) == 1


def test_real_trace_csv_matches_breakdown(traces_dir, capsys):
    from shardline.profiling.table.load import load

    path = traces_dir / "tracelens" / "b200" / "eager_trace.json.gz"
    assert main(["profile", "report", str(path), "--format", "csv"]) == 0
    got = pd.read_csv(io.StringIO(capsys.readouterr().out))
    want = breakdown(load(path))
    assert got[list(EXCLUSIVE_COLUMNS)].values.tolist() == want[list(EXCLUSIVE_COLUMNS)].values.tolist()


def test_unknown_format_is_rejected_by_the_parser(trace_folder):
    with pytest.raises(SystemExit) as info:
        main(["profile", "report", str(trace_folder), "--format", "xml"])
    assert info.value.code == 2


def test_format_follows_the_output_suffix(trace_folder, tmp_path):
    out = tmp_path / "b.csv"
    assert main(["profile", "report", str(trace_folder), "-o", str(out)]) == 0
    assert pd.read_csv(out)["step_ns"].tolist() == [650, 650]
    md = tmp_path / "r.md"
    assert main(["profile", "report", str(trace_folder), "-o", str(md)]) == 0
    assert md.read_text().startswith("# shardline profile report")
    txt = tmp_path / "r.txt"  # no format for .txt: the terminal table
    assert main(["profile", "report", str(trace_folder), "-o", str(txt)]) == 0
    assert txt.read_text().startswith("exclusive parts")
    explicit = tmp_path / "x.html"  # an explicit --format wins over the suffix
    assert main(["profile", "report", str(trace_folder), "--format", "json", "-o", str(explicit)]) == 0
    assert json.loads(explicit.read_text())[0]["step_ns"] == 650


def test_merge_command_writes_the_merged_trace(trace_folder, tmp_path):
    import gzip

    out = tmp_path / "merged.json.gz"
    assert main(["profile", "merge", str(trace_folder), "-o", str(out)]) == 0
    doc = json.loads(gzip.decompress(out.read_bytes()))
    names = sorted(e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name")
    assert names == ["rank 0", "rank 1"]


def test_merge_command_errors_are_one_line(tmp_path, capsys):
    assert main(["profile", "merge", str(tmp_path / "nope"), "-o", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardline profile merge: error:") and len(err.splitlines()) == 1


def test_reports_diff_and_merge_run_without_torch(trace_folder, tmp_path):
    """A fresh interpreter where importing torch fails: every profile command still works."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; sys.modules['shardline.plugins'] = None\n"
            "from shardline.profiling.present.cli import main\n"
            f"folder, out = {str(trace_folder)!r}, {str(tmp_path)!r}\n"
            "assert main(['profile', 'report', folder, '-o', out + '/r.html']) == 0\n"
            "assert main(['profile', 'diff', folder, folder, '-o', out + '/d.md', '--format', 'md']) == 0\n"
            "assert main(['profile', 'merge', folder, '-o', out + '/m.json']) == 0\n"
            "assert not [m for m in sys.modules if m.startswith('torch') and sys.modules[m] is not None]\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {"r.html", "d.md", "m.json"}


def test_large_sets_keep_the_fast_decoder_unless_op_args_is_given(tmp_path, capsys, monkeypatch):
    """Above ``OP_ARGS_MAX_BYTES`` the report reads no op args (and nothing re-reads the files for them): a
    note says so; ``--op-args`` reads them anyway."""
    import shardline.profiling.present.cli as cli
    from shardline.profiling.table.load import read_op_args

    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1.0, "dur": 2.0,
         "args": {"device": 0, "stream": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0.5, "dur": 1.0,
         "args": {"Input Dims": [[2, 3]], "Input type": ["float"]}}]}))
    monkeypatch.setattr(cli, "OP_ARGS_MAX_BYTES", 10)
    import argparse

    plain = argparse.Namespace(rules=None, rank=None, op_args=False)
    small = cli.load_traces(folder, plain, op_args=True)
    assert "note: " in capsys.readouterr().err and not small.reread_op_args
    assert (read_op_args(small)["input_dims"] == "").all()  # not read again either
    forced = cli.load_traces(folder, argparse.Namespace(rules=None, rank=None, op_args=True), op_args=True)
    assert capsys.readouterr().err == "" and (forced.events["input_dims"] == "[[2, 3]]").any()
