"""The events table: one pandas DataFrame for all ranks, one row per interval, fixed columns and dtypes.

Every reader produces exactly these columns (``empty_events()`` is the template; ``check_events`` enforces it).
Times are integer nanoseconds on the rank's own clock (``start_ns`` absolute as the source gives it,
``dur_ns >= 0``); nothing is ever rounded to microseconds. Missing integers are -1, missing strings are
empty-string categories, so no column holds Python ``None`` objects.

=============  ========  ==================================================================================
column         dtype     meaning
=============  ========  ==================================================================================
rank           int32     global rank of the process that recorded the event
lane           category  "cpu" (a host thread) or "gpu" (a device stream)
device         int32     GPU index for gpu lanes; -1 on cpu lanes
stream         int64     GPU stream id for gpu lanes; thread id for cpu lanes
name           category  event name as recorded (kernel name, op name, annotation)
cat            category  the source's own category (Kineto ``cat``, ``nvtx``, ``nccl_coll`` ...)
category       category  our classification (see ``CATEGORIES``); "" until classified
dim            category  parallel dimension of a collective (tp, cp, dp, pp, ep, unknown); "" otherwise
start_ns       int64     start time, ns
dur_ns         int64     duration, ns
step           int32     ProfilerStep number the event belongs to; -1 when the trace has no steps
correlation    int64     launch <-> kernel correlation id; -1
external_id    int64     Kineto "External id" linking GPU work to the CPU op; -1
collective     category  collective name from the trace args (e.g. "allreduce", "_allgather_base"); ""
pg_name        category  process-group name ("0", "1", ...); ""
pg_desc        category  process-group description ("sl:tp", "default_pg", ...); ""
pg_ranks       category  the group's global ranks as text "[0, 1, 2]"; ""
pg_size        int32     group size; -1
seq            int64     collective sequence number within its process group; -1
msg_bytes      int64     message size in bytes (input for sends/all-reduce, output for gathers); -1
peer           int32     peer global rank of a p2p op; -1
memory_kind    category  host memory of a memcpy ("Pageable", "Pinned", "Device"); ""
source         category  reader that produced the row ("kineto", "nccl_log", "nsys")
=============  ========  ==================================================================================

Op args (``OP_ARG_COLUMNS``): the Kineto reader adds these columns after the schema's only when asked
(``load(path, op_args=True)``, ``read_kineto(..., op_args=True)``); without them the table is exactly the
above. They keep the args of each event that the columns above drop: the shapes the profiler records with
``record_shapes=True`` and a collective's own element counts, dtype and all-to-all-v splits. A JSON column
holds the arg's value as the trace writes it (JSON text, e.g. ``[[8, 16], [16, 32]]``), "" where the event has
none; ``json_values`` decodes a column once per distinct text. Rows of other readers hold "" / -1.

===============  ========  ================================================================================
column           dtype     meaning
===============  ========  ================================================================================
input_dims       category  ``Input Dims``: one shape (a list of ints) per input, JSON; ""
input_types      category  ``Input type``: the inputs' C++ type names ("c10::BFloat16", "float"), JSON; ""
concrete_inputs  category  ``Concrete Inputs``: scalar inputs as texts ("True", "0."), JSON; ""
in_split_sizes   category  ``In split size`` of an all-to-all(-v) (a list, or a text holding one), JSON; ""
out_split_sizes  category  ``Out split size``, the same; ""
dtype            category  ``dtype`` of a collective (torch ScalarType name: "BFloat16"); ""
in_nelems        int64     ``In msg nelems``: elements of the collective's input; -1
out_nelems       int64     ``Out msg nelems``: elements of its output; -1
===============  ========  ================================================================================
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections import Counter

import numpy as np
import pandas as pd

CATEGORIES = (
    "compute", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p_send", "p2p_recv",
    "barrier", "other_comm", "memcpy_h2d", "memcpy_d2h", "memcpy_d2d", "memset", "sync", "idle",
)
COMM_CATEGORIES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p_send",
                   "p2p_recv", "barrier", "other_comm")
#: The point-to-point categories (a call meets one peer, not a group).
P2P_CATEGORIES = ("p2p_send", "p2p_recv")
MEMCPY_CATEGORIES = ("memcpy_h2d", "memcpy_d2h", "memcpy_d2d")

COLUMNS: dict[str, str] = {
    "rank": "int32",
    "lane": "category",
    "device": "int32",
    "stream": "int64",
    "name": "category",
    "cat": "category",
    "category": "category",
    "dim": "category",
    "start_ns": "int64",
    "dur_ns": "int64",
    "step": "int32",
    "correlation": "int64",
    "external_id": "int64",
    "collective": "category",
    "pg_name": "category",
    "pg_desc": "category",
    "pg_ranks": "category",
    "pg_size": "int32",
    "seq": "int64",
    "msg_bytes": "int64",
    "peer": "int32",
    "memory_kind": "category",
    "source": "category",
}
_COLUMN_LIST = list(COLUMNS)
#: The op-args columns (module docstring), present only in a table read with ``op_args=True``.
OP_ARG_COLUMNS: dict[str, str] = {
    "input_dims": "category",
    "input_types": "category",
    "concrete_inputs": "category",
    "in_split_sizes": "category",
    "out_split_sizes": "category",
    "dtype": "category",
    "in_nelems": "int64",
    "out_nelems": "int64",
}
#: The op-args columns that hold JSON text (``json_values`` decodes them).
JSON_ARG_COLUMNS = ("input_dims", "input_types", "concrete_inputs", "in_split_sizes", "out_split_sizes")
INT_COLUMNS = tuple(c for c, t in COLUMNS.items() if t.startswith("int"))
STR_COLUMNS = tuple(c for c, t in COLUMNS.items() if t == "category")


def category_texts(categories) -> list[str]:
    """The categories of a categorical (an Index) as a list of Python str, converted in one call.

    pandas' default string categories are Arrow-backed: iterating them yields one boxed scalar per element,
    while ``tolist`` converts the whole array at C speed.
    """
    return [v if type(v) is str else str(v) for v in categories.tolist()]


_TABLES: dict[tuple, tuple] = {}


def per_category_table(column: pd.Series, key, build) -> np.ndarray:
    """``build(texts)`` for the categories of a categorical column, with one extra trailing slot for missing
    values (so ``table[codes]`` works after mapping code -1 to ``len(categories)``); cached per categories
    object and ``key``, so the per-rank slices of one table (which share its categories) compute it once."""
    categories = column.dtype.categories  # the dtype's own Index (``.cat`` builds an accessor per call)
    slot = (id(categories), key)
    hit = _TABLES.get(slot)
    if hit is not None and hit[0]() is categories:
        return hit[1]
    table = build(category_texts(categories))
    # A weak reference: the cache never keeps a table's categories alive, and an entry whose categories are
    # gone is dropped (so its id, if reused, cannot hit).
    _TABLES[slot] = (weakref.ref(categories, lambda _ref, slot=slot: _TABLES.pop(slot, None)), table)
    return table


_STEP_MARKER = re.compile(r"^ProfilerStep#(\d+)$")
_STEP_MAX = np.iinfo(np.int32).max  # the ``step`` column is int32


def step_numbers(texts) -> np.ndarray:
    """N of every text that is a ``ProfilerStep#N`` step marker, -1 for the others (int64). N must be ASCII
    digits and fit the int32 ``step`` column, or the text marks no step: one rule for the reader (which gives
    events their step) and attribution (which makes windows of the markers)."""
    numbers = np.full(len(texts), -1, dtype=np.int64)
    for i, text in enumerate(texts):
        hit = _STEP_MARKER.match(text) if text.startswith("ProfilerStep#") else None
        if hit is not None and hit[1].isascii() and int(hit[1]) <= _STEP_MAX:
            numbers[i] = int(hit[1])
    return numbers


def codes_or_end(column: pd.Series) -> np.ndarray:
    """Category codes of a categorical column (read-only), a missing value mapped to one past the last
    category. From the Categorical itself: ``.cat.codes`` builds a new Series on every call."""
    codes = column.array.codes
    if (codes < 0).any():
        codes = np.where(codes < 0, len(column.dtype.categories), codes)
    return codes


def empty_events() -> pd.DataFrame:
    """A zero-row events table with the schema's columns and dtypes."""
    return pd.DataFrame({c: pd.Series(np.empty(0, dtype=t) if t != "category" else [], dtype=t)
                         for c, t in COLUMNS.items()})


