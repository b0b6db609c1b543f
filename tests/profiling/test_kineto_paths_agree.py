"""Inputs written for the (since dropped, see ``_plan``) Arrow chunk path: every decode path reads each exactly,
or steps aside.

Every check reads the file on every decode path (the ``read_paths`` fixture: each path forced alone and
checked against the independent ``json`` + ``Decimal`` reading of ``conftest``; where that reading declines
the input, the native path must refuse it).
"""

from __future__ import annotations

import gzip
import json

import pytest

from shardline.profiling.readers import _plan
from shardline.profiling.readers._kineto_columns import _int

BASE = 1_700_000_000_000_000_000


def _write(tmp_path, events: list[str], *, separator: str = ",\n  ", name: str = "rank0.json", base=BASE) -> object:
    body = ('{"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": [' + separator.join(events) + "]"
            + (f', "baseTimeNanoseconds": {base}' if base is not None else "") + "}")
    path = tmp_path / name
    path.write_bytes(body.encode("utf-8", errors="surrogateescape"))
    return path


def _op(ts="10.125", dur="2.5", name="aten::mm", extra="", args='"External id": 7') -> str:
    return (f'{{"ph": "X", "cat": "cpu_op", "name": "{name}", "pid": 1, "tid": 2, "ts": {ts}, "dur": {dur}'
            f'{extra}, "args": {{{args}}}}}')


def _kernel(ts="20.5", stream="7", correlation=5) -> str:
    return ('{"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, '
            f'"ts": {ts}, "dur": 3, "args": {{"device": 0, "stream": {stream}, "correlation": {correlation}}}}}')


def test_text_pids_and_tids_are_read_as_the_ordinary_path_reads_them(tmp_path, read_paths):
    events = [
        '{"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",'
        ' "ts": 1, "dur": 100}',
        '{"ph": "X", "cat": "Operator", "name": "aten::add", "pid": 12, "tid": "5555", "ts": 5, "dur": 1}',
        '{"ph": "X", "cat": "Kernel", "name": "k", "pid": 0, "tid": "stream 7", "ts": 6, "dur": 1,'
        ' "args": {"correlation": 3}}',
        '{"ph": "X", "cat": "cpu_op", "name": "x", "pid": "", "tid":"0x1f", "ts": 7, "dur": 1}',
        _op(),
    ]
    events_frame = read_paths(_write(tmp_path, events))
    assert events_frame["stream"].tolist() == [5555, 7, 31, 2]
    assert events_frame["device"].tolist() == [-1, 0, -1, -1]
    assert _int("stream 7", []) == 7 and _int("0x1f", []) == 31  # the rules both paths share


def test_many_text_tids_use_the_bulk_rename(tmp_path, read_paths):
    events = [f'{{"ph": "X", "cat": "Operator", "name": "op{i % 3}", "pid": 12, "tid": "{5000 + i % 4}",'
              f' "ts": {i}, "dur": 1}}' for i in range(200)]
    events_frame = read_paths(_write(tmp_path, events))
    assert events_frame["stream"].tolist() == [5000 + i % 4 for i in range(200)]


def test_absolute_microseconds_keep_every_nanosecond(tmp_path, read_paths):
    # 17 significant digits: a double would move these by up to 125 ns; the decimal read does not.
    events = [_op(ts="1712195495519689.047", dur="63.813"), _op(ts="1712195495519689.048", dur="0.001"),
              _kernel(ts="1712195495519690.999")]
    events_frame = read_paths(_write(tmp_path, events, base=None))
    assert events_frame["start_ns"].tolist() == [1712195495519689047, 1712195495519689048, 1712195495519690999]
    assert events_frame["dur_ns"].tolist() == [63813, 1, 3000]


