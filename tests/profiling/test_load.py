"""load(): folders, run directories, mixed jobs, rank mappings, and bad input of every kind."""

from __future__ import annotations

import gzip
import os
import threading
import warnings

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pandas.api.types import union_categoricals

import shardline.profiling.table.load as load_module
from shardline.profiling.base.errors import (
    MissingRankError,
    MixedJobsError,
    ProfilingError,
    TraceFormatError,
    TraceWarning,
)
from shardline.profiling.base.schema import check_events, text_dtype
from shardline.profiling.readers import _buffers, _plan, kineto
from shardline.profiling.table.load import load, union_texts

_EVENT = '{{"ph": "X", "cat": "cpu_op", "name": "{name}", "pid": 1, "tid": 1, "ts": {ts}, "dur": 1.5}}'


def _trace(n: int = 3, *, rank: int = 0, world: int = 4, name: str = "aten::add") -> str:
    events = ",\n".join(_EVENT.format(name=name, ts=10 * i + 0.25) for i in range(n))
    info = f'{{"backend": "nccl", "rank": {rank}, "world_size": {world}}}'
    return f'{{"distributedInfo": {info},\n"traceEvents": [\n{events}\n]}}'



def _link(src, dst):
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(src, dst)  # the corpus is read in place, never copied
    return dst


def test_run_directory_mixes_formats(tmp_path, traces_dir):
    # A run folder: two Kineto traces in a subfolder, an NCCL log and a README that is ignored.
    _link(traces_dir / "hta/trace_filter/sampled_rank-0.json.gz", tmp_path / "profiler" / "a.json.gz")
    _link(traces_dir / "hta/trace_filter/sampled_rank-1.json.gz", tmp_path / "profiler" / "b.json.gz")
    _link(traces_dir / "nccl_debug_logs/nvidia_nccl_issue1814_init_complete_64ranks.log", tmp_path / "nccl.log")
    (tmp_path / "README.md").write_text("notes")
    ts = load(tmp_path)
    assert {p.name: r for p, r in ts.files.items()} == {"a.json.gz": (0,), "b.json.gz": (1,),
                                                       "nccl.log": (32, 34, 35, 36)}
    assert ts.ranks == (0, 1)
    assert set(ts.events["source"]) == {"kineto"}
    assert ts.metadata[36]["nccl_comms"][0]["rank"] == 36
    check_events(ts.events)


def test_mixed_world_sizes_are_refused_naming_files(tmp_path, traces_dir):
    _link(traces_dir / "param/dlrm_kineto/worker2_step_12.1694128201554.pt.trace.json.gz", tmp_path / "x.json.gz")
    _link(traces_dir / "hta/trace_filter/sampled_rank-1.json.gz", tmp_path / "y.json.gz")
    with pytest.raises(MixedJobsError, match=r"world_size=8.*x\.json\.gz.*world_size=128.*y\.json\.gz"):
        load(tmp_path)


def test_one_rank_in_two_files_is_refused(tmp_path):
    (tmp_path / "a.json").write_text(_trace(rank=1))
    (tmp_path / "b.json").write_text(_trace(rank=1))
    with pytest.raises(MixedJobsError, match=r"rank 1 is claimed by two files: .*a\.json and .*b\.json"):
        load(tmp_path)


def test_rank_outside_world(tmp_path):
    (tmp_path / "a.json").write_text(_trace(rank=5, world=4))
    with pytest.raises(MixedJobsError, match="rank 5 is outside world_size 4"):
        load(tmp_path / "a.json")


def test_folder_rank_mapping_and_int_refused(tmp_path):
    body = '{"traceEvents": [' + _EVENT.format(name="a", ts=1) + "]}"
    (tmp_path / "first.json").write_text(body)
    (tmp_path / "second.json").write_text(body)
    with pytest.raises(MissingRankError, match="first.json"):
        load(tmp_path)
    with pytest.raises(TraceFormatError, match="mapping"):
        load(tmp_path, rank=0)
    ts = load(tmp_path, rank={"first.json": 4, tmp_path / "second.json": 6})
    assert ts.ranks == (4, 6)


