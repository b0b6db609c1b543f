"""``load(path) -> TraceSet``: every trace, log and export of one job, read into one events table.

``path`` is a trace file, a folder of per-rank files, or a whole run directory (searched recursively). Files
are recognised by content and extension (``readers.sniff``): Kineto JSON (``.json``, ``.json.gz``,
``.pt.trace.json(.gz)``), NCCL_DEBUG logs (``.log``/``.txt`` with NCCL lines), Nsight Systems SQLite exports,
flight-recorder JSON dumps and NCCL profiler-plugin dumps; anything else is ignored. The rows are
classified (``classify.classify_events``, with the ``layout`` given) before they are returned; the trace set
keeps that layout and its attributions (``attribution.attribute``), so each is computed once.

``load(path, op_args=True)`` also keeps the op args the schema's columns drop (``schema.OP_ARG_COLUMNS``:
shapes, a collective's element counts, dtype and splits), as extra columns of the same table: what
calibration and ``collective_bandwidth`` read. Without it the table has the schema's columns only.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import tempfile
import warnings as _warnings
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..base.errors import MissingRankError, MixedJobsError, ProfilingError, TraceFormatError, TraceWarning
from ..base.schema import (
    COLUMNS,
    OP_ARG_COLUMNS,
    category_texts,
    check_events,
    conform,
    empty_events,
    has_op_args,
    sorted_categorical,
    text_dtype,
)
from ..readers import Damage, Format, ReadResult, sniff
from ..readers._buffers import prefetch
from ..readers._kineto_columns import PYTHON_CATS, device_lane_note, device_lane_suspects
from ..readers._plan import plan
from ..readers.join import join_nccl_log
from .classify import classify_in_place
from .dims import check_layout

#: Readers by format, imported on first use so a Kineto-only job never imports sqlite3 or the log parser.
_READERS = {
    Format.KINETO: ("shardline.profiling.readers.kineto", "read_kineto"),
    Format.NCCL_LOG: ("shardline.profiling.readers.nccl_log", "read_nccl_log"),
    Format.NSYS: ("shardline.profiling.readers.nsys", "read_nsys"),
    Format.FLIGHT_RECORDER: ("shardline.profiling.readers.flight_recorder", "read_flight_recorder"),
    Format.NCCL_PROFILER: ("shardline.profiling.readers.nccl_profiler", "read_nccl_profiler"),
}
#: Formats whose rows come with their own per-row ranks (one file, many ranks); they never clash with traces.
_MULTI_RANK = (Format.NCCL_LOG, Format.NCCL_PROFILER)


@dataclass(frozen=True)
class TraceSet:
    """One job's events, all ranks.

    ``events``: the events table (``schema.COLUMNS``, checked with ``check_events``), classified.
    ``ranks``: sorted global ranks present. ``files``: each file read -> the ranks its rows carry (``-1`` for
    NCCL-log rows whose rank could not be told). ``metadata``: rank -> what the files said about it
    (``distributedInfo``, ``baseTimeNanoseconds``, ``deviceProperties``, the source file...).
    ``warnings``: every partial read, also issued as :class:`TraceWarning`. ``skipped``: recognised files
    that hold no events (an execution trace, a memory timeline) -> what they are. ``layout``: the parallel
    degrees (``dict(tp=, cp=, dp=, pp=)``) the events were classified with, or None. ``attributions``: the
    ``attribution.Attribution`` of each layout asked for, kept by ``attribute`` (not to be filled by hand).
    ``reread_op_args``: whether an analysis that wants the op args a set loaded without them lacks may read
    its Kineto files again for them (``read_op_args``); False keeps every analysis to the loaded table (the
    CLI's choice for large sets, see ``cli.OP_ARGS_MAX_BYTES``).
    """

    events: pd.DataFrame
    ranks: tuple[int, ...]
    files: dict[Path, tuple[int, ...]]
    metadata: dict[int, dict] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    skipped: dict[Path, str] = field(default_factory=dict)
    layout: Mapping[str, int] | None = None
    reread_op_args: bool = True
    attributions: dict = field(default_factory=dict, init=False, repr=False, compare=False)


def load(path: str | Path, *, rank: int | Mapping[str | Path, int] | None = None,
         keep_python: bool = False, classify: bool = True, workers: int | None = None,
         layout: Mapping[str, int] | None = None, op_args: bool = False) -> TraceSet:
    """Read every recognised file under ``path`` into one :class:`TraceSet`.

    ``rank`` supplies ranks a trace does not record itself: an int for a single file, or a mapping from file
    path (or file name) to rank for a folder. A trace's own ``distributedInfo.rank`` always wins; then
    ``rank``; then a rank written in the file name (``rank-3``, ``rank_3``, ``worker3``); a trace with none
    raises :class:`MissingRankError` naming it. Files of different jobs (different world sizes or default
    groups, two files claiming one rank) raise :class:`MixedJobsError` naming them. ``keep_python`` keeps
    ``python_function`` stack events (dropped by default: no analysis uses them). ``classify=False`` leaves
    ``category``/``dim`` empty. ``layout``: the parallel degrees (``dict(tp=2, dp=4)``) that name the dims of
    groups whose description does not (``classify``); kept on the trace set. ``op_args``: add the op-args
    columns (``schema.OP_ARG_COLUMNS``; "" / -1 on rows of other formats). ``workers``: processes reading
    files in parallel (default: one per core when several large files are read; for small ones a thread of
    this process reads, gunzips and scans the next file while this one decodes; 1 reads one file after
    another in this process).
    """
    root = Path(path)
    if layout is not None:
        check_layout(layout)
        layout = dict(layout)
    files = _discover(root)
    if isinstance(rank, int) and not isinstance(rank, bool) and len(files) > 1:
        raise TraceFormatError(f"{root}: rank={rank} given for a folder of {len(files)} trace files; pass a "
                               "{file: rank} mapping instead")
    jobs = [(file, fmt, _rank_for(file, rank), keep_python, bool(op_args)) for file, fmt in files]
    results = [(job[0], job[1], result) for job, result in zip(jobs, _read_all(jobs, workers=workers))]
    _check_one_job(results)
    notes = [w for _, _, result in results for w in result.warnings]
    for note in notes:
        _warnings.warn(note, TraceWarning, stacklevel=2)
    metadata: dict[int, dict] = {}
    file_ranks: dict[Path, tuple[int, ...]] = {}
    for file, _fmt, result in results:
        for r, meta in result.metadata.items():
            metadata.setdefault(r, {}).update({**meta, "files": [*metadata.get(r, {}).get("files", []), file]})
        ranks_here = np.unique(_table_of(result)["rank"]) if result.n_events else list(result.metadata)
        file_ranks[file] = tuple(sorted(int(r) for r in ranks_here))
    frames = [_table_of(result) for _, _, result in results if result.n_events]
    for _, _, result in results:
        result.events = None  # the concatenation below is the only copy kept
    events = _concat(frames, op_args=op_args)
    del frames
    if (events["source"] == "nccl_log").any() and (events["source"] == "kineto").any():

        events, joined_notes = join_nccl_log(events)
        for note in joined_notes:
            _warnings.warn(note, TraceWarning, stacklevel=2)
        notes += joined_notes
    lane_notes = _device_lane_notes(events, file_ranks)
    for note in lane_notes:
        _warnings.warn(note, TraceWarning, stacklevel=2)
    notes += lane_notes
    if classify:  # checks the table (check_events) before it fills category and dim
        events = classify_in_place(events, layout=layout)  # the loaded table is ours alone: no copy
    else:
        check_events(events)
    ranks = tuple(sorted(int(r) for r in events["rank"].unique() if r >= 0)) if len(events) else tuple(
        sorted(r for r in metadata if r >= 0))
    skipped = {file: result.skipped for file, _, result in results if result.skipped}
    return TraceSet(events=events, ranks=ranks, files=file_ranks, metadata=metadata, warnings=tuple(notes),
                    skipped=skipped, layout=layout)


def read_op_args(source) -> pd.DataFrame:
    """The op-args columns (``schema.OP_ARG_COLUMNS``) of the events of ``source`` (a ``TraceSet``, or an events
    table), row for row (the table's index).

    A table read with ``op_args=True`` has them. For a trace set loaded without, each of its Kineto traces is
    read again with them (one more decode of every file: ``load(path, op_args=True)`` decodes once) and they
    are set on that file's rows. Rows that no file gives them for hold "" / -1: rows of other formats, every
    row of a bare events table, and those of a file whose rows no longer match the table's (a
    ``TraceWarning`` names it)."""
    events = getattr(source, "events", source)
    if has_op_args(events):
        return pd.DataFrame({column: events[column] for column in OP_ARG_COLUMNS}, copy=False)
    if not getattr(source, "reread_op_args", True):  # the loader chose the table alone (a large set)
        return pd.DataFrame({column: _placed(len(events), [], OP_ARG_COLUMNS[column]) for column in OP_ARG_COLUMNS},
                            index=events.index, copy=False)

    parts: dict[str, list] = {column: [] for column in OP_ARG_COLUMNS}
    rank, kineto = events["rank"].to_numpy(), (events["source"] == Format.KINETO.value).to_numpy()
    for file, ranks in (getattr(source, "files", None) or {}).items():
        mine = np.flatnonzero(kineto & (rank == ranks[0])) if len(ranks) == 1 else []
        if not len(mine):
            continue
        keep_python = bool(events["cat"].isin(list(PYTHON_CATS)).to_numpy()[mine].any())
        try:
            got = _read(Path(file), Format.KINETO, rank=int(ranks[0]), keep_python=keep_python,
                        op_args=True).events
        except (ProfilingError, OSError) as exc:
            got, why = None, f"{type(exc).__name__}: {exc}"
        else:
            why = "its rows differ from the loaded table's"
        if got is None or len(got) != len(mine) or any(
                not np.array_equal(got[c].to_numpy(), events[c].to_numpy()[mine]) for c in ("start_ns", "dur_ns")):
            _warnings.warn(f"{file}: op args not read again ({why}); its shapes, dtypes and split sizes are "
                           "unknown", TraceWarning, stacklevel=2)
            continue
        for column in OP_ARG_COLUMNS:
            parts[column].append((mine, got[column].array if OP_ARG_COLUMNS[column] == "category"
                                  else got[column].to_numpy()))
    return pd.DataFrame({column: _placed(len(events), parts[column], OP_ARG_COLUMNS[column])
                         for column in OP_ARG_COLUMNS}, index=events.index, copy=False)


def _placed(n: int, parts: list, dtype: str):
    """A column of ``n`` rows: each part's values (positions, values) at its positions, "" / -1 elsewhere."""
    if dtype != "category":
        out = np.full(n, -1, dtype=dtype)
        for at, values in parts:
            out[at] = values
        return out
    texts = {"": 0}
    codes = np.zeros(n, dtype=np.int32)
    for at, values in parts:
        remap = np.array([texts.setdefault(t, len(texts)) for t in category_texts(values.categories)] + [0],
                         dtype=np.int32)
        codes[at] = remap[np.where(values.codes < 0, len(values.categories), values.codes)]
    return sorted_categorical(codes, list(texts))


def _discover(root: Path) -> list[tuple[Path, Format]]:
    if not root.exists():
        raise TraceFormatError(f"{root}: no such file or folder")
    if root.is_file():
        fmt = sniff(root)
        if fmt is None:
            raise TraceFormatError(f"{root}: not a Kineto trace, NCCL_DEBUG log, Nsight SQLite export, flight-"
                                   "recorder or NCCL profiler dump (by content and extension)")
        return [(root, fmt)]
    found = []
    for file in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        if _derived_by_shardline(file.relative_to(root)):
            continue
        fmt = sniff(file)
        if fmt is not None:
            found.append((file, fmt))
    if not found:
        raise TraceFormatError(f"{root}: no trace, log or export found in this folder")
    return found


def _derived_by_shardline(relative: Path) -> bool:
    """Files shardline derived from the traces (the TensorBoard plugin's merged trace and trace copies under
    ``plugins/shardline/``) would count every rank twice: a folder search skips them."""
    parts = relative.parts
    return any(parts[i:i + 2] == ("plugins", "shardline") for i in range(len(parts) - 1))


def _rank_for(file: Path, rank) -> int | None:
    if rank is None or isinstance(rank, int):
        return rank
    for key in (file, str(file), file.name):
        if key in rank:
            return int(rank[key])
    return None


#: Below this many bytes in all, forking workers costs more than it saves.
_PARALLEL_MIN_BYTES = 64 << 20


def _read_all(jobs: list, *, workers: int | None) -> list[ReadResult]:
    """Read every file, in a pool of forked processes when there are several big ones and several cores.

    Reading is CPU-bound (JSON decoding), so files are the natural unit of parallelism. A worker writes its
    columns to files (see ``_read_job_spilled``); when the workers already fill every core, each parses in
    one thread (Arrow's pool would only oversubscribe the cores).
    """
    total = sum(file.stat().st_size for file, *_ in jobs)
    cores = os.cpu_count() or 1
    if workers is None and total < _PARALLEL_MIN_BYTES and cores > 1:
        return _read_prefetched(jobs)
    if workers is None:
        workers = min(len(jobs), cores) if total >= _PARALLEL_MIN_BYTES else 1
    if workers <= 1 or len(jobs) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [_read_job(job) for job in jobs]
    # Largest files first, so one huge file does not start last.
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i][0].stat().st_size)
    with tempfile.TemporaryDirectory(prefix="shardline-load-") as spill:
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
            tasks = [(jobs[i], Path(spill) / str(i)) for i in order]
            done = dict(zip(order, pool.map(_read_job_spilled, tasks)))
        # The workers have exited; their columns are files, mapped here and copied once by the concatenation.
        return [_unspill(done[i]) for i in range(len(jobs))]


