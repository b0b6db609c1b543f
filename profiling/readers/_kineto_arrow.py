r"""Fast path of the Kineto reader: a chunk of event text parsed by Arrow's C++ JSON reader into columns.

The ordinary path decodes every event into a msgspec struct and then pulls each field out of every struct;
that Python-level column building is most of its time. Here Arrow parses the text straight into typed
columns (in several threads), so no Python object exists per event at all. The output is the same column
dict as :func:`columns_from_events`, value for value (the reader's tests compare the two on every shared
trace), and anything this path cannot read *exactly* returns None so the caller decodes the chunk the
ordinary way. How the text is prepared, and why each step is safe:

- Arrow reads a sequence of objects, not a JSON array, so the ``,`` between events must go. The separator
  (``}`` ``,`` whitespace ``{``) is taken from the chunk's first boundary and every occurrence is replaced by
  ``}`` newline ``{``. An occurrence inside a string literal becomes a raw newline there, which is invalid
  JSON; one between nested objects leaves an object without its ``,``, also invalid. So a wrong replacement
  can only make Arrow fail (and the chunk go the ordinary way), never change a value. A different separator
  left unreplaced fails the same way.
- Pretty-printed events span lines; Arrow is then told so (``newlines_in_values``) and finds object ends by
  parsing. Arrow, like msgspec, refuses raw control characters inside strings.
- Arrow columns have one type. ``pid``/``tid`` are numbers except for a few events (the profiler's own
  span writes ``"pid": "Spans"``; 2021 traces write every tid as text); keys ending in ``id`` with a text
  value, found by a literal search for ``id":"`` (a ``"`` right after ``id`` can only close a key, never sit
  inside a string), get ``\u0001`` appended to their name; ``pid``/``tid`` so renamed are read as text,
  ``External id`` so renamed refuses the chunk, the rest are unread. Any other type conflict (ROCm's text
  streams, ranks as lists, numbers beyond int64, floats where ints belong, duplicate keys) makes Arrow
  fail: ordinary path.
- Times are read as ``decimal(38, 3)``: Arrow converts the number text exactly (no double in between, so
  the ns of a 17-digit absolute µs time survive), and the unscaled integer is the time in ns. A time with
  more than 3 decimals makes Arrow refuse the chunk; one beyond int64 ns is refused here.
- Where Arrow is more lenient than msgspec, the chunk is refused before parsing (``_suspicious``,
  ``_valid_json``): an explicit ``null`` in a field (msgspec drops such an event), ``ts``/``dur`` written as
  strings (Arrow's decimal reader would take the number), any ``\u`` escape (it could spell a key the
  literal checks look for, or a renamed one), and, for streamed chunks msgspec has not yet read, invalid
  syntax Arrow tolerates (``NaN``, ``Infinity``, objects without a comma between them). Separators match
  JSON whitespace only.
- Arrow does not check UTF-8: every text the ordinary path decodes (``ph``, ``cat``, ``name``, the args
  texts) is validated in every row, kept or not, before anything is filtered.
"""

from __future__ import annotations

import os
import re

import msgspec
import numpy as np
import pandas as pd

from shardline.profiling.readers._kineto_columns import (
    _STR,
    DROP_CATS,
    GPU_CATS,
    PYTHON_CATS,
    _int,
    _subset,
    assemble,
    sorted_texts,
)

try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj
except ImportError:  # pragma: no cover - pyarrow is a dependency; the ordinary path still works without it
    pa = None

#: ``SHARDLINE_KINETO_ARROW=0`` turns the fast path off (every chunk is decoded the ordinary way).
ENABLED = os.environ.get("SHARDLINE_KINETO_ARROW", "1") not in ("0", "false", "no", "off")