def test_nothing_to_read(tmp_path):
    with pytest.raises(TraceFormatError, match="no such file"):
        load(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(TraceFormatError, match="no trace, log or export"):
        load(tmp_path)
    with pytest.raises(TraceFormatError, match="notes.txt: not a Kineto trace"):
        load(tmp_path / "notes.txt")


# ---- bad input: our error naming the file and the problem, or a warning and the readable part ----


def test_truncated_gzip(tmp_path):
    data = gzip.compress(_trace(50).encode())
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match=r"rank0\.json\.gz: truncated gzip"):
        load(path)


def test_corrupt_gzip(tmp_path):
    data = bytearray(gzip.compress(_trace(50).encode()))
    data[20:40] = b"\x00" * 20
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match="corrupt gzip"):
        load(path)


def test_truncated_json_keeps_complete_events(tmp_path):
    text = _trace(10)
    cut = text.index('"ts": 70.25')  # inside the 8th event
    path = tmp_path / "rank0.json"
    path.write_text(text[:cut])
    with pytest.warns(TraceWarning, match=r"rank0\.json: invalid JSON"):
        ts = load(path)
    # Events 0..6 are complete; times exact: 0.25 µs, 10.25 µs, ...
    assert ts.events["start_ns"].tolist() == [10_000 * i + 250 for i in range(7)]
    assert any("kept the 7 complete events" in w for w in ts.warnings)


def test_unescaped_quote_in_name(tmp_path):
    text = _trace(6).replace('"name": "aten::add", "pid": 1, "tid": 1, "ts": 30.25',
                             '"name": "aten::add"bad"", "pid": 1, "tid": 1, "ts": 30.25')
    path = tmp_path / "rank0.json"
    path.write_text(text)
    with pytest.warns(TraceWarning, match="invalid JSON"):
        ts = load(path)
    assert len(ts.events) == 3  # the three events before the broken one


def test_invalid_utf8(tmp_path):
    # A stray byte in one name: the event is kept, the byte replaced by U+FFFD, and a warning says so.
    data = _trace(4).encode().replace(b"aten::add", b"aten::\xff\xfe", 1)
    path = tmp_path / "rank0.json"
    path.write_bytes(data)
    with pytest.warns(TraceWarning, match=r"rank0\.json: invalid UTF-8 in 1 events"):
        ts = load(path)
    assert ts.events["name"].tolist() == ["aten::\ufffd\ufffd", "aten::add", "aten::add", "aten::add"]


def test_integers_beyond_int64(tmp_path):
    # A correlation id of 2**70 becomes -1 with a warning; a ts beyond int64 ns drops that event with a warning.
    text = _trace(3)
    text = text.replace('"dur": 1.5}', '"dur": 1.5, "args": {"correlation": 1180591620717411303424}}', 1)
    text = text.replace('"ts": 20.25', '"ts": 99999999999999999999999.5')
    path = tmp_path / "rank0.json"
    path.write_text(text)
    with pytest.warns(TraceWarning) as record:
        ts = load(path)
    messages = " ".join(str(w.message) for w in record)
    assert "beyond int64" in messages and "rank0.json" in messages
    assert ts.events["start_ns"].tolist() == [250, 10_250]
    assert ts.events["correlation"].tolist() == [-1, -1]


def test_empty_inputs(tmp_path):
    empty = tmp_path / "rank0.json"
    empty.write_text("")
    with pytest.raises(TraceFormatError, match=r"rank0\.json: empty file"):
        load(empty)
    no_events = tmp_path / "rank1.json"
    no_events.write_text('{"distributedInfo": {"rank": 1}, "traceEvents": []}')
    ts = load(no_events)
    assert len(ts.events) == 0 and ts.ranks == (1,)
    check_events(ts.events)


def test_top_level_not_a_trace(tmp_path):
    path = tmp_path / "rank0.json"
    path.write_text('"just a string"')
    with pytest.raises(TraceFormatError, match="rank0.json"):
        load(path)


