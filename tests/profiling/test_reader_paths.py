"""Every decode path of the Kineto reader against an independent reading of every Kineto trace of the corpus,
and the plan that picks the paths.

The reference is ``conftest.reference_read``: plain ``json`` with every number an exact ``Decimal``
(``start_ns = baseTimeNanoseconds + ts * 1000`` exactly), written from the format's rules and sharing no code
with the reader. Each path is forced alone (``read_kineto(force=...)``), so it either reads the whole trace
itself or raises ``PathRefused``: a path that silently handed a trace on to another would be caught here.
"""

from __future__ import annotations

import gzip
import json
import logging

import pytest

from shardline.profiling.readers import _plan, kineto
from shardline.profiling.readers._plan import DecodePath, PathRefused
from shardline.profiling.table.load import _discover

#: Corpus traces a path must refuse, and why (every other trace it must read): none today.
REFUSED: dict = {}


def _kineto_files(traces_dir):
    files = [path for path, fmt in _discover(traces_dir) if "kineto" in str(fmt).lower()]
    assert len(files) >= 30
    return files


def _paths():
    return [way for way in DecodePath if not (way is DecodePath.NATIVE and not _plan.native_built())]


def test_every_path_reads_every_corpus_trace_as_the_reference(traces_dir, reference, caplog):
    read = dict.fromkeys(_paths(), 0)
    for path in _kineto_files(traces_dir):
        try:
            expected = reference.read(path)
        except reference.NotModelled:  # not a trace (an execution trace, a memory timeline): no events
            expected = None
        for way in read:
            if expected is None or (way, path.name) in REFUSED:
                try:
                    assert kineto.read_kineto(path, force=way).skipped, (path, way)
                except PathRefused:
                    pass
                continue
            result = kineto.read_kineto(path, force=way)
            reference.check(result, expected, f"{path} [{way.value}]")
            assert not result.warnings, (path, way, result.warnings)
            read[way] += 1
        if expected is not None:  # and the default plan, which logs the path it took
            with caplog.at_level(logging.DEBUG, logger="shardline.profiling.readers"):
                reference.check(kineto.read_kineto(path), expected, f"{path} [default plan]")
    assert min(read.values()) >= 30, read
    taken = {m.rsplit(" ", 2)[-2] for m in caplog.messages if m.endswith(" path")}
    if _plan.native_on():  # every corpus trace is small: the scanner takes them all
        assert taken == {"native"}, taken


