"""Every decode path of the Kineto reader against an independent reading of every Kineto trace of the corpus,
and the plan that picks the paths.

The reference is ``conftest.reference_read``: plain ``json`` with every number an exact ``Decimal``
(``start_ns = baseTimeNanoseconds + ts * 1000`` exactly), written from the format's rules and sharing no code
with the reader. Each path is forced alone (``read_kineto(force=...)``), so it either reads the whole trace
itself or raises ``PathRefused``: a path that silently handed a trace on to another would be caught here.
"""

from __future__ import annotations

import gzip
import logging

import pytest

from shardline.profiling.load import _discover
from shardline.profiling.readers import _plan, kineto
from shardline.profiling.readers._plan import DecodePath, PathRefused

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

