"""Malformed and unusual inputs, written in review of the (since dropped, see ``_plan``) Arrow chunk path: every
decode path must read each exactly or refuse it.

Each test reads one small trace on every decode path (the ``read_paths`` fixture): a path reads it as the
independent ``json`` + ``Decimal`` reading of ``conftest`` does, or, where that reading declines the input
(a null, a mistyped field, damage), the native path must refuse it.
"""

from __future__ import annotations

import pytest

from shardline.profiling.readers import _plan

BASE = 1_700_000_000_000_000_000


def _write(tmp_path, events, *, separator=",\n  ", name="rank0.json", base=BASE):
    body = ('{"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": [' + separator.join(events) + "]"
            + (f', "baseTimeNanoseconds": {base}' if base is not None else "") + "}")
    path = tmp_path / name
    path.write_bytes(body.encode("utf-8", errors="surrogateescape"))
    return path


def _op(ts="10.125", dur="2.5", name="aten::mm", extra="", args='"External id": 7', pid="1", tid="2",
        ph="X", cat="cpu_op") -> str:
    return (f'{{"ph": {ph}, "cat": {cat}, "name": {name}, "pid": {pid}, "tid": {tid}, "ts": {ts}, "dur": {dur}'
            f'{extra}, "args": {{{args}}}}}')


def op(**kw):
    kw.setdefault("name", '"aten::mm"')
    kw.setdefault("ph", '"X"')
    kw.setdefault("cat", '"cpu_op"')
    return _op(**kw)


def _streamed(monkeypatch, chunk=200):
    monkeypatch.setattr(_plan, "MAP_MIN_BYTES", 0)
    monkeypatch.setattr(_plan, "CHUNK_BYTES", chunk)


# --- explicit nulls: msgspec refuses null for a str/int field (event dropped + warning), Arrow reads a null
@pytest.mark.parametrize("event", [
    op(name="null"),
    op(cat="null"),
    op(pid="null"),
    op(tid="null"),
    op(args='"correlation": null'),
    op(args='"External id": null'),
    op(args='"Collective name": null'),
    op(ph="null"),  # same events either way, but only the ordinary path warns
], ids=["name", "cat", "pid", "tid", "args.correlation", "args.External id", "args.Collective name", "ph"])
def test_explicit_null_fields(tmp_path, event, read_paths):
    read_paths(_write(tmp_path, [event, op()]))


# --- a time written as a JSON string: the ordinary path drops the event (not a number), Arrow parses it
@pytest.mark.parametrize("event", [op(ts='"10.5"'), op(dur='"5"')], ids=["ts", "dur"])
def test_times_written_as_strings(tmp_path, event, read_paths):
    read_paths(_write(tmp_path, [event, op()]))


# --- ts key written with an escape, value null: the explicit-null regex does not see it
@pytest.mark.parametrize("key", ["t\\u0073", "d\\u0075r"])
def test_escaped_time_key_with_a_null_value(tmp_path, key, read_paths):
    event = ('{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 2, "' + key + '": null'
             + (', "dur": 1}' if key.startswith("t") else ', "ts": 3}'))
    read_paths(_write(tmp_path, [event, op()]))


def test_escaped_keys_with_numbers_agree(tmp_path, read_paths):
    # Escapes in keys are decoded by both parsers, but a chunk with any \u escape is left to the ordinary path
    # (an escape could spell a key the fast path's literal checks look for).
    event = '{"\\u0070h": "X", "c\\u0061t": "cpu_op", "name": "a", "p\\u0069d": 1, "tid": 2, "t\\u0073": 3.5, "dur": 1}'
    events = read_paths(_write(tmp_path, [event, op()]))
    assert events["start_ns"].tolist()[0] == BASE + 3500


# --- a key the ordinary path ignores but the fast path reads (the renamed-key namespace)
def test_literal_tid_text_key(tmp_path, read_paths):
    # fast: stream 99 (tid_text read as the tid); ordinary: stream 2 (tid_text is an unknown key)
    read_paths(_write(tmp_path, [op(extra=', "tid_text": "99"'), op()]))


