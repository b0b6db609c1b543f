"""Nsight Systems SQLite exports (``nsys export --type sqlite``, schema 3.24 / 3.25) -> events (source ``nsys``).

Tables read (each optional): ``CUPTI_ACTIVITY_KIND_KERNEL`` (name = ``demangledName`` via ``StringIds``),
``CUPTI_ACTIVITY_KIND_MEMCPY`` (named like Kineto, ``Memcpy HtoD (Pageable -> Device)``, from ``copyKind``,
``srcKind``, ``dstKind``; ``msg_bytes`` = ``bytes``), ``CUPTI_ACTIVITY_KIND_MEMSET`` (``Memset (Device)``),
``CUPTI_ACTIVITY_KIND_RUNTIME`` (CPU launch calls, name via ``nameId``; they carry the correlation id) and
``NVTX_EVENTS`` ranges (``text``, or ``StringIds`` through ``textId``; NCCL's own NVTX ranges included).
Times are the export's ns as stored (``start``/``end`` on the session clock), exactly.

Ranks: an export holds one or more processes; each process with CUDA activity is one rank. Without a rank
argument, processes are numbered in order of the lowest GPU they used (then pid) — what ``torchrun`` gives
when ``LOCAL_RANK`` selects the device, on one node. ``rank=N`` offsets that numbering (a single-process export
from rank N of a bigger job). GPU rows belong to their ``globalPid``; CPU rows (runtime, NVTX) to the process
of their thread (``globalTid`` with the low 24 thread bits cleared). Rows of processes without CUDA activity
are dropped.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd

from ..base.errors import TraceFormatError
from ..base.schema import conform, empty_events
from . import ReadResult
from ._kineto_columns import assign_steps

_COPY_KIND = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD", 9: "HtoH",
              10: "PtoP", 11: "HtoD", 12: "DtoH", 13: "DtoD"}
_MEM_KIND = {0: "Pageable", 1: "Pinned", 2: "Device", 3: "Array", 4: "Managed", 5: "Device", 6: "Managed"}
_THREAD_BITS = 0xFFFFFF
_NVTX_RANGES = (59, 60, 70, 71)  # push/pop, start/end ranges (CPU and NVTX-extension kinds)


def read_nsys(path: Path, *, rank: int | None = None) -> ReadResult:
    """Read one export (see the module docstring for the tables and the rank mapping)."""
    path = Path(path)
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as exc:
        raise TraceFormatError(f"{path}: not a readable SQLite database ({exc})") from exc
    try:
        return _read(path, con, tables, rank=rank)
    except (sqlite3.DatabaseError, pd.errors.DatabaseError) as exc:
        raise TraceFormatError(f"{path}: damaged Nsight export ({exc})") from exc
    finally:
        con.close()


def _read(path: Path, con: sqlite3.Connection, tables: set[str], *, rank: int | None) -> ReadResult:
    warnings: list[str] = []
    meta = dict(con.execute("SELECT name, value FROM META_DATA_EXPORT").fetchall()) \
        if "META_DATA_EXPORT" in tables else {}
    version = meta.get("EXPORT_SCHEMA_VERSION", "")
    if "StringIds" not in tables:
        raise TraceFormatError(f"{path}: SQLite file without StringIds: not an Nsight Systems export")
    if version and not version.startswith("3."):
        warnings.append(f"{path}: export schema {version} is untested (3.24 and 3.25 are)")
    strings = pd.read_sql_query("SELECT id, value FROM StringIds", con).set_index("id")["value"]
    parts = [_kernels(con, tables, strings), _memcpy(con, tables), _memset(con, tables),
             _runtime(con, tables, strings), _nvtx(con, tables, strings)]
    frame = pd.concat([p for p in parts if p is not None and len(p)], ignore_index=True) \
        if any(p is not None and len(p) for p in parts) else None
    if frame is None:
        warnings.append(f"{path}: export holds no kernel, memcpy, memset, runtime or NVTX rows")
        return ReadResult(empty_events(), metadata={rank if rank is not None else 0: {"nsys": meta}},
                          warnings=warnings)
    gpu = frame["lane"] == "gpu"
    order = (frame[gpu].groupby("process")["device"].min().reset_index()
             .sort_values(["device", "process"])["process"].to_numpy())
    rank_of = {int(p): i + (rank or 0) for i, p in enumerate(order)}
    frame["rank"] = frame["process"].map(rank_of).fillna(-1).astype(np.int64)
    dropped = int((frame["rank"] < 0).sum())
    if dropped:
        warnings.append(f"{path}: dropped {dropped} CPU rows of processes without CUDA activity")
    frame = frame[frame["rank"] >= 0].drop(columns="process")
    frame["name"] = frame["name"].astype("category")
    frame["source"] = "nsys"
    events = conform(frame)
    events["step"] = _steps(events)
    processes = _processes(con, tables)
    metadata = {r: {"nsys": meta, "schema_version": version, "globalPid": p, "pid": processes.get(p)}
                for p, r in rank_of.items()}
    return ReadResult(events.reset_index(drop=True), metadata=metadata, warnings=warnings)


def _steps(events: pd.DataFrame) -> np.ndarray:
    out = np.full(len(events), -1, dtype=np.int32)
    for _, index in events.groupby("rank", observed=True).indices.items():
        out[index] = assign_steps(events.iloc[index].reset_index(drop=True))
    return out


def _processes(con, tables) -> dict[int, int]:
    if "PROCESSES" not in tables:
        return {}
    return {int(g): int(p) for g, p in con.execute("SELECT globalPid, pid FROM PROCESSES")}


def _kernels(con, tables, strings) -> pd.DataFrame | None:
    if "CUPTI_ACTIVITY_KIND_KERNEL" not in tables:
        return None
    k = pd.read_sql_query("SELECT start, end, deviceId, streamId, correlationId, globalPid, demangledName "
                          "FROM CUPTI_ACTIVITY_KIND_KERNEL", con)
    return _gpu_rows(k, name=k["demangledName"].map(strings).fillna("").to_numpy(), cat="kernel")


def _memcpy(con, tables) -> pd.DataFrame | None:
    if "CUPTI_ACTIVITY_KIND_MEMCPY" not in tables:
        return None
    m = pd.read_sql_query("SELECT start, end, deviceId, streamId, correlationId, globalPid, bytes, copyKind, "
                          "srcKind, dstKind FROM CUPTI_ACTIVITY_KIND_MEMCPY", con)
    kind = m["copyKind"].map(_COPY_KIND).fillna("Unknown")
    src, dst = m["srcKind"].map(_MEM_KIND).fillna("Unknown"), m["dstKind"].map(_MEM_KIND).fillna("Unknown")
    name = ("Memcpy " + kind + " (" + src + " -> " + dst + ")").to_numpy()
    host = np.where(kind.str.startswith("H"), src, np.where(kind.str.endswith("H"), dst, "Device"))
    return _gpu_rows(m, name=name, cat="gpu_memcpy", msg_bytes=m["bytes"], memory_kind=host)


def _memset(con, tables) -> pd.DataFrame | None:
    if "CUPTI_ACTIVITY_KIND_MEMSET" not in tables:
        return None
    m = pd.read_sql_query("SELECT start, end, deviceId, streamId, correlationId, globalPid, bytes "
                          "FROM CUPTI_ACTIVITY_KIND_MEMSET", con)
    return _gpu_rows(m, name=np.full(len(m), "Memset (Device)", dtype=object), cat="gpu_memset",
                     msg_bytes=m["bytes"])


def _gpu_rows(t: pd.DataFrame, *, name, cat: str, msg_bytes=None, memory_kind=None) -> pd.DataFrame:
    return pd.DataFrame({
        "process": t["globalPid"].astype(np.int64), "lane": "gpu", "device": t["deviceId"],
        "stream": t["streamId"], "name": name, "cat": cat, "start_ns": t["start"],
        "dur_ns": (t["end"] - t["start"]).clip(lower=0), "correlation": t["correlationId"],
        "msg_bytes": msg_bytes if msg_bytes is not None else -1,
        "memory_kind": memory_kind if memory_kind is not None else "",
    })


def _runtime(con, tables, strings) -> pd.DataFrame | None:
    if "CUPTI_ACTIVITY_KIND_RUNTIME" not in tables:
        return None
    r = pd.read_sql_query("SELECT start, end, globalTid, correlationId, nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME",
                          con)
    return _cpu_rows(r, name=r["nameId"].map(strings).fillna("").to_numpy(), cat="cuda_runtime",
                     correlation=r["correlationId"])


def _nvtx(con, tables, strings) -> pd.DataFrame | None:
    if "NVTX_EVENTS" not in tables:
        return None
    n = pd.read_sql_query("SELECT start, end, globalTid, text, textId FROM NVTX_EVENTS WHERE end IS NOT NULL "
                          f"AND eventType IN {_NVTX_RANGES}", con)
    text = n["text"].where(n["text"].notna(), n["textId"].map(strings)).fillna("")
    return _cpu_rows(n, name=text.to_numpy(), cat="nvtx", correlation=-1)


def _cpu_rows(t: pd.DataFrame, *, name, cat: str, correlation) -> pd.DataFrame:
    tid = t["globalTid"].fillna(0).astype(np.int64)
    return pd.DataFrame({
        "process": tid & ~_THREAD_BITS, "lane": "cpu", "device": -1, "stream": tid & _THREAD_BITS,
        "name": name, "cat": cat, "start_ns": t["start"], "dur_ns": (t["end"] - t["start"]).clip(lower=0),
        "correlation": correlation,
    })