def _read_job(job: tuple, prefetched=None) -> ReadResult:
    file, fmt, rank, keep_python, op_args = job
    return _read(file, fmt, rank=rank, keep_python=keep_python, op_args=op_args, prefetched=prefetched)


def _read_prefetched(jobs: list) -> list[ReadResult]:
    """Small files (even one), several cores: a thread reads, gunzips and natively scans the next Kineto
    trace (file reads, zlib and the scanner's events pass run without the GIL) while this one builds the
    columns of the current one, and, before the first, imports the readers. A forked pool would cost more to
    start than it saves, and a thread per file would fight over the GIL for the Python part of decoding. One
    file ahead at most, and only a trace the native scanner reads whole (at most 64 MB), so a big trace is
    never held ahead of its turn."""

    # Every file planned from disk (is it worth reading ahead, and mapped?) before the thread starts: a file
    # opened here while the thread holds the GIL would wait for it (up to the switch interval) on each call.
    plans = [plan(job[0], op_args=job[4]) if job[1] is Format.KINETO else None for job in jobs]

    def fetch(index: int):
        if index < len(jobs) and plans[index] is not None:
            planned = plans[index]
            if planned.prefetch:
                # Its plan goes along: every Python step the thread takes waits for the GIL this thread holds.
                return pool.submit(prefetch, jobs[index][0], mapped=planned.mapped, op_args=planned.op_args)
        return None  # the reader reads it itself, in its turn

    results = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardline-prefetch") as pool:
        ahead = fetch(0)
        for fmt in dict.fromkeys(job[1] for job in jobs):  # import the readers while the first file is read
            _reader(fmt)
        for index, job in enumerate(jobs):
            current, ahead = ahead, fetch(index + 1)
            results.append(_read_job(job, prefetched=None if current is None else current.result()))
    return results


