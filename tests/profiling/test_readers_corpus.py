"""Every file of the real corpus loads; counts and values checked against an independent plain-json reading.

The reference side uses only the standard library (``json`` with ``parse_float=Decimal`` so times are exact)
and the rules written in the reader's docstring, never the reader's own helpers.
"""

from __future__ import annotations

import gzip
import json
import re
import warnings
from collections import Counter
from decimal import Decimal
from pathlib import Path

import pytest

from shardline.profiling.base.errors import MissingRankError, TraceWarning
from shardline.profiling.base.schema import check_events
from shardline.profiling.table.load import TraceSet, load

REPO = Path(__file__).resolve().parents[2]
_ROW = re.compile(r"^\| ([^|]+?) \| (\d+) \|")


def _listed(traces_dir: Path) -> list[str]:
    text = (traces_dir / "PROVENANCE.md").read_text()
    return [m.group(1) for line in text.splitlines() if (m := _ROW.match(line))]


def _provenance_names() -> list[str]:
    # Read the table at collection time when the corpus is present; otherwise one placeholder that skips.
    import os

    root = Path(os.environ.get("SHARDLINE_TRACES", REPO.parent / "shared" / "traces"))
    if not (root / "PROVENANCE.md").is_file():
        return ["<corpus absent>"]
    return _listed(root)


#: Files without any record of their rank: load must ask for it, then accept rank=0.
_NO_RANK = {"hta/amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz",
            "hta/distributed_info_unavailable/distributed_info_not_found.json.gz",
            "hta/rank_unavailable/rank_not_found.json.gz", "hta/triton_example/triton_example.json.gz"}


def _kineto_reference(path: Path) -> dict:
    """Plain-json reading of a Kineto file: kept X events and their exact ns times, per the documented rules."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as handle:
        doc = json.load(handle, parse_float=Decimal)
    base = doc.get("baseTimeNanoseconds", 0) if isinstance(doc, dict) else 0
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    dropped = {"Trace", "ac2g", "fwdbwd", "async", "flow", "python_function", "python"}
    kept = [e for e in events if e.get("ph") == "X" and e.get("cat", "") not in dropped]
    starts = sorted(int((Decimal(e["ts"]) * 1000).to_integral_value("ROUND_HALF_UP")) + base for e in kept)
    return {"count": len(kept), "starts": starts, "cats": Counter(e.get("cat", "") for e in kept)}


@pytest.mark.parametrize("name", _provenance_names())
def test_every_corpus_file_loads(traces_dir, name):
    path = traces_dir / name
    assert path.is_file(), f"PROVENANCE.md lists {name} but it is missing"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        if name in _NO_RANK:
            with pytest.raises(MissingRankError, match=re.escape(path.name)):
                load(path)
            ts = load(path, rank=0)
        else:
            ts = load(path)
    assert isinstance(ts, TraceSet)
    check_events(ts.events)
    assert set(ts.files) == {path}
    if ts.skipped:
        assert len(ts.events) == 0  # an execution trace / memory timeline: recognised, holds no intervals
        return
    # An NCCL init-only log has no collective rows but still maps its communicators to ranks.
    assert len(ts.events) > 0 or ts.ranks
    if len(ts.events) and ts.events["source"].iloc[0] == "kineto":
        ref = _kineto_reference(path)
        assert len(ts.events) == ref["count"]
        # Exact ns, every event: the reference multiplies the decimal text, never a float.
        assert sorted(ts.events["start_ns"].tolist()) == ref["starts"]
        assert Counter(ts.events["cat"].astype(str)) == ref["cats"]


def test_dlrm_eight_ranks_against_plain_json(traces_dir):
    folder = traces_dir / "param" / "dlrm_kineto"
    ts = load(folder)
    assert ts.ranks == tuple(range(8))
    assert {p.name.split("_")[0]: r for p, r in ts.files.items()} == {f"worker{i}": (i,) for i in range(8)}
    rank3 = ts.events[ts.events["rank"] == 3]
    doc = json.load(gzip.open(next(folder.glob("worker3_*")), "rt"))
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    assert int((rank3["cat"] == "kernel").sum()) == len(kernels)
    # Each kernel keeps its stream and correlation (tid is the stream for GPU rows).
    want = sorted((e["args"]["stream"], e["args"]["correlation"]) for e in kernels)
    got = rank3[rank3["cat"] == "kernel"]
    assert sorted(zip(got["stream"].tolist(), got["correlation"].tolist())) == want
    # Steps: ProfilerStep#10 is the only CPU step window of this capture.
    assert set(rank3.loc[rank3["name"] == "ProfilerStep#10", "step"]) == {10}
    # Pinned HtoD copies, counted by name from the raw events.
    names = Counter(e["name"] for e in doc["traceEvents"] if e.get("cat") == "gpu_memcpy")
    pinned_h2d = names.get("Memcpy HtoD (Pinned -> Device)", 0)
    assert int(((rank3["memory_kind"] == "Pinned") & rank3["name"].str.startswith("Memcpy HtoD")).sum()) == pinned_h2d
    assert ts.metadata[3]["distributedInfo"]["world_size"] == 8


def test_collective_kernel_sizes_in_nccl_trace(traces_dir):
    path = traces_dir / "hta" / "nccl_parser_config" / "nccl_data.json.gz"
    ts = load(path)
    doc = json.load(gzip.open(path, "rt"))
    sizes = {"Float": 4, "Byte": 1, "Long": 8}  # torch ScalarType element sizes
    want = Counter()
    for e in doc["traceEvents"]:
        a = e.get("args", {})
        if e.get("cat") == "kernel" and "Collective name" in a:
            want[(a["Collective name"], max(a["In msg nelems"], a["Out msg nelems"]) * sizes[a["dtype"]])] += 1
    kern = ts.events[(ts.events["cat"] == "kernel") & (ts.events["collective"] != "")]
    got = Counter(zip(kern["collective"].astype(str), kern["msg_bytes"].tolist()))
    assert got == want and sum(want.values()) > 0
    assert set(kern["pg_ranks"].astype(str)) == {"[0, 1]"}
    assert set(kern["pg_desc"].astype(str)) == {"default_pg"}


def test_rocm_trace_lanes_and_steps(traces_dir):
    path = traces_dir / "hta" / "amd_trace" / "mi250_minitoy_train_ROCm6_2_kineto.json.gz"
    ev = load(path, rank=0).events
    doc = json.load(gzip.open(path, "rt"))
    gpu = [e for e in doc["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_user_annotation")]
    assert int((ev["lane"] == "gpu").sum()) == len(gpu)
    # pid is the device
    assert set(ev.loc[ev["lane"] == "gpu", "device"]) == {e["args"].get("device", e["pid"]) for e in gpu}
    steps = {int(e["name"].split("#")[1]) for e in doc["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert set(ev["step"]) - {-1} == steps


def test_gloo_cpu_only_trace(traces_dir):
    path = traces_dir / "hta" / "cpu_only" / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"
    ts = load(path)
    assert ts.ranks == (34,)
    assert set(ts.events["lane"]) == {"cpu"}
    assert int((ts.events["name"] == "gloo:all_reduce").sum()) == 10
    assert ts.metadata[34]["distributedInfo"]["backend"] == "gloo"
