"""Kineto reader on tiny hand-written traces: every expected value below is worked out by hand in the comment."""

from __future__ import annotations

import gzip
import json
from decimal import ROUND_HALF_UP, Decimal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.profiling.base.errors import MissingRankError
from shardline.profiling.base.schema import check_events
from shardline.profiling.readers import _buffers, _plan
from shardline.profiling.readers._numtext import decimal_texts_to_scaled
from shardline.profiling.table.load import load

BASE = 1_700_000_000_000_000_000


def _write(tmp_path, name, body: str, *, gz: bool = False):
    path = tmp_path / name
    data = body.encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _trace(events: list[str], *, rank: int | None = 0, base: int | None = BASE, extra: str = "") -> str:
    # Written as text, not json.dumps, so the exact number spellings (e.g. 12345.678) reach the reader.
    info = f'"distributedInfo": {{"backend": "nccl", "rank": {rank}, "world_size": 16}},' if rank is not None else ""
    tail = f', "baseTimeNanoseconds": {base}' if base is not None else ""
    return "{" + info + extra + '"traceEvents": [' + ",\n".join(events) + "]" + tail + "}"


def test_relative_times_keep_every_nanosecond(tmp_path):
    # ts 12345.678 µs after the base -> base + 12_345_678 ns; dur 1.001 µs -> 1_001 ns.
    ev = '{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 11, "tid": 12, "ts": 12345.678, "dur": 1.001}'
    ts = load(_write(tmp_path, "t.json", _trace([ev])), classify=False)
    row = ts.events.iloc[0]
    assert row["start_ns"] == BASE + 12_345_678
    assert row["dur_ns"] == 1_001
    assert (row["lane"], row["device"], row["stream"], row["rank"]) == ("cpu", -1, 12, 0)
    assert ts.metadata[0]["baseTimeNanoseconds"] == BASE


def test_absolute_microseconds_beyond_float_precision(tmp_path):
    # 1712195495519695.8 µs has 17 significant digits; exact ns is 1_712_195_495_519_695_800, which a float64
    # round trip does not give (the test checks that so the case stays meaningful).
    ev = ('{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1712195495519695.8, "dur": 3.3,'
          ' "args": {"device": 0, "stream": 7, "correlation": 5}}')
    assert int(float("1712195495519695.8") * 1000) != 1_712_195_495_519_695_800
    ts = load(_write(tmp_path, "t.json.gz", _trace([ev], base=None), gz=True), classify=False)
    row = ts.events.iloc[0]
    assert row["start_ns"] == 1_712_195_495_519_695_800
    assert row["dur_ns"] == 3_300
    assert (row["lane"], row["device"], row["stream"], row["correlation"]) == ("gpu", 0, 7, 5)


def test_decimal_text_parser_rounding_and_forms():
    texts = np.array([b"0.0004", b"0.0005", b"-2.5", b"7", b"1e3", b"1.5E-3", b"12.3456789"])
    values, bad = decimal_texts_to_scaled(texts, scale_digits=3)
    # 0.4 ns -> 0; 0.5 ns -> 1 (half away from zero); -2500; 7000; 1e3 µs = 1_000_000 ns; 1.5 ns -> 2;
    # 12345.6789 -> 12346
    assert values.tolist() == [0, 1, -2500, 7000, 1_000_000, 2, 12346]
    assert not bad.any()


