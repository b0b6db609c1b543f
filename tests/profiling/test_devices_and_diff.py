"""Issue 50 §4: any accelerator the trace records is analysed on its device lanes (or the breakdown says it is
CPU-only, and why); numeric runtime args written as text are read; ``profile diff`` compares single-rank runs
whatever their rank numbers, flags unmarked captures and prints no percentage of a near-zero base."""

from __future__ import annotations

import gzip
import io
import json
import warnings
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from shardline.profiling.analyses.diff import ALL_RANKS, diff_breakdowns, parse_pairs
from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, breakdown
from shardline.profiling.base.errors import AttributionError, TraceWarning
from shardline.profiling.present.cli import main
from shardline.profiling.readers import kineto
from shardline.profiling.readers._plan import DecodePath, PathRefused
from shardline.profiling.table.load import load

_PUBLIC = Path(__file__).resolve().parents[1] / "data" / "public"
MTIA = _PUBLIC / "mtia" / "hta_mtia_inference_rank0_device.json.gz"


def _ns(value) -> int:
    """µs (a JSON number read as Decimal) -> ns, exactly (these traces have at most 3 decimals)."""
    ns = Decimal(value) * 1000
    assert ns == ns.to_integral_value()
    return int(ns)


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _loaded(path, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traceset = load(path, **kw)
        table = breakdown(traceset)
    return traceset, table, [str(w.message) for w in caught if issubclass(w.category, TraceWarning)]


# --- device lanes -------------------------------------------------------------------------------------------------

def test_public_mtia_trace_is_analysed_on_its_device_lane(read_paths):
    doc = json.loads(gzip.decompress(MTIA.read_bytes()), parse_float=Decimal)
    device = [e for e in doc["traceEvents"] if e.get("cat") == "mtia_ccp_events" and e.get("ph") == "X"]
    intervals = [(_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])) for e in device]
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    busy = _union_ns(intervals)
    assert len(device) == 1313 and 0.95 < busy / span < 0.96  # the "MTIA 17" device, busy ~95.7% of its span

    events = read_paths(MTIA)  # every decode path reads it alike, and as the independent reference does
    gpu = events[events["lane"] == "gpu"]
    assert len(gpu) == len(device) and set(gpu["device"]) == {17}
    assert set(gpu["stream"]) == {e["args"]["stream"] for e in device}

    _, table, said = _loaded(MTIA, rank=0)
    assert not [w for w in said if "CPU-only" in w], said
    row = table.iloc[0]
    assert row["lanes"] == "gpu" and row["step"] == -1
    assert row["step_ns"] == span
    assert row["step_ns"] - row["idle"] == busy  # every ns of device activity, none of the CPU lane's
    assert abs((row["step_ns"] - row["idle"]) / row["step_ns"] - busy / span) < 1e-9


def _doc(events: list[dict], rank: int = 0) -> dict:
    return {"distributedInfo": {"rank": rank, "world_size": 1}, "baseTimeNanoseconds": 1_700_000_000_000_000_000,
            "traceEvents": events}


