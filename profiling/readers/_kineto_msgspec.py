"""The msgspec paths of the Kineto reader: event structs, decoders, the top-level split, the salvage of damaged
arrays and batches.

Apart from ``kineto`` so that a trace the native scanner reads (every intact small trace where the C extension
is built) never imports msgspec or builds these decoders, a large share of a fresh process's read of a small
set. ``kineto`` imports this module on first use of a msgspec path (``kineto.msgspec_paths``) and re-exports
its names (``kineto.Event``, ``kineto.OpArgsEvent``).
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from ..base.errors import TraceFormatError
from . import Damage, _buffers, truncation


class _Args(msgspec.Struct, gc=False):
    # Typed with -1 / "" defaults so columns build with one C-level conversion. Fields producers disagree on
    # (ROCm writes ``"stream": "0x0"`` and some versions ``"bytes": "4096"``; torch has written ranks as text
    # and as lists) admit both types: a numeric field's text is read as its number (``_kineto_columns``, which
    # warns about a text that is none and keeps the event without it).
    correlation: int | str = -1
    external_id: int | str = msgspec.field(name="External id", default=-1)
    external_id_legacy: int | str = msgspec.field(name="external id", default=-1)
    device: int | str = -1
    stream: int | str = -1
    nbytes: int | str = msgspec.field(name="bytes", default=-1)
    collective: str = msgspec.field(name="Collective name", default="")
    pg_name: str | int = msgspec.field(name="Process Group Name", default="")
    pg_desc: str = msgspec.field(name="Process Group Description", default="")
    pg_ranks: str | list = msgspec.field(name="Process Group Ranks", default="")
    group_size: int | str = msgspec.field(name="Group size", default=-1)
    in_nelems: int | str = msgspec.field(name="In msg nelems", default=-1)
    out_nelems: int | str = msgspec.field(name="Out msg nelems", default=-1)
    dtype: str = ""
    seq: int | str = msgspec.field(name="Seq", default=-1)
    src_rank: int | str = msgspec.field(name="Src Rank", default=-1)
    dst_rank: int | str = msgspec.field(name="Dst Rank", default=-1)


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


_DECODE_EVENT = msgspec.json.Decoder(Event)
_DECODE_EVENTS = msgspec.json.Decoder(list[Event])
_DECODE_OP_EVENT = msgspec.json.Decoder(OpArgsEvent)
_DECODE_OP_EVENTS = msgspec.json.Decoder(list[OpArgsEvent])
_DECODE_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_DECODE_RAWS = msgspec.json.Decoder(list[msgspec.Raw])
_BASE_IN_TAIL = re.compile(rb'"baseTimeNanoseconds"\s*:\s*(\d{1,19})\s*[,}]')


def _split_top(path: Path, data: bytes, warnings: list[str]) -> tuple[dict, msgspec.Raw | bytes | None]:
    """Top-level keys as raw slices, and the raw ``traceEvents`` array (None when the file has none). A
    document that is no JSON for its bare ``NaN``/``Infinity`` literals alone is read with them as null."""
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
        repaired = non_finite_as_null(path, data, warnings)
        if repaired is None:
            return _split_damaged(path, data, exc, warnings)
        return _split_top(path, repaired, warnings)
    return top, top.get("traceEvents")


#: A JSON string (skipped whole: a literal inside one is text), or a bare non-finite literal (group 1).
_STRING_OR_NON_FINITE = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"|(-?Infinity|NaN)')


def non_finite_as_null(path: Path, data, warnings: list[str]) -> bytes | None:
    """``data`` with each bare ``NaN``, ``Infinity`` and ``-Infinity`` outside strings written ``null`` (some
    writers emit them; JSON has no such literal, and msgspec refuses them), counted in one warning per file;
    None when it has none. A null time drops its event (counted), a null in a field no column reads is
    ignored, as for any null. Run only on a document (or chunk) that failed to decode: a regex pass over it."""
    if data.find(b"NaN") < 0 and data.find(b"Infinity") < 0:
        return None
    spans = [match.span(1) for match in _STRING_OR_NON_FINITE.finditer(data) if match.lastindex]
    if not spans:
        return None
    parts, at = [], 0
    for start, end in spans:
        parts += (data[at:start], b"null")
        at = end
    parts.append(data[at:])
    _add_count(warnings, f"{path}: read ", len(spans), " bare NaN/Infinity literals (not JSON) as null")
    return b"".join(parts)


def _split_damaged(path: Path, data, exc: Exception, warnings: list[str]) -> tuple[dict, bytes]:
    """For a file that is not valid JSON: the metadata before ``traceEvents`` and the events array text."""
    data = bytes(data)  # a damaged file takes the slow, copying path
    cut = truncation(data)
    cause = cut or f"invalid JSON ({exc})"
    key = data.find(b'"traceEvents"')
    if key < 0:
        raise TraceFormatError(f"{path}: {cause}, and no traceEvents array to salvage") from exc
    top: dict = {}
    head = data[:key].rstrip().rstrip(b",").rstrip()
    try:
        top = _DECODE_TOP.decode(head + b"}") if head.startswith(b"{") else {}
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        top = {}
    bracket = data.find(b"[", key)
    if bracket < 0:
        raise TraceFormatError(f"{path}: {cause}; traceEvents has no array") from exc
    what = f"invalid JSON ({exc}); reading the events before the damage" if cut is None else \
        f"invalid JSON, {cut.replace(' JSON', '', 1)}; reading the events before the cut"
    warnings.append(Damage(f"{path}: {what}", cause))
    # Current Kineto writes baseTimeNanoseconds after the events: recover it from an intact tail.
    tail = _BASE_IN_TAIL.search(data[-4096:])
    if tail and "baseTimeNanoseconds" not in top:
        top["baseTimeNanoseconds"] = msgspec.Raw(tail.group(1))
    elif not tail and "baseTimeNanoseconds" not in top:
        warnings.append(f"{path}: no baseTimeNanoseconds found; if the trace had one after its events (current "
                        "Kineto), the times read are relative to that lost base")
    return top, data[bracket:]


def _event_slices(path: Path, array: bytes | msgspec.Raw, warnings: list[str]) -> list:
    """The events array split into one raw slice per event (bare ``NaN``/``Infinity`` read as null: a bare
    array's are first met here); a damaged array keeps its readable prefix."""
    try:
        return _DECODE_RAWS.decode(array)
    except msgspec.ValidationError as exc:
        raise TraceFormatError(f"{path}: traceEvents is not an array ({exc})") from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        array = bytes(array)
        repaired = non_finite_as_null(path, array, warnings)
        if repaired is not None:
            return _event_slices(path, repaired, warnings)
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
    # The first note of the damage says what it is: here, where the array is the whole document (a bare array).
    note = str if any(isinstance(w, Damage) for w in warnings) else \
        lambda text: Damage(text, truncation(array) or f"invalid JSON ({exc})")
    if not good:
        warnings.append(note(f"{path}: no complete event could be read ({exc})"))
        return []
    warnings.append(note(f"{path}: kept the {len(good)} complete events before byte {good_end + 1} of traceEvents "
                         f"({exc})"))
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