def test_literal_pid_text_key_in_a_begin_end_pair(tmp_path, read_paths):
    # fast: the B event's pid is 3, so B/E do not pair (dropped + warning); ordinary: pid 1, paired
    events = [op(), '{"ph": "B", "cat": "user_annotation", "name": "r", "pid": 1, "pid_text": "3", "tid": 2, "ts": 1}',
              '{"ph": "E", "cat": "user_annotation", "name": "r", "pid": 1, "tid": 2, "ts": 20}']
    read_paths(_write(tmp_path, events))


# --- text tids: the ordinary path converts an all-numeric batch with numpy (int() rules), the fast path
#     always with _int (last run of digits)
@pytest.mark.parametrize("tid", ['"-5"', '"1_000"'])
def test_signed_and_underscored_text_tids(tmp_path, tid, read_paths):
    read_paths(_write(tmp_path, [op(tid=tid), op()]))


# --- invalid UTF-8 in an event the fast path filters out before validating its texts
def test_invalid_utf8_in_a_dropped_event(tmp_path, read_paths):
    meta = '{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "caf\udce9"}}'
    meta_name = '{"ph": "M", "name": "caf\udce9", "pid": 1}'
    read_paths(_write(tmp_path, [meta_name, meta, op()]))


# --- numbers that both read the same (no difference expected)
@pytest.mark.parametrize("ts", ["-0", "1E3", "1.0e-3", "100e-5", "1.0005e3", "-5.5", "1.2300000", "0.1e1"])
def test_number_forms_agree(tmp_path, ts, read_paths):
    read_paths(_write(tmp_path, [op(ts=ts), op()]))


@pytest.mark.parametrize("event", [
    op(args='"x": {"y": [1, {"z": null}]}, "correlation": 4'),
    op(extra=', "args": []'.replace(', "args"', ', "a"')),
    op(name='"\\ud83d\\ude00 a\\u0000b \\" id\\":\\"x"'),
    op(extra=', "External id": "5"'),
    op(args='"device": 0, "stream": 7, "x": "id\\": \\"5"'),
], ids=["nested args", "other key", "unicode", "top-level External id text", "quote-id in value"])
def test_nested_args_unicode_and_quoted_ids_agree(tmp_path, event, read_paths):
    read_paths(_write(tmp_path, [event, op()]))


@pytest.mark.parametrize("sep", [",\r\n", "\t,\t", " ,\n\t", "\r\n,\r\n"])
def test_separators_agree(tmp_path, sep, read_paths):
    _ = read_paths(_write(tmp_path, [op(), op(ts="11"), op(ts="12")], separator=sep))


# --- streamed (memory-mapped) files: the fast path sees a chunk before msgspec has validated the file
@pytest.mark.parametrize("sep", [",\x0c", "\x0b,"], ids=["formfeed", "vtab"])
def test_streamed_non_json_whitespace_separator(tmp_path, monkeypatch, sep, read_paths):
    _streamed(monkeypatch)
    read_paths(_write(tmp_path, [op(ts=str(i)) for i in range(20)], separator=sep))


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_streamed_nan_in_an_unread_field(tmp_path, monkeypatch, value, read_paths):
    _streamed(monkeypatch)
    events = [op(ts=str(i)) for i in range(20)]
    events[12] = op(ts="12", args=f'"weird": {value}')
    read_paths(_write(tmp_path, events))


def test_streamed_single_event_chunks(tmp_path, monkeypatch, read_paths):
    _streamed(monkeypatch, chunk=1)
    _ = read_paths(_write(tmp_path, [op(ts=str(i)) for i in range(10)], separator=","))


def test_gzipped_file_read_in_memory(tmp_path, read_paths):
    import gzip
    path = _write(tmp_path, [op(ts=str(i)) for i in range(10)])
    gz = tmp_path / "rank0.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    _ = read_paths(gz)


