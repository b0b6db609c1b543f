"""Fastest path of the Kineto reader: the native scanner (``_kscan``, C) reads a whole in-memory trace at once.

The ordinary path parses twice (msgspec splits the top level, then decodes every event into a struct) and
then pulls every field out of every struct in Python: work per event, most of a small trace's read
time. ``_kscan.scan`` walks the document once and hands back each event's fields as rows of int64s and of
text codes, every text interned per field (first-appearance order), so Python only works per *unique* text
(unescaping, number texts such as ``"pid": "Spans"``) and per column (numpy).

The result is the ``Columns`` of :func:`columns_from_events`, value for value, category order included (the
reader's tests check every path against an independent reading of every shared trace). The scanner
refuses - and the next path of the plan then reads the file, with its salvage and warnings - whatever it
does not read exactly as msgspec would: invalid JSON, a field of another type, integers beyond int64, times
with more than three decimals or beyond int64 ns, escaped keys, duplicated known keys (see ``_kscan.c``).
It is built only where a C compiler was present at install time; ``SHARDLINE_KINETO_NATIVE=0`` turns it
off (``_plan``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..base.schema import text_dtype
from . import _buffers
from ._kineto_columns import (
    _PHASES,
    _TEXT_ARGS,
    DROP_CATS,
    GPU_CATS,
    PYTHON_CATS,
    Columns,
    Decoded,
    _int,
    assemble,
    columns_from_events,
    empty_texts,
    sorted_texts,
)
from ._plan import DecodePath

# Column order of the scanner's rows (``_kscan.c``: the I_* and T_* enums).
_I64 = ("pid", "tid", "ts", "dur", "correlation", "external_id", "external_id_legacy", "device", "stream",
        "nbytes", "group_size", "in_nelems", "out_nelems", "seq", "src_rank", "dst_rank")
_TXT = ("ph", "cat", "name", "pid", "tid", "device", "stream", "seq", "collective", "pg_name", "pg_desc",
        "pg_ranks", "dtype")
_I = {name: i for i, name in enumerate(_I64)}
_T = {name: i for i, name in enumerate(_TXT)}


_NOT_SCANNED = object()


def read(data, *, keep_python: bool, scanned=_NOT_SCANNED) -> Decoded | None:
    """The top-level raw values (except traceEvents) and the one column batch of a whole trace document in
    memory, or None when the scanner is unavailable or refuses the document (the plan's next path then
    reads it). ``scanned``: ``_buffers.native_scan(data)``, when the caller has already run it (``load``'s
    prefetch)."""
    out = _buffers.native_scan(data) if scanned is _NOT_SCANNED else scanned
    if out is None:
        return None
    texts = [_decode(raws) for raws in out["texts"]]
    if any(t is None for t in texts):
        return None
    n = out["rows"]
    top = {key: data[start:end] for key, (start, end) in out["top"].items()}
    if n == 0:
        return Decoded(top, [columns_from_events([], keep_python=keep_python)], DecodePath.NATIVE)
    ints = np.frombuffer(out["i64"], dtype=np.int64).reshape(n, len(_I64))
    codes = np.frombuffer(out["txt"], dtype=np.int32).reshape(n, len(_TXT))
    return Decoded(top, [_columns(ints, codes, texts, keep_python=keep_python)], DecodePath.NATIVE)


def _decode(raws: list) -> list | None:
    """The texts of raw JSON string contents (already checked valid UTF-8 without control characters);
    None when an escape does not decode (or decodes to a lone surrogate, which msgspec refuses too)."""
    texts = []
    for raw in raws:
        if b"\\" not in raw:
            texts.append(raw.decode())
            continue
        text = _buffers.json_value(b'"' + raw + b'"')
        if not isinstance(text, str):
            return None
        texts.append(text)
    return texts


def _merged(codes: np.ndarray, texts: list) -> tuple[np.ndarray, list]:
    """Codes and texts with two spellings of one text (escaped and not) merged into the earlier one's id
    (the ids stay in first-appearance order)."""
    if len(set(texts)) == len(texts):
        return codes, texts
    ids: dict = {}
    remap = np.array([ids.setdefault(text, len(ids)) for text in texts], dtype=np.int32)
    return remap[codes], list(ids)


def _categorical(codes: np.ndarray, texts: list, *, trim: bool) -> pd.Categorical:
    """Categorical of ``texts[codes]``; ``trim``: categories only the used texts, in order of first appearance
    among ``codes`` (as factorising just these rows gives), else all of ``texts`` in their order."""
    if trim:
        order = pd.unique(codes)
        if len(order) != len(texts) or (order != np.arange(len(order))).any():
            remap = np.zeros(len(texts), dtype=np.int32)
            remap[order] = np.arange(len(order), dtype=np.int32)
            codes, texts = remap[codes], [texts[i] for i in order.tolist()]
    return pd.Categorical.from_codes(codes, dtype=text_dtype(texts), validate=False)


def _int_or_text(values: np.ndarray, codes: np.ndarray, texts: list, overflow: list) -> np.ndarray:
    """int64 column of an int|str field: the integers as read, a text as the ordinary path converts it
    (``_int``: an integer literal, hex, a trailing number, else -1), counting overflows per row."""
    out = values.copy()
    textual = codes >= 0
    if not textual.any():
        return out
    numbers = np.empty(len(texts), dtype=np.int64)
    overflows = np.zeros(len(texts), dtype=bool)
    for i, text in enumerate(texts):
        seen: list = []
        numbers[i] = _int(text, seen)
        overflows[i] = bool(seen)
    out[textual] = numbers[codes[textual]]
    if overflows.any():
        overflow.extend([None] * int(overflows[codes[textual]].sum()))
    return out


def _texts(codes: np.ndarray, texts: list) -> pd.Categorical:
    """The args-text categorical of ``_kineto_columns._texts``: absent (-1) and empty are ``""``, categories
    the sorted texts the rows use."""
    present = codes >= 0
    if not present.any() or not any(texts[c] for c in np.unique(codes[present])):
        return empty_texts(len(codes))
    extended = np.where(present, codes, len(texts))
    used = np.bincount(extended, minlength=len(texts) + 1) > 0
    return sorted_texts(extended, [text if used[i] else None for i, text in enumerate([*texts, ""])])


def _columns(ints: np.ndarray, codes: np.ndarray, texts: list, *, keep_python: bool) -> Columns:
    """The columns of :func:`columns_from_events` from the scanner's rows."""
    drop = DROP_CATS if keep_python else DROP_CATS | PYTHON_CATS
    ph_codes, ph_texts = _merged(codes[:, _T["ph"]], texts[_T["ph"]])
    cat_codes, cat_texts = _merged(codes[:, _T["cat"]], texts[_T["cat"]])
    keep_ph = np.array([text in _PHASES for text in ph_texts], dtype=bool)
    keep_cat = np.array([text not in drop for text in cat_texts], dtype=bool)
    mask = keep_ph[ph_codes] & keep_cat[cat_codes]
    if not mask.all():
        ints, codes, ph_codes, cat_codes = ints[mask], codes[mask], ph_codes[mask], cat_codes[mask]
    # ``ph`` keeps every phase of the file among its categories (only its B/E rows matter); ``cat`` and
    # ``name`` are trimmed to the kept rows, in their order of first appearance, as the ordinary path has them.
    ph = _categorical(ph_codes, ph_texts, trim=False)
    cat = _categorical(cat_codes, cat_texts, trim=True)
    name = _categorical(*_merged(codes[:, _T["name"]], texts[_T["name"]]), trim=True)
    n = len(ints)
    overflow: list = []

    def number(field: str) -> np.ndarray:
        return _int_or_text(ints[:, _I[field]], codes[:, _T[field]], texts[_T[field]], overflow)

    def text(field: str) -> pd.Categorical:
        return _texts(codes[:, _T[field]], texts[_T[field]])

    gpu_cat = np.array([c in GPU_CATS for c in cat.categories.tolist()] + [False], dtype=bool)
    gpu = gpu_cat[cat.codes] if n else np.zeros(0, dtype=bool)
    pid, tid = number("pid"), number("tid")
    arg_device, arg_stream = number("device"), number("stream")
    column = {field: ints[:, _I[field]].copy() for field in
              ("ts", "dur", "correlation", "external_id", "external_id_legacy", "nbytes", "group_size",
               "in_nelems", "out_nelems", "src_rank", "dst_rank")}
    external = np.where(column["external_id"] == -1, column["external_id_legacy"], column["external_id"])
    dst = np.where(column["dst_rank"] == -1, column["src_rank"], column["dst_rank"])
    return assemble(
        ph, cat, name, gpu=gpu, pid=pid, tid=tid, arg_device=arg_device, arg_stream=arg_stream, ts=column["ts"],
        dur=column["dur"], bad_time=np.zeros(n, dtype=bool), correlation=column["correlation"], external=external,
        texts={key: text(key) for key in _TEXT_ARGS}, group_size=column["group_size"],
        in_nelems=column["in_nelems"], out_nelems=column["out_nelems"], nbytes=column["nbytes"],
        seq=number("seq"), dst=dst, overflow=len(overflow))
