"""Invalid UTF-8 in a trace's texts: the event is kept, the bad bytes become U+FFFD, one warning counts them.

Pinned on every decode path of the Kineto reader (native scanner, chunks in memory, msgspec one-call,
batches with salvage, the memory-mapped stream, gzip) and on whatever msgspec the environment has: msgspec up to 0.22
raises ``UnicodeDecodeError`` on invalid UTF-8 and 0.23 raises ``msgspec.DecodeError`` with another text, so
a reader that trusted either dropped the event on one of them. CI runs this file at the lowest admitted
msgspec too (``.ci/floors``).
"""

from __future__ import annotations

import gzip
import json
import warnings

import msgspec
import pytest

from shardline.profiling.base.errors import TraceWarning
from shardline.profiling.readers import _buffers, _kineto_native, _plan, kineto
from shardline.profiling.readers import _kineto_stream as stream

BAD = b"\xff\xfe"  # two bytes that start no UTF-8 sequence: two U+FFFD
CUT = b"\xe2\x82"  # a three-byte sequence cut short: one U+FFFD
REPLACED_NAME = "aten::\ufffd\ufffd"


def _event(i: int, *, name: bytes = b"aten::add", cat: bytes = b"cpu_op", collective: bytes = b"") -> bytes:
    args = b'"External id": %d' % i
    if collective:
        args += b', "Collective name": "' + collective + b'", "Process Group Name": "0"'
    return (b'{"ph": "X", "cat": "' + cat + b'", "name": "' + name + b'", "pid": 1, "tid": 2, "ts": %d.5, '
            b'"dur": 1, "args": {' % (10 * i) + args + b"}}")


def _trace(n: int = 40) -> bytes:
    events = [_event(i) for i in range(n)]
    events[1] = _event(1, name=b"aten::" + BAD)
    events[7] = _event(7, cat=b"cpu" + CUT)
    events[20] = _event(20, name=b"nccl:all_reduce", collective=b"allreduce" + BAD)
    return (b'{"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": [\n'
            + b",\n".join(events) + b'\n], "traceName": "run-' + CUT + b'", "baseTimeNanoseconds": 1000}')


def _spy(monkeypatch, module, name, calls):
    original = getattr(module, name)

    def spied(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spied)


# path -> (settings, the function that must have run on that path)
PATHS = {
    "native scanner first": ({}, (_kineto_native, "read")),
    "chunks in memory": ({"native": False, "one_call": 0}, (stream, "stream_mapped")),
    "msgspec one call": ({"native": False, "arrow": False}, (kineto._Decoding, "one_call")),
    "batches with salvage": ({"native": False, "arrow": False, "one_call": 0, "chunks": False},
                             (kineto._Decoding, "slices")),
    "memory-mapped stream": ({"native": False, "map": 0}, (stream, "stream_mapped")),
}


CASES = [(name, compressed) for name in PATHS for compressed in (False, True)
         if not (compressed and name == "memory-mapped stream")]  # gzip is decompressed in memory, never mapped


@pytest.mark.parametrize(("path_name", "compressed"), CASES,
                         ids=[f"{name}-{'gzip' if gz else 'plain'}" for name, gz in CASES])
