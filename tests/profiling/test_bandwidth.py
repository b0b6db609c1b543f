"""collective_bandwidth: nccl-tests' bytes and busbw, the matched transfer time, the link a group crosses.

Hand-computed rows come from the raw JSON of real traces (``json``/``gzip`` and the event fields ts/dur/args),
sharing nothing with the profiler's tables; the formulas are nccl-tests' (doc/PERFORMANCE.md of NVIDIA/nccl-tests):
busbw = algbw x 2(n-1)/n for all-reduce, (n-1)/n for all-gather / reduce-scatter / all-to-all, 1 for broadcast
and p2p. Synthetic Kineto files (written here) cover what the corpus lacks: every category on one group, split
sizes, p2p, several node shapes.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest

from shardline.profiling import collective_bandwidth, load
from shardline.profiling.base.errors import ProfilingError
from shardline.profiling.matching.bandwidth import (
    LATENCY_BOUND_BYTES,
    LinkTableError,
    bandwidth_summary,
    busbw_factor,
    link_table,
)
from shardline.profiling.matching.collectives import ClockAlignment

CORPUS = Path(os.environ.get("SHARDLINE_TRACES", Path(__file__).resolve().parents[2].parent / "shared" / "traces"))
DLRM = CORPUS / "param" / "dlrm_kineto"
NCCL_ARGS = CORPUS / "hta" / "nccl_parser_config" / "nccl_data.json.gz"
B200 = CORPUS / "tracelens" / "b200" / "eager_trace.json.gz"
needs_corpus = pytest.mark.skipif(not DLRM.is_dir(), reason=f"trace corpus not at {CORPUS} (set SHARDLINE_TRACES)")


def _raw(path: Path) -> list[dict]:
    """The events, each ``ts`` made absolute ns (``baseTimeNanoseconds + ts x 1000``, exactly: Decimal) and
    ``dur`` ns."""
    with gzip.open(path, "rt") as fh:
        doc = json.load(fh, parse_float=Decimal)
    base = doc.get("baseTimeNanoseconds", 0)
    events = doc["traceEvents"]
    for e in events:
        if "ts" in e:
            e["ts"] = base + int(Decimal(e["ts"]) * 1000)
        if "dur" in e:
            e["dur"] = int(Decimal(e["dur"]) * 1000)
    return events


def _ns(ns) -> int:
    return ns


# --- hand-computed rows on real traces ------------------------------------------------------------------------

@needs_corpus
def test_dlrm_all_reduce_row_by_hand():
    """8 ranks of DLRM on V100-SXM2 (PyTorch 2.0 era: the NCCL kernels carry no size; the ``nccl:all_reduce``
    annotation holds ``Input Dims``/``Input type``). Rank 0's first all-reduce: S = 394241 floats from the
    annotation containing the kernel's launch; transfer = its end - the last rank's start (recorded clocks)."""
    firsts = {}
    for path in sorted(DLRM.glob("*.json.gz")):
        events = _raw(path)
        rank = int(path.name[len("worker")])
        kernels = sorted((e for e in events if e.get("cat") == "kernel"
                          and e["name"].startswith("ncclKernel_AllReduce")), key=lambda e: e["ts"])
        firsts[rank] = kernels[0]
        if rank == 0:
            kernel = kernels[0]
            launch = next(e for e in events if e.get("cat") == "cuda_runtime"
                          and e["args"].get("correlation") == kernel["args"]["correlation"])
            op = next(e for e in events if e.get("name") == "nccl:all_reduce" and e["tid"] == launch["tid"]
                      and e["ts"] <= launch["ts"] <= e["ts"] + e["dur"])
            assert op["args"]["Input type"] == ["float"]
            size = math.prod(op["args"]["Input Dims"][0]) * 4
    assert len(firsts) == 8 and size == 394241 * 4
    last_start = max(_ns(k["ts"]) for k in firsts.values())
    k0 = firsts[0]
    transfer = _ns(k0["ts"] + k0["dur"]) - last_start
    assert 0 < transfer < _ns(k0["dur"])

    df = collective_bandwidth(load(DLRM), clock=ClockAlignment.NONE)
    row = df[(df["rank"] == 0) & (df["category"] == "all_reduce")].sort_values("start_ns").iloc[0]
    assert row["start_ns"] == _ns(k0["ts"])
    assert row["bytes"] == size and row["dtype"] == "Float" and row["size_source"] == "op_input"
    assert row["group_size"] == 8 and row["time_basis"] == "transfer"
    assert row["time_ns"] == transfer  # exact: integer ns, no cross-rank sum
    algbw = size / transfer  # bytes per ns = GB/s
    assert row["algbw_gbps"] == pytest.approx(algbw, rel=1e-12)
    assert row["busbw_gbps"] == pytest.approx(algbw * 2 * 7 / 8, rel=1e-12)
    assert row["link"] == "nvlink2" and row["link_gbps"] == 150.0  # Tesla V100-SXM2-32GB, one 8-GPU node
    assert row["efficiency"] == pytest.approx(algbw * 2 * 7 / 8 / 150.0, rel=1e-12)
    assert not row["latency_bound"]  # 1.58 MB
    assert row["step"] == 10
    # every matched row: transfer within the call, 8 members
    assert (df.loc[df["time_basis"] == "transfer", "time_ns"] <= df.loc[df["time_basis"] == "transfer",
                                                                         "dur_ns"]).all()


@needs_corpus
def test_kernel_args_row_by_hand():
    """A100 rank 0 of 2 with PyTorch 2.3 kernel args: S = In msg nelems x 4 (Float); only one of the two ranks
    was published, so the time is the kernel's duration, labelled a lower bound."""
    kernel = min((e for e in _raw(NCCL_ARGS) if e.get("cat") == "kernel"
                  and e["name"].startswith("ncclKernel_AllReduce")), key=lambda e: e["ts"])
    size = kernel["args"]["In msg nelems"] * 4
    assert kernel["args"]["dtype"] == "Float" and kernel["args"]["Group size"] == 2
    df = collective_bandwidth(load(NCCL_ARGS))
    row = df[df["start_ns"] == _ns(kernel["ts"])].iloc[0]
    assert row["category"] == "all_reduce" and row["bytes"] == size and row["dtype"] == "Float"
    assert row["time_basis"] == "duration" and row["time_ns"] == _ns(kernel["dur"])
    assert row["busbw_gbps"] == pytest.approx(size / _ns(kernel["dur"]) * 2 * 1 / 2, rel=1e-12)
    assert row["link"] == "nvlink3" and row["link_gbps"] == 300.0  # NVIDIA A100-PG509-200 (SXM4 board)
    assert row["pg"] == "0" and row["group_size"] == 2


