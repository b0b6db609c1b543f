"""Column building for the Kineto reader: decoded event batches -> numpy columns -> one events frame.

Split from ``kineto.py`` to keep each file focused: this half knows nothing about JSON, only about turning
a batch of ``Event`` structs into arrays (then dropping the structs) and the arrays into schema rows:
exact ns times, lanes, message sizes, memcpy host-memory kind, B/E pairing and ``ProfilerStep`` steps; and,
when asked (``op_args``), the op-args columns (``schema.OP_ARG_COLUMNS``) after the schema's.

One file: every step from a decoded batch to the events frame works on the :class:`Columns` value and private
helpers that nothing outside the reader uses.
"""

from __future__ import annotations

import itertools
import operator
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
from pandas.api.types import union_categoricals

from ..base.schema import (
    COLUMNS,
    JSON_ARG_COLUMNS,
    OP_ARG_COLUMNS,
    category_texts,
    empty_texts,
    sorted_categorical,
    step_numbers,
    text_dtype,
)
from ._numtext import decimal_texts_to_scaled
from ._plan import DecodePath

#: Kineto categories of activity recorded on a device stream: CUDA/ROCm/XPU (current and 2021 legacy
#: spellings), MTIA's command-processor events (``mtia_ccp_events``, on a "MTIA N" process, one thread per
#: "Stream N"), Gaudi's ``hpu_op``, and the Cambricon (``mlu_*``) and Enflame (``GCU_*``) plugins' copies and
#: annotations (their kernels are ``kernel``), as Kineto's activity-type names spell them (only the MTIA lanes
#: are checked on a public trace). Each is a device lane: ``pid`` = device, ``tid`` = stream.
GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "Kernel", "Memcpy",
                      "Memset", "gpu_instant_event", "mtia_ccp_events", "hpu_op", "mlu_memcpy", "mlu_memset",
                      "mlu_user_annotation", "GCU_MEMCPY", "GCU_MEMSET", "GCU_USER_ANNOTATION"})
#: Host-side categories Kineto writes (ops, annotations, runtime and driver calls, overhead, syncs).
HOST_CATS = frozenset({"cpu_op", "user_annotation", "cpu_instant_event", "python_function", "python", "overhead",
                       "external_correlation", "cuda_sync", "xpu_sync", "Operator", "Runtime", "Trace", "ac2g",
                       "fwdbwd", "async", "flow", "collective_comm"})
#: Device categories the reader knowingly leaves off the device lanes, and why.
UNREAD_DEVICE_CATS = {
    "cuda_profiler_range": "CUPTI counter-profiler ranges: each kernel replayed alone to count its metrics, so "
                           "their times are not the run's",
}
#: A category that calls a device runtime or driver (``cuda_runtime``, ``mtia_runtime``, ``xpu_driver`` ...).
_RUNTIME_CAT = re.compile(r"_(?:runtime|driver)$", re.IGNORECASE)
#: Words of a category that records device-side activity the reader may not know (``npu_kernel``, ``tpu_op``).
_DEVICE_WORD = re.compile(r"kernel|gpu|hpu|xpu|npu|tpu|ipu|mtia|mlu|gcu|device|accel|memcpy|memset|dma|stream",
                          re.IGNORECASE)
#: The args read as integers that only a number can fill (a text that is not one is warned about, by
#: ``finish_frame``), by field name: their JSON keys.
NUMERIC_ARGS = {"correlation": "correlation", "external_id": "External id", "external_id_legacy": "external id",
                "nbytes": "bytes", "group_size": "Group size", "in_nelems": "In msg nelems",
                "out_nelems": "Out msg nelems", "src_rank": "Src Rank", "dst_rank": "Dst Rank"}
#: Categories no analysis uses: the profiler's own span, flows, and Python stacks (unless kept).
DROP_CATS = frozenset({"Trace", "ac2g", "fwdbwd", "async", "flow"})
PYTHON_CATS = frozenset({"python_function", "python"})
_PHASES = frozenset({"X", "B", "E"})
#: Bytes per element of the ``dtype`` arg of collectives (torch ScalarType names).
DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Int": 4, "Long": 8, "Short": 2, "Char": 1, "Byte": 1,
    "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "ComplexHalf": 4, "Float8_e4m3fn": 1,
    "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1, "UInt16": 2, "UInt32": 4, "UInt64": 8,
}
_MEMCPY_NAME = re.compile(r"^Memcpy (?P<kind>\w+) \((?P<src>\w+) -> (?P<dst>\w+)\)")
_STREAM_TEXT = re.compile(r"(\d+)\s*$")
_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), 2**31 - 1)
#: The events-table columns the reader stores as int32 (``schema.COLUMNS``), in their warnings' order.
NARROW_COLUMNS = ("device", "pg_size", "peer")
#: The dtype pandas gives string categories by default; every reader uses it so categoricals concatenate.
_STR = pd.Index(["x"]).dtype