#: JSON whitespace only (``\s`` would also take form feed and vertical tab, which JSON does not allow).
_SEPARATOR = re.compile(rb"\}[ \t\r\n]*,[ \t\r\n]*\{")
_TEXT_ID = re.compile(rb'id": ?"')
_ESCAPE = re.compile(rb"\\u")
_NULL = re.compile(rb"null")
_NULL_VALUE = re.compile(rb':[ \t\r\n]*null')
_ARGS_KEY = re.compile(rb'"args"[ \t\r\n]*$')
_TIME_TEXT = (re.compile(rb'ts"[ \t\r\n]*:[ \t\r\n]*"'), re.compile(rb'dur"[ \t\r\n]*:[ \t\r\n]*"'))
_DECODE_RAW = msgspec.json.Decoder(msgspec.Raw)
#: The renamed text-valued ``pid``/``tid`` keys: an escape in the name, so no key of the original text (which
#: has no escapes, see ``_suspicious``) can be one of them.
_PID_TEXT, _TID_TEXT = "pid\x01", "tid\x01"
_SUFFIX = b"\\u0001"
_RENAMED = b'id\\u0001": "'
_PHASES = ("X", "B", "E")

if pa is not None:
    _I, _S = pa.int64(), pa.string()
    #: µs with 3 decimals, parsed exactly from the number text: the unscaled integer is the time in ns.
    _DECIMAL = pa.decimal128(38, 3)
    _ARGS = pa.struct([
        ("correlation", _I), ("External id", _I), ("external id", _I), ("device", _I), ("stream", _I),
        ("bytes", _I), ("Collective name", _S), ("Process Group Name", _S), ("Process Group Description", _S),
        ("Process Group Ranks", _S), ("Group size", _I), ("In msg nelems", _I), ("Out msg nelems", _I),
        ("dtype", _S), ("Seq", _I), ("Src Rank", _I), ("Dst Rank", _I),
        # Renamed text values of int keys (see _rename_text_ids): present means "ordinary path".
        ("External id\x01", _S), ("external id\x01", _S)])
    _SCHEMA = pa.schema([("ph", _S), ("cat", _S), ("name", _S), ("pid", _I), ("tid", _I), (_PID_TEXT, _S),
                         (_TID_TEXT, _S), ("ts", _DECIMAL), ("dur", _DECIMAL), ("args", _ARGS)])
    _OPTIONS = pj.ParseOptions(explicit_schema=_SCHEMA, unexpected_field_behavior="ignore")
    _OPTIONS_MULTILINE = pj.ParseOptions(explicit_schema=_SCHEMA, unexpected_field_behavior="ignore",
                                         newlines_in_values=True)
    _FAILURES = (pa.ArrowException, UnicodeDecodeError, ValueError, TypeError, OverflowError)


def available() -> bool:
    return pa is not None and ENABLED


#: The fast path takes chunks of at least this many bytes with at least this many events per MB (see
#: ``_worth_it``); the tests set both to 0 to force it.
MIN_BYTES = 4 << 20
MIN_EVENTS_PER_MB = 3000
_SAMPLE_BYTES = 1 << 20
#: Below this many bytes a chunk is parsed in the calling thread (the pool's hand-off costs more than it saves).
_THREADED_MIN_BYTES = 4 << 20
#: Whether Arrow may parse in its thread pool (None: when the chunk is big enough). ``load``'s reader
#: workers, one per core already, set it False.
THREADS: bool | None = None


def columns_from_text(text, *, keep_python: bool, threads: bool | None = None,
                      validated: bool = False) -> dict | None:
    """Column dict of a chunk of comma-separated event objects (no brackets), or None to decode it the
    ordinary way (see the module docstring for when). ``validated``: the caller's JSON parser has already
    checked the chunk's syntax (the in-memory path decodes the whole file first); otherwise msgspec does."""
    if not available():
        return None
    with memoryview(text) as view:
        if not _worth_it(view):
            return None
        first, last = _ends(view)
        if first < 0 or view[first] != ord("{") or view[last] != ord("}"):
            return None
        events = view[first:last + 1]
        if _suspicious(events):
            return None
        # One copy out of the caller's buffer (the renaming's join), in brackets when msgspec must check the
        # syntax; one more for the separators.
        body = _rename_text_ids(events, brackets=not validated)
        del events
    if not validated and not _valid_json(body):
        return None
    # Pretty-printed events span lines: Arrow must then find object ends by parsing, not at newlines.
    options = _OPTIONS_MULTILINE if b"\n" in body else _OPTIONS
    separator = _SEPARATOR.search(body)
    lines = body.replace(separator.group(), b"}\n{") if separator else body
    del body
    text = pa.py_buffer(lines)
    if not validated:
        text = text.slice(1, len(lines) - 2)  # without the brackets
    try:
        if threads is None:
            threads = THREADS if THREADS is not None else len(lines) >= _THREADED_MIN_BYTES
        table = pj.read_json(pa.BufferReader(text), parse_options=options,
                             read_options=pj.ReadOptions(use_threads=threads, block_size=4 << 20))
        return _columns(table, keep_python=keep_python)
    except _FAILURES:
        return None