@pytest.mark.parametrize("texts", [
    [b"12345.678", b"1.001", b"-2.5", b"7", b"1e3", b"0", b"1712195495519695.8", b"9223372036854775.807"],
    [b"51.0", b"1682725898242253", b"0.5"],
    [b"1.2345", b"3"],  # a fourth decimal: Arrow refuses, the numpy path rounds
    [b"9223372036854775.808", b"1"],  # beyond int64 ns: refused, then marked bad
    [b'"12"', b"1"],  # a JSON string where a number belongs
])
def test_time_texts_arrow_cast_agrees_with_the_numpy_parser(texts):
    """The reader's first try (one Arrow decimal cast over all time texts) gives exactly what the numpy text
    parser gives, or steps aside (None) for the texts only the parser handles."""
    import msgspec

    from shardline.profiling.readers._kineto_columns import _arrow_times_ns, _times_ns

    raws = [msgspec.Raw(t) for t in texts]
    want, want_bad = decimal_texts_to_scaled(np.array(texts, dtype="S"), scale_digits=3)
    fast = _arrow_times_ns(raws)
    refused = any(b"." in t and len(t.split(b".")[1]) > 3 for t in texts) or want_bad.any() or b'"12"' in texts
    assert (fast is None) == refused
    if fast is not None:
        assert fast.tolist() == want.tolist()
    got, bad = _times_ns(raws)
    assert got.tolist() == want.tolist() and bad.tolist() == want_bad.tolist()


def test_legacy_2021_categories_and_string_tids(tmp_path):
    # Legacy Kineto: tid "stream 7" for GPU rows, tid "5555" text for CPU rows, lower-case "external id".
    events = [
        '{"ph": "X", "cat": "Operator", "name": "aten::conv2d", "pid": 5555, "tid": "5555", "ts": 100, "dur": 50,'
        ' "args": {"External id": 3}}',
        '{"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel", "pid": 5555, "tid": "5555", "ts": 110, "dur": 5,'
        ' "args": {"correlation": 9, "external id": 3}}',
        '{"ph": "X", "cat": "Kernel", "name": "implicit_gemm", "pid": 0, "tid": "stream 7", "ts": 120, "dur": 20,'
        ' "args": {"correlation": 9, "external id": 3}}',
    ]
    ev = load(_write(tmp_path, "worker1.pt.trace.json", _trace(events, rank=None, base=None)), classify=False).events
    assert ev["rank"].tolist() == [1, 1, 1]  # from "worker1" in the file name
    assert ev["lane"].tolist() == ["cpu", "cpu", "gpu"]
    assert ev["stream"].tolist() == [5555, 5555, 7]
    assert ev["device"].tolist() == [-1, -1, 0]
    assert ev["external_id"].tolist() == [3, 3, 3]
    assert ev["start_ns"].tolist() == [100_000, 110_000, 120_000]


def test_collective_args_give_sizes_groups_and_peer(tmp_path):
    # all-gather of BFloat16: in 25136, out 201088 elements -> output 201088 × 2 = 402176 bytes.
    # all-reduce of Float: 2049000 elements × 4 = 8196000 bytes. A send with "Dst Rank" 1 -> peer 1.
    comm = ('"Process Group Name": "3", "Process Group Description": "sl:dp", "Process Group Ranks": "[0, 1]",'
            ' "Group size": 2')
    events = [
        '{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "pid": 0, "tid": 7, "ts": 10,'
        ' "dur": 5, "args": {"device": 0, "stream": 7, "correlation": 1, "Collective name": "_allgather_base",'
        f' "In msg nelems": 25136, "Out msg nelems": 201088, "dtype": "BFloat16", {comm}, "Seq": 4}}}}',
        '{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1, "ts": 1, "dur": 2,'
        ' "args": {"Collective name": "allreduce", "In msg nelems": 2049000, "Out msg nelems": 2049000,'
        f' "dtype": "Float", {comm}}}}}',
        '{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1, "ts": 3, "dur": 2,'
        ' "args": {"Collective name": "send", "In msg nelems": 10, "Out msg nelems": 0, "dtype": "Long",'
        f' "Dst Rank": 1, {comm}}}}}',
    ]
    ev = load(_write(tmp_path, "t.json", _trace(events)), classify=False).events.set_index("collective")
    assert ev.loc["_allgather_base", "msg_bytes"] == 402_176
    assert ev.loc["allreduce", "msg_bytes"] == 8_196_000
    assert ev.loc["send", "msg_bytes"] == 80 and ev.loc["send", "peer"] == 1
    assert ev.loc["_allgather_base", "seq"] == 4
    assert set(ev["pg_ranks"]) == {"[0, 1]"} and set(ev["pg_desc"]) == {"sl:dp"} and set(ev["pg_size"]) == {2}