def test_bad_sqlite(tmp_path):
    path = tmp_path / "run.sqlite"
    path.write_bytes(b"SQLite format 3\x00" + b"\x00" * 200)
    with pytest.raises(ProfilingError, match="run.sqlite"):
        load(path)


def test_not_nsys_sqlite(tmp_path):
    import sqlite3

    path = tmp_path / "other.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    with pytest.raises(TraceFormatError, match="other.sqlite.*not an Nsight Systems export"):
        load(path)


def test_damaged_middle_keeps_base_time_from_the_tail(tmp_path):
    # Current Kineto writes baseTimeNanoseconds after traceEvents; damage in the middle must not lose it.
    body = _trace(5).replace('"ts": 30.25', '"ts": 30.25 oops', 1)[:-1] + ', "baseTimeNanoseconds": 1000000000}'
    path = tmp_path / "rank0.json"
    path.write_text(body)
    with pytest.warns(TraceWarning, match="invalid JSON"):
        ts = load(path)
    assert ts.events["start_ns"].tolist() == [1_000_000_000 + 250, 1_000_000_000 + 10_250, 1_000_000_000 + 20_250]


def test_public_spelling_is_callable_after_submodule_import(tmp_path):
    # Importing shardline.profiling.table.load binds the submodule on the package; the public call must still work.
    import shardline.profiling as profiling_pkg
    import shardline.profiling.table.load  # noqa: F401

    path = tmp_path / "rank0.json"
    path.write_text(_trace(2))
    from shardline.profiling import load as public_load

    assert len(public_load(path).events) == 2
    assert len(profiling_pkg.load(path, classify=False).events) == 2


def test_whole_corpus_folder_is_several_jobs(traces_dir):
    # The corpus root mixes dozens of unrelated jobs: load must refuse it and name the clashing files.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        with pytest.raises(MixedJobsError, match=r"rank 0 is claimed by two files: .*alexnet.* and .*event_sync"):
            load(traces_dir / "hta" / "critical_path")


def test_parallel_reading_gives_the_same_table(traces_dir):
    folder = traces_dir / "param" / "dlrm_kineto"
    one = load(folder, workers=1)
    two = load(folder, workers=2)
    assert two.files == one.files and two.ranks == one.ranks
    assert two.events.astype(str).equals(one.events.astype(str))


def _nccl_kernel(name: str, ts: float) -> str:
    args = '{"device": 0, "stream": 7}'
    return f'{{"ph": "X", "cat": "kernel", "name": "{name}", "pid": 0, "tid": 7, "ts": {ts}, "dur": 5, "args": {args}}}'



def test_nccl_log_joins_trace_kernels_by_order(tmp_path):
    # Rank 0's trace: AllReduce at 10 µs and 30 µs, AllGather at 20 µs. Its log (comm 0xa is rank 0 after the
    # Init line): AllReduce opCount 5 and 7, AllGather opCount 6 with count 3 fp32 × 2 ranks = 24 bytes.
    events = [_nccl_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 10),
              _nccl_kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 20),
              _nccl_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 30)]
    info = '{"backend": "nccl", "rank": 0, "world_size": 2}'
    (tmp_path / "rank0.json").write_text(f'{{"distributedInfo": {info}, "traceEvents": [{",".join(events)}]}}')
    prefix = "h:1:2 [0] NCCL INFO "
    coll = prefix + "{op}: opCount {n} sendbuff 0x1 recvbuff 0x2 count 3 datatype 7 op 0 root 0 comm 0xa " \
                    "[nranks=2] stream 0x9\n"
    (tmp_path / "nccl.log").write_text(
        prefix + "comm 0xa rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 1 commId 0xc0 - Init COMPLETE\n"
        + coll.format(op="AllReduce", n=5) + coll.format(op="AllGather", n=6) + coll.format(op="AllReduce", n=7))
    ev = load(tmp_path).events
    kern = ev[ev["source"] == "kineto"].sort_values("start_ns")
    assert kern["seq"].tolist() == [5, 6, 7]
    assert kern["msg_bytes"].tolist() == [12, 24, 12] and kern["pg_size"].tolist() == [2, 2, 2]