def _int(value, overflow: list) -> int:
    """An int64 from an arg value (int, digit text, hex text); -1 when absent or not a number."""
    if type(value) is int:
        if _INT64[0] <= value <= _INT64[1]:
            return value
        overflow.append(value)
        return -1
    if isinstance(value, str):
        # An integer literal reads as Python's int() reads it (numpy's conversion of a batch of such texts does
        # the same, so one rule holds whichever way a batch goes); then hex, then a trailing number.
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is not None:
            if _INT64[0] <= number <= _INT64[1]:
                return number
            overflow.append(value)
            return -1
        match = _STREAM_TEXT.search(value)
        if value.startswith("0x"):
            try:
                return int(value, 16) if len(value) <= 18 else -1
            except ValueError:
                return -1
        return int(match.group(1)) if match and len(match.group(1)) < 19 else -1
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return -1


def _number_text(text: str, overflow: list) -> int | None:
    """A numeric arg written as text (ROCm's ``"bytes": "4096"``): an integer literal as Python's int() reads
    it, or a decimal text of an integral value; -1 (counted in ``overflow``) beyond int64; None when the text is
    no number."""
    try:
        number = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            return None
        if not (value.is_integer() and abs(value) < 2**53):
            return None
        number = int(value)
    if _INT64[0] <= number <= _INT64[1]:
        return number
    overflow.append(text)
    return -1


def _text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _ints(values: list, overflow: list, bad: list | None = None) -> np.ndarray:
    """int64 column from a list of arg values: one C-level conversion, or per value when types are mixed.
    ``bad``: the field is numeric (``NUMERIC_ARGS``): a text is read by ``_number_text``, and the position of
    one that is no number is appended (its value -1, as if absent)."""
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        if bad is None:
            return np.array([_int(v, overflow) for v in values], dtype=np.int64)
    out = np.empty(len(values), dtype=np.int64)
    for i, value in enumerate(values):
        if isinstance(value, str):
            number = _number_text(value, overflow)
            if number is None:
                bad.append(i)
                number = -1
            out[i] = number
        else:
            out[i] = _int(value, overflow)
    return out


def _texts(values: list) -> pd.Categorical:
    """Categorical column from arg texts, most of them empty: sorted categories, ``""`` always among them.

    Factorised in C over the objects (first-appearance codes), then the few unique values are converted to
    text (a list or a number arg becomes its text, a falsy one ""; two spellings of one text share one
    category) and sorted.
    """
    if not any(values):  # the usual case for most args: nothing to factorise
        return empty_texts(len(values))
    array = np.empty(len(values), dtype=object)
    array[:] = values
    try:
        codes, uniques = pd.factorize(array)
    except TypeError:  # an unhashable value (a list of ranks): convert every value first
        array[:] = [_text(v) if v else "" for v in values]
        codes, uniques = pd.factorize(array)
    # A falsy value (0, an empty list) counts as absent, as a missing arg does.
    return sorted_texts(codes, [u if type(u) is str else _text(u) if u else "" for u in uniques])


def sorted_texts(codes: np.ndarray, texts: list) -> pd.Categorical:
    """Categorical of ``texts[codes]`` whose categories are the texts (``None``: unused, left out) sorted, with
    ``""`` always among them (the args text columns' form, whichever path read them)."""
    categories = sorted({text for text in texts if text is not None} | {""})
    position = {text: i for i, text in enumerate(categories)}
    remap = np.array([position.get(text, 0) for text in texts] or [0], dtype=np.int32)
    return pd.Categorical.from_codes(remap[codes] if len(codes) else np.asarray(codes, dtype=np.int32),
                                     dtype=text_dtype(categories), validate=False)


def _factorize(values: list) -> pd.Categorical:
    """Categorical from many repeated strings, categories in order of first appearance.

    ``dict.fromkeys`` finds the distinct values and a dict lookup per value gives the codes, both at C speed
    (faster than ``pd.factorize``, which first copies the list into an object array)."""
    index = {value: i for i, value in enumerate(dict.fromkeys(values))}
    codes = np.fromiter(map(index.__getitem__, values), dtype=np.int32, count=len(values))
    return pd.Categorical.from_codes(codes, dtype=text_dtype(list(index)), validate=False)