def _write(tmp_path: Path, name: str, doc: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def _x(cat: str, name: str, ts: float, dur: float, *, pid: int = 1, tid: int = 1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_unreadable_device_lanes_warn_once_that_the_breakdown_is_cpu_only(tmp_path):
    host = [_x("cpu_op", "aten::mm", 0, 50), _x("cpu_op", "aten::add", 60, 20)]
    unknown = _write(tmp_path, "npu.json", _doc(host + [_x("npu_kernel", f"matmul_{i}", 10 * i, 8, pid=3, tid=5)
                                                        for i in range(6)]))
    _, table, said = _loaded(unknown)
    cpu_only = [w for w in said if "CPU-only" in w]
    assert len(cpu_only) == 1 and "npu_kernel (6 events)" in cpu_only[0], said
    assert table.iloc[0]["lanes"] == "cpu"

    # Runtime calls that launched device work the trace does not record: CPU-only, said so.
    launches = _write(tmp_path, "mtia_host.json", _doc(host + [_x("mtia_runtime", "runFunction", 5, 3),
                                                               _x("mtia_runtime", "synchronize", 40, 9)]))
    said = _loaded(launches)[2]
    cpu_only = [w for w in said if "CPU-only" in w]
    assert len(cpu_only) == 1 and "mtia_runtime (2 calls)" in cpu_only[0] and "no device activity" in cpu_only[0]

    # A CPU trace launching nothing, and a device trace read on its lanes, say nothing of the kind.
    for doc in (_doc(host), _doc(host + [_x("cuda_runtime", "cudaLaunchKernel", 5, 3, correlation=1),
                                          _x("kernel", "gemm", 9, 30, pid=0, tid=7, correlation=1, device=0,
                                             stream=7)])):
        said = _loaded(_write(tmp_path, "quiet.json", doc))[2]
        assert not [w for w in said if "CPU-only" in w or "device lanes" in w], said


def test_numeric_args_written_as_text_are_read_not_dropped(tmp_path):
    events = [
        _x("cuda_runtime", "hipMemcpyAsync", 10, 5, correlation=3, bytes="4096", stream="0x0"),
        _x("gpu_memcpy", "Memcpy HtoD (Host -> Device)", 12, 2, pid=0, tid=0, correlation="3", bytes="4096",
           device=0, stream=0),
        _x("cuda_runtime", "hipMemcpyAsync", 20, 5, correlation=4, bytes="lots"),
        _x("cpu_op", "c10d::allreduce_", 30, 5, **{"In msg nelems": "256", "Out msg nelems": 256,
                                                      "dtype": "Float", "Group size": "2"}),
    ]
    path = _write(tmp_path, "rocm.json", _doc(events))
    read = 0
    for way in DecodePath:
        try:
            result = kineto.read_kineto(path, force=way)
        except PathRefused:
            assert way is DecodePath.NATIVE  # the scanner reads numbers only, and hands the trace on
            continue
        read += 1
        frame = result.events
        assert frame["name"].tolist() == [e["name"] for e in events], way  # none dropped
        assert frame["msg_bytes"].tolist() == [4096, 4096, -1, 256 * 4], way
        assert frame["correlation"].tolist() == [3, 3, 4, -1] and frame["pg_size"].tolist()[3] == 2, way
        bad = [w for w in result.warnings if "no number" in w]
        assert bad == [f"{path}: event 'hipMemcpyAsync' has args 'bytes' = 'lots', which is no number; the event "
                       "is kept without its 'bytes'"], (way, result.warnings)
    assert read >= 2


def test_public_rocm_trace_keeps_every_event(traces_dir):
    # HTA's MI250 trace writes its runtime args as text ("stream": "0x0", "size": "2560", "kind": "1"); it
    # has no text "bytes", which the generated trace above covers. Every X event of a kept category is read.
    path = traces_dir / "hta" / "amd_trace" / "mi250_minitoy_train_ROCm6_2_kineto.json.gz"
    doc = json.loads(gzip.decompress(path.read_bytes()))
    kept = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") not in ("Trace", "ac2g")]
    result = kineto.read_kineto(path)
    assert len(result.events) == len(kept) == 112
    assert int((result.events["lane"] == "gpu").sum()) == sum(
        e["cat"] in ("kernel", "gpu_memcpy", "gpu_user_annotation") for e in kept)
    assert not [w for w in result.warnings if "CPU-only" in w or "no number" in w], result.warnings


# --- profile diff -------------------------------------------------------------------------------------------------

def _run(synth, folder: Path, rank: int, *, compute_us: int, marked: bool = True) -> Path:
    """One single-rank trace: a 1000 µs GPU step (annotated, or not), compute for ``compute_us`` and a 100 µs
    host-to-device copy; returns its file."""
    t0 = 5_000_000
    rows = [synth.gpu_event(rank, "compute", t0 + 100_000, compute_us * 1000),
            synth.gpu_event(rank, "memcpy_h2d", t0 + 800_000, 100_000),
            synth.gpu_event(rank, "compute", t0 + 999_000, 1_000)]
    if marked:
        rows.append(synth.annotation(rank, "ProfilerStep#7", t0, 1_000_000))
    rows.append(synth.gpu_event(rank, "compute", t0, 1_000))
    (path,) = synth.write_kineto(rows, folder, world=4)
    return path


def test_single_rank_runs_compare_whatever_their_rank_numbers(synth, tmp_path, capsys):
    before = _run(synth, tmp_path / "before", 3, compute_us=300)
    after = _run(synth, tmp_path / "after", 1, compute_us=500)
    bd_b, bd_a = breakdown(load(before)), breakdown(load(after))
    assert bd_b["rank"].tolist() == [3] and bd_a["rank"].tolist() == [1]

    result = diff_breakdowns(bd_b, bd_a)
    assert result.notes == ("single-rank runs compared whatever their rank numbers: before's rank 3 with "
                            "after's rank 1",)
    rows = result.table[result.table["rank"] == 3].set_index("column")
    assert set(rows["rank_after"]) == {1} and rows["comparable"].all()
    for column in (*EXCLUSIVE_COLUMNS, "step"):  # each delta is the after row minus the before row
        source = "step_ns" if column == "step" else column
        assert rows.loc[column, "delta_ns"] == int(bd_a[source].iloc[0]) - int(bd_b[source].iloc[0]), column
    # The hand-laid step: compute grew by 200 µs of the 1000 µs step, out of idle; the step did not move.
    assert rows.loc["compute", "delta_ns"] == 200_000 and rows.loc["idle", "delta_ns"] == -200_000
    assert rows.loc["step", "delta_ns"] == 0 and rows["share_of_delta"].isna().all()  # no base to share
    assert rows.loc["compute", "delta_of_step"] == pytest.approx(0.2, abs=1e-12)

    assert main(["profile", "diff", str(before), str(after)]) == 0
    out = capsys.readouterr().out
    assert "rank 3 -> 1: mean step 1.000 ms -> 1.000 ms" in out and "before's rank 3 with after's rank 1" in out
    shown = pd.read_fwf(io.StringIO(out.split("\n\n", 1)[1]), dtype=str)
    assert set(shown["share_of_delta_%"]) == {"-"}
    assert shown[(shown["rank"] == "3->1") & (shown["column"] == "compute")]["delta_%_of_step"].tolist() == ["20.0"]


def test_rank_pairs_are_explicit_and_checked(capsys, tmp_path):
    before = _breakdown({0: 1000, 1: 1200, 2: 900})
    after = _breakdown({0: 1100, 1: 1000, 5: 950})
    result = diff_breakdowns(before, after, pairs=parse_pairs(["2:5", "0:1"]))
    assert result.notes[0] == "ranks paired as asked: before 2 with after 5, before 0 with after 1"
    assert result.notes[1] == "ranks only before: [1]; only after: [0] (left out)"
    step = result.table[result.table["column"] == "step"].set_index("rank")
    assert step.loc[2, "delta_ns"] == 950 - 900 and step.loc[0, "delta_ns"] == 1000 - 1000
    assert step.loc[ALL_RANKS, "before_ns"] == (1000 + 900) // 2 and step.loc[ALL_RANKS, "after_ns"] == 975
    with pytest.raises(AttributionError, match="rank pair '3-1' is not BEFORE:AFTER"):
        parse_pairs(["3-1"])
    with pytest.raises(AttributionError, match="rank 4 is not in the after run"):
        diff_breakdowns(before, after, pairs=((0, 4),))
    with pytest.raises(AttributionError, match="rank 0 is paired twice"):
        diff_breakdowns(before, after, pairs=((0, 1), (0, 5)))
    # Disjoint multi-rank runs still need the pairs, and the error says how to give them.
    with pytest.raises(AttributionError, match=r"no rank in both runs .*--rank BEFORE:AFTER"):
        diff_breakdowns(_breakdown({0: 5, 1: 5}), _breakdown({2: 5, 3: 5}))


def _breakdown(step_ns: dict[int, int], *, compute: dict[int, int] | None = None, step: int = 4) -> pd.DataFrame:
    """One step per rank: ``compute`` ns (default: half the step) and the rest idle."""
    rows = []
    for rank, total in step_ns.items():
        row = dict.fromkeys(EXCLUSIVE_COLUMNS, 0)
        row["compute"] = (compute or {}).get(rank, total // 2)
        row["idle"] = total - row["compute"]
        rows.append({"rank": rank, "step": step, "step_ns": total, **row})
    return pd.DataFrame(rows)


def test_cli_pairs_ranks_across_numbers(synth, tmp_path, capsys):
    before = _run(synth, tmp_path / "before", 3, compute_us=300)
    after = _run(synth, tmp_path / "after", 1, compute_us=400)
    assert main(["profile", "diff", str(before), str(after), "--rank", "3:1", "--format", "csv"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert set(table["rank"]) == {3, ALL_RANKS} and set(table[table["rank"] == 3]["rank_after"]) == {1}
    assert table[(table["rank"] == 3) & (table["column"] == "compute")]["delta_ns"].tolist() == [100_000]
    assert main(["profile", "diff", str(before), str(after), "--rank", "3:9"]) == 2
    assert "rank 9 is not in the after run" in capsys.readouterr().err
    assert main(["profile", "diff", str(before), str(after), "--rank", "2", "--rank", "3:1"]) == 2
    assert "not both" in capsys.readouterr().err


def test_unmarked_captures_are_flagged_not_diffed_into_shares(synth, tmp_path, capsys):
    before = _run(synth, tmp_path / "before", 0, compute_us=300, marked=False)
    after = _run(synth, tmp_path / "after", 0, compute_us=301, marked=False)
    result = diff_breakdowns(breakdown(load(before)), breakdown(load(after)))
    assert not result.table["comparable"].any()
    assert result.table["share_of_delta"].isna().all() and result.table["delta_of_step"].isna().all()
    assert any("no step markers (ProfilerStep)" in note and "not comparable" in note for note in result.notes)
    assert main(["profile", "diff", str(before), str(after)]) == 0
    out = capsys.readouterr().out
    assert "whole capture (no step markers: not comparable)" in out
    shown = pd.read_fwf(io.StringIO(out.split("\n\n", 1)[1]), dtype=str)
    assert set(shown["share_of_delta_%"]) == {"-"} and set(shown["delta_%_of_step"]) == {"-"}


def test_shares_only_of_a_step_delta_beyond_the_noise_floor():
    before = _breakdown({0: 1_000_000}, compute={0: 400_000})
    # Compute +5000 ns, idle -4999 ns: the step moved 1 ns; a share would be +500000%.
    tiny = _breakdown({0: 1_000_001}, compute={0: 405_000})
    table = diff_breakdowns(before, tiny).table
    assert table["share_of_delta"].isna().all()
    compute = table[(table["rank"] == 0) & (table["column"] == "compute")].iloc[0]
    assert Fraction(compute["delta_of_step"]).limit_denominator(10**7) == Fraction(5_000, 1_000_000)
    # A step that moved 10% shares it out exactly: compute +150 µs, idle -50 µs of a +100 µs step.
    moved = _breakdown({0: 1_100_000}, compute={0: 550_000})
    rows = diff_breakdowns(before, moved).table.set_index(["rank", "column"])
    assert rows.loc[(0, "compute"), "share_of_delta"] == 150_000 / 100_000
    assert rows.loc[(0, "idle"), "share_of_delta"] == -50_000 / 100_000
    assert np.isclose(rows.loc[(0, "step"), "share_of_delta"], 1.0)