def _read_job_spilled(task: tuple) -> ReadResult:
    """A worker's read, its events written column by column to ``.npy`` files instead of being pickled
    back: a pickled frame would be a second copy in the worker and a third in the parent's pipe buffer."""
    job, folder = task
    _worker_malloc()
    result = _read_job(job)
    folder.mkdir()
    frame, columns = result.events, {}
    for column in frame.columns:
        values = frame[column]
        if isinstance(values.dtype, pd.CategoricalDtype):
            np.save(folder / f"{column}.npy", values.cat.codes.to_numpy())
            columns[column] = [str(c) for c in values.cat.categories]
        else:
            np.save(folder / f"{column}.npy", values.to_numpy())
            columns[column] = None
    result.events = (folder, columns)
    return result


def _worker_malloc() -> None:
    """In a reader worker (a forked process of ours, gone after the read): big blocks straight from mmap.

    glibc raises its mmap threshold after the first big free, after which the decoder's ~MB temporaries
    land on the heap, fragment it and stay resident; a fixed threshold returns each one to the OS when it
    is freed. Only the worker is affected, never the caller's process.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 256 << 10)
    except (OSError, AttributeError):
        pass


_M_MMAP_THRESHOLD = -3


def _unspill(result: ReadResult) -> ReadResult:
    """The frame of a spilled worker result, its columns memory-mapped from the files (read-only)."""
    folder, columns = result.events
    out = {}
    for column, categories in columns.items():
        values = np.load(folder / f"{column}.npy", mmap_mode="r")
        out[column] = values if categories is None else pd.Categorical.from_codes(
            values, categories=pd.Index(categories, dtype=_STR_DTYPE))
    result.events = pd.DataFrame(out, copy=False)
    return result


def _reader(fmt: Format):
    module, function = _READERS[fmt]
    return getattr(importlib.import_module(module), function)


def _device_lane_notes(events: pd.DataFrame, file_ranks: dict[Path, tuple[int, ...]]) -> list[str]:
    """Never a silent CPU-only analysis of a device trace: the ranks whose device activity is not read as
    device lanes, or that call a device runtime but record no device activity (``device_lane_note``), one
    warning per distinct note naming its ranks and a file of theirs. Each rank is looked at only when the
    set's categories give cause (most sets: none, or every rank has device rows)."""
    if not len(events) or not isinstance(events["cat"].dtype, pd.CategoricalDtype):
        return []
    cats = events["cat"].array
    codes = np.asarray(cats.codes)
    texts = category_texts(cats.categories)
    present = np.bincount(codes[codes >= 0], minlength=len(texts))
    unread, runtime = device_lane_suspects([t for t, n in zip(texts, present.tolist()) if n])
    if not (unread or runtime):
        return []
    rank = events["rank"].to_numpy()
    gpu = (events["lane"] == "gpu").to_numpy()
    with_device = set(pd.unique(rank[gpu]).tolist())
    suspects = [r for r in pd.unique(rank).tolist() if unread or r not in with_device]
    by_note: dict[str, list[int]] = {}
    for r in suspects:
        mine = rank == r
        counts = np.bincount(codes[mine & (codes >= 0)], minlength=len(texts)).tolist()
        note = device_lane_note({t: n for t, n in zip(texts, counts) if n}, on_device=r in with_device)
        if note is not None:
            by_note.setdefault(note, []).append(int(r))
    out = []
    for note, ranks in by_note.items():
        files = sorted(str(f) for f, held in file_ranks.items() if set(held) & set(ranks))
        where = files[0] + (f" and {len(files) - 1} more files" if len(files) > 1 else "") if files else "trace"
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {sorted(ranks)}"
        out.append(f"{where}: {who}: {note}")
    return out


