"""NCCL_DEBUG logs, Nsight SQLite, flight recorder and the NCCL profiler-plugin dump: values checked by hand
(logs, dumps) or against direct SQL on the export (Nsight)."""

from __future__ import annotations

import sqlite3
import warnings

import pytest

from shardline.profiling.base.errors import TraceWarning
from shardline.profiling.readers.nccl_profiler import quote_bare_tokens
from shardline.profiling.table.load import load


def _quiet_load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        return load(path, **kw)


def test_nccl_log_coll_lines_ray_prefix(traces_dir):
    path = traces_dir / "nccl_debug_logs" / "nvidia_nccl_issue1193_ray_128ranks_allreduce.log"
    with pytest.warns(TraceWarning, match="no Init COMPLETE line"):
        ev = load(path).events
    # 4 AllReduce lines; opCount 139d (hex) = 5021; count 7382228 float32 (datatype 7) = 29528912 bytes.
    assert len(ev) == 4 and set(ev["name"]) == {"AllReduce"}
    first = ev.iloc[0]
    assert (first["seq"], first["msg_bytes"], first["pg_size"], first["device"]) == (0x139D, 7382228 * 4, 128, 2)
    assert first["stream"] == 0x78D07125E5E0 and first["pg_name"] == "0x78cfda045840"
    assert (first["start_ns"], first["dur_ns"], first["rank"]) == (-1, 0, -1)  # no timestamps, no Init line
    assert set(ev["category"]) == {"all_reduce"}


def test_nccl_log_sizes_per_op(traces_dir):
    ev = _quiet_load(traces_dir / "nccl_debug_logs" / "pytorch_torchtitan_issue1369_tp2_ag_rs.log").events
    def sizes(name, seq=None):  # plain masks: a categorical MultiIndex lookup differs between pandas 2 and 3
        rows = ev[(ev["name"] == name) & ((ev["seq"] == seq) if seq is not None else True)]
        return rows["msg_bytes"].tolist()

    # AllGather count is per rank: 2097152 × 4 B × nranks 2; ReduceScatter likewise; AllReduce count 1 × 4 B.
    assert sizes("AllGather", 0xD) == [2097152 * 4 * 2]
    assert set(sizes("ReduceScatter")) == {2097152 * 4 * 2}
    assert sizes("AllReduce", 0x10) == [4]


def test_nccl_log_send_recv_peers(traces_dir):
    ev = _quiet_load(traces_dir / "nccl_debug_logs" / "nvidia_nccl_issue584_sendrecv_2ranks.log").events
    assert ev["name"].value_counts().to_dict() == {"Send": 6, "Recv": 1}
    # "root" is the peer for Send/Recv: the first four sends go to 1, the next two to 0; the recv is from 1.
    assert ev["peer"].tolist() == [1, 1, 1, 1, 0, 0, 1]
    assert ev["seq"].tolist() == [0x12, 0x14, 0x16, 0x18, 0xD60, 0xD62, 0xD60]


def test_nccl_log_init_complete_maps_comm_to_rank(traces_dir, tmp_path):
    init = traces_dir / "nccl_debug_logs" / "nvidia_nccl_issue1814_init_complete_64ranks.log"
    ts = _quiet_load(init)
    assert ts.ranks == (32, 34, 35, 36)
    assert ts.metadata[36]["nccl_comms"][0]["comm"] == "0x557fe785f7a0"
    # A COLL line on an initialised comm gets that rank and the shared commId as its group name.
    coll = ("hostname-test:984:1257 [4] NCCL INFO AllReduce: opCount 3 sendbuff 0x1 recvbuff 0x1 count 10 "
            "datatype 9 op 0 root 0 comm 0x557fe785f7a0 [nranks=64] stream 0x10\n")
    log = tmp_path / "job.log"
    log.write_text(init.read_text() + coll)
    ev = load(log).events
    assert ev[["rank", "seq", "msg_bytes", "pg_name"]].values.tolist() == [[36, 3, 20, "0x5ae77eb5ea4ec1ee"]]


