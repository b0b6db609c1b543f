"""Kineto / PyTorch-profiler Chrome-trace JSON (``.json``, ``.json.gz``, ``.pt.trace.json(.gz)``) -> events.

Formats handled: the current schema (``ts`` in µs relative to ``baseTimeNanoseconds``), older traces with
absolute µs times, the 2021 legacy categories (``Operator``/``Runtime``/``Kernel``/``Memcpy``/``Memset``, string
tids such as ``"stream 7"``, lower-case ``external id``), CPU-only and gloo traces, ROCm traces.

Times: ``start_ns = baseTimeNanoseconds + ts·1000`` and ``dur_ns = dur·1000``, computed from the number *text*
(``_numtext``), so ns fractions survive exactly. Lanes: Kineto puts GPU activity (``kernel``, ``gpu_memcpy``,
``gpu_memset``, ``gpu_user_annotation`` and the legacy ``Kernel``/``Memcpy``/``Memset``) on ``pid`` = device and
``tid`` = stream; the ``device``/``stream`` args win when present. Everything else is a CPU lane whose
``stream`` is the thread id. Kept: complete events (``ph`` X) and B/E pairs; dropped: metadata, flows,
instant events, the profiler's own ``Trace`` span, and ``python_function`` stacks unless ``keep_python``.

Decoding is columnar, by one of five paths that give the same columns (``_kineto_columns.Columns``): the
native C scanner, a memory-mapped stream of chunks, msgspec in one call, Arrow chunks, and msgspec slices
with salvage (damage keeps the events before it, with a warning). Which path reads a trace, and what each
hands on when it cannot read it exactly, is the plan's (``_plan.plan``, which logs its choice at debug level).

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

import msgspec

from shardline.profiling.errors import TraceFormatError
from shardline.profiling.readers import ReadResult, _buffers, _kineto_native, _plan
from shardline.profiling.readers._buffers import Prefetched
from shardline.profiling.readers._kineto_columns import Decoded, columns_from_events, finish_frame
from shardline.profiling.readers._plan import DecodePath
from shardline.profiling.schema import conform, empty_events


class _Args(msgspec.Struct, gc=False):
    # Typed with -1 / "" defaults so columns build with one C-level conversion. Fields producers disagree on
    # (ROCm writes ``"stream": "0x0"``; torch has written ranks as text and as lists) admit both types.
    correlation: int = -1
    external_id: int = msgspec.field(name="External id", default=-1)
    external_id_legacy: int = msgspec.field(name="external id", default=-1)
    device: int | str = -1
    stream: int | str = -1
    nbytes: int = msgspec.field(name="bytes", default=-1)
    collective: str = msgspec.field(name="Collective name", default="")
    pg_name: str | int = msgspec.field(name="Process Group Name", default="")
    pg_desc: str = msgspec.field(name="Process Group Description", default="")
    pg_ranks: str | list = msgspec.field(name="Process Group Ranks", default="")
    group_size: int = msgspec.field(name="Group size", default=-1)
    in_nelems: int = msgspec.field(name="In msg nelems", default=-1)
    out_nelems: int = msgspec.field(name="Out msg nelems", default=-1)
    dtype: str = ""
    seq: int | str = msgspec.field(name="Seq", default=-1)
    src_rank: int = msgspec.field(name="Src Rank", default=-1)
    dst_rank: int = msgspec.field(name="Dst Rank", default=-1)


class Event(msgspec.Struct, gc=False):
    """The fields of one Chrome-trace event that the events table uses."""

    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = -1
    tid: int | str = -1
    ts: msgspec.Raw = msgspec.Raw(b"0")
    dur: msgspec.Raw = msgspec.Raw(b"0")
    args: _Args | None = None


class _OpArgs(_Args, gc=False):
    # The op args (``schema.OP_ARG_COLUMNS``) that are JSON values, kept as raw text: decoded by whoever reads
    # them, once per distinct text (``schema.json_values``).
    input_dims: msgspec.Raw = msgspec.field(name="Input Dims", default=msgspec.Raw(b""))
    input_types: msgspec.Raw = msgspec.field(name="Input type", default=msgspec.Raw(b""))
    concrete_inputs: msgspec.Raw = msgspec.field(name="Concrete Inputs", default=msgspec.Raw(b""))
    in_split_sizes: msgspec.Raw = msgspec.field(name="In split size", default=msgspec.Raw(b""))
    out_split_sizes: msgspec.Raw = msgspec.field(name="Out split size", default=msgspec.Raw(b""))


class OpArgsEvent(Event, gc=False):
    """``Event`` with the op args too (a read with ``op_args=True``)."""

    args: _OpArgs | None = None


_META_KEYS = ("distributedInfo", "baseTimeNanoseconds", "deviceProperties", "schemaVersion", "traceName",
              "displayTimeUnit", "cupti_version", "cuda_runtime_version", "cuda_driver_version", "record_shapes")
_DECODE_EVENT = msgspec.json.Decoder(Event)
_DECODE_EVENTS = msgspec.json.Decoder(list[Event])
_DECODE_OP_EVENT = msgspec.json.Decoder(OpArgsEvent)
_DECODE_OP_EVENTS = msgspec.json.Decoder(list[OpArgsEvent])
_DECODE_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_DECODE_RAWS = msgspec.json.Decoder(list[msgspec.Raw])
_BASE_IN_TAIL = re.compile(rb'"baseTimeNanoseconds"\s*:\s*(\d{1,19})\s*[,}]')
_RANK_IN_NAME = re.compile(r"(?:^|[^a-z])(?:rank|worker)[-_]?(\d+)(?![\d])", re.IGNORECASE)


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
    decoded = _Decoding(path, data, chosen, keep_python=keep_python, warnings=warnings).run(scanned)
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
    frame = finish_frame(path, batches, base_ns=base_ns, rank=-1 if file_rank is None else file_rank,
                         warnings=warnings)
    metadata["rank_source"] = ("distributedInfo" if info.get("rank") == file_rank and file_rank is not None
                               else "argument" if rank is not None and rank == file_rank
                               else "file name" if file_rank is not None else "none")
    return ReadResult(conform(frame, op_args=op_args), metadata={-1 if file_rank is None else file_rank: metadata},
                      warnings=warnings)


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
        # The event structs: with the op args only when the plan keeps them.
        self.decode_events = (_DECODE_OP_EVENTS if plan.op_args else _DECODE_EVENTS).decode
        self.decode_batch = functools.partial(_decode_batch, decode=(_DECODE_OP_EVENT if plan.op_args
                                                                     else _DECODE_EVENT).decode)

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
        # read by the native scanner never needs (~3 ms of a ~35 ms fresh-process read).
        from shardline.profiling.readers._kineto_stream import stream_mapped

        noted = len(self.warnings)
        with _gc_paused():
            out = stream_mapped(self.path, self.data, chunk_bytes=self.plan.chunk_bytes,
                                decode_events=self.decode_events, decode_batch=self.decode_batch,
                                warnings=self.warnings, to_columns=self._columns)
        if out is None:
            del self.warnings[noted:]
            self._refused(DecodePath.STREAM, "the events array cannot be cut into chunks")
        return out

    def split(self) -> tuple[dict, msgspec.Raw | bytes]:
        """Top-level keys as raw slices and the raw ``traceEvents`` (once); raises ``_NotATrace``."""
        if self._split is None:
            top, events_raw = _split_top(self.path, self.data, self.warnings)
            if events_raw is None:
                raise _NotATrace(ReadResult(empty_events(), warnings=self.warnings, skipped=_what_it_is(self.path, top)))
            self._split = {k: v for k, v in top.items() if k != "traceEvents"}, events_raw
        return self._split

    def one_call(self) -> Decoded | None:
        """The events array decoded in one call; refused when it is not an intact array (damaged, bare) or
        some event does not decode (the slices then salvage what they can, and warn)."""
        top, events_raw = self.split()
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
        raws = _event_slices(self.path, events_raw, self.warnings)
        if raws and not all(memoryview(raw)[:1] == b"{" for raw in raws[:16]):
            return ReadResult(empty_events(), warnings=self.warnings, skipped=_what_it_is(self.path, {}))
        from shardline.profiling.readers._kineto_stream import PageReleaser

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
        try:
            metadata[key] = msgspec.json.decode(top[key])
            continue
        except (msgspec.DecodeError, UnicodeDecodeError):
            metadata[key] = None
        repaired = _buffers.utf8_repaired(top[key])
        if repaired is not None:
            repaired_keys.append(key)
            with contextlib.suppress(msgspec.DecodeError, UnicodeDecodeError):
                metadata[key] = msgspec.json.decode(repaired)
    if repaired_keys:
        warnings.append(f"{path}: invalid UTF-8 in {', '.join(repaired_keys)}; the bad bytes were replaced by "
                        "U+FFFD")
    return metadata


def _split_top(path: Path, data: bytes, warnings: list[str]) -> tuple[dict, msgspec.Raw | bytes | None]:
    """Top-level keys as raw slices, and the raw ``traceEvents`` array (None when the file has none)."""
    if not bytes(data[:65536]).strip() and not bytes(data).strip():
        raise TraceFormatError(f"{path}: empty file")
    try:
        top = _DECODE_TOP.decode(data)
    except msgspec.ValidationError:
        if bytes(data[:65536]).lstrip()[:1] == b"[":
            # Chrome's bare-array form: the whole file is the events list.
            return {}, data
        raise TraceFormatError(f"{path}: top level is neither a JSON object nor an array") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        return _split_damaged(path, data, exc, warnings)
    return top, top.get("traceEvents")


def _split_damaged(path: Path, data, exc: Exception, warnings: list[str]) -> tuple[dict, bytes]:
    """For a file that is not valid JSON: the metadata before ``traceEvents`` and the events array text."""
    data = bytes(data)  # a damaged file takes the slow, copying path
    key = data.find(b'"traceEvents"')
    if key < 0:
        raise TraceFormatError(f"{path}: invalid JSON ({exc}) and no traceEvents array to salvage") from exc
    top: dict = {}
    head = data[:key].rstrip().rstrip(b",").rstrip()
    try:
        top = _DECODE_TOP.decode(head + b"}") if head.startswith(b"{") else {}
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        top = {}
    bracket = data.find(b"[", key)
    if bracket < 0:
        raise TraceFormatError(f"{path}: invalid JSON ({exc}); traceEvents has no array") from exc
    warnings.append(f"{path}: invalid JSON ({exc}); reading the events before the damage")
    # Current Kineto writes baseTimeNanoseconds after the events: recover it from an intact tail.
    tail = _BASE_IN_TAIL.search(data[-4096:])
    if tail and "baseTimeNanoseconds" not in top:
        top["baseTimeNanoseconds"] = msgspec.Raw(tail.group(1))
    elif not tail and "baseTimeNanoseconds" not in top:
        warnings.append(f"{path}: no baseTimeNanoseconds found; if the trace had one after its events (current "
                        "Kineto), the times read are relative to that lost base")
    return top, data[bracket:]


def _event_slices(path: Path, array: bytes | msgspec.Raw, warnings: list[str]) -> list:
    """The events array split into one raw slice per event; a damaged array keeps its readable prefix."""
    try:
        return _DECODE_RAWS.decode(array)
    except msgspec.ValidationError as exc:
        raise TraceFormatError(f"{path}: traceEvents is not an array ({exc})") from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        array = bytes(array)
        return _prefix_slices(path, array, exc, warnings)


def _prefix_slices(path: Path, array: bytes, exc: Exception, warnings: list[str]) -> list:
    """Raw slices of the complete events before the first damage in ``array`` (which starts with ``[``).

    The longest prefix that ends at an event boundary (``}`` then ``{``, a comma between) and decodes once closed
    with ``]`` is found by trying prefixes: the last boundary first (a truncated file: one decode), then a
    bisection. Nothing is read from the decoder's error but the fact that it failed (its text is no
    contract). A boundary inside a string literal fails to decode although the damage lies further on, so a
    failed prefix is confirmed by the next boundary failing too.
    """
    good_end, good, bad = 0, [], len(array)
    probe = _boundary_before(array, bad, good_end)
    while probe is not None:
        slices = _decode_prefix(array, probe)
        if slices is None:
            after = _boundary_after(array, probe + 1, bad)
            slices = _decode_prefix(array, after) if after is not None else None
            if slices is None:
                bad = probe
            else:
                probe = after
        if slices is not None:
            good_end, good = probe, slices
        mid = (good_end + bad) // 2
        probe = _boundary_before(array, mid + 1, good_end)
        if probe is None:
            probe = _boundary_after(array, mid + 1, bad)
    if not good:
        warnings.append(f"{path}: no complete event could be read ({exc})")
        return []
    warnings.append(f"{path}: kept the {len(good)} complete events before byte {good_end + 1} of traceEvents "
                    f"({exc})")
    return good


def _decode_prefix(array: bytes, cut: int) -> list | None:
    """The raw event slices of ``array[:cut + 1]`` closed with ``]``; None when that does not decode."""
    try:
        return _DECODE_RAWS.decode(array[:cut + 1] + b"]")
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None


def _is_boundary(array: bytes, brace: int) -> bool:
    """Whether this ``}`` may end an event: the next event follows (``,`` then ``{``, or a ``{`` alone where
    the comma is the damage)."""
    after = array[brace + 1:brace + 64].lstrip()
    return after[:1] == b"{" or (after[:1] == b"," and after[1:].lstrip()[:1] == b"{")


def _boundary_before(array: bytes, end: int, floor: int) -> int | None:
    """The last event boundary (its ``}``) in ``(floor, end)``; None when there is none."""
    cut = array.rfind(b"}", floor + 1, end)
    while cut > floor and not _is_boundary(array, cut):
        cut = array.rfind(b"}", floor + 1, cut)
    return cut if cut > floor else None


def _boundary_after(array: bytes, start: int, end: int) -> int | None:
    """The first event boundary (its ``}``) in ``[start, end)``; None when there is none."""
    cut = array.find(b"}", start, end)
    while cut >= 0 and not _is_boundary(array, cut):
        cut = array.find(b"}", cut + 1, end)
    return cut if cut >= 0 else None


@contextlib.contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _decode_batch(path: Path, raws: list, warnings: list[str], *, decode=_DECODE_EVENT.decode) -> list[Event]:
    """Decode one batch of raw event slices (one ``decode`` call each: no joined copy of the batch)."""
    try:
        return [decode(raw) for raw in raws]
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
        return _salvage_batch(path, raws, warnings, decode=decode)


def _salvage_batch(path: Path, raws: list, warnings: list[str], *, decode) -> list[Event]:
    """The careful path: an event with invalid UTF-8 is kept with the bad bytes replaced by U+FFFD, a
    mistyped event is dropped; one warning per file and kind counts them.

    Whether an event's bytes are valid UTF-8 is decided by Python's codec after any failed decode, never by
    the decoder's error class or text (they differ between msgspec versions: ``_buffers.utf8_repaired``).
    """
    kept, replaced, dropped, first = [], 0, 0, None
    for raw in raws:
        try:
            kept.append(decode(raw))
            continue
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # ValidationError is a DecodeError
            error = exc
        repaired = _buffers.utf8_repaired(raw)
        if repaired is not None:
            try:
                kept.append(decode(repaired))
                replaced += 1
                continue
            except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                error = exc
        dropped, first = dropped + 1, first or error
    if replaced:
        _add_count(warnings, f"{path}: invalid UTF-8 in ", replaced,
                   " events; the bad bytes were replaced by U+FFFD")
    if dropped:
        _add_count(warnings, f"{path}: dropped ", dropped, f" events with fields of the wrong type (first: {first})")
    return kept


def _add_count(warnings: list[str], head: str, count: int, tail: str) -> None:
    """One warning per file and kind: a later batch or chunk adds its count to the warning already there
    (whose ``tail``, e.g. the first error, is kept)."""
    for i, text in enumerate(warnings):
        number, _, rest = text.removeprefix(head).partition(" ")
        if text.startswith(head) and number.isdigit():
            warnings[i] = f"{head}{int(number) + count} {rest}"
            return
    warnings.append(f"{head}{count}{tail}")


def _what_it_is(path: Path, top: dict) -> str:
    if "nodes" in top and "schema" in top:
        return "PyTorch execution trace (operator graph, no timings)"
    if not top:
        return "JSON array that is not a list of trace events (e.g. a memory timeline)"
    return f"JSON without traceEvents (keys: {sorted(top)[:8]})"