@needs_corpus
def test_b200_all_gather_row_by_hand():
    """All-gather on B200 (NCCL 2.27, args on the kernel): S = Out msg nelems x 2 (BFloat16), busbw x 7/8,
    NVLink 5; 402 KB is latency-bound."""
    kernel = next(e for e in _raw(B200) if e.get("cat") == "kernel" and e["name"].startswith("ncclDevKernel_AllGather"))
    size = kernel["args"]["Out msg nelems"] * 2
    df = collective_bandwidth(load(B200))
    row = df[df["category"] == "all_gather"].iloc[0]
    assert row["bytes"] == size and row["dtype"] == "BFloat16" and row["size_source"] == "args"
    assert row["time_ns"] == _ns(kernel["dur"]) and row["time_basis"] == "duration"
    assert row["busbw_gbps"] == pytest.approx(size / _ns(kernel["dur"]) * 7 / 8, rel=1e-12)
    assert row["link"] == "nvlink5" and row["link_gbps"] == 900.0
    assert row["latency_bound"] and size < LATENCY_BOUND_BYTES
    summary = bandwidth_summary(df)
    assert summary.loc[summary["category"] == "all_gather", "verdict"].tolist() == ["latency-bound"]


# --- synthetic Kineto traces ----------------------------------------------------------------------------------

