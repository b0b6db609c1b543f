"""Dumps of NCCL's example profiler plugin (``ext-profiler/example``) -> events (source ``nccl_profiler``).

The plugin writes a Chrome-trace-like array that is *not* strict JSON: enum values appear bare
(``"datatype": ncclFloat32``) and pointers as bare hex (``"Stream": 0x262ca50``). We quote those two token
kinds (outside strings only), then decode. Kept: the ``COLL`` and ``P2P`` begin/end pairs (``ph`` b/e, paired by
``id`` within a process), one row each: ``rank`` and ``peer`` from ``Rank``/``Peer``, ``pg_name`` the
``CommHash``, ``msg_bytes`` = ``Count`` × datatype size, ``seq`` the ``SeqNum`` when present; lane ``gpu``
(the plugin times the network/kernel side), times µs → ns from the number text. Everything else (group API,
kernel-channel, proxy states) is dropped: no analysis uses it.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd

from ..base.errors import TraceFormatError
from ..base.schema import conform, empty_events
from . import ReadResult
from ._buffers import read_bytes, too_deep
from ._numtext import decimal_texts_to_scaled

_DTYPE_BYTES = {"ncclInt8": 1, "ncclUint8": 1, "ncclInt32": 4, "ncclUint32": 4, "ncclInt64": 8, "ncclUint64": 8,
                "ncclFloat16": 2, "ncclFloat32": 4, "ncclFloat64": 8, "ncclBfloat16": 2, "ncclFloat8e4m3": 1,
                "ncclFloat8e5m2": 1, "ncclChar": 1, "ncclInt": 4, "ncclHalf": 2, "ncclFloat": 4, "ncclDouble": 8}
# A JSON string, or (outside strings) a bare hex number / bare identifier in value position.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|(?<=[:\[,\s])(0x[0-9a-fA-F]+|[A-Za-z_]\w*)(?=\s*[,}\]])')
_KEEP = (b"true", b"false", b"null")


class _Event(msgspec.Struct):
    name: str = ""
    cat: str = ""
    ph: str = ""
    id: int = -1
    pid: int = -1
    ts: msgspec.Raw = msgspec.Raw(b"0")
    args: dict | None = None


def quote_bare_tokens(data: bytes) -> bytes:
    """Make the plugin's output JSON: quote bare hex and identifiers that stand where a value belongs."""
    def fix(match: re.Match) -> bytes:
        token = match.group(1)
        if token is None or token in _KEEP:
            return match.group(0)
        return b'"' + token + b'"'
    return _TOKENS.sub(fix, data)


def read_nccl_profiler(path: Path, *, rank: int | None = None) -> ReadResult:
    """Read one profiler-plugin dump (see the module docstring); ``rank`` is unused (rows carry ``Rank``)."""
    path = Path(path)
    data = quote_bare_tokens(read_bytes(path))
    try:
        events = msgspec.json.decode(data, type=list[_Event])
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: unreadable NCCL profiler dump even after quoting bare tokens ({exc})") \
            from exc
    except RecursionError:
        raise too_deep(path) from None
    warnings = [f"{path}: NCCL profiler-plugin output is not strict JSON; bare enum/hex tokens were quoted"]
    begins: dict = {}
    rows = []
    for ev in events:
        if ev.cat not in ("COLL", "P2P"):
            continue
        key = (ev.pid, ev.cat, ev.id)
        if ev.ph == "b":
            begins[key] = ev
        elif ev.ph == "e" and key in begins:
            rows.append((begins.pop(key), ev))
    if begins:
        warnings.append(f"{path}: {len(begins)} COLL/P2P events without an end were dropped")
    if not rows:
        return ReadResult(empty_events(), warnings=warnings)
    return ReadResult(conform(_frame(rows)), metadata={}, warnings=warnings)


def _frame(rows: list) -> pd.DataFrame:
    texts = np.array([bytes(b.ts) for b, _ in rows] + [bytes(e.ts) for _, e in rows], dtype="S")
    ns, _ = decimal_texts_to_scaled(texts, scale_digits=3)
    start, end = ns[:len(rows)], ns[len(rows):]
    args = [b.args or {} for b, _ in rows]
    count = np.array([int(a.get("Count", -1)) for a in args], dtype=np.int64)
    size = np.array([_DTYPE_BYTES.get(str(a.get("Datatype")), -1) for a in args], dtype=np.int64)
    return pd.DataFrame({
        "rank": [int(a.get("Rank", -1)) for a in args], "lane": "gpu", "name": [b.name for b, _ in rows],
        "cat": [b.cat for b, _ in rows], "start_ns": start, "dur_ns": np.maximum(end - start, 0),
        "collective": [b.name for b, _ in rows], "pg_name": [str(a.get("CommHash", "")) for a in args],
        "seq": [int(a.get("SeqNum", -1)) for a in args], "peer": [int(a.get("Peer", -1)) for a in args],
        "msg_bytes": np.where((count >= 0) & (size > 0), count * size, -1), "source": "nccl_profiler",
    })