def columns_from_events(events: list, *, keep_python: bool, arrow: bool = True, op_args: bool = False) -> Columns:
    """One batch of decoded events (msgspec ``Event`` structs) -> its columns; ``arrow``: the time texts may
    be cast by Arrow (else numpy parses them: the same ns); ``op_args``: the events were decoded with their op
    args (``kineto.OpArgsEvent``), which become the batch's ``op_args`` columns.

    Every field is pulled out with ``operator.attrgetter`` over the whole batch (a C loop, no Python frame
    per event) and converted to an array in one call; per-value Python runs only for mixed-type fields.
    """
    drop = DROP_CATS if keep_python else DROP_CATS | PYTHON_CATS
    n_all = len(events)
    ph_all = _factorize(list(map(_get("ph"), events)))
    cat_all = _factorize(list(map(_get("cat"), events)))
    keep_ph = np.isin(ph_all.categories.to_numpy(dtype=object), list(_PHASES))
    keep_cat = ~np.isin(cat_all.categories.to_numpy(dtype=object), list(drop))
    mask = (keep_ph[ph_all.codes] & keep_cat[cat_all.codes]) if n_all else np.zeros(0, dtype=bool)
    if mask.all():
        kept = events
    else:
        kept = list(itertools.compress(events, mask.tolist()))
    # ``ph`` only serves to find B/E pairs (then it is dropped): the kept rows' codes, categories untrimmed.
    ph = pd.Categorical.from_codes(ph_all.codes[mask], dtype=ph_all.dtype, validate=False) \
        if not mask.all() else ph_all
    cat = _subset(cat_all, mask) if not mask.all() else cat_all
    del ph_all, cat_all
    n = len(kept)
    overflow: list = []
    none = _NO_ARGS
    args = [none if a is None else a for a in map(_get("args"), kept)]
    gpu_cat = np.isin(cat.categories.to_numpy(dtype=object), list(GPU_CATS))
    gpu = gpu_cat[cat.codes] if n else np.zeros(0, dtype=bool)
    pid = _field(kept, "pid", overflow)
    tid = _field(kept, "tid", overflow)
    arg_device = _field(args, "device", overflow)
    arg_stream = _field(args, "stream", overflow)
    scaled, bad = _times_ns([*map(_get("ts"), kept), *map(_get("dur"), kept)], arrow=arrow)
    ts, dur = scaled[:n], scaled[n:]
    not_numbers: list = []  # (row, field) of a numeric arg written as a text that is no number

    def numeric(field: str) -> np.ndarray:
        return _field(args, field, overflow, not_numbers)

    external = _ints_or_else(args, "external_id", "external_id_legacy", overflow, not_numbers)
    dst = _ints_or_else(args, "dst_rank", "src_rank", overflow, not_numbers)
    texts = {key: _texts(list(map(_get(key), args))) for key in _TEXT_ARGS}
    in_nelems, out_nelems = numeric("in_nelems"), numeric("out_nelems")
    extra = None
    if op_args:
        extra = {key: _json_texts(list(map(_get(key), args))) for key in JSON_ARG_COLUMNS}
        extra.update(dtype=texts["dtype"], in_nelems=in_nelems, out_nelems=out_nelems)
    columns = assemble(
        ph, cat, _factorize(list(map(_get("name"), kept))), gpu=gpu, pid=pid, tid=tid, arg_device=arg_device,
        arg_stream=arg_stream, ts=ts, dur=dur, bad_time=bad[:n] | bad[n:],
        correlation=numeric("correlation"), external=external, texts=texts,
        group_size=numeric("group_size"), in_nelems=in_nelems, out_nelems=out_nelems,
        nbytes=numeric("nbytes"), seq=_field(args, "seq", overflow), dst=dst,
        overflow=len(overflow), op_args=extra)
    columns.not_numbers = [(kept[row].name, NUMERIC_ARGS[field], getattr(args[row], field))
                           for row, field in not_numbers]
    return columns


#: The args text columns, by their events-table (and ``_Args``) names.
_TEXT_ARGS = ("collective", "pg_name", "pg_desc", "pg_ranks", "dtype")


def _json_texts(raws: list) -> pd.Categorical:
    """Categorical of the raw JSON values of one op arg (msgspec ``Raw`` slices, ``b""`` where absent), as
    text: each distinct value is decoded from UTF-8 once (invalid bytes replaced), "" where absent."""
    values = list(map(bytes, raws))
    index = {value: i for i, value in enumerate(dict.fromkeys(values))}
    codes = np.fromiter(map(index.__getitem__, values), dtype=np.int32, count=len(values))
    return sorted_texts(codes, [value.decode("utf-8", errors="replace") for value in index])


