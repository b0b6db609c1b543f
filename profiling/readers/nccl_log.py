"""NCCL_DEBUG=INFO logs -> events (source ``nccl_log``).

Lines used (any prefix before ``host:pid:tid [cudaDev]`` is skipped, e.g. Ray's ``(RayTrainWorker pid=…)``)::

    host:pid:tid [dev] NCCL INFO AllReduce: opCount 1a sendbuff 0x… recvbuff 0x… count 64 datatype 7 op 0
        root 0 comm 0x7f0c741162f0 [nranks=2] stream 0x7f0c74002f00
    host:pid:tid [dev] NCCL INFO comm 0x557fe785f7a0 rank 36 nranks 64 cudaDev 4 nvmlDev 4 busId 9b000
        commId 0x5ae77eb5ea4ec1ee - Init COMPLETE                      (older NCCL: no commId, no "Init")

Each COLL line is one row: ``name`` and ``collective`` the NCCL op (``AllReduce``, ``Send`` ...), ``seq`` the
opCount (hex in the log), ``msg_bytes`` = count × datatype size (× nranks for AllGather, whose count is per
rank; ReduceScatter's count is its output, so × nranks too), ``peer`` the ``root`` field of Send/Recv,
``pg_size`` nranks, ``pg_name`` the communicator's ``commId`` when an Init line gave it (shared by all ranks of
the communicator) else the comm pointer, ``device`` the ``[cudaDev]``, ``stream`` the stream pointer.
The rank comes from the Init line of the same comm pointer; a comm without one gives rows with rank ``-1``
and a warning. The log gives order and sizes, not times: ``start_ns`` is the line's timestamp when the line
starts with one (``NCCL_DEBUG_TIMESTAMP_FORMAT``), else -1, and ``dur_ns`` is 0.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from ..base.errors import TraceFormatError
from ..base.schema import conform, empty_events
from . import ReadResult

#: ncclDataType_t -> bytes (int8, uint8, int32, uint32, int64, uint64, half, float, double, bfloat16, fp8 x2).
NCCL_DTYPE_BYTES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}
_PREFIX = r"(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] NCCL INFO "
_COLL = re.compile(
    _PREFIX + r"(?P<op>\w+): opCount (?P<opcount>[0-9a-fA-F]+) sendbuff (?P<send>\S+) recvbuff (?P<recv>\S+) "
    r"count (?P<count>\d+) datatype (?P<dtype>\d+) op (?P<redop>\d+) root (?P<root>-?\d+) comm (?P<comm>0x[0-9a-fA-F]+)"
    r" \[nranks=(?P<nranks>\d+)\] stream (?P<stream>0x[0-9a-fA-F]+|\(nil\))")
_INIT = re.compile(
    _PREFIX + r"comm (?P<comm>0x[0-9a-fA-F]+) rank (?P<rank>\d+) nranks (?P<nranks>\d+) cudaDev (?P<cudadev>\d+)"
    r"(?:.*?commId (?P<commid>0x[0-9a-fA-F]+))?")
_TIMESTAMP = re.compile(r"^\[?(?P<date>\d{4}-\d\d-\d\d)[T ](?P<time>\d\d:\d\d:\d\d(?:\.\d+)?)")
_PER_RANK_COUNT = ("AllGather", "ReduceScatter")


def read_nccl_log(path: Path, *, rank: int | None = None) -> ReadResult:
    """Parse one NCCL_DEBUG log (see the module docstring). ``rank`` is unused: ranks come from the log."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read file ({exc})") from exc
    comms: dict[str, dict] = {}
    rows = []
    for line in text.splitlines():
        if "NCCL INFO" not in line:
            continue
        init = _INIT.search(line)
        if init:
            comms[init["comm"]] = {"rank": int(init["rank"]), "nranks": int(init["nranks"]),
                                   "commId": init["commid"] or "", "host": init["host"], "pid": int(init["pid"]),
                                   "cudaDev": int(init["cudadev"])}
            continue
        coll = _COLL.search(line)
        if coll:
            rows.append((coll, _timestamp_ns(line)))
    warnings: list[str] = []
    if not rows:
        metadata = _metadata(comms)
        if not comms:
            warnings.append(f"{path}: NCCL log without COLL or Init COMPLETE lines; nothing to read")
        return ReadResult(empty_events(), metadata=metadata, warnings=warnings)
    frame = _frame(rows, comms)
    unknown = sorted({m["comm"] for m, _ in rows if m["comm"] not in comms})
    if unknown:
        warnings.append(f"{path}: no Init COMPLETE line for communicators {unknown[:8]}"
                        f"{' …' if len(unknown) > 8 else ''}: their {int((frame['rank'] < 0).sum())} rows have "
                        "rank -1 (set NCCL_DEBUG=INFO from the start of the job to get them)")
    return ReadResult(conform(frame), metadata=_metadata(comms), warnings=warnings)


def _frame(rows: list, comms: dict[str, dict]) -> pd.DataFrame:
    # Few rows per log (one per collective call), so building them from the regex matches is cheap.
    ops = [m["op"] for m, _ in rows]
    nranks = np.array([int(m["nranks"]) for m, _ in rows], dtype=np.int64)
    count = np.array([int(m["count"]) for m, _ in rows], dtype=np.int64)
    size = np.array([NCCL_DTYPE_BYTES.get(int(m["dtype"]), -1) for m, _ in rows], dtype=np.int64)
    per_rank = np.array([op in _PER_RANK_COUNT for op in ops])
    msg = np.where(size > 0, count * size * np.where(per_rank, nranks, 1), -1)
    p2p = np.array([op in ("Send", "Recv") for op in ops])
    comm_info = [comms.get(m["comm"], {}) for m, _ in rows]
    return pd.DataFrame({
        "rank": [info.get("rank", -1) for info in comm_info],
        "lane": "gpu",
        "device": [int(m["dev"]) for m, _ in rows],
        "stream": [0 if m["stream"] == "(nil)" else int(m["stream"], 16) for m, _ in rows],
        "name": ops,
        "cat": "nccl_coll",
        "start_ns": [ts for _, ts in rows],
        "dur_ns": 0,
        "collective": ops,
        "pg_name": [info.get("commId") or m["comm"] for (m, _), info in zip(rows, comm_info)],
        "pg_size": nranks,
        "seq": [int(m["opcount"], 16) for m, _ in rows],
        "msg_bytes": msg,
        "peer": np.where(p2p, [int(m["root"]) for m, _ in rows], -1),
        "source": "nccl_log",
    })


def _timestamp_ns(line: str) -> int:
    match = _TIMESTAMP.match(line)
    if not match:
        return -1
    try:
        return int(pd.Timestamp(f"{match['date']} {match['time']}").value)
    except ValueError:
        return -1


def _metadata(comms: dict[str, dict]) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for pointer, info in comms.items():
        out.setdefault(info["rank"], {}).setdefault("nccl_comms", []).append({"comm": pointer, **info})
    return out