def test_memcpy_direction_memory_and_bytes(tmp_path):
    events = [
        '{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0, "tid": 7, "ts": 1,'
        ' "dur": 1, "args": {"device": 0, "stream": 7, "bytes": 4096}}',
        '{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "pid": 0, "tid": 7, "ts": 2,'
        ' "dur": 1, "args": {"device": 0, "stream": 7, "bytes": 8}}',
        '{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "pid": 0, "tid": 7, "ts": 3,'
        ' "dur": 1, "args": {"device": 0, "stream": 7, "bytes": 2}}',
        '{"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "pid": 0, "tid": 7, "ts": 4, "dur": 1,'
        ' "args": {"device": 0, "stream": 7, "bytes": 16}}',
    ]
    ev = load(_write(tmp_path, "t.json", _trace(events)), classify=False).events
    assert ev["memory_kind"].tolist() == ["Pageable", "Pinned", "Device", ""]
    assert ev["msg_bytes"].tolist() == [4096, 8, 2, 16]


def test_steps_by_window_then_correlation_then_gpu_annotation(tmp_path):
    # ProfilerStep#3 covers [100, 200) µs on the CPU. An op at 150 is in step 3, one at 250 in none.
    # A runtime call at 160 (correlation 9) is in step 3, so its kernel (correlation 9, running at 300, after
    # the CPU window) is in step 3 too. A kernel without a launch (correlation 77) falls in the GPU-side
    # ProfilerStep#4 window [400, 500) on device 0.
    events = [
        '{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 1, "ts": 100, "dur": 100}',
        '{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 2, "ts": 150, "dur": 10}',
        '{"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 1, "ts": 250, "dur": 10}',
        '{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 160, "dur": 5,'
        ' "args": {"correlation": 9}}',
        '{"ph": "X", "cat": "kernel", "name": "k1", "pid": 0, "tid": 7, "ts": 300, "dur": 5,'
        ' "args": {"device": 0, "stream": 7, "correlation": 9}}',
        '{"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#4", "pid": 0, "tid": 7, "ts": 400,'
        ' "dur": 100, "args": {"device": 0, "stream": 7}}',
        '{"ph": "X", "cat": "kernel", "name": "k2", "pid": 0, "tid": 7, "ts": 450, "dur": 5,'
        ' "args": {"device": 0, "stream": 7, "correlation": 77}}',
    ]
    ev = load(_write(tmp_path, "t.json", _trace(events)), classify=False).events.set_index("name")
    assert ev.loc["aten::add", "step"] == 3 and ev.loc["aten::mul", "step"] == -1
    assert ev.loc["k1", "step"] == 3 and ev.loc["k2", "step"] == 4
    assert ev.loc["ProfilerStep#3", "step"] == 3


def test_begin_end_pairs_become_intervals(tmp_path):
    # Nested B/E on one thread: outer [10, 40] µs, inner [15, 20] µs.
    events = [
        '{"ph": "B", "cat": "user_annotation", "name": "outer", "pid": 1, "tid": 1, "ts": 10}',
        '{"ph": "B", "cat": "user_annotation", "name": "inner", "pid": 1, "tid": 1, "ts": 15}',
        '{"ph": "E", "cat": "user_annotation", "name": "inner", "pid": 1, "tid": 1, "ts": 20}',
        '{"ph": "E", "cat": "user_annotation", "name": "outer", "pid": 1, "tid": 1, "ts": 40}',
    ]
    ev = load(_write(tmp_path, "t.json", _trace(events, base=None)), classify=False).events.set_index("name")
    assert ev.loc["outer", "dur_ns"] == 30_000 and ev.loc["inner", "dur_ns"] == 5_000
    assert ev.loc["inner", "start_ns"] == 15_000