def test_nccl_log_join_refuses_count_mismatch(tmp_path):
    events = [_nccl_kernel("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", 10)]
    info = '{"backend": "nccl", "rank": 0, "world_size": 2}'
    (tmp_path / "rank0.json").write_text(f'{{"distributedInfo": {info}, "traceEvents": [{",".join(events)}]}}')
    prefix = "h:1:2 [0] NCCL INFO "
    coll = prefix + "AllReduce: opCount {n} sendbuff 0x1 recvbuff 0x2 count 3 datatype 7 op 0 root 0 comm 0xa " \
                    "[nranks=2] stream 0x9\n"
    (tmp_path / "nccl.log").write_text(prefix + "comm 0xa rank 0 nranks 2 cudaDev 0 nvmlDev 0 - Init COMPLETE\n"
                                       + coll.format(n=1) + coll.format(n=2))
    with pytest.warns(TraceWarning, match="rank 0: 2 AllReduce lines in the NCCL log but 1 AllReduce kernels"):
        ev = load(tmp_path).events
    assert ev.loc[ev["source"] == "kineto", "seq"].tolist() == [-1]


def _spy_reads(monkeypatch) -> list:
    """Record, in order and from every thread, ``(what, file name or "", thread name)`` for each trace_buffer
    call ("fetch"), native scan ("scan") and read_kineto start ("read") and end ("done")."""
    log = []
    buffer, read, scan = _buffers.trace_buffer, kineto.read_kineto, _buffers.native_scan

    def note(what: str, name: str = "") -> None:
        log.append((what, name, threading.current_thread().name))

    def spied_buffer(path, **options):
        note("fetch", path.name)
        return buffer(path, **options)

    def spied_read(path, **options):
        note("read", path.name)
        try:
            return read(path, **options)
        finally:
            note("done", path.name)

    def spied_scan(data):
        note("scan")
        return scan(data)

    monkeypatch.setattr(_buffers, "trace_buffer", spied_buffer)
    monkeypatch.setattr(_buffers, "native_scan", spied_scan)
    monkeypatch.setattr(kineto, "read_kineto", spied_read)
    monkeypatch.setattr(load_module.os, "cpu_count", lambda: 2)
    return log


def test_small_folder_is_read_with_one_file_prefetched(tmp_path, monkeypatch):
    names = [f"rank{r}.json.gz" for r in range(4)]
    for r, name in enumerate(names):
        (tmp_path / name).write_bytes(gzip.compress(_trace(40 + r, rank=r).encode()))
    log = _spy_reads(monkeypatch)
    prefetched = load(tmp_path)
    fetches = [name for what, name, _ in log if what == "fetch"]
    assert fetches == names  # every file read once, in order
    threads = {thread for what, _, thread in log if what in ("fetch", "scan")}
    assert len(threads) == 1 and threads.pop().startswith("shardline-prefetch")  # ahead, by the thread
    if _buffers.native_available():
        assert [what for what, _, _ in log].count("scan") == len(names)
    at = {(what, name): i for i, (what, name, _) in enumerate(log)}
    for k in range(2, len(names)):  # never more than one file ahead of the one being decoded
        assert at["fetch", names[k]] > at["done", names[k - 2]]
    log.clear()
    one_by_one = load(tmp_path, workers=1)
    assert {thread for what, _, thread in log if what in ("fetch", "scan")} == {threading.current_thread().name}
    pd.testing.assert_frame_equal(prefetched.events, one_by_one.events)
    assert prefetched.files == one_by_one.files and prefetched.metadata == one_by_one.metadata


