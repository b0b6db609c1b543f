"""Fuzz: mutated real traces (truncation, byte flips, deletions, on the text and on the gzip bytes) either load
into a schema-valid table, with only TraceWarnings, or raise our ProfilingError naming the file. Nothing else
escapes, and nothing hangs (bounded inputs, bounded examples). Hostile structure too (issue 46 §4): nesting
past the decoders' recursion limit, bare NaN/Infinity, gzip bombs against a small inflate cap, with the memory
traced while reading bounded."""

from __future__ import annotations

import gzip
import os
import re
import tempfile
import tracemalloc
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline.profiling.base.errors import ProfilingError, TraceWarning
from shardline.profiling.base.schema import check_events
from shardline.profiling.table.load import load

REPO = Path(__file__).resolve().parents[2]
CORPUS = Path(os.environ.get("SHARDLINE_TRACES", REPO.parent / "shared" / "traces"))
#: Small real inputs of every format (name to write the mutant under, corpus file).
SEEDS = {
    "rank0.json": "hta/call_stack/backward_thread.json",
    "rank1.json.gz": "hta/trace_compare/base/base.json.gz",
    "rank0.pt.trace.json": "hta/execution_trace/benchmark_simple_add_trace.json.gz",
    "nccl.log": "nccl_debug_logs/pytorch_torchtitan_issue1369_tp2_ag_rs.log",
    "prof_dump.txt": "nccl_profiler_plugin/example_profiler_p2p_ring_4gpu.txt",
    "fr_rank0.json": "flight_recorder/fr_doc_example_rank0.json",
}
_SETTINGS = settings(max_examples=80, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _seed_bytes(target: str) -> bytes:
    source = CORPUS / SEEDS[target]
    if not source.is_file():
        pytest.skip(f"trace corpus not found at {CORPUS}")
    data = source.read_bytes()
    text = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    return text[:12_000]  # bounded: keeps each example fast, and still spans many events


@st.composite
def mutations(draw, size: int):
    """A list of edits: ('cut', at) truncation, ('flip', at, byte) overwrite, ('del', at, n) deletion."""
    edits = draw(st.lists(st.one_of(
        st.tuples(st.just("cut"), st.integers(0, size)),
        st.tuples(st.just("flip"), st.integers(0, max(size - 1, 0)), st.integers(0, 255)),
        st.tuples(st.just("del"), st.integers(0, size), st.integers(1, 64)),
    ), min_size=1, max_size=4))
    return edits


def _apply(data: bytes, edits) -> bytes:
    out = bytearray(data)
    for edit in edits:
        at = min(edit[1], len(out))
        if edit[0] == "cut":
            del out[at:]
        elif edit[0] == "flip" and at < len(out):
            out[at] = edit[2]
        elif edit[0] == "del":
            del out[at:at + edit[2]]
    return bytes(out)


def _check(target: str, payload: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / target
        path.write_bytes(payload)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning but ours is an escape
            warnings.simplefilter("ignore", TraceWarning)
            try:
                ts = load(path, rank={path.name: 0})
            except ProfilingError as exc:
                assert path.name in str(exc), f"error does not name the file: {exc}"
                return
        check_events(ts.events)
        assert (ts.events["dur_ns"] >= 0).all() or ts.events["source"].isin(["nccl_log"]).all()


@pytest.mark.parametrize("target", sorted(SEEDS))
@_SETTINGS
@given(data=st.data())
def test_mutated_text_never_escapes(target, data):
    seed = _seed_bytes(target)
    edits = data.draw(mutations(len(seed)))
    payload = _apply(seed, edits)
    if target.endswith(".gz"):
        payload = gzip.compress(payload)
    _check(target, payload)


@_SETTINGS
@given(data=st.data())
def test_mutated_gzip_bytes_never_escape(data):
    seed = gzip.compress(_seed_bytes("rank1.json.gz"))
    _check("rank1.json.gz", _apply(seed, data.draw(mutations(len(seed)))))


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_nsys_export_never_escapes(data):
    source = CORPUS / "nsys_ai/tests/fixtures/mock.sqlite"
    if not source.is_file():
        pytest.skip(f"trace corpus not found at {CORPUS}")
    seed = source.read_bytes()
    _check("run.sqlite", _apply(seed, data.draw(mutations(len(seed)))))


# --- hostile structure: what a mutation of bytes rarely builds ----------------------------------------------

#: A JSON number after a key: where a nest or a non-finite literal takes a value's place.
_VALUE = re.compile(rb": (-?[0-9][0-9.eE+-]*)")
#: Nothing here needs more than this (seeds of 12 kB, nests of 400 kB; 3 MiB measured): a 16 MiB bomb inflated
#: whole, or far past the 1 MiB cap, would show.
_HOSTILE_PEAK = 8 << 20


@st.composite
def hostile_edits(draw, seed: bytes):
    """Values replaced by a nest of arrays (some past any recursion limit) or a bare NaN/Infinity, nests
    dropped anywhere, and zero bytes appended (a bomb once gzipped)."""
    values = [m.span(1) for m in _VALUE.finditer(seed)]
    value = st.sampled_from(values) if values else st.just((0, 0))
    depth = st.sampled_from([2, 150, 300, 5000, 200_000])
    literal = st.sampled_from([b"NaN", b"Infinity", b"-Infinity"])
    return draw(st.lists(st.one_of(
        st.tuples(st.just("nest"), value, depth),
        st.tuples(st.just("literal"), value, literal),
        st.tuples(st.just("nest_anywhere"), st.integers(0, len(seed)), depth),
    ), min_size=1, max_size=3)), draw(st.sampled_from([0, 0, 1 << 20, 16 << 20]))


def _hostile(seed: bytes, edits) -> bytes:
    out = seed
    for kind, where, what in sorted(edits, key=lambda e: -(e[1][0] if isinstance(e[1], tuple) else e[1])):
        if kind == "nest_anywhere":
            out = out[:where] + b"[" * what + b"]" * what + out[where:]
            continue
        start, end = where
        out = out[:start] + (b"[" * what + b"]" * what if kind == "nest" else what) + out[end:]
    return out


@pytest.mark.parametrize("target", ["rank0.json", "rank1.json.gz"])
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_hostile_structure_never_escapes_and_stays_bounded(target, data):
    seed = _seed_bytes(target)
    edits, zeros = data.draw(hostile_edits(seed))
    payload = _hostile(seed, edits)
    if target.endswith(".gz"):
        payload = gzip.compress(payload + b"\0" * zeros, compresslevel=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHARDLINE_GZIP_MAX_BYTES", "1M")
        tracemalloc.start()
        try:
            _check(target, payload)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < _HOSTILE_PEAK + 4 * len(payload), peak