def test_python_stacks_dropped_unless_kept(tmp_path):
    events = [
        '{"ph": "X", "cat": "python_function", "name": "train.py(10): step", "pid": 1, "tid": 1, "ts": 1, "dur": 9}',
        '{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 2, "dur": 1}',
        '{"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "x", "ts": 0, "dur": 99}',
    ]
    path = _write(tmp_path, "t.json", _trace(events))
    assert load(path, classify=False).events["name"].tolist() == ["aten::add"]
    kept = load(path, keep_python=True, classify=False).events
    assert sorted(kept["name"].tolist()) == ["aten::add", "train.py(10): step"]
    check_events(kept)


def test_rank_sources_in_order(tmp_path):
    ev = '{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 1, "dur": 1}'
    # distributedInfo wins over the file name and over rank=.
    assert load(_write(tmp_path, "rank-5.json", _trace([ev], rank=2)), rank=7, classify=False).ranks == (2,)
    nameless = _write(tmp_path, "trace.json", _trace([ev], rank=None))
    with pytest.raises(MissingRankError, match="trace.json.*rank=N"):
        load(nameless)
    assert load(nameless, rank=3, classify=False).ranks == (3,)
    assert load(_write(tmp_path, "job_rank_12.json", _trace([ev], rank=None)), classify=False).ranks == (12,)


def test_bare_array_form(tmp_path):
    # Chrome's JSON-array form without the object wrapper.
    body = '[{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 2.5, "dur": 0.5}]'
    ev = load(_write(tmp_path, "rank0.json", body), classify=False).events
    assert ev["start_ns"].tolist() == [2500] and ev["dur_ns"].tolist() == [500]


def test_load_classifies_when_the_classifier_exists(tmp_path):
    ev = ('{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0, "tid": 7, "ts": 1,'
          ' "dur": 1, "args": {"device": 0, "stream": 7, "bytes": 4}}')
    events = load(_write(tmp_path, "t.json", _trace([ev]))).events
    assert events["category"].tolist() == ["memcpy_h2d"]


def test_json_library_agrees_on_counts(tmp_path):
    # Cross-check on a generated trace: rows kept = X events not in dropped categories, counted with json.
    rng = np.random.default_rng(0)
    cats = ["cpu_op", "kernel", "cuda_runtime", "python_function", "gpu_memcpy", "user_annotation"]
    events = [json.dumps({"ph": "X", "cat": str(rng.choice(cats)), "name": f"n{i % 7}", "pid": 0, "tid": 7,
                          "ts": round(float(rng.uniform(0, 1e6)), 3), "dur": 1.0, "args": {"device": 0}})
              for i in range(500)]
    path = _write(tmp_path, "t.json", _trace(events))
    want = sum(json.loads(e)["cat"] != "python_function" for e in events)
    assert len(load(path, classify=False).events) == want


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.decimals(min_value=-10**14, max_value=10**15, places=6,
                            allow_nan=False, allow_infinity=False), min_size=1, max_size=40),
       st.booleans())
def test_decimal_text_parser_matches_decimal_reference(numbers, exponent_form):
    # Reference: Python's Decimal, scaled by 1000 and rounded half away from zero; both the numpy fast path
    # (plain texts) and the general path (an exponent form forces it) must agree exactly.
    texts = [format(d, "E") if exponent_form else format(d, "f") for d in numbers]
    values, bad = decimal_texts_to_scaled(np.array([t.encode() for t in texts]), scale_digits=3)
    want = [int((Decimal(t) * 1000).to_integral_value(rounding=ROUND_HALF_UP)) for t in texts]
    assert not bad.any()
    assert values.tolist() == want