def sorted_categorical(codes: np.ndarray, vocabulary) -> pd.Categorical:
    """Categorical of ``vocabulary[codes]`` whose categories are the values used, sorted (what
    ``pd.Categorical`` of the strings would give), built from the codes without a string per row."""
    used = np.flatnonzero(np.bincount(codes, minlength=len(vocabulary)))
    order = sorted(used.tolist(), key=lambda i: vocabulary[i])
    remap = np.zeros(len(vocabulary), dtype=np.int32)
    remap[order] = np.arange(len(order), dtype=np.int32)
    return pd.Categorical.from_codes(remap[codes], dtype=text_dtype([vocabulary[i] for i in order]),
                                     validate=False)


def empty_texts(n: int) -> pd.Categorical:
    """A categorical of ``n`` empty strings (built from codes: no string per row)."""
    return pd.Categorical.from_codes(np.zeros(n, dtype=np.int8), dtype=_EMPTY_TEXT, validate=False)


_STR = pd.Index(["x"]).dtype
#: Vocabularies up to this many texts share one cached dtype per distinct list.
_CACHED_TEXTS = 1024


def text_dtype(texts) -> pd.CategoricalDtype:
    """The categorical dtype of these texts (distinct, in this order) as categories, pandas' default string
    dtype. Building one checks the categories (an index and a hash table each time: tens of µs); the columns
    of many files and calls mostly repeat a few short vocabularies, so those share one cached dtype object
    (and with it the per-category tables of ``per_category_table``)."""
    if len(texts) <= _CACHED_TEXTS:
        return _cached_text_dtype(tuple(texts))
    return _new_text_dtype(texts)