def _suspicious(events: memoryview) -> bool:
    """Text Arrow would read differently from msgspec (the ordinary path), found by literal searches:

    - an escape ``\\u`` anywhere: it could spell a key (``"t\\u0073"``) the other checks look for literally,
      or one of the renamed keys;
    - an explicit ``null`` value other than ``"args": null``: msgspec refuses null for every field the
      events table reads (the event is dropped with a warning), Arrow would read it as missing;
    - ``ts`` or ``dur`` written as a JSON string: Arrow's decimal reader accepts the string's number, the
      ordinary path counts it a bad time.
    """
    if _ESCAPE.search(events):
        return True
    if _NULL.search(events):
        for match in _NULL_VALUE.finditer(events):
            if not _ARGS_KEY.search(bytes(events[max(0, match.start() - 16):match.start()])):
                return True
    for pattern in _TIME_TEXT:
        for match in pattern.finditer(events):
            if match.start() >= 1 and events[match.start() - 1] == ord('"'):  # the whole key is ts / dur
                return True
    return False


def _valid_json(text: bytes) -> bool:
    """Whether ``text`` (the chunk in brackets) is valid JSON (msgspec's syntax check, ~1.5 GB/s): Arrow
    accepts some text msgspec refuses (NaN, Infinity, objects without a comma between them)."""
    try:
        _DECODE_RAW.decode(text)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return False
    return True


def _worth_it(view: memoryview) -> bool:
    """Whether this path is the faster one for the chunk (both give the same columns).

    Arrow's parser runs at about 100 MB/s per thread whatever the events, while the ordinary path costs
    about 4 ms per MB plus 3 µs per event; so Arrow wins only on big chunks (where its threads help and its
    fixed costs, ~5 ms, vanish) of densely packed events. Measured on the shared traces (CPU, one thread):
    4,600 events/MB 1.5x faster, 4,500/MB even, 2,300/MB 0.8x, 900/MB 0.5x, and every trace under 4 MB
    0.35-0.8x. The density is sampled from the chunk's first MB.
    """
    if len(view) < MIN_BYTES:
        return False
    sample = bytes(view[:_SAMPLE_BYTES])
    return sample.count(b'"ph"') * 1e6 >= MIN_EVENTS_PER_MB * len(sample)


def _ends(view: memoryview) -> tuple[int, int]:
    """Positions of the first and last non-whitespace bytes of ``view`` ((-1, -1) when there are none)."""
    n = len(view)
    first = next((i for i in range(n) if view[i] not in _WHITESPACE), -1)
    last = next((i for i in range(n - 1, first - 1, -1) if view[i] not in _WHITESPACE), -1) if first >= 0 else -1
    return first, last


_WHITESPACE = frozenset(b" \t\r\n")


