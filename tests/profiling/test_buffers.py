"""``_buffers.gunzip`` is ``gzip.decompress``: same bytes, or the same kind of error, on any input."""

from __future__ import annotations

import gzip
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.profiling.base.errors import TraceFormatError
from shardline.profiling.readers import _buffers


def _same(data: bytes) -> None:
    try:
        want = gzip.decompress(data)
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as exc:
        with pytest.raises(type(exc)):
            _buffers.gunzip(data)
        return
    assert _buffers.gunzip(data) == want


_payload = st.binary(max_size=3000) | st.text(max_size=2000).map(str.encode)


@settings(max_examples=150, deadline=None)
@given(members=st.lists(_payload, min_size=1, max_size=3), padding=st.integers(0, 3), cut=st.integers(0, 40),
       flip=st.none() | st.tuples(st.integers(0, 10_000), st.integers(1, 255)),
       trailer=st.none() | st.integers(0, 2**32 - 1))
def test_gunzip_is_gzip_decompress(members, padding, cut, flip, trailer):
    data = bytearray(b"".join(gzip.compress(m) for m in members) + b"\x00" * padding)
    if trailer is not None:  # a size trailer that lies (too small, too big, absurd)
        data[-4 - padding:len(data) - padding] = trailer.to_bytes(4, "little")
    if flip is not None:
        at, bits = flip
        data[at % len(data)] ^= bits
    if cut:
        data = data[:-cut]
    _same(bytes(data))


def test_gunzip_edge_cases():
    one = gzip.compress(b'{"traceEvents": []}')
    for data in (one, one + one, one + b"\x00" * 7, one[:-1], one[:10], b"\x1f\x8b", gzip.compress(b""),
                 gzip.compress(b"x" * 5_000_000)):  # 5 MB of one byte: past the trailer-size cap, grows
        _same(data)
    assert _buffers.gunzip(one + gzip.compress(b" more")) == b'{"traceEvents": []} more'


def test_damaged_gzip_file_is_our_error(tmp_path):
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(gzip.compress(b'{"traceEvents": []}')[:-5])
    with pytest.raises(TraceFormatError, match=r"rank0\.json\.gz: truncated gzip"):
        _buffers.read_bytes(path)


# --- json_value: the standard library's JSON with msgspec's strictness (the native path's metadata and escapes)

@pytest.mark.parametrize("raw, want", [
    (b'{"rank": 3, "world_size": 8}', {"rank": 3, "world_size": 8}),
    (b"1700000000123456789", 1700000000123456789),  # beyond float precision: an exact int
    (b'"caf\\u00e9"', "caf\u00e9"),
    (b'"\\ud83d\\ude00"', "\U0001f600"),  # a surrogate pair is one character
    (b"[1.5, null, true]", [1.5, None, True]),
])
def test_json_value_decodes_json(raw, want):
    assert _buffers.json_value(raw) == want
    assert _buffers.json_value(memoryview(raw)) == want  # a slice of the document buffer


@pytest.mark.parametrize("raw", [
    b"NaN", b"[Infinity]", b"-Infinity",  # not JSON (msgspec refuses them; json.loads would not)
    b'"a\\ud800b"', b'{"k": ["\\udfff"]}', b'{"\\ud800": 1}',  # a lone surrogate: no text
    b'"\xff"', b'"\xed\xa0\x80"',  # invalid UTF-8, including a UTF-8-encoded surrogate
    b'"\x00a\x00"', b"\xef\xbb\xbf1",  # bytes json.loads would read as UTF-16, a BOM
    b"{", b"", b"1 2",
])
def test_json_value_refuses_what_is_not_json(raw):
    assert _buffers.json_value(raw) is _buffers.NOT_JSON


def test_a_natively_read_trace_never_imports_msgspec(traces_dir):
    """The msgspec paths (``kineto.msgspec_paths``) are imported only when one reads a trace: ``load`` and
    ``breakdown`` of intact traces the scanner reads leave msgspec unimported (~10 ms of a small set's read)."""
    import subprocess
    import sys

    if not _buffers.native_available():
        pytest.skip("the native scanner was not built (no C compiler)")
    code = ("import sys, warnings; warnings.simplefilter('ignore')\n"
            "from shardline.profiling import breakdown, load\n"
            f"assert len(breakdown(load({str(traces_dir / 'hta' / 'trace_filter')!r})))\n"
            "assert 'msgspec' not in sys.modules, 'msgspec was imported'\n"
            "from shardline.profiling.readers import kineto\n"
            "assert kineto.Event.__module__.endswith('_kineto_msgspec')  # the names still reachable\n"
            "assert 'msgspec' in sys.modules\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