KERNELS = {
    "all_reduce": ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "allreduce"),
    "all_gather": ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "_allgather_base"),
    "reduce_scatter": ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                       "_reduce_scatter_base"),
    "all_to_all": ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "all_to_allv"),
    "broadcast": ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "broadcast"),
    "p2p_send": ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "send"),
}
WORLD = 4
N = 1 << 22  # elements of the full buffer: 16 MiB of float, 8 MiB of bf16
# (category, dtype, In msg nelems, Out msg nelems, expected S bytes, nccl-tests factor for n = 4)
CASES = (
    ("all_reduce", "Float", N, N, 4 * N, 2 * 3 / 4),
    ("all_gather", "BFloat16", N // 4, N, 2 * N, 3 / 4),
    ("reduce_scatter", "BFloat16", N, N // 4, 2 * N, 3 / 4),
    ("all_to_all", "Float", N, N, 4 * N, 3 / 4),
    ("broadcast", "Float", N, N, 4 * N, 1.0),
    ("all_reduce", "Float", 1024, 1024, 4096, 2 * 3 / 4),  # latency-bound
)
ARRIVE = (0, 3_000, 1_000, 7_000)  # ns after the call's first arrival, per rank
TRANSFER = 200_000  # ns after the last arrival


def _kernel(rank, category, dtype, n_in, n_out, *, ts, dur, corr, seq, extra=None) -> dict:
    name, collective = KERNELS[category]
    args = {"device": rank, "stream": 20, "correlation": corr, "External id": corr, "Collective name": collective,
            "In msg nelems": n_in, "Out msg nelems": n_out, "Group size": WORLD, "dtype": dtype,
            "In split size": "[]", "Out split size": "[]", "Process Group Name": "0",
            "Process Group Description": "default_pg", "Process Group Ranks": str(list(range(WORLD))), "Seq": seq}
    args.update(extra or {})
    return {"ph": "X", "cat": "kernel", "name": name, "pid": rank, "tid": 20, "ts": ts / 1000, "dur": dur / 1000,
            "args": args}


def _write(folder: Path, events: dict[int, list[dict]], *, device="NVIDIA H100 80GB HBM3") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for rank, rows in events.items():
        end = max(e["ts"] + e["dur"] for e in rows)
        step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1000 + rank, "tid": 1,
                "ts": 0, "dur": end + 1}
        doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": WORLD},
               "deviceProperties": [{"id": rank, "name": device}], "traceEvents": [step, *rows]}
        (folder / f"rank{rank}.pt.trace.json").write_text(json.dumps(doc))
    return folder


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    events = {r: [] for r in range(WORLD)}
    t = 10_000
    for k, (category, dtype, n_in, n_out, _, _) in enumerate(CASES):
        for r in range(WORLD):
            extra = {"In split size": "[1, 1, 1, 5]", "Out split size": "[2, 2, 2, 2]"} \
                if category == "all_to_all" else None
            start = t + ARRIVE[r]
            events[r].append(_kernel(r, category, dtype, n_in, n_out, ts=start,
                                     dur=t + max(ARRIVE) + TRANSFER - start, corr=100 + k, seq=k, extra=extra))
        t += 1_000_000
    # p2p: rank 0 sends 1 MiB of bytes to rank 3, 50 µs
    events[0].append(_kernel(0, "p2p_send", "Byte", 1 << 20, 1 << 20, ts=t, dur=50_000, corr=999, seq=-1,
                             extra={"Dst Rank": 3, "Collective name": "send"}))
    return _write(tmp_path_factory.mktemp("bw") / "synthetic", events)


def test_nccl_tests_formulas_per_category(synthetic):
    df = collective_bandwidth(load(synthetic), gpus_per_node=8)
    assert len(df) == len(CASES) * WORLD + 1
    for category, dtype, _, _, size, factor in CASES:
        rows = df[(df["category"] == category) & (df["bytes"] == size)]
        assert len(rows) == WORLD, (category, size)
        assert (rows["dtype"] == dtype).all() and (rows["group_size"] == WORLD).all()
        assert (rows["time_basis"] == "transfer").all() and (rows["time_ns"] == TRANSFER).all()
        assert np.allclose(rows["algbw_gbps"], size / TRANSFER, rtol=1e-12)
        assert np.allclose(rows["busbw_gbps"], size / TRANSFER * factor, rtol=1e-12)
        assert (rows["link"] == "nvlink4").all() and (rows["link_gbps"] == 450.0).all()  # H100 SXM, one node
        assert np.allclose(rows["efficiency"], size / TRANSFER * factor / 450.0, rtol=1e-12)
        assert (rows["latency_bound"] == (size < (1 << 20))).all()
        assert (rows["step"] == 1).all()
    p2p = df[df["category"] == "p2p_send"].iloc[0]
    assert p2p["bytes"] == 1 << 20 and p2p["time_basis"] == "duration" and p2p["time_ns"] == 50_000
    assert p2p["busbw_gbps"] == pytest.approx((1 << 20) / 50_000, rel=1e-12)  # factor 1
    assert not p2p["latency_bound"]  # exactly 1 MiB is not under it


