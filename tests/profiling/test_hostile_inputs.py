"""One line for every bad input, never a traceback or a silent wrong number (issue 46 §4, the profiler's part).

Each hostile input gives our exception, one line naming the file (and the value at fault), on every decode path
of the Kineto reader (each forced alone, as ``read_paths`` does: a forced path may refuse instead), or is read
exactly with a warning: JSON nested past the decoders' recursion limit, gzip bombs, truncated documents and
``.gz`` files that are not gzip, bare ``NaN``/``Infinity`` literals. The TensorBoard plugin skips a run whose
manifest it cannot read (logged) and serves the others, and answers a malformed index with 400.
"""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import lzma
import tracemalloc
import warnings
import zlib
from pathlib import Path

import pytest

from shardline.profiling.base.errors import ProfilingError, TraceFormatError, TraceWarning
from shardline.profiling.readers import _plan, kineto
from shardline.profiling.readers._plan import DecodePath, PathRefused, native_built
from shardline.profiling.table.load import load

BASE = 1_700_000_000_000_000_000
DEEP = 10**6
OP = '{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 10.5, "dur": 2, "args": {}}'


def _nested(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


def _one_line(exc: BaseException, path: Path, *words: str) -> str:
    text = str(exc)
    assert str(path) in text and "\n" not in text, text
    for word in words:
        assert word in text, text
    return text


def _forced_ways():
    return [way for way in DecodePath if way is not DecodePath.NATIVE or native_built()]


# --- 1. nesting past the decoders' recursion limit ------------------------------------------------------------

DEEP_SHAPES = {
    "the events array": '{"traceEvents": ' + _nested() + ', "distributedInfo": {"rank": 0}}',
    "an event's args": ('{"distributedInfo": {"rank": 0}, "traceEvents": [' + OP + ', ' + OP[:-2]
                        + '"x": ' + _nested() + "}}]}"),
    "the metadata before the events": '{"distributedInfo": ' + _nested() + ', "traceEvents": [' + OP + "]}",
    "the metadata after the events": '{"traceEvents": [' + OP + '], "deviceProperties": ' + _nested() + "}",
    "a bare array": "[" + OP + ", " + _nested() + "]",
}


@pytest.fixture(scope="module")
def deep_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deep")
    files = {}
    for i, (shape, text) in enumerate(DEEP_SHAPES.items()):
        files[shape] = folder / f"deep{i}_rank0.json"
        files[shape].write_text(text)
    return files


@pytest.mark.parametrize("shape", list(DEEP_SHAPES))
def test_deep_nesting_is_our_error_on_every_path(deep_files, shape, monkeypatch):
    path = deep_files[shape]
    for way in [None, *_forced_ways()]:
        try:
            kineto.read_kineto(path, force=way)
        except PathRefused:
            assert way is not None
            continue
        except TraceFormatError as exc:
            _one_line(exc, path, "nested too deep")
            continue
        raise AssertionError(f"{path} [{way}]: read without an error")
    with pytest.raises(TraceFormatError) as info:
        load(path)
    _one_line(info.value, path, "nested too deep")
    monkeypatch.setenv("SHARDLINE_KINETO_NATIVE", "0")
    with pytest.raises(TraceFormatError) as info:
        kineto.read_kineto(path, op_args=True)
    _one_line(info.value, path, "nested too deep")


@pytest.mark.parametrize("shape", list(DEEP_SHAPES))
def test_deep_nesting_streamed_and_gzipped(deep_files, shape, monkeypatch, tmp_path):
    path = deep_files[shape]
    packed = tmp_path / (path.name + ".gz")
    packed.write_bytes(gzip.compress(path.read_bytes(), compresslevel=1))
    monkeypatch.setattr(_plan, "MAP_MIN_BYTES", 0)  # plain files mapped and streamed in chunks
    monkeypatch.setattr(_plan, "CHUNK_BYTES", 4096)
    for file in (path, packed):
        with pytest.raises(TraceFormatError) as info:
            load(file)
        _one_line(info.value, file, "nested too deep")


def test_deep_nesting_in_a_folder_read_ahead(deep_files, tmp_path):
    """``load`` of a folder reads the next file in a thread (prefetch): the error still names its file."""
    good = tmp_path / "rank1.json"
    good.write_text('{"distributedInfo": {"rank": 1}, "traceEvents": [' + OP + "]}")
    deep = tmp_path / "rank0.json"
    deep.write_bytes(deep_files["an event's args"].read_bytes())
    with pytest.raises(TraceFormatError) as info:
        load(tmp_path)
    _one_line(info.value, deep, "nested too deep")


@pytest.mark.parametrize("name, text", [
    ("fr_rank0.json", '{"pg_config": {}, "entries": ' + _nested() + "}"),
    ("prof_dump.txt", '[{"cat": "GROUP_API", "x": ' + _nested() + "}]"),
], ids=["flight recorder", "NCCL profiler plugin"])
def test_deep_nesting_in_the_other_json_readers(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceFormatError) as info:
        load(path, rank=0)
    _one_line(info.value, path, "nested too deep")


# --- 2. gzip bombs: refused while inflating, holding at most the limit ----------------------------------------

def _bomb(path: Path, inflated: int, *, trailer: int | None = None, members: int = 1) -> Path:
    """A gzip of a trace's start and ``inflated`` bytes of zeros (about 1000x), written member by member."""
    data = bytearray()
    for _ in range(members):
        pack = zlib.compressobj(9, zlib.DEFLATED, 31)
        parts = [pack.compress(b'{"traceEvents": [')]
        block = b"\0" * (1 << 20)
        parts += [pack.compress(block) for _ in range(inflated // members >> 20)]
        data += b"".join(parts) + pack.flush()
    if trailer is not None:  # a size trailer that lies
        data[-4:] = trailer.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


def _peak_while(call) -> int:
    """Peak traced bytes (Python's allocator: every bytes object zlib fills) while ``call()`` runs."""
    tracemalloc.start()
    try:
        call()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("inflated, trailer, members", [
    (48 << 20, None, 1), (48 << 20, 1000, 1), (48 << 20, (4 << 20) - 1, 1), (6 << 20, None, 3),
], ids=["honest trailer", "trailer says 1000", "trailer just under the cap", "3 members, each under the cap"])
def test_gzip_bomb_past_the_cap(tmp_path, monkeypatch, inflated, trailer, members):
    monkeypatch.setenv("SHARDLINE_GZIP_MAX_BYTES", "4M")
    path = _bomb(tmp_path / "rank0.json.gz", inflated, trailer=trailer, members=members)
    caught = []

    def read():
        with pytest.raises(TraceFormatError) as info:
            load(path)
        caught.append(info.value)

    peak = _peak_while(read)
    _one_line(caught[0], path, "decompression bomb", str(path.stat().st_size), str(4 << 20),
              "SHARDLINE_GZIP_MAX_BYTES")
    assert peak < 16 << 20, peak  # the bomb never sits in memory: at most the 4 MiB cap, and its copy


def test_gzip_bomb_past_the_ratio(tmp_path, monkeypatch, traces_dir):
    monkeypatch.setattr(_plan, "GZIP_FREE_BYTES", 1 << 20)  # else any inflated size up to 64 MiB passes
    path = _bomb(tmp_path / "rank0.json.gz", 32 << 20)
    with pytest.raises(TraceFormatError) as info:
        load(path)
    _one_line(info.value, path, "decompression bomb", f"{_plan.GZIP_MAX_RATIO}x", "SHARDLINE_GZIP_MAX_RATIO")
    # A real trace compresses far below the ratio and is read under the same settings.
    real = traces_dir / "hta" / "trace_compare" / "base" / "base.json.gz"
    assert len(load(real).events)
    monkeypatch.setenv("SHARDLINE_GZIP_MAX_RATIO", "2000")  # the knob: the same file now within the limit
    with pytest.warns(TraceWarning):  # its zeros are no JSON: the events before them (none), with a warning
        assert len(load(path, rank=0).events) == 0


@pytest.mark.parametrize("value", ["lots", "1.5G", "-1", "4X"])
def test_gzip_limit_settings_are_checked(tmp_path, monkeypatch, value):
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(gzip.compress(('{"traceEvents": [' + OP + "]}").encode()))
    monkeypatch.setenv("SHARDLINE_GZIP_MAX_BYTES", value)
    with pytest.raises(ProfilingError, match=f"SHARDLINE_GZIP_MAX_BYTES={value!r}"):
        load(path)
    monkeypatch.setenv("SHARDLINE_GZIP_MAX_BYTES", "16G")
    assert _plan.gzip_limit(1000) == _plan.GZIP_FREE_BYTES
    monkeypatch.setenv("SHARDLINE_GZIP_MAX_BYTES", "1024")
    assert _plan.gzip_limit(1000) == 1024


# --- 3. the real cause: truncated, not gzip ---------------------------------------------------------------------

def _trace_with_rank_after_events(n: int = 20) -> str:
    events = ", ".join(OP.replace('"ts": 10.5', f'"ts": {10 * i}') for i in range(n))
    return ('{"schemaVersion": 1, "traceEvents": [' + events + '], "distributedInfo": {"rank": 0, "world_size": 2},'
            f' "baseTimeNanoseconds": {BASE}}}')


@pytest.mark.parametrize("gz", [False, True], ids=["json", "json.gz"])
def test_truncated_trace_names_the_truncation_not_the_rank(tmp_path, gz):
    text = _trace_with_rank_after_events()
    cut = text.encode()[:text.index('"ts": 120')]  # inside the 13th event: the rank (after the events) is lost
    path = tmp_path / ("trace.json.gz" if gz else "trace.json")
    path.write_bytes(gzip.compress(cut) if gz else cut)
    with pytest.raises(TraceFormatError) as info:
        load(path)
    message = _one_line(info.value, path, f"truncated JSON (it ends at byte {len(cut)}", "rank=N",
                        "12 events")
    assert "the rank is not recorded" not in message
    with pytest.warns(TraceWarning, match="truncated"):  # given the rank, the complete events are read
        assert len(load(path, rank=0).events) == 12


def test_truncated_gzip_and_other_compressions(tmp_path):
    text = _trace_with_rank_after_events().encode()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(text)[:200])
    with pytest.raises(TraceFormatError) as info:
        load(cut)
    _one_line(info.value, cut, "truncated gzip", "200 bytes")
    for kind, packed in (("bzip2", bz2.compress(text)), ("xz", lzma.compress(text)), ("zlib", zlib.compress(text)),
                         ("not JSON either", b"hello, not a trace\n")):
        path = tmp_path / f"{kind.split()[0]}.json.gz"
        path.write_bytes(packed)
        with pytest.raises(TraceFormatError) as info:
            load(path)
        _one_line(info.value, path, "not gzip", kind)
    plain = tmp_path / "plain.json.gz"  # plain JSON under a .gz name: read as what it is
    plain.write_bytes(text)
    assert len(load(plain).events) == 20


# --- 4. bare NaN / Infinity: read as null on every path, never a cut trace ------------------------------------

def _write(tmp_path, events: list[str], *, name="rank0.json", extra="") -> Path:
    path = tmp_path / name
    path.write_text('{"distributedInfo": {"rank": 0, "world_size": 1}' + extra + ', "traceEvents": ['
                    + ", ".join(events) + f'], "baseTimeNanoseconds": {BASE}}}')
    return path


def _ops(n: int = 20) -> list[str]:
    return [OP.replace('"ts": 10.5', f'"ts": {10 * i}') for i in range(n)]


@pytest.mark.parametrize("where", ["arg", "ts", "dur", "metadata", "name text"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_literals_are_null_on_every_path(tmp_path, monkeypatch, read_paths, where, literal):
    events, extra = _ops(), ""
    if where == "arg":
        events[5] = events[5].replace('"args": {}', f'"args": {{"scale": {literal}, "x": [1, {literal}]}}')
    elif where in ("ts", "dur"):
        events[5] = events[5].replace(f'"{where}": ' + ("50" if where == "ts" else "2"), f'"{where}": {literal}')
    elif where == "metadata":
        extra = f', "deviceProperties": [{{"clock": {literal}}}]'
    events[7] = events[7].replace('"aten::mm"', f'"{literal} \\" {literal}"')  # text: never touched
    events.append(OP.replace('"args": {}', f'"args": {{"x": {literal}}}'))
    path = _write(tmp_path, events, extra=extra)
    expected = len(events) - (where in ("ts", "dur"))
    for streamed in (False, True):
        with monkeypatch.context() as patch:
            if streamed:
                patch.setattr(_plan, "MAP_MIN_BYTES", 0)
                patch.setattr(_plan, "CHUNK_BYTES", 600)
            table = read_paths(path)
            result = kineto.read_kineto(path)
        assert len(table) == expected, (streamed, result.warnings)
        assert f'{literal} " {literal}' in set(table["name"].astype(str))
        noted = [w for w in result.warnings if "NaN/Infinity literals (not JSON) as null" in w]
        count = {"arg": 3, "name text": 1}.get(where, 2)  # the one in the last event, and those placed
        assert noted == [f"{path}: read {count} bare NaN/Infinity literals (not JSON) as null"], result.warnings


def test_nan_never_cuts_a_step(tmp_path):
    """A step with one NaN arg among its kernels: every kernel read, the table equal to the clean trace's."""
    step = ('{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 2, "ts": 0, '
            '"dur": 13009}')
    kernels = [f'{{"ph": "X", "cat": "kernel", "name": "k{i}", "pid": 0, "tid": 7, "ts": {151 + 640 * i}, '
               f'"dur": 600, "args": {{"device": 0, "stream": 7, "correlation": {100 + i}}}}}' for i in range(20)]
    clean = _write(tmp_path, [step, *kernels], name="clean_rank0.json")
    kernels[2] = kernels[2].replace('"correlation": 102', '"correlation": 102, "scale": NaN')
    dirty = _write(tmp_path, [step, *kernels], name="dirty_rank0.json")
    with pytest.warns(TraceWarning, match="NaN"):
        got = load(dirty).events
    want = load(clean).events
    assert len(got) == 21
    assert got.drop(columns="category").equals(want.drop(columns="category"))


def test_bare_array_with_nan_reads_every_event(tmp_path, read_paths):
    path = tmp_path / "rank0.json"
    path.write_text("[" + ", ".join(_ops(5)[:2] + [OP.replace('"args": {}', '"args": {"x": NaN}')] + _ops(5)[2:])
                    + "]")
    assert len(read_paths(path)) == 6


# --- 5. the TensorBoard plugin: a malformed manifest costs its run only --------------------------------------

@pytest.fixture
def plugin_logdir(tmp_path):
    from shardline.profiling.present.tb_plugin import PLUGIN_NAME

    def run(name: str, manifest: str, files=()):
        folder = tmp_path / name / "plugins" / PLUGIN_NAME
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(manifest)
        for file in files:
            (folder / file).write_text('{"breakdown": []}')

    good = {"version": 1, "windows": [{"name": "w", "first_step": 0, "data": "w.json",
                                       "traces": [{"label": "t", "kind": "raw", "path": "plugins/shardline/w.json"}]}]}
    run("good", json.dumps(good), ["w.json"])
    run("deep", '{"version": 1, "windows": ' + _nested() + "}")
    run("dict_windows", json.dumps({"version": 1, "windows": {"a": 1}}))
    run("bad_window", json.dumps({"version": 1, "windows": [1]}))
    run("bad_traces", json.dumps({"version": 1, "windows": [{"name": "w", "data": "w.json", "traces": "x"}]}),
        ["w.json"])
    run("bad_step", json.dumps({"version": 1, "windows": [{"name": "w", "data": "w.json", "first_step": [[0]]}]}),
        ["w.json"])
    run("not_json", "{")
    run("nul_path", json.dumps({"version": 1, "windows": [{"name": "w", "data": "w\u0000.json"}]}))
    return tmp_path


def _client(logdir: Path):
    from tensorboard.plugins import base_plugin
    from werkzeug.test import Client

    from shardline.profiling.present.tb_plugin import ShardlinePlugin

    apps = ShardlinePlugin(base_plugin.TBContext(logdir=str(logdir))).get_plugin_apps()

    def get(route: str, query: str = ""):
        response = Client(apps[route]).get(f"/data/plugin/shardline{route}{query}")
        return response.status_code, response.get_data()

    return get


def test_plugin_skips_a_malformed_run_and_serves_the_others(plugin_logdir, caplog):
    get = _client(plugin_logdir)
    with caplog.at_level(logging.WARNING, logger="shardline.profiling.present.tb_plugin"):
        status, body = get("/runs")
        assert status == 200
        assert set(json.loads(body)["runs"]) == {"good", "nul_path"}  # nul_path: its window is not a file
        assert get("/window", "?run=good&window=w") == (200, b'{"breakdown": []}')
        assert get("/trace", "?run=good&window=w&index=0")[0] == 200
        assert get("/window", "?run=deep&window=w")[0] == 404
        get("/runs")
    skipped = [r.getMessage() for r in caplog.records if "skipping the run" in r.getMessage()]
    assert len(skipped) == 6, skipped  # each malformed run once, however often it is listed
    for run, why in [("deep", "nested too deep"), ("dict_windows", "windows is an object, not an array"),
                     ("bad_window", "a window is an integer, not an object"),
                     ("bad_traces", "a window's traces is a string, not an array"),
                     ("bad_step", "first_step is an array, not an integer"), ("not_json", "not JSON")]:
        assert any(f"{run}/plugins/shardline/manifest.json" in m and why in m for m in skipped), (run, skipped)


@pytest.mark.parametrize("index", ["%C2%B2", "%D9%A3", "-1", "", "1.0", "0x1"],
                         ids=["superscript two", "arabic-indic three", "-1", "empty", "1.0", "hex"])
def test_plugin_answers_a_malformed_index_with_400(plugin_logdir, index):
    status, body = _client(plugin_logdir)("/trace", f"?run=good&window=w&index={index}")
    assert status == 400 and "ASCII digits" in json.loads(body)["error"]


# --- the command line: the same one line, status 2 ------------------------------------------------------------

def test_cli_prints_one_line(tmp_path, deep_files, monkeypatch, capsys):
    from shardline.profiling.present.cli import main

    monkeypatch.setenv("SHARDLINE_GZIP_MAX_BYTES", "2M")
    bomb = _bomb(tmp_path / "rank0.json.gz", 8 << 20)
    for path, words in ((deep_files["an event's args"], "nested too deep"), (bomb, "decompression bomb")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert main(["profile", "report", str(path)]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and str(path) in err and words in err, err


# --- found on the way: the streamed path took a tail key's array for the events' end -------------------------

@pytest.mark.parametrize("tail", ['"x": [1, 2]', '"INFO": ["log line", "another"]'])
def test_a_tail_array_never_costs_the_metadata_before_it(tmp_path, monkeypatch, read_paths, tail):
    """``"baseTimeNanoseconds": B, "INFO": [...]}`` after the events (Kineto writes INFO there): the streamed
    path took INFO's ``]`` for the events' end, never read the keys before it and lost the base (every time
    off by B, silently). It now reads them, as every other path does."""
    path = tmp_path / "rank0.json"
    path.write_text('{"traceEvents": [' + ", ".join(_ops(30)) + f'], "baseTimeNanoseconds": {BASE}, {tail}}}')
    monkeypatch.setattr(_plan, "MAP_MIN_BYTES", 0)
    monkeypatch.setattr(_plan, "CHUNK_BYTES", 500)
    want = [BASE + 10_000 * i for i in range(30)]
    assert read_paths(path)["start_ns"].tolist() == want
    assert kineto.read_kineto(path, force=DecodePath.STREAM).events["start_ns"].tolist() == want