def test_nsys_export_against_sql(traces_dir):
    path = traces_dir / "nsys_ai" / "tests" / "fixtures" / "h100_2gpu_1s.sqlite"
    ts = load(path)
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        # Two python processes, each on its own GPU: rank = order of the lowest device used.
        pid_dev = dict(con.execute("SELECT globalPid, MIN(deviceId) FROM CUPTI_ACTIVITY_KIND_KERNEL GROUP BY 1"))
        counts = dict(con.execute("SELECT deviceId, COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL GROUP BY 1"))
        h2d_pageable = con.execute("SELECT COUNT(*), SUM(bytes) FROM CUPTI_ACTIVITY_KIND_MEMCPY "
                                   "WHERE copyKind = 1 AND srcKind = 0").fetchone()
        first = con.execute("SELECT k.start, k.end - k.start, s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN "
                            "StringIds s ON s.id = k.demangledName ORDER BY k.start LIMIT 1").fetchone()
        nvtx = con.execute("SELECT COUNT(*) FROM NVTX_EVENTS WHERE end IS NOT NULL").fetchone()[0]
    finally:
        con.close()
    ev = ts.events
    assert ts.ranks == (0, 1) and sorted(pid_dev.values()) == [0, 1]
    kernels = ev[ev["cat"] == "kernel"]
    assert kernels.groupby("rank").size().to_dict() == {0: counts[0], 1: counts[1]}
    assert set(kernels.loc[kernels["rank"] == 1, "device"]) == {1}
    h2d = ev[ev["name"] == "Memcpy HtoD (Pageable -> Device)"]
    assert (len(h2d), int(h2d["msg_bytes"].sum())) == h2d_pageable
    assert set(h2d["memory_kind"]) == {"Pageable"}
    top = kernels.sort_values("start_ns").iloc[0]
    assert (top["start_ns"], top["dur_ns"], top["name"]) == first
    assert int((ev["cat"] == "nvtx").sum()) == nvtx
    assert ts.metadata[0]["schema_version"] == "3.25.0"


def test_nsys_schema_324(traces_dir):
    path = traces_dir / "nsys_ai" / "tests" / "fixtures" / "mock.sqlite"
    ts = load(path)
    ev = ts.events
    assert ts.metadata[0]["schema_version"] == "3.24.14"
    assert int((ev["cat"] == "kernel").sum()) == 2
    # The one memcpy: copyKind 2 (DtoH), srcKind 2 (Device), dstKind 1 (Pinned), read from the table by hand.
    memcpy = ev[ev["cat"] == "gpu_memcpy"].iloc[0]
    assert memcpy["name"] == "Memcpy DtoH (Device -> Pinned)" and memcpy["memory_kind"] == "Pinned"
    assert memcpy["category"] == "memcpy_d2h"


def test_flight_recorder_json(traces_dir):
    ev = load(traces_dir / "flight_recorder" / "fr_doc_example_rank0.json").events
    row = ev.iloc[0]
    # Entry: nccl:all_reduce on pg "0" (default_pg, ranks [0, 1]), seq 1, 3×4 floats = 48 bytes, started
    # unknown -> created 1724779239936775119, completed 1724779239975811724 -> 39036605 ns.
    assert (row["rank"], row["name"], row["collective"], row["seq"], row["msg_bytes"]) == \
        (0, "nccl:all_reduce", "all_reduce", 1, 48)
    assert (row["pg_name"], row["pg_desc"], row["pg_ranks"], row["pg_size"]) == ("0", "default_pg", "[0, 1]", 2)
    assert (row["start_ns"], row["dur_ns"]) == (1724779239936775119, 1724779239975811724 - 1724779239936775119)


def test_nccl_profiler_plugin_dump(traces_dir):
    path = traces_dir / "nccl_profiler_plugin" / "example_profiler_p2p_ring_4gpu.txt"
    with pytest.warns(TraceWarning, match="not strict JSON"):
        ts = load(path)
    ev = ts.events
    assert ts.ranks == (0, 1, 2, 3)
    assert ev["name"].value_counts().to_dict() == {"Send": 4, "Recv": 4}
    send0 = ev[(ev["rank"] == 0) & (ev["name"] == "Send")].iloc[0]
    # b at 1818542.097656 µs -> 1818542098 ns (rounded); e at 1818670.567871 µs -> 1818670568 ns.
    assert (send0["start_ns"], send0["dur_ns"]) == (1818542098, 1818670568 - 1818542098)
    assert (send0["peer"], send0["msg_bytes"]) == (1, 268435456 * 4)
    # The ring: rank r sends to r+1 and receives from r-1 (mod 4).
    sends = ev[ev["name"] == "Send"].set_index("rank")["peer"].to_dict()
    assert sends == {0: 1, 1: 2, 2: 3, 3: 0}


def test_quote_bare_tokens_leaves_strings_alone():
    text = b'{"a": ncclFloat32, "b": 0x1f, "c": "keep ncclFloat32, 0x2", "d": true, "e": [x1, 2]}'
    assert quote_bare_tokens(text) == \
        b'{"a": "ncclFloat32", "b": "0x1f", "c": "keep ncclFloat32, 0x2", "d": true, "e": ["x1", 2]}'


def test_nccl_log_timestamps_when_present(tmp_path):
    # A line prefixed with a timestamp gives start_ns = that instant (naive time read as UTC): 2024-05-01
    # 12:00:00.000123 = 1714564800 s + 123 µs.
    line = ("[2024-05-01 12:00:00.000123] node1:10:11 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x2 "
            "count 8 datatype 6 op 0 root 0 comm 0xabc [nranks=4] stream 0x5\n")
    log = tmp_path / "ts.log"
    log.write_text(line)
    with pytest.warns(TraceWarning, match="no Init COMPLETE"):
        row = load(log).events.iloc[0]
    assert row["start_ns"] == 1714564800 * 10**9 + 123_000
    assert row["msg_bytes"] == 8 * 2  # datatype 6 = half