def test_busbw_factor_table():
    factors = busbw_factor(["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p_recv",
                            "all_reduce"], [8, 8, 8, 8, 8, 2, -1])
    assert factors[:6].tolist() == [1.75, 0.875, 0.875, 0.875, 1.0, 1.0] and math.isnan(factors[6])


def test_all_to_all_v_imbalance(synthetic):
    df = collective_bandwidth(load(synthetic))
    a2a = df[df["category"] == "all_to_all"]
    assert np.allclose(a2a["imbalance"], 5 / 2)  # max/mean of [1, 1, 1, 5]; the out splits are balanced
    assert df.loc[df["category"] != "all_to_all", "imbalance"].isna().all()


def test_link_intra_vs_inter_node(synthetic):
    ts = load(synthetic)
    two = collective_bandwidth(ts, gpus_per_node=2)  # the 4-rank group spans 2 nodes: H100's NIC, NDR
    coll = two[two["category"] != "p2p_send"]
    assert (coll["nodes"] == 2).all() and (coll["link"] == "ib-ndr").all() and (coll["ranks_per_node"] == 2).all()
    # One NDR port (50 GB/s) per GPU. A ring leaves each node once per channel: its bus traffic crosses on the
    # node's two ports, 2 x 50 (under NVLink 4's 450). An all-to-all sends 2 of its 4 shares off the node through
    # its own port: algbw <= 50 x 4/2, busbw = algbw x 3/4 <= 75.
    ring = coll["category"] != "all_to_all"
    assert (coll.loc[ring, "link_gbps"] == 100.0).all() and (coll.loc[~ring, "link_gbps"] == 75.0).all()
    p2p = two[two["category"] == "p2p_send"].iloc[0]
    assert p2p["nodes"] == 2 and p2p["link"] == "ib-ndr" and p2p["link_gbps"] == 50.0  # rank 0 -> 3 crosses
    four = collective_bandwidth(ts, gpus_per_node=4)
    assert (four["link"] == "nvlink4").all() and four.attrs["gpus_per_node_source"] == "argument"
    default = collective_bandwidth(ts)
    assert default.attrs == {"gpus_per_node": 8, "gpus_per_node_source": "default"}


@pytest.mark.parametrize(("device", "intra", "nic"), [
    ("Tesla V100-SXM2-32GB", "nvlink2", "ib-edr"),  # names as Kineto's deviceProperties record them
    ("Tesla V100-PCIE-16GB", "pcie-gen3", "ib-edr"),
    ("NVIDIA A100-SXM4-80GB", "nvlink3", "ib-hdr"),
    ("NVIDIA A100-PG509-200", "nvlink3", "ib-hdr"),
    ("NVIDIA A100 80GB PCIe", "pcie-gen4", "ib-hdr"),
    ("NVIDIA H100 80GB HBM3", "nvlink4", "ib-ndr"),
    ("NVIDIA H100 PCIe", "pcie-gen5", "ib-ndr"),
    ("NVIDIA H200", "nvlink4", "ib-ndr"),
    ("NVIDIA B200", "nvlink5", "ib-ndr"),
    ("AMD Instinct MI300X", "xgmi", "roce-400"),
    ("NVIDIA L4", "pcie-gen4", "ib-hdr"),
    ("Some Future GPU", "", "ib-ndr"),
])
def test_device_name_mapping(device, intra, nic):
    assert link_table().device_links(device) == (intra, nic)


def test_limits_cite_their_data_sheets():
    table = link_table()
    assert table.links["pcie-gen5"].gbps == 63.0 and table.links["nvlink4"].gbps == 450.0
    assert table.links["ib-ndr"].gbps == 50.0
    assert all(link.source for link in table.links.values())