class Columns:
    """One batch of kept events as columns: what every decode path returns (built by :func:`assemble`).

    Times are as parsed (ns, before the time base); ``bad_time`` marks rows whose ts/dur is not a number or
    beyond int64 ns; ``overflow`` counts integer args beyond int64 (set to -1); ``narrowed`` counts, per int32
    column (``NARROW_COLUMNS``), the values beyond int32 that were set to -1 instead; ``ph`` and ``pid`` only
    serve B/E pairing (``pid`` is all -1 where the batch has no B/E rows). Categoricals: ``ph``, ``cat``,
    ``name``, ``lane`` and the args texts; every other column is a numpy array. ``not_numbers``: (event name,
    arg key, text) of each numeric arg written as a text that is no number (read as absent).

    A plain class with slots, every field a required keyword: a dataclass of these fields is slow to build at
    import, inside a fresh small read (the reader is imported while ``load``'s prefetch thread reads).
    """

    __slots__ = ("ph", "cat", "name", "lane", "device", "stream", "ts", "dur", "bad_time", "correlation",
                 "external_id", "collective", "pg_name", "pg_desc", "pg_ranks", "pg_size", "msg_bytes", "seq",
                 "peer", "pid", "overflow", "narrowed", "op_args", "not_numbers")

    ph: pd.Categorical
    cat: pd.Categorical
    name: pd.Categorical
    lane: pd.Categorical
    device: np.ndarray
    stream: np.ndarray
    ts: np.ndarray
    dur: np.ndarray
    bad_time: np.ndarray
    correlation: np.ndarray
    external_id: np.ndarray
    collective: pd.Categorical
    pg_name: pd.Categorical
    pg_desc: pd.Categorical
    pg_ranks: pd.Categorical
    pg_size: np.ndarray
    msg_bytes: np.ndarray
    seq: np.ndarray
    peer: np.ndarray
    pid: np.ndarray
    overflow: int
    narrowed: dict
    #: the op-args columns by ``schema.OP_ARG_COLUMNS`` name, or None (not asked for)
    op_args: dict | None
    not_numbers: list

    def __init__(self, **columns) -> None:
        missing = [name for name in self.__slots__ if name not in columns]
        unknown = sorted(set(columns) - set(self.__slots__))
        if missing or unknown:
            raise TypeError(f"Columns: missing {missing}, unknown {unknown}")
        for name in self.__slots__:
            setattr(self, name, columns[name])


_FIELDS = Columns.__slots__


class Decoded(NamedTuple):
    """What a decode path made of a document: its top-level keys as raw JSON (``traceEvents`` left out), its
    column batches, and which path it was."""

    top: dict
    batches: list[Columns]
    path: DecodePath


def assemble(ph, cat, name, *, gpu, pid, tid, arg_device, arg_stream, ts, dur, bad_time, correlation, external,
             texts: dict, group_size, in_nelems, out_nelems, nbytes, seq, dst, overflow: int,
             op_args: dict | None = None) -> Columns:
    """The columns of one batch, whichever path read it, from its kept rows' fields (int64, as read):
    ``texts`` holds the args text categoricals by ``_TEXT_ARGS`` name, ``dst`` the peer (Dst Rank, else Src
    Rank), ``op_args`` the op-args columns (or None).

    The int32 columns are narrowed here, for every path alike: an arg beyond int32 counts as absent (-1), as
    one beyond int64 does when it is read (so a GPU row's device then falls back to its pid), and a pid that a
    GPU row's device takes beyond int32 gives -1; each such value is counted in ``narrowed`` for the warning.
    """
    narrowed: dict = {}
    arg_device = _narrow(arg_device, "device", narrowed)
    return Columns(
        ph=ph, cat=cat, name=name,
        lane=pd.Categorical.from_codes(gpu.astype(np.int8), dtype=_LANES, validate=False),
        device=_narrow(np.where(gpu, np.where(arg_device >= 0, arg_device, pid), -1), "device", narrowed),
        stream=np.where(gpu & (arg_stream >= 0), arg_stream, tid),
        ts=ts, dur=dur, bad_time=bad_time, correlation=correlation, external_id=external,
        collective=texts["collective"], pg_name=texts["pg_name"], pg_desc=texts["pg_desc"],
        pg_ranks=texts["pg_ranks"], pg_size=_narrow(group_size, "pg_size", narrowed),
        msg_bytes=_message_bytes(in_nelems=in_nelems, out_nelems=out_nelems, dtype=texts["dtype"], nbytes=nbytes),
        seq=seq, peer=_narrow(dst, "peer", narrowed),
        # The process id only matters for pairing B/E events; most traces have none, so it is not kept.
        pid=pid if has_begin_end(ph) else np.full(len(gpu), -1, dtype=np.int64),
        overflow=overflow, narrowed=narrowed, op_args=op_args, not_numbers=[])