def test_invalid_utf8_is_kept_as_replacement_characters_on_every_decode_path(tmp_path, monkeypatch, path_name,
                                                                              compressed):
    options, (module, function) = PATHS[path_name]
    if path_name == "native scanner first" and not _buffers.native_available():
        pytest.skip("the native scanner was not built (no C compiler at install time)")
    data = _trace()
    file = tmp_path / ("rank0.json.gz" if compressed else "rank0.json")
    file.write_bytes(gzip.compress(data) if compressed else data)
    if options.get("native") is False:
        monkeypatch.setenv("SHARDLINE_KINETO_NATIVE", "0")
    if "arrow" in options:
        monkeypatch.setenv("SHARDLINE_KINETO_ARROW", "1" if options["arrow"] else "0")
    if "one_call" in options:
        monkeypatch.setattr(_plan, "ONE_CALL_MAX_BYTES", options["one_call"] - 1)  # then chunks, then slices
        monkeypatch.setattr(_plan, "CHUNK_BYTES", 1_000)
    if options.get("chunks") is False:  # a chunk that does not decode is salvaged in the stream itself
        monkeypatch.setattr(kineto._Decoding, "stream", lambda self: None)
    if "map" in options:
        monkeypatch.setattr(_plan, "MAP_MIN_BYTES", options["map"])
        monkeypatch.setattr(_plan, "CHUNK_BYTES", 1_000)
    calls: list[str] = []
    _spy(monkeypatch, module, function, calls)
    result = kineto.read_kineto(file)
    assert calls, f"{path_name}: {function} never ran, so this case did not test its path"
    events = result.events
    # Every event kept, in order; exactly the bad bytes replaced (Python's codec is the reference).
    assert len(events) == 40
    assert events["name"].tolist()[:3] == ["aten::add", REPLACED_NAME, "aten::add"]
    assert events["cat"].tolist()[7] == "cpu\ufffd"
    assert events["collective"].tolist()[20] == "allreduce\ufffd\ufffd"
    assert events["external_id"].tolist() == list(range(40))
    assert result.metadata[0]["traceName"] == "run-\ufffd"
    counted = [w for w in result.warnings if "invalid UTF-8 in" in w and "events" in w]
    assert counted == [f"{file}: invalid UTF-8 in 3 events; the bad bytes were replaced by U+FFFD"], \
        result.warnings
    assert not [w for w in result.warnings if "dropped" in w], result.warnings


def test_counts_of_several_batches_make_one_warning_per_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_KINETO_NATIVE", "0")
    monkeypatch.setenv("SHARDLINE_KINETO_ARROW", "0")
    monkeypatch.setattr(_plan, "ONE_CALL_MAX_BYTES", -1)
    monkeypatch.setattr(_plan, "BATCH_EVENTS", 4)  # ten batches, a bad name in each of the first five
    events = [_event(i, name=b"x" + BAD if i % 8 == 0 else b"aten::add") for i in range(40)]
    events[3] = events[3].replace(b'"tid": 2', b'"tid": [2]')
    events[13] = events[13].replace(b'"tid": 2', b'"tid": {}')
    file = tmp_path / "rank0.json"
    file.write_bytes(b'{"traceEvents": [' + b",".join(events) + b"]}")
    result = kineto.read_kineto(file)
    assert len(result.events) == 38
    assert [w for w in result.warnings if "invalid UTF-8" in w] == [
        f"{file}: invalid UTF-8 in 5 events; the bad bytes were replaced by U+FFFD"]
    dropped = [w for w in result.warnings if "dropped" in w]
    assert len(dropped) == 1 and dropped[0].startswith(f"{file}: dropped 2 events with fields of the wrong type")


def test_the_msgspec_in_use_fails_on_invalid_utf8_in_some_way():
    # What the reader must not depend on: which error msgspec raises. This pins that it raises at all
    # (so the careful path is reached), whatever the class.
    with pytest.raises((msgspec.DecodeError, UnicodeDecodeError)):
        kineto._DECODE_EVENT.decode(_event(0, name=b"a" + BAD))


def test_a_mistyped_event_with_invalid_utf8_is_dropped_not_counted_as_replaced(tmp_path):
    events = [_event(i) for i in range(4)]
    events[2] = events[2].replace(b'"tid": 2', b'"tid": [2]').replace(b"aten::add", b"aten::" + BAD)
    file = tmp_path / "rank0.json"
    file.write_bytes(b'{"traceEvents": [' + b",".join(events) + b"]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        result = kineto.read_kineto(file)
    assert result.events["external_id"].tolist() == [0, 1, 3]
    assert not [w for w in result.warnings if "invalid UTF-8" in w]
    assert [w for w in result.warnings if "dropped 1 events" in w]


def test_valid_utf8_is_not_touched():
    text = "ünïcödé 🙂"
    assert _buffers.utf8_repaired(json.dumps(text, ensure_ascii=False).encode()) is None
    assert _buffers.utf8_repaired(b"a" + BAD) == "a\ufffd\ufffd".encode()