def test_streamed_missing_comma_between_events(tmp_path, monkeypatch, read_paths):
    # invalid JSON (two events without a comma): Arrow reads a sequence of objects, msgspec refuses
    _streamed(monkeypatch)
    events = [op(ts=str(i)) for i in range(20)]
    events[11] = events[11] + " " + events[12]
    del events[12]
    read_paths(_write(tmp_path, events, separator=","))


def test_bom_and_bare_array_agree(tmp_path, monkeypatch, read_paths):
    path = _write(tmp_path, [op(), op(ts="11")])
    bom = tmp_path / "bom_rank0.json"
    bom.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    read_paths(bom)
    bare = tmp_path / "bare_rank0.json"
    bare.write_text("[" + ",".join([op(), op(ts="11")]) + "]")
    read_paths(bare)
    _streamed(monkeypatch)
    read_paths(bom)
    read_paths(bare)


# --- a bounded fuzz over event shapes, leaving out the difference classes confirmed above (explicit nulls,
#     time strings, *_text keys, signed/underscored text ids); anything it finds is a new class.
def test_fuzzed_event_shapes(tmp_path_factory, monkeypatch, read_paths):
    import json

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    digits = st.from_regex(r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,4})?([eE][-+]?[0-9])?", fullmatch=True)
    # the int32 and int64 edges (each side), where a column's narrowing or an arg's overflow begins
    edges = st.sampled_from([2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63 - 1, 2**63, -2**63, -2**63 - 1])
    ints = st.one_of(st.integers(-5, 10), st.integers(-2**64, 2**64), edges)
    texts = st.one_of(st.sampled_from(["", "X", "B", "stream 7", "0x1f", "5555", "Spans", "id\":\"", "},{", "a}, {b"]),
                      st.text(max_size=6))
    scalar = st.one_of(ints, texts, st.booleans(), st.floats(allow_nan=False, allow_infinity=False))
    value = st.one_of(scalar, st.lists(ints, max_size=2),
                      st.dictionaries(st.sampled_from(["a", "id"]), ints, max_size=2))
    arg_keys = st.sampled_from(["correlation", "External id", "external id", "device", "stream", "bytes",
                                "Collective name", "Process Group Name", "Process Group Ranks", "Group size",
                                "In msg nelems", "dtype", "Seq", "Src Rank", "Dst Rank", "other id", "x"])
    event = st.fixed_dictionaries(
        {"ph": st.one_of(st.sampled_from(["X", "X", "B", "E", "i", "M"]), ints)},
        optional={"cat": st.one_of(st.sampled_from(["cpu_op", "kernel", "Trace", "python_function", "Kernel"]), ints),
                  "name": st.one_of(texts, ints),
                  "pid": st.one_of(ints, texts.filter(lambda t: not t.startswith(("-", "+")) and "_" not in t)),
                  "tid": st.one_of(ints, texts.filter(lambda t: not t.startswith(("-", "+")) and "_" not in t)),
                  "ts": digits, "dur": digits,
                  "args": st.one_of(st.dictionaries(arg_keys, value, max_size=4), st.sampled_from([[], "x", 1]))})

    def dump(e):
        parts = []
        for k, v in e.items():
            parts.append(f'"{k}": ' + (v if k in ("ts", "dur") else json.dumps(v)))
        return "{" + ", ".join(parts) + "}"

    counter = iter(range(10**6))

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(event, min_size=1, max_size=6), st.sampled_from([",", ",\n", ", ", ",\r\n\t"]), st.booleans())
    def check(events, sep, streamed):
        path = tmp_path_factory.mktemp("fz") / f"rank0-{next(counter)}.json"
        body = '{"traceEvents": [' + sep.join(dump(e) for e in events) + '], "baseTimeNanoseconds": 1000}'
        if any(k in body for k in ("_text",)):
            return
        path.write_text(body)
        with monkeypatch.context() as m:
            if streamed:
                m.setattr(_plan, "MAP_MIN_BYTES", 0)
                m.setattr(_plan, "CHUNK_BYTES", 60)
            read_paths(path)

    check()