def _narrow(values: np.ndarray, column: str, narrowed: dict) -> np.ndarray:
    """int32 of an int64 column, its values beyond int32 set to -1 (the columns' missing value) and counted
    in ``narrowed[column]`` (``astype`` alone would wrap 2**31 to -2**31)."""
    outside = (values < _INT32[0]) | (values > _INT32[1])
    if outside.any():
        narrowed[column] = narrowed.get(column, 0) + int(np.count_nonzero(outside))
        values = np.where(outside, -1, values)
    return values.astype(np.int32)


def has_begin_end(ph: pd.Categorical) -> bool:
    """Whether any row of a ``ph`` column is a B or E event (its categories may include unused phases)."""
    table = np.array([text in ("B", "E") for text in category_texts(ph.categories)] + [False], dtype=bool)
    return bool(table[np.asarray(ph.codes)].any()) if len(ph) else False


_LANES = pd.CategoricalDtype(pd.Index(["cpu", "gpu"], dtype=_STR))


_get = operator.attrgetter


def _times_ns(raws: list, *, arrow: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(ns, bad)`` of µs number texts (msgspec ``Raw`` slices), exactly: Arrow's decimal(38, 3) cast over
    all of them at once when it can read every one exactly, else the numpy text path (which also rounds
    digits beyond the third decimal and marks what is not a number)."""
    values = _arrow_times_ns(raws) if arrow else None
    if values is not None:
        return values, np.zeros(len(raws), dtype=bool)
    texts = np.array([*map(bytes, raws)] or [b"0"], dtype="S")
    return decimal_texts_to_scaled(texts[:len(raws)], scale_digits=3)


def _arrow_times_ns(raws: list) -> np.ndarray | None:
    """The texts joined into one Arrow string array (offsets from their lengths: no object per text) and
    cast to decimal(38, 3); the unscaled integers are the ns. None when Arrow is not installed, or
    when any text is not a plain number with at most 3 decimals whose ns fit int64."""
    from . import _kineto_arrow

    if not raws or not _kineto_arrow.available():
        return None
    data = b"".join(raws)
    if len(data) >= 2**31:
        return None
    offsets = np.zeros(len(raws) + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, raws), dtype=np.int32, count=len(raws)), out=offsets[1:])
    pa = _kineto_arrow.pa
    texts = pa.Array.from_buffers(pa.string(), len(raws), [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    try:
        decimals = _kineto_arrow.cast_decimal(texts)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    return _kineto_arrow.exact_ns(decimals)


def _field(items: list, field: str, overflow: list, not_numbers: list | None = None) -> np.ndarray:
    """int64 column of one attribute of every item, converted without an intermediate list when it can.
    ``not_numbers``: the field is numeric; (row, field) of each text that is no number is appended."""
    try:
        return np.fromiter(map(_get(field), items), dtype=np.int64, count=len(items))
    except (TypeError, ValueError, OverflowError):
        bad: list | None = None if not_numbers is None else []
        out = _ints(list(map(_get(field), items)), overflow, bad)
        if bad:
            not_numbers.extend((row, field) for row in bad)
        return out


def _ints_or_else(args: list, field: str, fallback: str, overflow: list, not_numbers: list) -> np.ndarray:
    """int64 column of numeric ``field``, taking numeric ``fallback`` where ``field`` is absent (or -1); a
    present but unreadable or overflowing ``field`` stays -1 (only the rows without ``field`` read
    ``fallback``)."""
    values = list(map(_get(field), args))
    try:
        out = np.array(values, dtype=np.int64)
        absent = out == -1
    except (TypeError, ValueError, OverflowError):
        bad: list = []
        out = _ints(values, overflow, bad)
        not_numbers.extend((row, field) for row in bad)
        absent = np.fromiter((type(v) is int and v == -1 for v in values), dtype=bool, count=len(values))
    missing = np.flatnonzero(absent)
    if len(missing):
        rows = operator.itemgetter(*missing.tolist())(args) if len(missing) > 1 else (args[int(missing[0])],)
        bad_rows: list = []
        out[missing] = _field(rows, fallback, overflow, bad_rows)
        not_numbers.extend((int(missing[row]), name) for row, name in bad_rows)
    return out


def _subset(values: pd.Categorical, mask: np.ndarray) -> pd.Categorical:
    """The kept rows of a batch categorical, its categories trimmed to those still used, in order of first
    appearance among the kept rows (as if only they had been factorised)."""
    codes = values.codes[mask] if not mask.all() else values.codes
    order = pd.unique(codes)  # the codes still used, in order of first appearance among the kept rows
    if len(order) == len(values.categories) and (order == np.arange(len(order))).all():
        return pd.Categorical.from_codes(codes, categories=values.categories)
    remap = np.zeros(len(values.categories), dtype=np.int32)
    remap[order] = np.arange(len(order), dtype=np.int32)
    return pd.Categorical.from_codes(remap[codes], categories=values.categories[order])


class _NoArgs:
    __slots__ = ()
    correlation = external_id = external_id_legacy = device = stream = nbytes = -1
    group_size = in_nelems = out_nelems = seq = src_rank = dst_rank = -1
    collective = pg_name = pg_desc = pg_ranks = dtype = ""
    input_dims = input_types = concrete_inputs = in_split_sizes = out_split_sizes = b""


_NO_ARGS = _NoArgs()


def _concat(batches: list[Columns]) -> dict:
    """The batches' columns joined, as a dict (each batch's part is freed as soon as it is merged)."""
    if not batches:
        batches = [columns_from_events([], keep_python=False)]
    out = {}
    for key in _FIELDS:
        first = getattr(batches[0], key)
        if key == "overflow":
            out[key] = sum(b.overflow for b in batches)
        elif key == "narrowed":
            out[key] = {column: sum(b.narrowed.get(column, 0) for b in batches) for column in NARROW_COLUMNS}
        elif key == "not_numbers":
            out[key] = [entry for b in batches for entry in b.not_numbers]
        elif key == "op_args":
            out[key] = None if first is None else {column: _joined([b.op_args.pop(column) for b in batches])
                                                   for column in OP_ARG_COLUMNS}
        elif len(batches) == 1:
            out[key] = first
        else:
            out[key] = _joined([getattr(b, key) for b in batches])
            for b in batches:
                setattr(b, key, None)
    return out


def _joined(parts: list):
    """One column of several batches' parts (categoricals unioned, arrays concatenated)."""
    return parts[0] if len(parts) == 1 else union_categoricals(parts) if isinstance(parts[0], pd.Categorical) \
        else np.concatenate(parts)