def _read(file: Path, fmt: Format, *, rank: int | None, keep_python: bool, op_args: bool = False,
          prefetched=None) -> ReadResult:
    reader = _reader(fmt)
    options = {"keep_python": keep_python, "op_args": op_args, "prefetched": prefetched} \
        if fmt is Format.KINETO else {}
    result = reader(file, rank=rank, **options)
    if op_args and fmt is not Format.KINETO:  # no op args in these formats: the columns, empty
        result.events = conform(result.events, op_args=True)
    if fmt not in _MULTI_RANK and result.skipped is None and -1 in result.metadata:
        damage = next((note for note in result.warnings if isinstance(note, Damage)), None)
        if damage is not None:  # the rank went with the damaged part: the damage is the cause to report
            raise TraceFormatError(f"{file}: {damage.cause}; no rank in what is left nor in the file name" + (
                f": load(path, rank=N) reads the {result.n_events} events before the damage" if result.n_events
                else ", and no event"))
        raise MissingRankError(f"{file}: the rank is not recorded (no distributedInfo.rank, no rank in the file "
                               "name); pass load(path, rank=N), or rank={file: N, ...} for a folder")
    return result


def _check_one_job(results: list[tuple[Path, Format, ReadResult]]) -> None:
    """Refuse files that cannot belong to one job: one rank claimed twice, or disagreeing job descriptions."""
    owner: dict[int, Path] = {}
    jobs: dict[tuple, list[Path]] = {}
    for file, fmt, result in results:
        if fmt in _MULTI_RANK or result.skipped:
            continue
        for r, meta in result.metadata.items():
            if r in owner and owner[r] != file:
                raise MixedJobsError(f"rank {r} is claimed by two files: {owner[r]} and {file}; load them "
                                     "separately (or move one out of the folder)")
            owner[r] = file
            jobs.setdefault(_job_key(meta), []).append(file)
    known = {key: paths for key, paths in jobs.items() if key != (None, None, None)}
    if len(known) > 1:
        lines = "; ".join(f"world_size={k[0]} backend={k[1]} default group={k[2]}: {[str(p) for p in v]}"
                          for k, v in known.items())
        raise MixedJobsError(f"files of different jobs in one load: {lines}")
    for file, fmt, result in results:
        for r, meta in result.metadata.items():
            world = _job_key(meta)[0]
            if isinstance(world, int) and r >= world and fmt not in _MULTI_RANK:
                raise MixedJobsError(f"{file}: rank {r} is outside world_size {world}")


