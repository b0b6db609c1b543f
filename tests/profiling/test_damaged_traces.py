"""A trace damaged part-way keeps exactly the complete events before the damage, found without reading the
JSON decoder's error text (which names a byte in some msgspec versions and messages, and nothing in others)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.profiling.readers import kineto

# Names that put an event boundary's look-alike ("}, {") inside a string literal.
NAMES = st.sampled_from(["aten::mm", "x}, {y", "}, {", "a} ,{b", "nccl:all_reduce"])


def _event(i: int, name: str) -> str:
    return (f'{{"ph": "X", "cat": "cpu_op", "name": "{name}", "pid": 1, "tid": 2, "ts": {i}, "dur": 1, '
            f'"args": {{"External id": {i}}}}}')


@settings(max_examples=60, deadline=None)
@given(names=st.lists(NAMES, min_size=2, max_size=30), data=st.data())
def test_damage_keeps_the_events_before_it(tmp_path_factory, names, data):
    damaged = data.draw(st.integers(0, len(names) - 1))
    how = data.draw(st.sampled_from(["garbage", "truncated", "missing comma"]))
    events = [_event(i, name) for i, name in enumerate(names)]
    if how == "garbage":
        events[damaged] = events[damaged].replace('"ts": ', '"ts": ][', 1)
        text = '{"traceEvents": [' + ", ".join(events) + '], "baseTimeNanoseconds": 5000}'
    elif how == "truncated":
        text = '{"traceEvents": [' + ", ".join(events[:damaged]) + (", " if damaged else "") \
            + events[damaged][:len(events[damaged]) // 2]
    else:
        events[damaged] = events[damaged] + " " + _event(99, "q")
        text = '{"traceEvents": [' + ", ".join(events) + "]}"
    path = tmp_path_factory.mktemp("t") / "rank0.json"
    path.write_text(text)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHARDLINE_KINETO_NATIVE", "0")
        patch.setenv("SHARDLINE_KINETO_ARROW", "0")
        result = kineto.read_kineto(path)
    # The event cut by the damage is lost with everything after it; a missing comma damages the event
    # after the one it follows.
    kept = damaged + 1 if how == "missing comma" else damaged
    assert result.events["external_id"].tolist() == list(range(kept))
    assert any("complete event" in w for w in result.warnings)


def test_the_result_does_not_depend_on_the_decoders_error_text(tmp_path, monkeypatch):
    events = [_event(i, "aten::mm") for i in range(50)]
    events[31] = events[31].replace('"ts": ', '"ts": }', 1)
    path = tmp_path / "rank0.json"
    path.write_text('{"traceEvents": [' + ", ".join(events) + "]}")
    monkeypatch.setenv("SHARDLINE_KINETO_NATIVE", "0")
    monkeypatch.setenv("SHARDLINE_KINETO_ARROW", "0")
    expected = kineto.read_kineto(path).events

    class Mute:  # a decoder that fails as msgspec does, saying nothing about where
        def __init__(self, real):
            self.real = real

        def decode(self, data):
            try:
                return self.real.decode(data)
            except msgspec.DecodeError:
                raise msgspec.DecodeError("malformed") from None

    for name in ("_DECODE_TOP", "_DECODE_RAWS", "_DECODE_EVENTS", "_DECODE_EVENT"):
        monkeypatch.setattr(kineto, name, Mute(getattr(kineto, name)))
    muted = kineto.read_kineto(path).events
    assert muted["external_id"].tolist() == expected["external_id"].tolist() == list(range(31))