def finish_frame(path: Path, batches: list[Columns], *, base_ns: int, rank: int,
                 warnings: list[str]) -> dict:
    """Concatenate batches, apply the time base, pair B/E, and derive sizes, memory kinds and steps.

    Works on the column dict and returns it in the schema's column order and dtypes (``schema.conforms``
    checks it): a frame per step of the way would pay pandas' per-frame overhead each time, and ``load`` joins
    the columns of many files without building a frame per file (``ReadResult.columns``).
    """
    cols = _concat(batches)
    cols.update(cols.pop("op_args") or {})  # the op-args columns, when asked for, go along with every row
    if cols["overflow"]:
        warnings.append(f"{path}: {cols['overflow']} integer args beyond int64 were set to -1")
    warnings.extend(f"{path}: {count} integer values beyond int32 in the {column} column were set to -1"
                    for column, count in cols.pop("narrowed").items() if count)
    _warn_not_numbers(path, cols.pop("not_numbers"), warnings)
    keep = ~cols.pop("bad_time")
    del cols["overflow"]
    if not keep.all():
        warnings.append(f"{path}: dropped {int((~keep).sum())} events whose ts/dur is not a number "
                        "or beyond int64 ns")
    if keep.any() and base_ns and int(cols["ts"][keep].max()) > _INT64[1] - base_ns:
        warnings.append(f"{path}: ts + baseTimeNanoseconds overflows int64; times kept relative to the base")
        base_ns = 0
    cols["start_ns"] = cols.pop("ts")
    if base_ns:
        cols["start_ns"] += base_ns  # in place: no second copy of the biggest column
    cols["dur_ns"] = cols.pop("dur")
    if not keep.all():
        cols = {key: values[keep] for key, values in cols.items()}
    ph = cols["ph"]
    if has_begin_end(ph):  # B/E pairs (rare: a few user ranges) go through a frame
        frame = _pair_begin_end(pd.DataFrame(cols, copy=False), warnings=warnings, path=path)
        cols = {key: frame[key].array if isinstance(frame[key].dtype, pd.CategoricalDtype)
                else frame[key].to_numpy() for key in frame.columns}
    del cols["ph"], cols["pid"]
    n = len(cols["start_ns"])
    cols["rank"] = np.full(n, rank, dtype=np.int32)
    cols["source"] = pd.Categorical.from_codes(np.zeros(n, dtype=np.int8), dtype=_KINETO)
    cols["category"] = cols["dim"] = empty_texts(n)
    cols["memory_kind"] = _memory_kind(cols["name"])
    cols["step"] = assign_steps(cols)
    return {column: cols[column] for column in (*COLUMNS, *OP_ARG_COLUMNS) if column in cols}