def _job_key(meta: dict) -> tuple:
    info = meta.get("distributedInfo")
    if not isinstance(info, dict):
        return (None, None, None)
    default = None
    for group in info.get("pg_config") or []:
        if isinstance(group, dict) and str(group.get("pg_name")) == "0":
            default = str(group.get("ranks"))
    return (info.get("world_size"), info.get("backend"), default)


def _table_of(result: ReadResult):
    """A read's rows as ``_concat`` takes them: its columns where the reader handed columns (no frame built),
    else its frame."""
    return result.columns if result.columns is not None else result.events


def _concat(frames: list, *, op_args: bool = False) -> pd.DataFrame:
    """Concatenate event frames (or readers' column dicts, ``ReadResult.columns``) column by column, keeping
    categoricals categorical (pandas would fall back to object) and making exactly one copy of the data. The
    frames are consumed: each column is deleted from them once joined, so the peak is one copy plus one column,
    not two copies. ``op_args``: the frames carry the op-args columns, and so does the result."""
    if not frames:
        return conform(empty_events(), op_args=op_args)
    if len(frames) == 1:
        if isinstance(frames[0], dict):
            return pd.DataFrame(frames[0], copy=False)
        frame = frames[0].reset_index(drop=True)
        for column in frame.columns:  # a spilled worker's columns are maps of files: own them
            values = frame[column]
            if not isinstance(values.dtype, pd.CategoricalDtype) and _is_mapped(values.to_numpy()):
                frame[column] = np.array(values.to_numpy())
        return frame
    out = {}
    # Freeing each joined column keeps the peak at one copy; it costs a block-manager update per column and
    # frame, which only pays on big sets.
    big = sum(len(f) if isinstance(f, pd.DataFrame) else len(f["rank"]) for f in frames) >= 1_000_000
    for column, dtype in ({**COLUMNS, **OP_ARG_COLUMNS} if op_args else COLUMNS).items():
        parts = [f[column] for f in frames]
        if dtype == "category":
            out[column] = union_texts([_text_categorical(p) for p in parts])
        else:
            out[column] = np.concatenate([np.asarray(p, dtype=dtype) if isinstance(p, np.ndarray)
                                          else p.to_numpy(dtype=dtype) for p in parts])
        del parts
        if big:
            for frame in frames:  # the caller's frames are spent: free each column once it is joined
                del frame[column]
    return pd.DataFrame(out, copy=False)