@pytest.mark.parametrize(("case", "events", "separator"), [
    ("more than 3 decimals (rounded by the ordinary path)", [_op(ts="10.12345"), _op()], ",\n  "),
    ("a separator inside a name", [_op(name="lambda},{x"), _op(name="a}, {b")], ","),
    ("mixed separators", [_op(), _op(), _op()], "MIXED"),
    ("invalid UTF-8 in a name", [_op(name="caf\udce9"), _op()], ",\n  "),
    ("External id as text", [_op(args='"External id": "12"'), _op()], ",\n  "),
    ("explicit null duration", [_op(dur="null"), _op()], ",\n  "),
    ("an int arg beyond int64", [_op(args='"External id": 9223372036854775808'), _op()], ",\n  "),
    ("a time beyond int64 ns", [_op(ts="99999999999999999.5"), _op()], ",\n  "),
    ("ROCm text stream", [_kernel(stream='"0x0"'), _op()], ",\n  "),
    ("a duplicate key", [_op(extra=', "dur": 4'), _op()], ",\n  "),
    ("ranks as a list", [_op(args='"Process Group Ranks": [0, 1]'), _op()], ",\n  "),
    ("a float where an int belongs", [_op(args='"External id": 7.0'), _op()], ",\n  "),
    ("a raw newline inside a name (invalid JSON)", [_op(name="two\nlines"), _op()], ", "),
])
def test_refused_chunks_read_the_ordinary_way(tmp_path, case, events, separator, read_paths):
    if separator == "MIXED":
        body = events[0] + ",\n  " + events[1] + ", " + events[2]
        events, separator = [body], ""
    _ = read_paths(_write(tmp_path, events, separator=separator))


def test_missing_times_and_args_match_the_ordinary_defaults(tmp_path, read_paths):
    events = ['{"ph": "X", "cat": "cpu_op", "name": "no dur", "pid": 1, "tid": 2, "ts": 4}',
              '{"ph": "X", "cat": "cpu_op", "name": "null args", "pid": 1, "tid": 2, "ts": 5, "dur": 1,'
              ' "args": null}',
              '{"ph": "B", "cat": "user_annotation", "name": "range", "pid": 1, "tid": 2, "ts": 6}',
              '{"ph": "E", "cat": "user_annotation", "name": "range", "pid": 1, "tid": 2, "ts": 9}',
              '{"ph": "i", "cat": "cpu_instant_event", "name": "dropped", "pid": 1, "tid": 2, "ts": 7}',
              '{"ph": "M", "name": "process_name", "pid": "Spans", "args": {"name": "Spans"}}']
    events_frame = read_paths(_write(tmp_path, events))
    assert sorted(events_frame["name"]) == ["no dur", "null args", "range"]
    assert events_frame.set_index("name").loc["range", "dur_ns"] == 3000


def test_collective_args_and_texts(tmp_path, read_paths):
    args = ('"External id": 9, "Collective name": "allreduce", "Process Group Name": "3",'
            ' "Process Group Description": "tp", "Process Group Ranks": "[0, 1]", "Group size": 2,'
            ' "In msg nelems": 1024, "Out msg nelems": 1024, "dtype": "BFloat16", "Seq": 4')
    events = [_op(name="record_param_comms", args=args), _op(args='"Dst Rank": 1, "bytes": 64'),
              _op(args='"Src Rank": 3')]
    events_frame = read_paths(_write(tmp_path, events, separator=", "))
    first = events_frame.iloc[0]
    assert (first["collective"], first["pg_desc"], first["pg_size"], first["msg_bytes"], first["seq"]) == \
        ("allreduce", "tp", 2, 2048, 4)
    assert events_frame["peer"].tolist() == [-1, 1, 3]
    assert events_frame["msg_bytes"].tolist() == [2048, 64, -1]


def test_streamed_big_file_reads_every_chunk_fast(tmp_path, monkeypatch, traces_dir, read_paths):
    # A plain file is memory-mapped and read in chunks; with small chunks every one must take the fast path
    # and the whole still equal the reference (compact and pretty separators alike).
    seed = json.loads(gzip.decompress(
        (traces_dir / "hta" / "trace_filter" / "sampled_rank-0.json.gz").read_bytes()))
    monkeypatch.setattr(_plan, "MAP_MIN_BYTES", 0)
    monkeypatch.setattr(_plan, "CHUNK_BYTES", 100_000)
    for indent in (None, 2):
        path = tmp_path / f"rank0-{indent}.json"
        path.write_text(json.dumps(seed, indent=indent, separators=(",", ":") if indent is None else None))
        events_frame = read_paths(path)
        assert len(events_frame) > 4000


def test_pretty_printed_document_over_8_mib_read_whole(tmp_path, traces_dir, read_paths):
    # Arrow cuts its input into 4 MB blocks; pretty-printed events span lines, so the cut must not fall
    # inside an event (one chunk of ~9 MB here, read in memory).
    seed = json.loads(gzip.decompress(
        (traces_dir / "hta" / "trace_filter" / "sampled_rank-0.json.gz").read_bytes()))
    seed["traceEvents"] = seed["traceEvents"] * 4
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps(seed, indent=4))
    assert path.stat().st_size > 2 * (4 << 20)
    events_frame = read_paths(path)
    assert len(events_frame) > 16_000
