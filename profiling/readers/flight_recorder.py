"""PyTorch NCCL flight-recorder dumps in JSON form -> events (source ``flight_recorder``).

Real dumps are pickles (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``); we never unpickle files (that runs code), so
only the JSON form (``torch.distributed`` can write ``--json``/``dump_nccl_trace_json``, and tools convert) is
read. One row per entry: ``name`` the ``profiling_name`` (``nccl:all_reduce``), ``collective`` the part after
``nccl:``, ``pg_name``/``pg_desc`` from ``process_group``, ``pg_ranks`` from ``pg_config``, ``seq`` the
``collective_seq_id`` (``p2p_seq_id`` for p2p), ``msg_bytes`` the larger of the input and output sizes ×
dtype size, ``start_ns`` the discovered start (else the creation time) and ``dur_ns`` completed − start when
both are known, else 0. The rows are on the ``cpu`` lane (the recorder watches the host side of each work
item), ``cat`` "flight_recorder". Rank: the dump's ``rank`` field, else ``rank=``, else the file name.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import msgspec
import pandas as pd

from ..base.errors import TraceFormatError
from ..base.schema import conform, empty_events
from . import ReadResult
from ._buffers import read_bytes, too_deep
from ._kineto_columns import DTYPE_BYTES
from .kineto import rank_from_name


def read_flight_recorder(path: Path, *, rank: int | None = None) -> ReadResult:
    """Read one JSON flight-recorder dump (see the module docstring)."""
    path = Path(path)
    try:
        dump = msgspec.json.decode(read_bytes(path))
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: invalid flight-recorder JSON ({exc})") from exc
    except RecursionError:
        raise too_deep(path) from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries", []), list):
        raise TraceFormatError(f"{path}: flight-recorder dump without an entries list")
    own = dump.get("rank")
    file_rank = own if isinstance(own, int) else rank if rank is not None else rank_from_name(path)
    file_rank = -1 if file_rank is None else file_rank
    groups = dump.get("pg_config") if isinstance(dump.get("pg_config"), dict) else {}
    warnings: list[str] = []
    rows = []
    for entry in dump.get("entries") or []:
        try:
            rows.append(_row(entry, groups))
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            warnings.append(f"{path}: skipped a malformed entry ({type(exc).__name__}: {exc})")
    metadata = {file_rank: {"flight_recorder": {k: v for k, v in dump.items() if k != "entries"}}}
    if not rows:
        return ReadResult(empty_events(), metadata=metadata, warnings=warnings)
    frame = pd.DataFrame(rows)
    frame["rank"] = file_rank
    return ReadResult(conform(frame), metadata=metadata, warnings=warnings)


def _row(entry: dict, groups: dict) -> dict:
    name = str(entry.get("profiling_name", ""))
    group = entry.get("process_group") or ["", ""]
    pg_name, pg_desc = (str(group[0]), str(group[1])) if len(group) > 1 else (str(group[0]), "")
    ranks = (groups.get(pg_name) or {}).get("ranks", "")
    started = entry.get("time_discovered_started_ns")
    completed = entry.get("time_discovered_completed_ns")
    start = started if isinstance(started, int) else int(entry.get("time_created_ns") or -1)
    p2p = bool(entry.get("is_p2p"))
    return {
        "lane": "cpu", "name": name, "cat": "flight_recorder", "start_ns": start,
        "dur_ns": completed - start if isinstance(completed, int) and start >= 0 and completed >= start else 0,
        "collective": name.split(":", 1)[-1], "pg_name": pg_name, "pg_desc": pg_desc,
        "pg_ranks": ranks if isinstance(ranks, str) else str(list(ranks)),
        "pg_size": len(ranks.strip("[]").split(",")) if isinstance(ranks, str) and ranks.strip("[]") else -1,
        "seq": int(entry.get("p2p_seq_id" if p2p else "collective_seq_id", -1)),
        "msg_bytes": max(_bytes(entry.get("input_sizes"), entry.get("input_dtypes")),
                         _bytes(entry.get("output_sizes"), entry.get("output_dtypes"))),
        "source": "flight_recorder",
    }


def _bytes(sizes, dtypes) -> int:
    if not sizes or not dtypes:
        return -1
    per = [DTYPE_BYTES.get(str(d), -1) for d in dtypes]
    if min(per) < 0:
        return -1
    return sum(prod(shape) * b for shape, b in zip(sizes, per))