def union_texts(parts: list[pd.Categorical]) -> pd.Categorical:
    """``union_categoricals(parts)`` for categoricals of text categories (same result: the first part's
    categories, then each later part's new ones in its order), without pandas' per-part overhead."""
    first = parts[0].dtype
    if all(part.dtype is first for part in parts):  # one shared dtype (a fixed vocabulary): codes only
        return pd.Categorical.from_codes(np.concatenate([part.codes for part in parts]), dtype=first,
                                         validate=False)
    ids: dict[str, int] = {}
    remaps = [[ids.setdefault(text, len(ids)) for text in category_texts(part.categories)] for part in parts]
    # The codes are written once, straight into the narrowest type pandas keeps for this many categories.
    width = next(t for t in (np.int8, np.int16, np.int32, np.int64) if len(ids) < np.iinfo(t).max)
    codes = np.empty(sum(len(part) for part in parts), dtype=width)
    at = 0
    for part, remap in zip(parts, remaps):
        # One past the part's last code holds -1, so a missing value (code -1) stays missing.
        codes[at:at + len(part)] = np.array([*remap, -1], dtype=width)[part.codes]
        at += len(part)
    return pd.Categorical.from_codes(codes, dtype=text_dtype(list(ids)), validate=False)


def _is_mapped(array: np.ndarray) -> bool:
    while array is not None:
        if isinstance(array, np.memmap):
            return True
        array = array.base if isinstance(array, np.ndarray) else None
    return False


def _text_categorical(column: pd.Series) -> pd.Categorical:
    """The column as a categorical whose categories have pandas' default string dtype (readers may differ:
    object vs str categories cannot be unioned)."""
    values = column if isinstance(column, pd.Categorical) else column.array if column.dtype == "category" \
        else pd.Categorical(column.astype(str))
    categories = values.categories
    if categories.dtype != _STR_DTYPE:
        values = pd.Categorical.from_codes(values.codes, categories=categories.astype(str).astype(_STR_DTYPE))
    return values


_STR_DTYPE = pd.Index(["x"]).dtype