def _rename_text_ids(body: memoryview, *, brackets: bool) -> bytes:
    """A copy of ``body`` (in ``[`` ``]`` when ``brackets``) with every key that ends in ``id`` and has a
    text value renamed with ``\\u0001`` appended (``"pid": "Spans"`` -> ``"pid\\u0001": "Spans"``); of the
    renamed keys the schema reads ``pid``/``tid`` as text, ``External id`` refuses the chunk, the others are
    unread."""
    found = []
    for match in _TEXT_ID.finditer(body):
        found.append(match.start() + 2)
        if len(found) > 64:  # many (legacy traces write every tid as text): one C-level substitution
            renamed = _TEXT_ID.sub(_RENAMED.replace(b"\\", b"\\\\"), bytes(body))  # (a template: \\ is \)
            return b"[" + renamed + b"]" if brackets else renamed
    pieces, last = [b"["] if brackets else [], 0
    for cut in found:
        pieces += [body[last:cut], _SUFFIX]
        last = cut
    pieces.append(body[last:])
    if brackets:
        pieces.append(b"]")
    return b"".join(pieces)


def _columns(table, *, keep_python: bool) -> dict | None:
    """The column dict of a parsed chunk, or None to refuse it.

    Every column is taken from the whole (multi-chunk) table and only then cut to the kept rows, as numpy
    arrays or categorical codes: filtering and recombining the Arrow table first would copy every column,
    the args struct included (~40 ms per 25 MB chunk). The categoricals come out as if built from the kept
    rows alone (first-seen order among them; args texts sorted with ``""``).
    """
    drop = DROP_CATS if keep_python else DROP_CATS | PYTHON_CATS
    n_all = table.num_rows
    ph_all = pc.fill_null(table["ph"], "")
    cat_all = pc.fill_null(table["cat"], "")
    mask = pc.and_(pc.is_in(ph_all, value_set=pa.array(_PHASES)),
                   pc.invert(pc.is_in(cat_all, value_set=pa.array(sorted(drop)))))
    keep = mask.to_numpy(zero_copy_only=False) if n_all else np.zeros(0, dtype=bool)
    _check_utf8(table)
    ts = exact_ns(table["ts"])
    dur = exact_ns(table["dur"])
    if ts is None or dur is None:
        return None
    everything = bool(keep.all())

    def kept(values: np.ndarray) -> np.ndarray:
        return values if everything else values[keep]

    ts, dur = kept(ts), kept(dur)
    n = len(ts)

    def first_seen(column) -> pd.Categorical:  # categories in order of first appearance among kept rows
        values = _first_seen(column)
        return values if everything else _subset(values, keep)

    ph, cat, name = first_seen(ph_all), first_seen(cat_all), first_seen(pc.fill_null(table["name"], ""))
    args = table["args"]
    for legacy in ("External id\x01", "external id\x01"):
        text = pc.struct_field(args, legacy)
        if text.null_count != len(text) and kept(text.is_valid().to_numpy(zero_copy_only=False)).any():
            return None
    field = _fields(args, kept)

    def texts(key: str) -> pd.Categorical:
        return _sorted_texts(pc.struct_field(args, key), keep=None if everything else keep)

    gpu_cat = np.isin(cat.categories.to_numpy(dtype=object), list(GPU_CATS))
    gpu = gpu_cat[cat.codes] if n else np.zeros(0, dtype=bool)
    pid = kept(_id_column(table, "pid"))
    tid = kept(_id_column(table, "tid"))
    arg_device, arg_stream = field("device"), field("stream")
    external = field("External id")
    external = np.where(external == -1, field("external id"), external)
    dst = field("Dst Rank")
    dst = np.where(dst == -1, field("Src Rank"), dst)
    return assemble(
        ph, cat, name, gpu=gpu, pid=pid, tid=tid, arg_device=arg_device, arg_stream=arg_stream, ts=ts, dur=dur,
        bad_time=np.zeros(n, dtype=bool), correlation=field("correlation"), external=external,
        texts={"collective": texts("Collective name"), "pg_name": texts("Process Group Name"),
               "pg_desc": texts("Process Group Description"), "pg_ranks": texts("Process Group Ranks"),
               "dtype": texts("dtype")},
        group_size=field("Group size"), in_nelems=field("In msg nelems"), out_nelems=field("Out msg nelems"),
        nbytes=field("bytes"), seq=field("Seq"), dst=dst, overflow=0)