@functools.lru_cache(maxsize=256)
def _cached_text_dtype(texts: tuple) -> pd.CategoricalDtype:
    return _new_text_dtype(texts)


def _new_text_dtype(texts) -> pd.CategoricalDtype:
    """A categorical dtype of these distinct texts. Their distinctness is checked here with a set (cheap), so
    pandas' own check (an index hash table per dtype: a large share of a small file's categorical work) is
    skipped where pandas offers the way (``_from_fastpath``, pandas 2 and 3)."""
    texts = list(texts)
    if len(set(texts)) != len(texts):
        raise ValueError(f"categories must be distinct: {len(texts) - len(set(texts))} repeated among {texts[:8]}")
    index = pd.Index(texts, dtype=_STR)
    fast = getattr(pd.CategoricalDtype, "_from_fastpath", None)
    if fast is None or index.hasnans:  # a missing text: pandas' check says so
        return pd.CategoricalDtype(index)
    return fast(index, False)


_EMPTY_TEXT = text_dtype([""])


def has_op_args(frame: pd.DataFrame) -> bool:
    """Whether an events table carries the op-args columns (``OP_ARG_COLUMNS``: read with ``op_args=True``)."""
    return all(column in frame.columns for column in OP_ARG_COLUMNS)


def json_values(column: pd.Series) -> np.ndarray:
    """The decoded value of every row of a JSON op-args column (``JSON_ARG_COLUMNS``), as an object array: None
    where the row has none ("") or its text is not JSON. Each distinct text the rows use is decoded once."""
    codes = codes_or_end(column)
    categories = np.array([*category_texts(column.cat.categories), ""], dtype=object)
    used = np.unique(codes)
    table = np.full(len(categories), None, dtype=object)
    for code, text in zip(used.tolist(), categories[used].tolist()):
        try:
            table[code] = json.loads(text) if text else None
        except ValueError:
            pass
    return table[codes]


def conform(frame: pd.DataFrame, *, op_args: bool = False) -> pd.DataFrame:
    """Add missing columns (-1 / ""), cast to the schema's dtypes and order the columns; ``op_args``: the
    op-args columns (``OP_ARG_COLUMNS``) too, after the schema's. Any other column is dropped."""
    wanted = {**COLUMNS, **OP_ARG_COLUMNS} if op_args else COLUMNS
    if list(frame.columns) == (list(wanted) if op_args else _COLUMN_LIST) and all(str(dtype) == want for dtype, want in
                                                   zip(frame.dtypes, wanted.values())):
        return frame  # already the schema (the Kineto reader builds it so)
    n = len(frame)
    out = {}
    for column, dtype in wanted.items():
        if column in frame:
            values = frame[column]
            if dtype == "category":
                values = values.fillna("").astype(str) if values.dtype != "category" else values
                out[column] = values if isinstance(values.dtype, pd.CategoricalDtype) else values.astype("category")
            elif str(values.dtype) == dtype:
                out[column] = values  # an integer column cannot hold a missing value: nothing to fill
            else:
                out[column] = values.fillna(-1).astype(dtype)
        else:
            out[column] = (pd.Series(np.full(n, -1, dtype=dtype), index=frame.index) if dtype != "category"
                           else pd.Series(empty_texts(n), index=frame.index))
    return pd.DataFrame(out, index=frame.index, copy=False)  # columns already right are shared, not copied


def conforms(columns: dict, *, op_args: bool = False) -> bool:
    """Whether a dict of columns (numpy arrays, categoricals) is already the schema: its columns, in order, with
    their dtypes (``ReadResult.columns``)."""
    wanted = {**COLUMNS, **OP_ARG_COLUMNS} if op_args else COLUMNS
    return list(columns) == list(wanted) and all(str(values.dtype) == want
                                                 for values, want in zip(columns.values(), wanted.values()))


def check_events(frame: pd.DataFrame) -> None:
    """Raise ``ValueError`` naming every column whose presence or dtype breaks the schema."""
    # One look at the dtypes (not a column access per column: this runs on every load and analysis).
    dtypes = dict(zip(frame.columns, frame.dtypes))
    problems = [f"column {c!r} appears {n} times" for c, n in Counter(frame.columns).items() if n > 1 and c in COLUMNS]
    problems += [f"missing column {c!r}" for c in COLUMNS if c not in dtypes]
    problems += [f"column {c!r} has dtype {dtypes[c]}, expected {t}"
                 for c, t in (*COLUMNS.items(), *OP_ARG_COLUMNS.items()) if c in dtypes and str(dtypes[c]) != t]
    if problems:
        raise ValueError("events table breaks the schema: " + "; ".join(problems))