def test_a_big_generated_trace_reads_as_the_reference_on_every_path(tmp_path, traces_dir, monkeypatch, reference):
    # A plain file above the map threshold is streamed; chunks small enough that each path cuts it many times.
    seed = gzip.decompress((traces_dir / "hta" / "trace_filter" / "sampled_rank-0.json.gz").read_bytes())
    path = tmp_path / "rank0.json"
    path.write_bytes(seed)
    monkeypatch.setattr(_plan, "MAP_MIN_BYTES", len(seed) // 2)
    monkeypatch.setattr(_plan, "CHUNK_BYTES", 200_000)
    monkeypatch.setattr(_plan, "BATCH_EVENTS", 1000)
    expected = reference.read(path)
    assert _plan.plan(path).paths[0] is DecodePath.STREAM
    for way in [None, *_paths()]:
        reference.check(kineto.read_kineto(path, force=way), expected, f"{path} [{way}]")


# --- the plan's rules

def _file(tmp_path, size: int, *, gz: bool = False):
    body = b'{"traceEvents": [' + b" " * max(0, size - 20) + b"]}"
    path = tmp_path / ("t.json.gz" if gz else "t.json")
    path.write_bytes(gzip.compress(body) if gz else body)
    return path


def test_plan_rules(tmp_path, monkeypatch):
    monkeypatch.setattr(_plan, "native_built", lambda: True)
    monkeypatch.setattr(_plan, "arrow_installed", lambda: True)
    small, big = _file(tmp_path, 1000), tmp_path / "big.json"
    big.write_bytes(b"{}")
    assert _plan.plan(small).paths == (DecodePath.NATIVE, DecodePath.ONE_CALL, DecodePath.SLICES)
    assert _plan.plan(small).prefetch and not _plan.plan(small).mapped and _plan.plan(small).arrow
    assert _plan.plan(small, data=b"x" * (5 << 20)).paths == (DecodePath.NATIVE, DecodePath.STREAM,
                                                               DecodePath.SLICES)
    assert _plan.plan(small, data=b"x" * (65 << 20)).paths == (DecodePath.STREAM, DecodePath.SLICES)
    monkeypatch.setattr(_plan, "MAP_MIN_BYTES", 1)
    assert _plan.plan(big).mapped and _plan.plan(big).paths == (DecodePath.STREAM, DecodePath.SLICES)
    assert not _plan.plan(big).prefetch
    gz = _file(tmp_path, 1000, gz=True)
    assert not _plan.plan(gz).mapped and _plan.plan(gz).prefetch  # gzip is never mapped
    # Environment variables are read when the plan is made, not at import.
    monkeypatch.setenv("SHARDLINE_KINETO_NATIVE", "0")
    monkeypatch.setenv("SHARDLINE_KINETO_ARROW", "off")
    assert _plan.plan(small, data=b"x" * (5 << 20)).paths == (DecodePath.STREAM, DecodePath.SLICES)
    assert not _plan.plan(small).arrow
    monkeypatch.setenv("SHARDLINE_KINETO_PATH", "one_call")
    forced = _plan.plan(small)
    assert forced.paths == (DecodePath.ONE_CALL,) and forced.strict


def test_the_plan_says_which_path_it_took_and_why(tmp_path, caplog):
    path = _file(tmp_path, 1000)
    with caplog.at_level(logging.DEBUG, logger="shardline.profiling.readers"):
        kineto.read_kineto(path, force=DecodePath.SLICES)
        kineto.read_kineto(path)
    messages = [record.getMessage() for record in caplog.records]
    assert f"{path}: plan slices (forced ({path.stat().st_size} bytes))" in messages
    assert f"{path}: read by the slices path" in messages
    assert any(m.startswith(f"{path}: plan ") and "(" in m and "forced" not in m for m in messages)


def test_a_forced_path_raises_where_it_refuses_and_the_plan_hands_on_otherwise(tmp_path):
    path = tmp_path / "rank0.json"
    path.write_text('{"traceEvents": [{"ph": "X", "name": "a", "tid": [2], "ts": 1, "dur": 1}, '
                    '{"ph": "X", "name": "b", "ts": 2, "dur": 1}]}')
    for way in (DecodePath.ONE_CALL, *([DecodePath.NATIVE] if _plan.native_built() else [])):
        with pytest.raises(PathRefused, match=way.value):
            kineto.read_kineto(path, force=way)
    result = kineto.read_kineto(path)  # the slices salvage: the mistyped event dropped, with a warning
    assert result.events["name"].tolist() == ["b"]
    assert any("dropped 1 events" in w for w in result.warnings)



# --- the int32 columns (``schema.COLUMNS``: device, pg_size, peer, and rank): an integer beyond int32 is -1
#     (their missing value) with a warning naming the file and the column, on every path alike; never wrapped.

_EDGES = {2**31 - 1: True, 2**31: False, -2**31: True, -2**31 - 1: False, 2**40: False, -2**40: False,
          2**63 - 1: False, 2**63: False, 2**70: False, -2**63: False,
          -2**63 - 1: False}
_INT32_WARNING = "{path}: {count} integer values beyond int32 in the {column} column were set to -1"
_INT64_WARNING = "{path}: {count} integer args beyond int64 were set to -1"


def _event(*, cat="kernel", pid=3, args=None) -> dict:
    return {"ph": "X", "cat": cat, "name": "k", "pid": pid, "tid": 7, "ts": 1, "dur": 2, "args": args or {}}


def _every_path(path, monkeypatch, *, beyond_int64: bool) -> dict:
    """Each path's reading of ``path`` (forced alone), and the default plan's, mapped and streamed in one-event
    chunks too; only the scanner may refuse, and only an integer beyond int64 (the others' -1 and warning)."""
    results = {"default": kineto.read_kineto(path)}
    for way in _paths():
        try:
            results[way.value] = kineto.read_kineto(path, force=way)
        except PathRefused:
            assert way is DecodePath.NATIVE and beyond_int64, (path, way)
    with monkeypatch.context() as m:
        m.setattr(_plan, "MAP_MIN_BYTES", 0)
        m.setattr(_plan, "CHUNK_BYTES", 1)
        results["mapped stream"] = kineto.read_kineto(path)
        results["forced mapped stream"] = kineto.read_kineto(path, force=DecodePath.STREAM)
    return results


def _expected_warnings(path, value: int, count: int, column: str) -> list[str]:
    if abs(value) >= 2**63 and value != -2**63:
        return [_INT64_WARNING.format(path=path, count=count)]
    if not -2**31 <= value < 2**31:
        return [_INT32_WARNING.format(path=path, count=count, column=column)]
    return []


# (column, how the trace gives it, the value that column takes from ``value`` when it fits int32, and when not)
_CASES = {
    # a GPU row's device arg; one beyond int32 is absent, as one beyond int64 is: the row takes its pid (3)
    "device arg": ("device", lambda v: _event(args={"device": v}), lambda v: v if v >= 0 else 3, 3),
    "device arg as text": ("device", lambda v: _event(args={"device": str(v)}), lambda v: v if v >= 0 else 3, 3),
    # a GPU row without a device arg takes its pid as the device; a pid beyond int64 is absent (-1) too
    "device from pid": ("device", lambda v: _event(pid=v), lambda v: v, -1),
    "device from pid as text": ("device", lambda v: _event(pid=str(v)), lambda v: v, -1),
    # a CPU row's device is -1 whatever its args say, but its device arg is read (and counted) all the same
    "cpu row's device arg": ("device", lambda v: _event(cat="cpu_op", args={"device": v}), lambda v: -1, -1),
    "pg_size": ("pg_size", lambda v: _event(cat="cpu_op", args={"Group size": v}), lambda v: v, -1),
    "peer from Dst Rank": ("peer", lambda v: _event(cat="cpu_op", args={"Dst Rank": v, "Src Rank": 5}),
                           lambda v: v if v != -1 else 5, -1),
    "peer from Src Rank": ("peer", lambda v: _event(cat="cpu_op", args={"Src Rank": v}), lambda v: v, -1),
}


@pytest.mark.parametrize("value", list(_EDGES))
@pytest.mark.parametrize("case", list(_CASES))
def test_an_int32_column_beyond_int32_is_minus_one_with_a_warning_on_every_path(
        tmp_path, monkeypatch, read_paths, case, value):
    column, event_of, fits, beyond = _CASES[case]
    path = tmp_path / "rank0.json"
    events = [event_of(value), _event(cat="cpu_op"), event_of(value)]  # two of them: the warning counts both
    path.write_text(json.dumps({"traceEvents": events, "baseTimeNanoseconds": 1000}))
    read_paths(path)  # every path against the independent reference (``conftest``), which narrows alike
    want = fits(value) if _EDGES[value] else beyond
    warned = _expected_warnings(path, value, 2, column)
    for label, result in _every_path(path, monkeypatch, beyond_int64=not -2**63 <= value < 2**63).items():
        assert result.events[column].dtype == "int32", label
        assert result.events[column].tolist() == [want, -1, want], (label, result.events[column].tolist())
        assert result.warnings == warned, (label, result.warnings)


@pytest.mark.parametrize("value", list(_EDGES))
def test_a_rank_beyond_int32_is_not_used_with_a_warning_on_every_path(tmp_path, monkeypatch, value):
    # distributedInfo.rank beyond int32: not used (the file name's rank 4 is, as where no rank is recorded)
    path = tmp_path / "rank4.json"
    path.write_text(json.dumps({"distributedInfo": {"rank": value}, "traceEvents": [_event()]}))
    fits = _EDGES[value]
    for label, result in _every_path(path, monkeypatch, beyond_int64=False).items():
        assert result.events["rank"].dtype == "int32", label
        assert result.events["rank"].tolist() == [value if fits else 4], label
        assert result.warnings == ([] if fits else [
            f"{path}: rank {value} from distributedInfo.rank is beyond int32 (the rank column); not used"]), label
    # a rank argument beyond int32, and one in a file name: no rank (-1; ``load`` says it is missing)
    if value >= 0:
        # (an argument is taken before the file name, so one beyond int32 leaves no rank)
        assert kineto.read_kineto(path, rank=value).metadata.keys() == {value if fits else -1}
        named = tmp_path / f"rank{value}.json"
        named.write_text(json.dumps({"traceEvents": [_event()]}))
        result = kineto.read_kineto(named)
        assert result.events["rank"].tolist() == [value if fits else -1]
        assert result.warnings == ([] if fits else [
            f"{named}: rank {value} from the file name is beyond int32 (the rank column); not used"])
        given = tmp_path / "trace.json"
        given.write_text(json.dumps({"traceEvents": [_event()]}))
        result = kineto.read_kineto(given, rank=value)
        assert result.events["rank"].tolist() == [value if fits else -1]
        assert result.warnings == ([] if fits else [
            f"{given}: rank {value} from the rank argument is beyond int32 (the rank column); not used"])