def _fields(args, kept):
    """Getter of one int64 args field of the kept rows (``kept`` cuts a whole-table array to them), -1 where
    the event has no args or no such key."""
    present = kept(args.is_valid().to_numpy(zero_copy_only=False) if len(args) else np.zeros(0, dtype=bool))

    def get(key: str) -> np.ndarray:
        values = kept(pc.fill_null(pc.struct_field(args, key), -1).to_numpy())
        return values if present.all() else np.where(present, values, -1)
    return get


def _id_column(table, key: str) -> np.ndarray:
    """``pid``/``tid`` as int64: the number, else the integer read from its text (``_int`` rules), else -1."""
    values = pc.fill_null(table[key], -1).to_numpy()
    texts = table[f"{key}\x01"]
    if texts.null_count == len(texts):
        return values
    present = texts.is_valid().to_numpy(zero_copy_only=False)
    codes, uniques = _dictionary(pc.fill_null(texts, ""))
    parsed = np.array([_int(text, []) for text in uniques], dtype=np.int64)
    return np.where(present, parsed[codes], values)


def cast_decimal(texts):
    """Number texts (an Arrow string array) as decimal(38, 3), exactly; raises ``ArrowInvalid`` for a text
    that is not a number or has more than 3 decimals."""
    return pc.cast(texts, _DECIMAL)


def exact_ns(column) -> np.ndarray | None:
    """int64 ns of a µs time column read as decimal(38, 3): its unscaled integer, exactly; 0 where the key is
    missing (explicit nulls were refused by ``_suspicious``); None when a value is beyond int64 ns (more than
    3 decimals already made Arrow refuse the chunk)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(column) == 0:
        return np.zeros(0, dtype=np.int64)
    words = np.frombuffer(column.buffers()[1], dtype=np.int64, count=2 * (len(column) + column.offset))
    low, high = words[2 * column.offset::2], words[2 * column.offset + 1::2]
    if column.null_count:
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        low, high = np.where(valid, low, 0), np.where(valid, high, 0)
    # The 128-bit value must fit int64; int64's minimum is refused too, as the numpy text parser (the
    # ordinary path) counts magnitudes beyond int64's maximum out of range.
    if (high != (low >> 63)).any() or (low == np.iinfo(np.int64).min).any():
        return None
    return low.copy()


def _check_utf8(table) -> None:
    """Raise (refusing the chunk) on invalid UTF-8 in any text the ordinary path decodes, in every row, kept
    or not: its decoder checks them all (and warns), Arrow's reader checks none."""
    arrays = [chunk for name in ("ph", "cat", "name") for chunk in table[name].chunks]
    arrays += [chunk.field(key) for chunk in table["args"].chunks
               for key in ("Collective name", "Process Group Name", "Process Group Description",
                           "Process Group Ranks", "dtype")]
    for array in arrays:
        if array.null_count != len(array):
            array.validate(full=True)


def _dictionary(column) -> tuple[np.ndarray, list]:
    """Codes (int32) and unique values (in order of first appearance) of a text column, UTF-8 checked."""
    encoded = pc.dictionary_encode(column)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks() if encoded.num_chunks != 1 else encoded.chunk(0)
    encoded.dictionary.validate(full=True)
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int32, copy=False), \
        encoded.dictionary.to_pylist()


def _first_seen(column) -> pd.Categorical:
    codes, uniques = _dictionary(column)
    return pd.Categorical.from_codes(codes, categories=pd.Index(uniques, dtype=_STR))


def _sorted_texts(column, *, keep: np.ndarray | None = None) -> pd.Categorical:
    """Categorical of an args text (of the ``keep`` rows when given), ``""`` where absent, categories the
    values present sorted, with ``""`` among them."""
    codes, uniques = _dictionary(pc.fill_null(column, ""))
    if keep is not None:
        codes = codes[keep]
        used = np.bincount(codes, minlength=len(uniques)) > 0 if len(uniques) else np.zeros(0, dtype=bool)
        uniques = [text if present else None for text, present in zip(uniques, used)]
    return sorted_texts(codes, uniques)