def test_prefetched_damage_is_reported_for_its_file(tmp_path, monkeypatch):
    for r in range(3):
        data = gzip.compress(_trace(30, rank=r).encode())
        (tmp_path / f"rank{r}.json.gz").write_bytes(data if r != 1 else data[: len(data) // 2])
    _spy_reads(monkeypatch)
    with pytest.raises(TraceFormatError, match=r"rank1\.json\.gz: truncated gzip"):
        load(tmp_path)


def test_shared_small_set_reads_the_same_prefetched(traces_dir, monkeypatch):
    folder = traces_dir / "param" / "dlrm_kineto"
    one_by_one = load(folder, workers=1)
    _spy_reads(monkeypatch)
    prefetched = load(folder)
    pd.testing.assert_frame_equal(prefetched.events, one_by_one.events)


_texts = st.lists(st.sampled_from(["", "a", "b", "nccl:all_reduce", "ß", "x y"]), unique=True, max_size=6)


@settings(max_examples=80, deadline=None)
@given(parts=st.lists(st.tuples(_texts, st.lists(st.integers(-1, 5), max_size=8)), min_size=1, max_size=4),
       shared=st.booleans())
def test_union_texts_is_union_categoricals(parts, shared):
    categoricals = []
    for texts, codes in parts:
        codes = np.array([c if c < len(texts) else -1 for c in codes], dtype=np.int8)
        dtype = text_dtype(parts[0][0]) if shared else pd.CategoricalDtype(pd.Index(texts, dtype="str"))
        if shared:
            codes = np.where(codes < len(parts[0][0]), codes, -1).astype(np.int8)
        categoricals.append(pd.Categorical.from_codes(codes, dtype=dtype))
    got, want = union_texts(categoricals), union_categoricals(categoricals)
    assert got.categories.tolist() == want.categories.tolist() and got.categories.dtype == want.categories.dtype
    assert np.array_equal(got.codes, want.codes) and got.codes.dtype == want.codes.dtype


def test_text_dtype_is_shared_for_short_vocabularies_only():
    assert text_dtype(["b", "a"]) is text_dtype(("b", "a"))  # cached: one object for one list
    assert text_dtype(["b", "a"]) is not text_dtype(["a", "b"])  # the order is part of the dtype
    assert text_dtype(["b", "a"]).categories.tolist() == ["b", "a"]
    many = [f"kernel_{i}" for i in range(5000)]
    assert text_dtype(many) is not text_dtype(many) and text_dtype(many) == text_dtype(many)


def test_union_texts_keeps_pandas_code_width():
    # 100 + 100 texts, 50 shared: 150 categories need int16 codes (pandas' width for 127..32766 categories).
    parts = [pd.Categorical.from_codes(np.array([0, 99, -1, 5], dtype=np.int8),
                                       dtype=pd.CategoricalDtype(pd.Index([f"t{i}" for i in range(k, k + 100)])))
             for k in (0, 50)]
    got, want = union_texts(parts), union_categoricals(parts)
    assert got.codes.dtype == want.codes.dtype == np.int16
    assert got.categories.tolist() == want.categories.tolist() and np.array_equal(got.codes, want.codes)


def test_only_traces_read_whole_are_prefetched(tmp_path, monkeypatch):
    # A trace bigger than the native scanner's limit is decoded in chunks in its turn, never held ahead.
    small = gzip.compress(_trace(5, rank=0).encode())
    big = gzip.compress(_trace(400, rank=1).encode())
    (tmp_path / "rank0.json.gz").write_bytes(small)
    (tmp_path / "rank1.json.gz").write_bytes(big)
    (tmp_path / "rank2.json").write_text(_trace(5, rank=2))
    monkeypatch.setattr(_plan, "NATIVE_MAX_BYTES", len(gzip.decompress(small)) + 100)
    assert len(gzip.decompress(big)) > _plan.NATIVE_MAX_BYTES
    assert _buffers.worth_prefetching(tmp_path / "rank0.json.gz")
    assert not _buffers.worth_prefetching(tmp_path / "rank1.json.gz")
    assert _buffers.worth_prefetching(tmp_path / "rank2.json")
    monkeypatch.setattr(_plan, "MAP_MIN_BYTES", 10)  # now the plain file would be memory-mapped
    assert not _buffers.worth_prefetching(tmp_path / "rank2.json")
    log = _spy_reads(monkeypatch)
    ts = load(tmp_path)
    main = threading.current_thread().name
    assert [(name, thread == main) for what, name, thread in log if what == "fetch"] == [
        ("rank0.json.gz", False), ("rank1.json.gz", True), ("rank2.json", True)]
    assert ts.ranks == (0, 1, 2)
