"""The native Kineto scanner (``_kscan``) reads a document exactly, or refuses it.

Every case reads one file on every decode path (the ``read_paths`` fixture: each path forced alone, checked
against the independent ``json`` + ``Decimal`` reading of ``conftest``, and where that reading declines the
input, the native path must refuse it); each case also says whether the scanner must have
accepted or refused it, so a scanner that silently never runs, or runs where it cannot be exact, fails.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline.profiling.readers import _buffers, _kineto_native, kineto
from shardline.profiling.readers._plan import DecodePath
from shardline.profiling.table.load import _discover

_kscan = _buffers._kscan
needs_scanner = pytest.mark.skipif(_kscan is None, reason="the native scanner was not built (no C compiler)")


def test_scanner_is_built_where_a_compiler_exists():
    # optional=True lets a machine without a compiler install shardline; one with a compiler must get it.
    if shutil.which("cc") or shutil.which("gcc"):
        assert _kscan is not None, "a C compiler exists but shardline.profiling.readers._kscan was not built"
    else:
        pytest.skip("no C compiler on this machine")


def _accepts(path: Path) -> bool:
    """Whether the native path reads the file (the scanner, then the unescaping of its texts)."""
    return _kineto_native.read(_buffers.read_bytes(path), keep_python=False) is not None


@needs_scanner
def test_every_shared_kineto_trace_reads_natively(traces_dir, read_paths):
    # The check of every path against the reference on every shared trace is test_reader_paths.py; here: the
    # scanner takes every one of them, and the traces read with ``keep_python`` (Python stacks kept) read as
    # the reference too.
    files = [path for path, fmt in _discover(traces_dir) if "kineto" in str(fmt).lower()]
    assert len(files) >= 30
    for path in files:
        if path.stat().st_size < 4 << 20:
            read_paths(path, keep_python=True)
            skipped = bool(kineto.read_kineto(path).skipped)
        else:  # the big shared files are all traces
            skipped = False
        # Every shared Kineto trace is intact, typed as the ordinary path expects: the scanner takes them all
        # (an execution trace, JSON without traceEvents, is the ordinary path's to name and skip).
        assert _accepts(path) is not skipped, f"{path}: the native path accepted it: {not skipped}"


def _write(tmp_path, events: list[str], *, top_extra: str = ', "baseTimeNanoseconds": 1700000000000000000',
           name: str = "rank0.json", raw: bytes | None = None) -> Path:
    path = tmp_path / name
    if raw is None:
        raw = ('{"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": [' + ",\n".join(events) + "]"
               + top_extra + "}").encode("utf-8", errors="surrogatepass")
    path.write_bytes(raw)
    return path


def _op(ts="10.125", dur="2.5", name="aten::mm", args='"External id": 7', extra="", pid="1", tid="2") -> str:
    return (f'{{"ph": "X", "cat": "cpu_op", "name": "{name}", "pid": {pid}, "tid": {tid}, "ts": {ts}, '
            f'"dur": {dur}{extra}, "args": {{{args}}}}}')


def _kernel(ts="20.5", args='"stream": 7, "correlation": 5, "device": 0') -> str:
    return (f'{{"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": {ts}, "dur": 1, '
            f'"args": {{{args}}}}}')


_COMM = ('"Collective name": "allreduce", "Process Group Name": "3", "Process Group Description": "tp", '
         '"Process Group Ranks": "[0, 1]", "Group size": 2, "In msg nelems": 1024, "Out msg nelems": 1024, '
         '"dtype": "BFloat16", "Seq": 4, "correlation": 9')

#: (case, events or raw document, whether the scanner reads it): each is also compared with the ordinary path.
CASES = [
    ("plain", [_op(), _kernel()], True),
    ("absolute µs with ns", [_op(ts="1694128201435418.123", dur="0.001")], True),
    ("negative and integer times", [_op(ts="-5.5", dur="3"), _op(ts="0", dur="0.1")], True),
    ("no decimals beyond three", [_op(ts="1.1234")], False),
    ("exponent time", [_op(ts="1e3")], False),
    ("time as text", [_op(ts='"12.5"')], False),
    ("time null", [_op(ts="null")], False),
    ("ns beyond int64", [_op(ts="9223372036854775.808")], False),
    ("largest ns the scanner takes", [_op(ts="9223372036854774.999")], True),
    ("text pid and tid", [_op(pid='"Spans"', tid='"stream 7"'), _op(pid='"0x1f"', tid='"12"')], True),
    ("text pid beyond int64 (counted as an overflow)", [_op(pid='"99999999999999999999"')], True),
    ("integer beyond int64", [_op(args='"External id": 9223372036854775808')], False),
    ("int64 bounds", [_op(args='"External id": 9223372036854775807, "correlation": -9223372036854775808')], True),
    ("float where an int belongs", [_op(args='"External id": 7.0')], False),
    ("null arg", [_op(args='"External id": null')], False),
    ("args null", [_op().replace('"args": {"External id": 7}', '"args": null')], True),
    ("args not an object", [_op().replace('"args": {"External id": 7}', '"args": [1]')], False),
    ("ranks as a list", [_op(args='"Process Group Ranks": [0, 1]')], False),
    ("group name as a number", [_op(args='"Process Group Name": 3')], False),
    ("collective args", [_op(name="record_param_comms", args=_COMM), _kernel(args=_COMM)], True),
    ("legacy external id and src rank",
     [_op(args='"external id": 11, "Src Rank": 1'), _op(args='"External id": -1, "external id": 12')], True),
    ("text device and stream (ROCm)", [_kernel(args='"stream": "0x0", "device": "3", "correlation": 5')], True),
    ("escaped name merges with the plain one",
     [_op(name="aten::mm"), _op(name="aten::\\u006dm"), _op(name='quote \\" and \\\\ and \\n')], True),
    ("escaped key", [_op(extra=', "\\u0064ur": 9')], False),
    ("duplicate known key", [_op(extra=', "dur": 9')], False),
    ("duplicate unknown key", [_op(extra=', "x": 1, "x": 2')], True),
    ("duplicate arg", [_op(args='"External id": 7, "External id": 8')], False),
    ("nested unknown values", [_op(extra=', "x": {"a": [1, 2.5e-3, true, false, null, "s", {"b": []}]}')], True),
    ("missing fields take the defaults", ['{"ph": "X"}', '{}', '{"name": "n", "ts": 1}'], True),
    ("phases and dropped categories",
     ['{"ph": "B", "cat": "user_annotation", "name": "r", "pid": 1, "tid": 1, "ts": 1}',
      '{"ph": "E", "cat": "user_annotation", "name": "r", "pid": 1, "tid": 1, "ts": 5}',
      '{"ph": "s", "cat": "ac2g", "name": "f", "id": 3, "pid": 1, "tid": 1, "ts": 1}',
      '{"ph": "X", "cat": "python_function", "name": "py", "pid": 1, "tid": 1, "ts": 1, "dur": 2}',
      '{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "x"}}', _op()], True),
    ("profiler steps", ['{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 2, '
                        '"ts": 0, "dur": 100}', _op(ts="5"), _kernel(ts="50")], True),
    ("NaN", [_op(dur="NaN")], False),
    ("leading zero", [_op(dur="01")], False),
    ("control character in a name", [_op(name="a\tb")], False),
    ("event not an object", [_op(), "3"], False),
    ("empty events", [], True),
]

RAW_CASES = [
    ("trailing bytes", b'{"traceEvents": []} x', False),
    ("truncated", b'{"traceEvents": [{"ph": "X", "ts": 1', False),
    ("bare array", b'[{"ph": "X", "name": "a", "ts": 1, "dur": 2}]', False),
    ("no traceEvents", b'{"nodes": [], "schema": "1.0"}', False),
    ("duplicate top-level key", b'{"traceEvents": [], "traceEvents": []}', False),
    ("base after the events", b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1.5, "dur": 2}], '
                              b'"baseTimeNanoseconds": 1000}', True),
    ("invalid UTF-8", b'{"traceEvents": [{"ph": "X", "name": "a\xff", "ts": 1, "dur": 2}]}', False),
    ("invalid UTF-8 in an unread field", b'{"traceEvents": [{"ph": "X", "x": "\xc0\xaf", "ts": 1}]}', False),
    ("surrogate in UTF-8", b'{"traceEvents": [{"ph": "X", "name": "\xed\xa0\x80", "ts": 1}]}', False),
    ("four-byte UTF-8", '{"traceEvents": [{"ph": "X", "name": "\U0001F600 é", "ts": 1, "dur": 1}]}'.encode(), True),
    ("lone surrogate escape", b'{"traceEvents": [{"ph": "X", "name": "\\ud800", "ts": 1, "dur": 1}]}', False),
    ("deep nesting", b'{"traceEvents": [{"ph": "X", "x": ' + b"[" * 300 + b"]" * 300 + b', "ts": 1}]}', False),
    ("whitespace everywhere", b' \r\n\t{ "traceEvents" : [ { "ph" : "X" , "ts" : 1 , "dur" : 2 } ] } \n', True),
]


@needs_scanner
@pytest.mark.parametrize("case,events,accepted", CASES, ids=[c[0] for c in CASES])
def test_crafted_events(tmp_path, case, events, accepted, read_paths):
    path = _write(tmp_path, events)
    assert _accepts(path) is accepted, case
    read_paths(path)
    read_paths(path, keep_python=True)


@needs_scanner
@pytest.mark.parametrize("case,raw,accepted", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_crafted_documents(tmp_path, case, raw, accepted, read_paths):
    path = _write(tmp_path, [], raw=raw)
    assert _accepts(path) is accepted, case
    try:
        read_paths(path)
    except Exception as exc:  # a refused document the salvaging path rejects: it must reject it the same way
        with pytest.raises(type(exc)) as ordinary:
            kineto.read_kineto(path, force=DecodePath.SLICES)
        assert str(ordinary.value) == str(exc)
        assert not accepted


@needs_scanner
def test_exact_values_against_hand_computed(tmp_path, read_paths):
    # An independent check of the numbers (not only agreement between two of our paths).
    path = _write(tmp_path, [_op(ts="1694128201435418.123", dur="0.5", pid='"Spans"', args=_COMM),
                             _kernel(ts="-0.25", args='"stream": 7, "correlation": 5, "device": 3')],
                  top_extra="")
    events = kineto.read_kineto(path).events
    op, kernel = events.iloc[0], events.iloc[1]
    assert op["start_ns"] == 1694128201435418123 and op["dur_ns"] == 500
    assert op["collective"] == "allreduce" and op["pg_desc"] == "tp" and op["pg_ranks"] == "[0, 1]"
    assert op["msg_bytes"] == 1024 * 2 and op["seq"] == 4 and op["pg_size"] == 2 and op["correlation"] == 9
    assert kernel["start_ns"] == -250 and kernel["dur_ns"] == 1000
    assert kernel["lane"] == "gpu" and kernel["device"] == 3 and kernel["stream"] == 7
    read_paths(path)


@needs_scanner
def test_gzip_and_keep_python(tmp_path, traces_dir, read_paths):
    source = traces_dir / "hta" / "trace_filter"
    first = sorted(source.iterdir())[0]
    data = _buffers.read_bytes(first)
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(gzip.compress(data))
    native = read_paths(path, keep_python=True)
    assert len(native) > 1000


_FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

_values = st.one_of(st.integers(-2**64, 2**64), st.floats(allow_nan=False, allow_infinity=False), st.none(),
                    st.booleans(), st.text(max_size=6), st.lists(st.integers(0, 3), max_size=2),
                    st.sampled_from(["Spans", "0x0", "stream 7", "", "12", "1.25", "X", "B", "E", "kernel",
                                     "cpu_op", "ac2g", "python_function", "ProfilerStep#1"]))
_keys = st.sampled_from(["ph", "cat", "name", "pid", "tid", "ts", "dur", "args", "id", "x"])
_arg_keys = st.sampled_from(["correlation", "External id", "external id", "device", "stream", "bytes",
                             "Collective name", "Process Group Name", "Process Group Description",
                             "Process Group Ranks", "Group size", "In msg nelems", "Out msg nelems", "dtype",
                             "Seq", "Src Rank", "Dst Rank", "other"])


@st.composite
def _event(draw):
    event = draw(st.dictionaries(_keys, _values, max_size=8))
    if draw(st.booleans()):
        event["args"] = draw(st.dictionaries(_arg_keys, _values, max_size=6))
    return event


@needs_scanner
@_FUZZ
@given(st.lists(_event(), max_size=8), st.sampled_from([",", ",\n  ", ", "]))
def test_fuzz_generated_events_agree(tmp_path_factory, read_paths, events, separator):
    # Any mix of field types: the scanner either refuses the document or reads it as the reference does.
    path = tmp_path_factory.mktemp("fuzz") / "rank0.json"
    body = '{"traceEvents": [' + separator.join(json.dumps(e) for e in events) + '], "baseTimeNanoseconds": 7}'
    path.write_text(body)
    try:
        read_paths(path)
    except Exception as exc:  # the salvaging path must fail alike (its own refusal)
        assert not isinstance(exc, AssertionError), exc
        with pytest.raises(type(exc)):
            kineto.read_kineto(path, force=DecodePath.SLICES)


@needs_scanner
@_FUZZ
@given(st.data())
def test_fuzz_mutated_real_trace_agrees(tmp_path_factory, read_paths, traces_dir, data):
    # Byte-level damage to a real trace: never a crash; refused, or read exactly as the reference reads it.
    source = _buffers.read_bytes(traces_dir / "hta" / "call_stack" / "backward_thread.json")[:6000]
    cut = source.rfind(b"},", 0, 6000)
    text = bytearray(source[:cut + 1] + b"]}")
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(text) - 1))
        text[at] = data.draw(st.sampled_from(b'{}[],:"\\ 0123456789.-eE\x00\xff\xc3tnfa'))
    path = tmp_path_factory.mktemp("mut") / "rank0.json"
    path.write_bytes(bytes(text))
    result = _kscan.scan(bytes(text))
    assert result is None or isinstance(result, dict)
    try:
        read_paths(path)
    except AssertionError:
        raise
    except Exception as exc:
        with pytest.raises(type(exc)):
            kineto.read_kineto(path, force=DecodePath.SLICES)
