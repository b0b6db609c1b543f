"""``_buffers.gunzip`` is ``gzip.decompress``: same bytes, or the same kind of error, on any input."""

from __future__ import annotations

import gzip
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.profiling.errors import TraceFormatError
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
    with pytest.raises(TraceFormatError, match=r"rank0\.json\.gz: corrupt or truncated gzip"):
        _buffers.read_bytes(path)