def test_override_file(synthetic, tmp_path):
    path = tmp_path / "links.yaml"
    path.write_text("links:\n  nvlink4: {gbps: 400, source: measured nccl-tests peak}\n"
                    "  my-nic: {gbps: 80}\nnic: my-nic\ngpus_per_node: 2\nnics_per_node: 1\n")
    ts = load(synthetic)
    df = collective_bandwidth(ts, links=path)
    assert df.attrs["gpus_per_node_source"] == "links file"
    assert (df.loc[df["category"] != "p2p_send", "link"] == "my-nic").all()
    # one 80 GB/s port shared by the node's two GPUs: 40 each; a ring's crossing uses the node's port (2 x 40),
    # an all-to-all its share x 3/2 (as in test_link_intra_vs_inter_node), a send its share
    expected = df["category"].map({"all_to_all": 60.0, "p2p_send": 40.0}).fillna(80.0)
    assert (df["link_gbps"] == expected).all() and set(df["category"]) >= {"all_to_all", "p2p_send", "all_reduce"}
    intra = collective_bandwidth(ts, links={"links": {"nvlink4": {"gbps": 400}}}, gpus_per_node=4)
    assert (intra["link_gbps"] == 400.0).all()
    forced = collective_bandwidth(ts, links={"intra": "pcie-gen5", "devices": [{"match": "H100", "intra": "nvlink4"}]},
                                  gpus_per_node=4)
    assert (forced["link"] == "pcie-gen5").all()


@pytest.mark.parametrize(("text", "key"), [
    ("links:\n  nvlink4: {gbps: -1}\n", "links.nvlink4.gbps"),
    ("links:\n  nvlink4: {gbps: fast}\n", "links.nvlink4.gbps"),
    ("links:\n  new-link: {source: x}\n", "links.new-link.gbps"),
    ("links:\n  nvlink4: {gbsp: 3}\n", "links.nvlink4"),
    ("nic: ib-qdr\n", "nic"),
    ("speed: 3\n", "speed"),
    ("devices:\n  - {match: '(', intra: nvlink4}\n", "devices[0].match"),
    ("devices:\n  - {match: H100, intra: warp-drive}\n", "devices[0].intra"),
    ("gpus_per_node: 0\n", "gpus_per_node"),
    ("links: [1, 2\n", "YAML"),
])
def test_bad_link_file_names_file_and_key(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(LinkTableError) as info:
        link_table(path)
    assert str(path) in str(info.value) and key in str(info.value)
    assert isinstance(info.value, ProfilingError)


def test_bad_link_arguments(tmp_path):
    with pytest.raises(LinkTableError, match="cannot read"):
        link_table(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(LinkTableError, match="bad.json"):
        link_table(bad)
    with pytest.raises(LinkTableError, match="links mapping: key links.x.gbps"):
        link_table({"links": {"x": {"gbps": 0}}})


def test_summary_verdicts(synthetic):
    df = collective_bandwidth(load(synthetic), gpus_per_node=8)
    summary = bandwidth_summary(df)
    small = summary[(summary["category"] == "all_reduce") & (summary["bucket_bytes"] == 4096)].iloc[0]
    assert small["verdict"] == "latency-bound" and small["calls"] == WORLD and small["ranks"] == WORLD
    big = summary[(summary["category"] == "all_reduce") & (summary["bucket_bytes"] == 4 ** 12)].iloc[0]
    expected = round(100 * 4 * N / TRANSFER * 1.5 / 450.0, 1)
    assert big["verdict"] == f"{expected:g} % of peak" and big["size_bucket"] == "[16 MiB, 64 MiB)"
    assert big["group"] == "world" and big["time_basis"] == "transfer"
    p2p = summary[summary["category"] == "p2p_send"].iloc[0]
    assert p2p["verdict"].startswith("≥ ") and p2p["time_basis"] == "duration"  # a lower bound


def test_events_table_source_uses_msg_bytes(synthetic):
    """An events DataFrame has no files to read args from: sizes from ``msg_bytes``, dtype unknown."""
    df = collective_bandwidth(load(synthetic).events, gpus_per_node=8)
    ar = df[(df["category"] == "all_reduce") & (df["bytes"] == 4 * N)]
    assert len(ar) == WORLD and (ar["size_source"] == "msg_bytes").all()
    assert (ar["dtype"] == "Float").all()  # from the kernel name (_f32_) when no dtype arg is at hand
    assert (df.loc[df["category"] == "all_gather", "dtype"] == "").all()
