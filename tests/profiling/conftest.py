"""Fixtures of the profiling tests: the synthetic-trace generator and the report readers (helper modules loaded by
path: tests use importlib mode), the DLRM report the report tests share, and the independent reference reading of
a Kineto trace that every decode path of the reader is checked against."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import types
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import numpy as np
import pytest


def _helper(name: str) -> types.ModuleType:
    """A helper module of this folder, loaded by path (the tests run in importlib mode: no package to import)."""
    spec = importlib.util.spec_from_file_location(f"shardline_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


synthetic_traces = _helper("synthetic_traces")
report_pages = _helper("report_pages")
job_traces = _helper("job_traces")


@pytest.fixture(scope="session")
def synth():
    """The generator module ``tests/profiling/synthetic_traces.py``."""
    return synthetic_traces


@pytest.fixture(scope="session")
def jobs():
    """The multi-rank job generator ``tests/profiling/job_traces.py`` (``write_job``)."""
    return job_traces


@pytest.fixture(scope="session")
def pages():
    """``tests/profiling/report_pages.py``: a rendered report's tables read back (``parse_html``, ``frame``,
    ``md_tables``)."""
    return report_pages


@pytest.fixture(scope="session")
def dlrm_report(traces_dir):
    """Eight real ranks (param's DLRM: Tesla V100-SXM2, NCCL all-reduce / all-to-all, pinned and pageable copies)
    and their report sections, ``(traceset, sections)``, loaded once for every report test."""
    from shardline.profiling.present.report_sections import report_sections
    from shardline.profiling.table.load import load

    ts = load(traces_dir / "param" / "dlrm_kineto")
    return ts, report_sections(ts)


# --- the reference: plain ``json`` with exact decimals, one event at a time, written from the format's rules
#     (the reader's module docstrings), sharing no code with the reader.

class _IntText(Decimal):
    """An integer literal of the JSON text (``parse_int``), told apart from a number with a fraction or an
    exponent (``parse_float`` gives a plain Decimal)."""


class NotModelled(Exception):
    """The document holds something the reference does not read (damage, a mistyped field, a duplicate
    key, invalid UTF-8 ...): the reader salvages or drops there, which other tests pin."""


_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), 2**31 - 1)
#: the columns the events table stores as int32, that a trace's integers fill (``rank`` aside)
NARROW = ("device", "pg_size", "peer")
_GPU = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "Kernel", "Memcpy", "Memset",
        "gpu_instant_event", "mtia_ccp_events", "hpu_op", "mlu_memcpy", "mlu_memset", "mlu_user_annotation",
        "GCU_MEMCPY", "GCU_MEMSET", "GCU_USER_ANNOTATION"}
_DROPPED = {"Trace", "ac2g", "fwdbwd", "async", "flow"}
_PYTHON = {"python_function", "python"}
#: bytes per element of torch's scalar types, as the profiler names them
_ELEMENT = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Int": 4, "Long": 8, "Short": 2, "Char": 1,
            "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "ComplexHalf": 4, "Float8_e4m3fn": 1,
            "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1, "UInt16": 2, "UInt32": 4, "UInt64": 8}
_KNOWN = {"ph", "cat", "name", "pid", "tid", "ts", "dur", "args", "correlation", "External id", "external id",
          "device", "stream", "bytes", "Collective name", "Process Group Name", "Process Group Description",
          "Process Group Ranks", "Group size", "In msg nelems", "Out msg nelems", "dtype", "Seq", "Src Rank",
          "Dst Rank", "traceEvents", "baseTimeNanoseconds", "distributedInfo"}
#: the columns every path builds (the rest are derived from them by code all paths share)
COMPARED = ("start_ns", "dur_ns", "name", "cat", "lane", "device", "stream", "correlation", "external_id",
            "collective", "pg_name", "pg_desc", "pg_ranks", "pg_size", "msg_bytes", "seq", "peer")


def _pairs(pairs):
    keys = [key for key, _ in pairs]
    if "traceEvents" in keys:  # the top level: a repeated key's last value counts (as for both decoders)
        return dict(pairs)
    if len(set(keys)) != len(keys) and any(keys.count(k) > 1 for k in _KNOWN):
        raise NotModelled("a known key twice")
    return dict(pairs)


def _null_constant(text):
    # The reader's rule (``readers/kineto.py``): a bare NaN, Infinity or -Infinity, which JSON lacks and some
    # writers emit, is read as null.
    return None


def _text(value) -> str:
    if not isinstance(value, str):
        raise NotModelled(f"text expected, got {value!r}")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in value):  # a lone surrogate escape, or invalid UTF-8
        raise NotModelled("a text that is not valid Unicode")
    return value


def _from_text(text: str, overflow: list) -> int:
    """An integer written as text: Python's int() of it, else hex after ``0x``, else its last run of digits."""
    try:
        number = int(text)
    except ValueError:
        number = None
    if number is not None:
        if _INT64[0] <= number <= _INT64[1]:
            return number
        overflow.append(text)
        return -1
    if text.startswith("0x"):
        try:
            return int(text, 16) if len(text) <= 18 else -1
        except ValueError:
            return -1
    digits = re.search(r"(\d+)\s*$", text)
    return int(digits.group(1)) if digits and len(digits.group(1)) < 19 else -1


def _integer(value, overflow: list, *, text_too: bool = False) -> int:
    if value is None:
        raise NotModelled("null where an integer belongs")
    if isinstance(value, str) and text_too:
        return _from_text(_text(value), overflow)
    if not isinstance(value, _IntText):
        raise NotModelled(f"integer expected, got {value!r}")
    if _INT64[0] <= int(value) <= _INT64[1]:
        return int(value)
    overflow.append(value)
    return -1


def _ns(value) -> int:
    """µs -> ns exactly, half away from zero beyond the third decimal."""
    if not isinstance(value, Decimal):
        raise NotModelled(f"a time that is not a number: {value!r}")
    ns = int((value * 1000).to_integral_value(rounding=ROUND_HALF_UP))
    if not _INT64[0] < ns <= _INT64[1]:
        raise NotModelled("a time beyond int64 ns")
    return ns


def _event_row(event, overflow: list) -> dict:
    if not isinstance(event, dict):
        raise NotModelled("an event that is not an object")
    args = event.get("args")
    if args is not None and not isinstance(args, dict):
        raise NotModelled("args that are not an object")
    args = args or {}
    row = {key: _text(event[key]) if key in event else "" for key in ("ph", "cat", "name")}
    row["pid"] = _integer(event["pid"], overflow, text_too=True) if "pid" in event else -1
    row["tid"] = _integer(event["tid"], overflow, text_too=True) if "tid" in event else -1
    row["ts"] = _ns(event["ts"]) if "ts" in event else 0
    row["dur"] = _ns(event["dur"]) if "dur" in event else 0

    def arg(key, *, text_too=False):
        return _integer(args[key], overflow, text_too=text_too) if key in args else -1

    def arg_text(key):
        value = args.get(key)
        if isinstance(value, list) and key == "Process Group Ranks":
            return "[" + ", ".join(str(v) for v in value) + "]" if value else ""
        if isinstance(value, _IntText) and key == "Process Group Name":
            return str(value) if value else ""
        return _text(value) if key in args else ""

    for key in ("correlation", "bytes", "Group size", "In msg nelems", "Out msg nelems"):
        row[key] = arg(key)
    for key in ("device", "stream", "Seq"):
        row[key] = arg(key, text_too=True)
    # The lower-case (2021) key, and Src Rank, are read only where the first key is absent or -1; a first key
    # beyond int64 stays -1 (counted), never the other key's value.
    for column, key, other in (("external_id", "External id", "external id"), ("peer", "Dst Rank", "Src Rank")):
        first = args.get(key, _IntText(-1))
        row[column] = arg(other) if isinstance(first, _IntText) and first == -1 else arg(key)
    for key in ("Collective name", "Process Group Name", "Process Group Description", "Process Group Ranks",
                "dtype"):
        row[key] = arg_text(key)
    return row


def _columns_of(row: dict, narrowed: dict) -> dict:
    """The compared columns of a kept row. An int32 column's integer beyond int32 is -1, counted per column in
    ``narrowed``; a device arg beyond int32 is absent, as one beyond int64 is (a GPU row then takes its pid)."""

    def fit(value: int, column: str) -> int:
        if _INT32[0] <= value <= _INT32[1]:
            return value
        narrowed[column] += 1
        return -1

    gpu = row["cat"] in _GPU
    nelems = max(row["In msg nelems"], row["Out msg nelems"])
    size = _ELEMENT.get(row["dtype"], -1)
    collective = nelems * size if nelems >= 0 and size > 0 else -1
    device = fit(row["device"], "device")
    return {
        "start_ns": row["ts"], "dur_ns": row["dur"], "name": row["name"], "cat": row["cat"],
        "lane": "gpu" if gpu else "cpu",
        "device": (device if device >= 0 else fit(row["pid"], "device")) if gpu else -1,
        "stream": row["stream"] if gpu and row["stream"] >= 0 else row["tid"],
        "correlation": row["correlation"], "external_id": row["external_id"],
        "collective": row["Collective name"], "pg_name": row["Process Group Name"],
        "pg_desc": row["Process Group Description"], "pg_ranks": row["Process Group Ranks"],
        "pg_size": fit(row["Group size"], "pg_size"),
        "msg_bytes": row["bytes"] if row["bytes"] >= 0 else collective,
        "seq": row["Seq"], "peer": fit(row["peer"], "peer"), "_ph": row["ph"], "_pid": row["pid"],
    }


def _pair(rows: list[dict]) -> tuple[list[dict], int]:
    """Complete events, then each B closed by its E (same pid and stream, innermost first) in the order the
    E's come by start time; the unmatched count."""
    complete = [r for r in rows if r["_ph"] == "X"]
    marks = sorted((r for r in rows if r["_ph"] in ("B", "E")), key=lambda r: r["start_ns"])
    open_ranges: dict = {}
    closed = []
    for r in marks:
        stack = open_ranges.setdefault((r["_pid"], r["stream"]), [])
        if r["_ph"] == "B":
            stack.append(r)
        elif stack:
            begin = stack.pop()
            closed.append({**begin, "dur_ns": r["start_ns"] - begin["start_ns"]})
    return complete + closed, len(marks) - 2 * len(closed)


def reference_read(path: Path, *, keep_python: bool = False) -> dict:
    """Expected events columns (``COMPARED``) and warnings facts of a Kineto trace, read with plain
    ``json`` (every number an exact Decimal); raises ``NotModelled`` where it does not read the document."""
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    try:
        # Invalid UTF-8 is kept as surrogates, so that it is refused only in a text the reader reads.
        text = data.decode("utf-8", errors="surrogateescape")
        top = json.loads(text, parse_float=Decimal, parse_int=_IntText, parse_constant=_null_constant,
                         object_pairs_hook=_pairs)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotModelled(str(exc)) from None
    if not isinstance(top, dict) or not isinstance(top.get("traceEvents"), list):
        raise NotModelled("not a trace object")
    base = top.get("baseTimeNanoseconds")
    if base is not None and not isinstance(base, _IntText):
        raise NotModelled("a base that is not an integer")
    dropped = _DROPPED if keep_python else _DROPPED | _PYTHON
    overflow: list = []
    narrowed = dict.fromkeys(NARROW, 0)
    rows = []
    for event in top["traceEvents"]:
        beyond: list = []
        row = _event_row(event, beyond)
        if row["ph"] in ("X", "B", "E") and row["cat"] not in dropped:
            # Only a kept event's integers are counted: a dropped one's values go into no column.
            overflow += beyond
            rows.append(_columns_of(row, narrowed))
    rows, unmatched = _pair(rows)
    base = int(base) if base else 0
    relative = bool(base and rows and max(r["start_ns"] for r in rows) > _INT64[1] - base)
    columns = {key: [r[key] for r in rows] for key in COMPARED}
    if not relative:  # else the times stay relative to the base, with a warning
        columns["start_ns"] = [start + base for start in columns["start_ns"]]
    return {"path": str(path), "columns": columns, "overflow": len(overflow), "narrowed": narrowed,
            "unmatched": unmatched, "relative": relative}


def assert_reads_as_reference(result, expected: dict, label: str) -> None:
    """A reader's result equals the reference: the compared columns value for value, in order, and the
    overflow and B/E warnings exactly when the reference counts some (the int32 ones word for word, naming the
    file and the column)."""
    events = result.events
    assert len(events) == len(expected["columns"]["start_ns"]), label
    for key in COMPARED:
        got = events[key].astype(object).tolist() if events[key].dtype == object or \
            hasattr(events[key], "cat") else events[key].to_numpy(dtype=np.int64).tolist()
        assert got == expected["columns"][key], f"{label}: column {key}"
    overflowed = [w for w in result.warnings if "integer args beyond int64" in w]
    assert bool(overflowed) == bool(expected["overflow"]), (label, result.warnings)
    if expected["overflow"]:
        assert f": {expected['overflow']} integer args" in overflowed[0], (label, overflowed)
    for column, count in expected["narrowed"].items():
        said = [w for w in result.warnings if f"beyond int32 in the {column} column" in w]
        assert said == ([f"{expected['path']}: {count} integer values beyond int32 in the {column} column were "
                         "set to -1"] if count else []), (label, column, result.warnings)
    unpaired = [w for w in result.warnings if "B/E events without a partner" in w]
    assert bool(unpaired) == bool(expected["unmatched"]), (label, result.warnings)
    relative = [w for w in result.warnings if "overflows int64; times kept relative" in w]
    assert bool(relative) == expected["relative"], (label, result.warnings)


@pytest.fixture(scope="session")
def reference():
    """The reference reading: ``reference.read(path)``, ``reference.check(result, expected, label)``,
    ``reference.NotModelled``."""
    return types.SimpleNamespace(read=reference_read, check=assert_reads_as_reference, NotModelled=NotModelled)


@pytest.fixture
def read_paths():
    """``read_paths(path, keep_python=False)``: read a Kineto file on every decode path, each forced alone
    (``read_kineto(force=...)``: a path either reads the whole document itself or refuses it), and by the
    default plan; check each reading against the reference (``reference_read``), or, where the reference
    does not read the document, that the native path refuses it; return the default reading's events."""
    from shardline.profiling.readers import kineto
    from shardline.profiling.readers._plan import DecodePath, PathRefused, native_built

    def read(path, *, keep_python=False):
        try:
            expected = reference_read(path, keep_python=keep_python)
        except NotModelled:
            expected = None
        for way in DecodePath:
            if way is DecodePath.NATIVE and not native_built():
                continue
            try:
                result = kineto.read_kineto(path, force=way, keep_python=keep_python)
            except PathRefused:
                continue
            if result.skipped:  # no trace (every path says so alike: it is told before any decoding)
                continue
            assert expected is not None or way is not DecodePath.NATIVE, \
                f"{path}: the {way.value} path read a document the reference does not model"
            if expected is not None:
                assert_reads_as_reference(result, expected, f"{path} [{way.value}]")
        default = kineto.read_kineto(path, keep_python=keep_python)
        if expected is not None:
            assert_reads_as_reference(default, expected, f"{path} [default plan]")
        return default.events

    return read
