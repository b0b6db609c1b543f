"""Kineto / PyTorch-profiler Chrome-trace JSON (``.json``, ``.json.gz``, ``.pt.trace.json(.gz)``) -> events.

Formats handled: the current schema (``ts`` in µs relative to ``baseTimeNanoseconds``), older traces with
absolute µs times, the 2021 legacy categories (``Operator``/``Runtime``/``Kernel``/``Memcpy``/``Memset``, string
tids such as ``"stream 7"``, lower-case ``external id``), CPU-only and gloo traces, ROCm traces.

Times: ``start_ns = baseTimeNanoseconds + ts·1000`` and ``dur_ns = dur·1000``, computed from the number *text*
(``_numtext``), so ns fractions survive exactly. Lanes: Kineto puts device activity (``kernel``, ``gpu_memcpy``,
``gpu_memset``, ``gpu_user_annotation``, the legacy ``Kernel``/``Memcpy``/``Memset``, MTIA's ``mtia_ccp_events``,
Gaudi's ``hpu_op``: ``_kineto_columns.GPU_CATS``) on ``pid`` = device and ``tid`` = stream; the
``device``/``stream`` args win when present. Everything else is a CPU lane whose ``stream`` is the thread id. A
trace whose device activity is in categories not read as device lanes, or that calls a device runtime but
records no device activity, is warned about by ``load`` (``_kineto_columns.device_lane_note``): its breakdown is
CPU-only. Numeric args written as text (ROCm's ``"bytes": "4096"``) are read as their numbers; a text that is no
number is warned about, naming the event and the arg, and the event is kept without it. Kept: complete events
(``ph`` X) and B/E pairs; dropped: metadata, flows, instant events, the profiler's own ``Trace`` span, and
``python_function`` stacks unless ``keep_python``.

Decoding is columnar, by one of five paths that give the same columns (``_kineto_columns.Columns``): the
native C scanner, a memory-mapped stream of chunks, msgspec in one call, Arrow chunks, and msgspec slices
with salvage (damage keeps the events before it, with a warning). Which path reads a trace, and what each
hands on when it cannot read it exactly, is the plan's (``_plan.plan``, which logs its choice at debug level).

Not JSON but written by some tools: a bare ``NaN``, ``Infinity`` or ``-Infinity`` is read as null (one warning
counts them): a null time drops its event (counted), a null in a field no column reads is ignored. A document
nested past the decoders' recursion limit is our error, as are gzip bombs (``_plan.gzip_limit``).

``op_args=True`` also keeps the args the schema's columns drop (shapes, a collective's element counts, dtype
and splits: ``schema.OP_ARG_COLUMNS``, after the schema's columns): the events are then decoded into
``OpArgsEvent`` (the same fields and those args as raw JSON) by the msgspec paths, never the native scanner.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import re
from pathlib import Path

import pandas as pd

from ..base.schema import conform, conforms, empty_events
from . import ReadResult, _buffers, _kineto_native, _plan
from ._buffers import Prefetched
from ._kineto_columns import Decoded, columns_from_events, finish_frame
from ._plan import DecodePath

_META_KEYS = ("distributedInfo", "baseTimeNanoseconds", "deviceProperties", "schemaVersion", "traceName",
              "displayTimeUnit", "cupti_version", "cuda_runtime_version", "cuda_driver_version", "record_shapes")
_RANK_IN_NAME = re.compile(r"(?:^|[^a-z])(?:rank|worker)[-_]?(\d+)(?![\d])", re.IGNORECASE)


def msgspec_paths():
    """The msgspec paths' module (``_kineto_msgspec``), imported on first use: a trace the native scanner reads
    never needs it."""
    from . import _kineto_msgspec

    return _kineto_msgspec


def __getattr__(name: str):
    # ``kineto.Event``, ``kineto.OpArgsEvent`` and the decoders live in ``_kineto_msgspec`` (imported lazily).
    module = msgspec_paths()
    if hasattr(module, name):
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def rank_from_name(path: Path) -> int | None:
    """Rank written in a file name (``rank-3``, ``rank_3``, ``rank3``, ``worker3``); None when absent."""
    match = _RANK_IN_NAME.search(path.name)
    return int(match.group(1)) if match else None


def read_kineto(path: Path, *, rank: int | None = None, keep_python: bool = False, op_args: bool = False,
                prefetched: Prefetched | None = None, force: DecodePath | str | None = None) -> ReadResult:
    """Read one Kineto trace into events (see the module docstring for the mapping).

    The rank is ``distributedInfo.rank``, else ``rank``, else one written in the file name; none of them
    raises :class:`MissingRankError` from ``load`` (here it is returned as ``-1`` in ``metadata``). A trace
    truncated or corrupted part-way gives a warning and the events before the damage. ``op_args``: add the
    op-args columns (``schema.OP_ARG_COLUMNS``). ``prefetched``: ``prefetch(path)``, when the caller has already
    run it. ``force``: decode with this path only (``_plan.plan``), raising ``PathRefused`` where it cannot
    read the trace exactly.
    """
    path = Path(path)
    if prefetched is not None:
        data, scanned, chosen = prefetched.data, prefetched.scanned, prefetched.plan
        if chosen is not None and chosen.op_args != op_args:
            scanned, chosen = _NOT_SCANNED, None  # planned for another read: plan this one
    else:
        data = _buffers.trace_buffer(path) if force is None else \
            _buffers.trace_buffer(path, mapped=_plan.plan(path, force=force, op_args=op_args).mapped)
        scanned, chosen = _NOT_SCANNED, None
    if chosen is None or force is not None:
        chosen = _plan.plan(path, data=data, force=force, op_args=op_args)
    warnings: list[str] = []
    try:
        decoded = _Decoding(path, data, chosen, keep_python=keep_python, warnings=warnings).run(scanned)
    except RecursionError:  # msgspec's decoders (and skips) recurse per level, up to the interpreter's limit
        raise _buffers.too_deep(path) from None
    del data
    if isinstance(decoded, ReadResult):
        decoded.events = conform(decoded.events, op_args=op_args)
        return decoded
    top, batches, _ = decoded
    del decoded
    metadata = _metadata(path, top, warnings)
    info = metadata.get("distributedInfo") if isinstance(metadata.get("distributedInfo"), dict) else {}
    file_rank = _int32_rank(path, info.get("rank"), "distributedInfo.rank", warnings) \
        if isinstance(info.get("rank"), int) else None
    if file_rank is None:
        file_rank = _int32_rank(path, rank, "the rank argument", warnings) if rank is not None else \
            _int32_rank(path, rank_from_name(path), "the file name", warnings)
    base = metadata.get("baseTimeNanoseconds")
    integral = isinstance(base, int) and not isinstance(base, bool)
    base_ns = base if integral else 0
    if base is not None and not integral:  # 0 is a valid base (times already absolute)
        warnings.append(f"{path}: baseTimeNanoseconds {base!r} is not an integer; times kept as written")
    columns = finish_frame(path, batches, base_ns=base_ns, rank=-1 if file_rank is None else file_rank,
                           warnings=warnings)
    metadata["rank_source"] = ("distributedInfo" if info.get("rank") == file_rank and file_rank is not None
                               else "argument" if rank is not None and rank == file_rank
                               else "file name" if file_rank is not None else "none")
    ranks = {-1 if file_rank is None else file_rank: metadata}
    if conforms(columns, op_args=op_args):  # as finish_frame builds them: the frame only when asked for
        return ReadResult(columns=columns, metadata=ranks, warnings=warnings)
    return ReadResult(conform(pd.DataFrame(columns, copy=False), op_args=op_args), metadata=ranks, warnings=warnings)


_NOT_SCANNED = object()


def _int32_rank(path: Path, rank: int | None, source: str, warnings: list[str]) -> int | None:
    """``rank``, or None (no rank, with a warning) when it does not fit the int32 ``rank`` column."""
    if rank is None or -(2**31) <= rank < 2**31:
        return rank
    warnings.append(f"{path}: rank {rank} from {source} is beyond int32 (the rank column); not used")
    return None


class _Decoding:
    """One document decoded by its plan: each path in turn until one reads it (``run``). A path returns
    ``Decoded``, or None to refuse (the plan notes it, and raises when forced); the ONE_CALL and SLICES paths
    share one split of the top level, which may also find the JSON is no trace (a ReadResult)."""

    def __init__(self, path: Path, data, plan: _plan.ReadPlan, *, keep_python: bool, warnings: list[str]):
        self.path, self.data, self.plan = path, data, plan
        self.keep_python, self.warnings = keep_python, warnings
        self._split = None

    @functools.cached_property
    def decode_events(self):
        """The events-array decoder: its structs with the op args only when the plan keeps them."""
        m = msgspec_paths()
        return (m._DECODE_OP_EVENTS if self.plan.op_args else m._DECODE_EVENTS).decode

    @functools.cached_property
    def decode_batch(self):
        m = msgspec_paths()
        return functools.partial(m._decode_batch, decode=(m._DECODE_OP_EVENT if self.plan.op_args
                                                          else m._DECODE_EVENT).decode)

    def run(self, scanned) -> Decoded | ReadResult:
        for step in self.plan.paths:
            try:
                out = getattr(self, step.value)(scanned) if step is DecodePath.NATIVE else getattr(self, step.value)()
            except _NotATrace as skip:
                return skip.result
            if out is not None:
                _plan.log.debug("%s: read by the %s path", self.path, step.value)
                return out
        raise AssertionError(f"{self.path}: no path of the plan read it ({self.plan})")  # SLICES never refuses

    def _columns(self, events: list):
        return columns_from_events(events, keep_python=self.keep_python, arrow=self.plan.arrow,
                                   op_args=self.plan.op_args)

    def _refused(self, step: DecodePath, why: str) -> None:
        self.plan.refused(self.path, step, why)

    def native(self, scanned) -> Decoded | None:
        out = _kineto_native.read(self.data, keep_python=self.keep_python,
                                  **({} if scanned is _NOT_SCANNED else {"scanned": scanned}))
        if out is None:
            self._refused(DecodePath.NATIVE, "not exactly readable by the scanner")
        return out

    def stream(self) -> Decoded | None:
        # Imported here, not at the top: it loads ctypes and looks libc up (malloc_trim), which a small trace
        # read by the native scanner never needs (a noticeable share of a fresh process's read).
        from ._kineto_stream import stream_mapped

        noted = len(self.warnings)
        with _gc_paused():
            out = stream_mapped(self.path, self.data, chunk_bytes=self.plan.chunk_bytes,
                                decode_events=self.decode_events, decode_batch=self.decode_batch,
                                warnings=self.warnings, to_columns=self._columns)
        if out is None:
            del self.warnings[noted:]
            self._refused(DecodePath.STREAM, "the events array cannot be cut into chunks")
        return out

    def split(self) -> tuple[dict, bytes]:
        """Top-level keys as raw slices and the raw ``traceEvents`` (once); raises ``_NotATrace``."""
        if self._split is None:
            top, events_raw = msgspec_paths()._split_top(self.path, self.data, self.warnings)
            if events_raw is None:
                raise _NotATrace(ReadResult(empty_events(), warnings=self.warnings,
                                            skipped=_what_it_is(self.path, top)))
            self._split = {k: v for k, v in top.items() if k != "traceEvents"}, events_raw
        return self._split

    def one_call(self) -> Decoded | None:
        """The events array decoded in one call; refused when it is not an intact array (damaged, bare) or
        some event does not decode (the slices then salvage what they can, and warn)."""
        top, events_raw = self.split()
        msgspec = msgspec_paths().msgspec
        if not isinstance(events_raw, msgspec.Raw) or events_raw is self.data:
            self._refused(DecodePath.ONE_CALL, "not an intact traceEvents array")
            return None
        try:
            with _gc_paused():
                events = self.decode_events(events_raw)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            self._refused(DecodePath.ONE_CALL, "some event does not decode")
            return None
        return Decoded(top, [self._columns(events)], DecodePath.ONE_CALL)

    def slices(self) -> Decoded | ReadResult:
        top, events_raw = self.split()
        raws = msgspec_paths()._event_slices(self.path, events_raw, self.warnings)
        if raws and not all(memoryview(raw)[:1] == b"{" for raw in raws[:16]):
            return ReadResult(empty_events(), warnings=self.warnings, skipped=_what_it_is(self.path, {}))
        from ._kineto_stream import PageReleaser  # lazy: as in ``stream`` (ctypes, libc)

        pages = PageReleaser(self.data)
        pages.release()  # the slicing pass touched every page; decoding re-touches them one batch at a time
        # Millions of short-lived objects would otherwise trigger full collections that rescan every live one.
        with _gc_paused():
            batches = []
            step = self.plan.batch_events
            for start in range(0, len(raws), step):
                decoded = self.decode_batch(self.path, raws[start:start + step], self.warnings)
                batches.append(self._columns(decoded))
                del decoded
                pages.release(raws[min(start + step, len(raws)) - 1])
        return Decoded(top, batches, DecodePath.SLICES)


class _NotATrace(Exception):
    def __init__(self, result: ReadResult):
        super().__init__(result.skipped)
        self.result = result


def _metadata(path: Path, top: dict, warnings: list[str]) -> dict:
    """The known top-level keys, decoded; invalid UTF-8 in them is replaced by U+FFFD (with a warning), and
    a value that is not JSON is None."""
    metadata, repaired_keys = {}, []
    for key in _META_KEYS:
        if key not in top:
            continue
        metadata[key] = value = _buffers.json_value(top[key])
        if value is not _buffers.NOT_JSON:
            continue
        metadata[key] = None
        repaired = _buffers.utf8_repaired(top[key])
        if repaired is not None:
            repaired_keys.append(key)
            value = _buffers.json_value(repaired)
            if value is not _buffers.NOT_JSON:
                metadata[key] = value
    if repaired_keys:
        warnings.append(f"{path}: invalid UTF-8 in {', '.join(repaired_keys)}; the bad bytes were replaced by "
                        "U+FFFD")
    return metadata


@contextlib.contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _what_it_is(path: Path, top: dict) -> str:
    if "nodes" in top and "schema" in top:
        return "PyTorch execution trace (operator graph, no timings)"
    if not top:
        return "JSON array that is not a list of trace events (e.g. a memory timeline)"
    return f"JSON without traceEvents (keys: {sorted(top)[:8]})"