#: At most this many (event, arg) pairs are named in the warnings about numeric args that are no number.
_NAMED_NOT_NUMBERS = 5


def _warn_not_numbers(path: Path, not_numbers: list, warnings: list[str]) -> None:
    """One warning per (event name, arg key) whose text is no number (the first few pairs; then a count)."""
    if not not_numbers:
        return
    pairs: dict = {}
    for name, key, text in not_numbers:
        pairs.setdefault((name, key), []).append(text)
    for (name, key), texts in itertools.islice(pairs.items(), _NAMED_NOT_NUMBERS):
        times = f" ({len(texts)} events)" if len(texts) > 1 else ""
        warnings.append(f"{path}: event {name!r} has args {key!r} = {texts[0]!r}{times}, which is no number; the "
                        f"event is kept without its {key!r}")
    if len(pairs) > _NAMED_NOT_NUMBERS:
        rest = sum(len(texts) for texts in itertools.islice(pairs.values(), _NAMED_NOT_NUMBERS, None))
        warnings.append(f"{path}: {rest} more events of {len(pairs) - _NAMED_NOT_NUMBERS} other names have a "
                        "numeric arg that is no number; kept without it")


def unread_device_categories(categories) -> list[str]:
    """The categories among ``categories`` that look like device activity (a device word in a category no
    Kineto host category and no known device category is) and that the reader therefore does not put on a
    device lane."""
    return sorted(c for c in categories if c in UNREAD_DEVICE_CATS or (
        c and c not in GPU_CATS and c not in HOST_CATS and not _RUNTIME_CAT.search(c) and _DEVICE_WORD.search(c)))


def device_lane_note(counts: dict[str, int], *, on_device: bool) -> str | None:
    """What to say of one rank's trace whose events fall in ``counts`` (category -> events) and that has
    device-lane rows or not (``on_device``): never a silent CPU-only reading of a device trace. A note when its
    device activity is in categories not read as device lanes, or when it calls a device runtime but records
    no device activity at all; else None. (``table.load`` warns with it, once per note.)"""
    unread = unread_device_categories(counts)
    if unread:
        listed = ", ".join(f"{c} ({counts[c]} events" + (f": {UNREAD_DEVICE_CATS[c]})" if c in UNREAD_DEVICE_CATS
                                                           else ")") for c in unread)
        if on_device:
            return (f"events in {listed} look like device activity this reader does not read as device lanes; "
                    "the device breakdown leaves them out")
        return (f"the breakdown is CPU-only: the trace's device activity is in {listed}, which this reader does "
                "not read as device lanes (it reads kernel, gpu_memcpy, gpu_memset, mtia_ccp_events, hpu_op and "
                "the like)")
    runtime = sorted(c for c in counts if counts[c] and _RUNTIME_CAT.search(c))
    if runtime and not on_device:
        listed = ", ".join(f"{c} ({counts[c]} calls)" for c in runtime)
        return (f"the breakdown is CPU-only: the trace calls a device runtime ({listed}) but records no device "
                "activity (no kernel, copy or device-op events), so its device lanes cannot be read")
    return None


def device_lane_suspects(categories) -> tuple[bool, bool]:
    """(any category is unread device activity, any calls a device runtime): whether ``device_lane_note`` may
    have something to say of a trace with these categories."""
    return bool(unread_device_categories(categories)), any(_RUNTIME_CAT.search(c) for c in categories if c)


_KINETO = pd.CategoricalDtype(pd.Index(["kineto"], dtype=_STR))


def _pair_begin_end(frame: pd.DataFrame, *, warnings: list[str], path: Path) -> pd.DataFrame:
    """Turn matched B/E events (same pid, thread, nesting) into complete events; unmatched ones are dropped."""
    is_b, is_e = (frame["ph"] == "B").to_numpy(), (frame["ph"] == "E").to_numpy()
    if not (is_b.any() or is_e.any()):
        return frame
    be = frame[is_b | is_e].sort_values("start_ns", kind="stable")
    stacks: dict = {}
    ends: dict = {}
    # B/E are rare in Kineto output (a few user ranges), so a plain stack walk over just them is fine.
    for index, ph, pid, stream, start in zip(be.index, be["ph"], be["pid"], be["stream"], be["start_ns"]):
        stack = stacks.setdefault((pid, stream), [])
        if ph == "B":
            stack.append(index)
        elif stack:
            ends[stack.pop()] = start
    unmatched = int(is_b.sum() + is_e.sum()) - 2 * len(ends)
    if unmatched:
        warnings.append(f"{path}: {unmatched} B/E events without a partner were dropped")
    out = frame[~(is_b | is_e)]
    begins = frame.loc[list(ends)]
    begins = begins.assign(dur_ns=np.array(list(ends.values()), dtype=np.int64) - begins["start_ns"].to_numpy())
    return pd.concat([out, begins]) if len(begins) else out