def test_memory_mapped_read_matches_in_memory_read(tmp_path, monkeypatch, traces_dir):
    # Big plain files are memory-mapped and released page by page; force that path on a real trace (decompressed
    # into tmp_path) with tiny batches and compare every column with the ordinary in-memory read.
    source = traces_dir / "hta" / "trace_filter" / "sampled_rank-1.json.gz"
    plain = tmp_path / "sampled_rank-1.json"
    plain.write_bytes(gzip.decompress(source.read_bytes()))
    expected = load(source, classify=False).events
    monkeypatch.setattr(_plan, "MAP_MIN_BYTES", 0)
    monkeypatch.setattr(_plan, "BATCH_EVENTS", 333)
    monkeypatch.setattr(_plan, "CHUNK_BYTES", 50_000)  # many chunks, cut at event boundaries
    assert isinstance(_buffers.trace_buffer(plain), __import__("mmap").mmap)
    got = load(plain, classify=False).events
    assert got.astype(str).equals(expected.astype(str))


def test_streamed_read_falls_back_when_a_cut_lands_in_a_string(tmp_path, monkeypatch):
    # Names containing "}, {" offer false event boundaries; the streamed read must then fall back to the
    # whole-file read and still give every event exactly.
    events = [_EVENT_TEXT.format(name="lambda}, {x" * 20, ts=10 * i + 0.125) for i in range(400)]
    path = _write(tmp_path, "t.json", _trace(events))
    monkeypatch.setattr(_plan, "MAP_MIN_BYTES", 0)
    monkeypatch.setattr(_plan, "CHUNK_BYTES", 2_000)
    ev = load(path, classify=False).events
    assert ev["start_ns"].tolist() == [BASE + 10_000 * i + 125 for i in range(400)]
    assert set(ev["name"]) == {"lambda}, {x" * 20}


_EVENT_TEXT = '{{"ph": "X", "cat": "cpu_op", "name": "{name}", "pid": 1, "tid": 1, "ts": {ts}, "dur": 1}}'


def test_an_overflowing_external_id_stays_unread_and_never_borrows_the_legacy_key(tmp_path):
    """Only an *absent* "External id" falls back to the legacy lower-case key; a present one beyond int64 is
    counted in the overflow warning and stays -1, so the kernel cannot be linked through the other key."""
    events = [
        '{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1, "ts": 10, "dur": 50,'
        ' "args": {"External id": 1180591620717411303424, "external id": 21, "Collective name": "allgather"}}',
        '{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 70, "dur": 5,'
        ' "args": {"external id": 22}}',
    ]
    with pytest.warns(Warning, match="1 integer args beyond int64"):
        ev = load(_write(tmp_path, "t.json", _trace(events)), classify=False).events
    assert ev["external_id"].tolist() == [-1, 22]


def test_step_numbers_are_ascii_digits_that_fit_the_int32_step_column(tmp_path):
    names = ["ProfilerStep#\u0663", "ProfilerStep#99999999999", "ProfilerStep#7"]
    events = [f'{{"ph": "X", "cat": "user_annotation", "name": "{n}", "pid": 1, "tid": 1, "ts": {100 * i},'
              f' "dur": 50}}' for i, n in enumerate(names)]
    events += [f'{{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": {100 * i + 10},'
               f' "dur": 5}}' for i in range(3)]
    ev = load(_write(tmp_path, "t.json", _trace(events)), classify=False).events
    assert ev.loc[ev["name"] == "op", "step"].tolist() == [-1, -1, 7]


def test_the_int64_minimum_time_is_out_of_range_on_every_path(tmp_path, read_paths):
    """-9223372036854775.808 µs is exactly int64's minimum in ns: the numpy parser counts it out of range,
    and so must the Arrow casts (the JSON fast path and the time-text cast), whichever reads the file."""
    events = ['{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 100.5, "dur": 5}',
              '{"ph": "X", "cat": "cpu_op", "name": "b", "pid": 1, "tid": 1, "ts": -9223372036854775.808, "dur": 5}']
    path = _write(tmp_path, "t.json", _trace(events, base=None))
    with pytest.warns(Warning, match="dropped 1 events whose ts/dur"):
        ev = load(path, classify=False).events
    assert ev["name"].tolist() == ["a"]
    both = read_paths(path)  # every path, each against the reference reading
    assert both["name"].tolist() == ["a"]