def _message_bytes(*, in_nelems, out_nelems, dtype: pd.Categorical, nbytes) -> np.ndarray:
    """Collective payload: max(in, out) elements × dtype size (the output of gathers, the input otherwise);
    memcpy/memset rows take the ``bytes`` arg."""
    per_code = np.array([DTYPE_BYTES.get(str(c), -1) for c in dtype.categories], dtype=np.int64)
    size = per_code[dtype.codes] if len(per_code) else np.full(len(dtype), -1, dtype=np.int64)
    nelems = np.maximum(in_nelems, out_nelems)
    collective = np.where((nelems >= 0) & (size > 0), nelems * np.maximum(size, 0), -1)
    return np.where(nbytes >= 0, nbytes, collective)


def _memory_kind(names: pd.Categorical) -> pd.Categorical:
    """Host-side memory of a memcpy from its name: the source of HtoD, the destination of DtoH, else Device."""
    kinds = {"": 0}
    table = np.zeros(len(names.categories), dtype=np.int32)
    for i, name in enumerate(category_texts(names.categories)):
        hit = _MEMCPY_NAME.match(name) if name.startswith("Memcpy") else None
        if hit is None:
            continue
        kind = hit["kind"]
        text = hit["src"] if kind.startswith("H") else hit["dst"] if kind.endswith("H") else "Device"
        table[i] = kinds.setdefault(text, len(kinds))
    if len(names) == 0:
        return pd.Categorical([])
    return sorted_categorical(table[np.asarray(names.codes)], list(kinds))


def assign_steps(columns) -> np.ndarray:
    """Step of every event: CPU events by the ``ProfilerStep#N`` window containing their start; GPU events by
    the step of the runtime call with the same correlation id, else by a GPU-side ``ProfilerStep#N`` window
    on their device; -1 when no window applies (and everywhere when the trace has no steps).

    ``columns``: an events frame, or a dict of its columns (numpy arrays, ``name``/``lane`` categoricals)."""
    names = pd.Categorical(columns["name"]) if isinstance(columns, pd.DataFrame) else columns["name"]
    step = np.full(len(names), -1, dtype=np.int32)
    number_of_code = step_numbers(category_texts(names.categories))
    if len(names) == 0 or (number_of_code < 0).all():
        return step
    event_step = number_of_code[np.asarray(names.codes)]
    start = np.asarray(columns["start_ns"])
    end = start + np.asarray(columns["dur_ns"])
    gpu = np.asarray(columns["lane"] == "gpu")
    _fill_windows(step, ~gpu, event_step, start, end, within=~gpu)
    correlation = np.asarray(columns["correlation"])
    launch = np.flatnonzero(~gpu & (correlation >= 0) & (step >= 0))
    linked = np.flatnonzero(gpu & (correlation >= 0))
    if len(linked) and len(launch):  # (GPU rows are still -1 here)
        # The first launch row of each correlation id gives its step.
        ids, first = np.unique(correlation[launch], return_index=True)
        slot = np.minimum(np.searchsorted(ids, correlation[linked]), len(ids) - 1)
        step[linked] = np.where(ids[slot] == correlation[linked], step[launch[first[slot]]], -1)
    device = np.asarray(columns["device"])
    for dev in np.unique(device[gpu & (step < 0)]):
        _fill_windows(step, gpu & (device == dev), event_step, start, end, within=gpu & (device == dev) & (step < 0))
    return step


def _fill_windows(step, lane_mask, event_step, start, end, *, within) -> None:
    """Set ``step[within]`` from the ProfilerStep windows found among ``lane_mask`` rows (sorted by start)."""
    windows = np.flatnonzero(lane_mask & (event_step >= 0))
    if len(windows) == 0:
        return
    order = windows[np.argsort(start[windows], kind="stable")]
    w_start, w_end, w_num = start[order], end[order], event_step[order]
    targets = np.flatnonzero(within)
    slot = np.searchsorted(w_start, start[targets], side="right") - 1
    ok = slot >= 0
    ok[ok] = start[targets[ok]] < w_end[slot[ok]]
    step[targets[ok]] = w_num[slot[ok]]
