"""``merged_trace(traceset, path=...)``: every rank of a job in one Chrome-trace JSON file.

Layout of the file (loadable by chrome://tracing, Perfetto UI and XProf's trace viewer)::

    {"displayTimeUnit": "ns", "baseTimeNanoseconds": T0, "traceName": ..., "traceEvents": [...]}

- one process per rank: ``pid`` = rank, named ``"rank N"`` (``process_name`` / ``process_sort_index``); rows
  whose rank is unknown (-1: NCCL-log lines of a communicator whose init the log lacks) form ``"rank unknown"``;
- per rank, one thread per original track, numbered 1, 2, ... in (lane, device, stream) order and named
  ``"gpu D stream S"`` / ``"cpu thread T"``; every row of the events table is one complete (``"X"``) event with
  its ``name``, its source ``cat`` (the reader's name when the source gave none) and args: our ``sl_category``
  and ``sl_dim``, GPU ``device``/``stream``, and the collective fields in Kineto's spelling; each call
  ``collective_bandwidth`` reports (the collective kernels of a GPU rank, the outermost comm ops of a CPU one) also
  carries ``busbw_gbps``, ``algbw_gbps``, ``link`` and ``efficiency`` (its row of
  ``report_sections.bandwidth_rows``, joined on rank, name, start and duration; a NaN is left out);
- four added threads per rank: ``sl: steps`` (one slice per step window), ``sl: categories`` (the exclusive
  attribution as a timeline: each ns of a step window under the label that wins it, by ``attribution``'s priority
  over the rank's label sets, so its per-window totals are the ``breakdown`` columns exactly),
  ``sl: pipeline bubbles`` (the rank's bubble set) and ``sl: critical path`` (the pieces of each step's
  cross-rank critical path that lie on this rank, ``"step N: label"``, at the rank's recorded times:
  ``critical_path``); all four read the trace set's ``Attribution``;
- flow arrows (``"ph": "s"`` -> ``"ph": "f"``, ``"bp": "e"``) from the last-arriving rank of every matched
  collective instance (``match_collectives``) to each other member: the arrow points from the rank that was
  waited for to the ranks that waited.

Times: ``ts = (start_ns - T0) / 1000`` and ``dur = dur_ns / 1000`` in µs written as decimal text with exactly three
decimals (``"ts": 1234.567``), so no ns is lost to floating point however large the absolute clock; each rank keeps
its recorded clock (no alignment is applied). T0 is the earliest start of any rank.

Reading it back. ``load`` reads any Chrome trace as *one* rank (Kineto writes one file per rank), so
``load(merged, rank=0)`` returns every original row with exact ``start_ns``/``dur_ns``, names, lanes, GPU devices
and streams and collective args -- all under rank 0, CPU thread ids replaced by track numbers, plus the added
tracks' rows (``cat`` ``sl_step``, ``sl_category``, ``sl_bubble``, ``sl_critical_path``). The file is for
viewers; analysis should load the per-rank traces.

Memory: events are formatted and written in chunks of ``CHUNK_ROWS`` rows, one string per row, never a dict per
event, so the writer holds the events table plus one chunk.
"""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from ..analyses.critical_path import critical_path
from ..analyses.traffic import bandwidth_rows
from ..attribution.core import RankAttribution, attribute
from ..base import intervals as iv
from ..base.errors import AttributionError, ProfilingError, TraceFormatError, TraceWarning
from ..matching.bandwidth import CATEGORIES
from ..matching.collectives import match_collectives
from ..table.partition import LABELS, segment_owners

CHUNK_ROWS = 200_000
ADDED_TRACKS = ("sl: steps", "sl: categories", "sl: pipeline bubbles", "sl: critical path")
_ADDED_CATS = {"sl: steps": "sl_step", "sl: categories": "sl_category", "sl: pipeline bubbles": "sl_bubble",
               "sl: critical path": "sl_critical_path"}
#: events-table column -> Kineto arg name (the ones ``readers.kineto`` reads back).
_ARG_NAMES = {"collective": "Collective name", "pg_name": "Process Group Name",
              "pg_desc": "Process Group Description", "pg_ranks": "Process Group Ranks", "pg_size": "Group size",
              "seq": "Seq", "correlation": "correlation", "external_id": "External id"}


def merged_trace(source, *, path: str | Path, progress: bool = False) -> Path:
    """Write the merged trace of ``source`` (a ``TraceSet``, an events table or an ``Attribution``) to ``path``
    and return it.

    ``path`` ending in ``.gz`` is gzip-compressed. ``progress`` shows a bar over the event chunks (tqdm).
    Raises ``TraceFormatError`` when ``path`` cannot be written.
    """

    attribution = attribute(source, caller="merged_trace")
    events = attribution.events
    path = Path(path)
    base = int(events["start_ns"].min()) if len(events) else 0
    tracks = _tracks(events)
    bandwidth = _bandwidth_args(attribution, source if hasattr(source, "files") and hasattr(source, "metadata")
                                else None)
    try:
        # level 1: the text is repetitive, so it already shrinks well; higher levels cost much more write time
        handle = gzip.open(path, "wt", compresslevel=1) if path.suffix == ".gz" else open(path, "w")
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot write the merged trace ({exc})") from exc
    with handle:
        # (a zero base is left out: the Kineto reader takes a 0 base for a missing one and says so)
        handle.write('{"displayTimeUnit": "ns", %s"traceName": "shardline merged trace",\n"traceEvents": [\n'
                     % (f'"baseTimeNanoseconds": {base}, ' if base else ""))
        first = True
        for line in _metadata_lines(tracks):
            handle.write(("" if first else ",\n") + line)
            first = False
        for chunk in _progress(range(0, len(events), CHUNK_ROWS), enabled=progress, what="merged trace"):
            lines = _event_lines(events.iloc[chunk:chunk + CHUNK_ROWS], tracks=tracks, base=base,
                                 extra=None if bandwidth is None else bandwidth[chunk:chunk + CHUNK_ROWS])
            if len(lines):
                handle.write(",\n" + ",\n".join(lines.tolist()))
        for line in _added_lines(attribution, tracks=tracks, base=base):
            handle.write(",\n" + line)
        for line in _flow_lines(attribution, tracks=tracks, base=base):
            handle.write(",\n" + line)
        handle.write("\n]}\n")
    return path


def _progress(iterable, *, enabled: bool, what: str):
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, desc=what, unit="chunk", leave=False)


def _tracks(events: pd.DataFrame) -> pd.DataFrame:
    """One row per (rank, lane, device, stream) with its thread number ``tid`` (1.. per rank) and name; the
    added tracks follow each rank's own."""
    keys = events[["rank", "lane", "device", "stream"]].astype({"lane": str}).drop_duplicates()
    keys = keys.sort_values(["rank", "lane", "device", "stream"]).reset_index(drop=True)
    keys["tid"] = keys.groupby("rank").cumcount() + 1
    keys["label"] = np.where(keys["lane"] == "gpu",
                             "gpu " + keys["device"].astype(str) + " stream " + keys["stream"].astype(str),
                             "cpu thread " + keys["stream"].astype(str))
    added = []
    for rank, last in keys.groupby("rank")["tid"].max().items():
        for k, name in enumerate(ADDED_TRACKS):
            added.append({"rank": rank, "lane": "sl", "device": -1, "stream": -1, "tid": last + 1 + k,
                          "label": name})
    return pd.concat([keys, pd.DataFrame(added)], ignore_index=True) if added else keys


def _metadata_lines(tracks: pd.DataFrame) -> list[str]:
    lines = []
    for rank in tracks["rank"].unique():
        rank = int(rank)
        label = f"rank {rank}" if rank >= 0 else "rank unknown"  # NCCL-log rows whose rank the log never said
        lines.append(json.dumps({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": label}}))
        lines.append(json.dumps({"ph": "M", "name": "process_sort_index", "pid": rank,
                                 "args": {"sort_index": rank}}))
    for row in tracks.itertuples(index=False):  # one line per track, not per event
        where = {"pid": int(row.rank), "tid": int(row.tid)}
        lines.append(json.dumps({"ph": "M", "name": "thread_name", **where, "args": {"name": row.label}}))
        lines.append(json.dumps({"ph": "M", "name": "thread_sort_index", **where,
                                 "args": {"sort_index": int(row.tid)}}))
    return lines


_FRACTIONS = np.array([f".{i:03d}" for i in range(1000)], dtype=object)


def _int_text(values) -> np.ndarray:
    """Decimal text of integers as a numpy object array (numpy's conversion; pandas' string dtypes are slower)."""
    return np.asarray(values).astype(np.int64).astype(str).astype(object)


def us_text(ns: np.ndarray) -> np.ndarray:
    """Integer ns -> µs as decimal text with exactly three decimals (exact for any int64)."""
    ns = np.asarray(ns, dtype=np.int64)
    negative = ns < 0
    # |ns| as unsigned, so the most negative int64 has a magnitude too
    mag = np.where(negative, (~ns).astype(np.uint64) + np.uint64(1), ns.astype(np.uint64))
    text = (mag // np.uint64(1000)).astype(str).astype(object) + _FRACTIONS[(mag % np.uint64(1000)).astype(np.int64)]
    return np.where(negative, "-" + text, text)


def _json_texts(column: pd.Series) -> np.ndarray:
    """JSON string literals of a categorical/string column, escaped once per distinct value."""
    cat = column.astype("category")
    texts = np.array([json.dumps(str(c)) for c in cat.cat.categories] + ['""'], dtype=object)
    codes = cat.cat.codes.to_numpy()
    return texts[np.where(codes < 0, len(texts) - 1, codes)]


_BANDWIDTH_KEYS = ("rank", "name", "start_ns", "dur_ns")


def _bandwidth_args(attribution, traceset) -> np.ndarray | None:
    """Per events-table row, the bandwidth args text (``', "busbw_gbps": ...'``; "" for rows without one), or
    None when no call has a bandwidth. One merge over the communication rows; numbers as shortest round-trip
    float text."""

    try:
        rows = bandwidth_rows(attribution, traceset=traceset)
    except ProfilingError as exc:  # the merged trace is still written, without the bandwidth args
        warnings.warn(f"merged_trace: no bandwidth args ({exc})", TraceWarning, stacklevel=3)
        return None
    if rows.empty:
        return None
    events = attribution.events
    pos = np.flatnonzero(events["category"].isin(CATEGORIES).to_numpy())
    keys = pd.DataFrame({"rank": events["rank"].to_numpy()[pos].astype(np.int64),
                         "name": events["name"].iloc[pos].astype(str).to_numpy(),
                         "start_ns": events["start_ns"].to_numpy()[pos].astype(np.int64),
                         "dur_ns": events["dur_ns"].to_numpy()[pos].astype(np.int64)})
    bw = rows[[*_BANDWIDTH_KEYS, "busbw_gbps", "algbw_gbps", "link", "efficiency"]].astype(
        {"rank": np.int64, "name": str, "start_ns": np.int64, "dur_ns": np.int64}).drop_duplicates(
        list(_BANDWIDTH_KEYS))
    hit = keys.merge(bw, how="left", on=list(_BANDWIDTH_KEYS))  # a left merge keeps the left order
    text = np.full(len(pos), "", dtype=object)
    for column in ("busbw_gbps", "algbw_gbps"):
        text = text + _float_arg(column, hit[column].to_numpy(dtype=np.float64))
    link = hit["link"].fillna("").astype(str)
    text = text + np.where((link != "").to_numpy(), ', "link": ' + _json_texts(link), "")
    text = text + _float_arg("efficiency", hit["efficiency"].to_numpy(dtype=np.float64))
    out = np.full(len(events), "", dtype=object)
    out[pos] = text
    return out


def _float_arg(key: str, values: np.ndarray) -> np.ndarray:
    finite = np.isfinite(values)
    return np.where(finite, f', "{key}": ' + np.where(finite, values, 0.0).astype(str).astype(object), "")


def _event_lines(chunk: pd.DataFrame, *, tracks: pd.DataFrame, base: int,
                 extra: np.ndarray | None = None) -> np.ndarray:
    if chunk.empty:
        return np.empty(0, dtype=object)
    keyed = chunk[["rank", "lane", "device", "stream"]].astype({"lane": str})
    tid = keyed.merge(tracks[["rank", "lane", "device", "stream", "tid"]], how="left",
                      on=["rank", "lane", "device", "stream"])["tid"].to_numpy()
    # comparisons on the categoricals themselves: converting 10^5 rows to strings costs more than writing them
    cat = np.where((chunk["cat"] == "").to_numpy(), _json_texts(chunk["source"]), _json_texts(chunk["cat"]))
    gpu = (chunk["lane"] == "gpu").to_numpy()
    args = ('"sl_category": ' + _json_texts(chunk["category"]) + ', "sl_dim": ' + _json_texts(chunk["dim"]))
    args = args + np.where(gpu, ', "device": ' + _int_text(chunk["device"]) + ', "stream": '
                           + _int_text(chunk["stream"]), "")
    for column, key in _ARG_NAMES.items():
        values = chunk[column]
        if values.dtype == "category":
            present = (values != "").to_numpy()
            text = _json_texts(values)
        else:
            present = (values != -1).to_numpy()
            text = _int_text(values)
        if present.any():
            args = args + np.where(present, f', "{key}": ' + text, "")
    nbytes = chunk["msg_bytes"].to_numpy()
    memcpy = chunk["category"].isin(("memcpy_h2d", "memcpy_d2h", "memcpy_d2d", "memset")).to_numpy() & (nbytes >= 0)
    args = args + np.where(memcpy, ', "bytes": ' + _int_text(nbytes), "")
    if extra is not None:
        args = args + extra
    return ('{"ph": "X", "pid": ' + _int_text(chunk["rank"]) + ', "tid": '
            + _int_text(tid) + ', "ts": ' + us_text(chunk["start_ns"].to_numpy() - base)
            + ', "dur": ' + us_text(chunk["dur_ns"].to_numpy()) + ', "name": ' + _json_texts(chunk["name"])
            + ', "cat": ' + cat + ', "args": {' + args + "}}")


def category_segments(source) -> pd.DataFrame:
    """The exclusive attribution of one rank's step windows as a timeline: rows step, label, start_ns, end_ns.

    ``source``: a ``RankAttribution``, or the events table of one rank. Each elementary segment inside a
    window goes to the first ``LABELS`` entry whose set covers it (idle when none), as in
    ``partition.partition``; adjacent segments with one label are joined. Summing a window's segments per
    label gives that window's ``breakdown`` columns exactly.
    """
    rank = _one_rank(source)
    if rank is None or not rank.has_work:
        return pd.DataFrame({"step": [], "label": [], "start_ns": [], "end_ns": []}).astype(
            {"step": "int64", "start_ns": "int64", "end_ns": "int64"})
    windows = rank.attributed_windows
    sets = rank.label_sets
    points = iv.distinct(np.concatenate([windows["start_ns"].to_numpy(), windows["end_ns"].to_numpy()]
                                        + [a for s in sets.values() for a in s]), scratch=True)
    seg_s, seg_e = points[:-1], points[1:]
    label = segment_owners(sets, points)  # what breakdown gives each segment
    frames = []
    for w in windows.itertuples(index=False):  # a few windows per rank
        inside = (seg_s >= w.start_ns) & (seg_e <= w.end_ns)
        s, e, lab = seg_s[inside], seg_e[inside], label[inside]
        if not len(s):
            continue
        new = np.concatenate([[True], (lab[1:] != lab[:-1]) | (s[1:] != e[:-1])])
        run = np.cumsum(new) - 1
        run_end = np.zeros(run[-1] + 1, dtype=np.int64)
        np.maximum.at(run_end, run, e)
        frames.append(pd.DataFrame({"step": int(w.step), "label": np.asarray(LABELS)[lab[new]],
                                    "start_ns": s[new], "end_ns": run_end}))
    if not frames:
        return pd.DataFrame({"step": pd.Series(dtype="int64"), "label": pd.Series(dtype="str"),
                             "start_ns": pd.Series(dtype="int64"), "end_ns": pd.Series(dtype="int64")})
    return pd.concat(frames, ignore_index=True)


def _one_rank(source):
    """The ``RankAttribution`` of ``source`` (itself, or the one rank of an events table; None: no rows)."""

    if isinstance(source, RankAttribution):
        return source
    ranks = attribute(source, caller="category_segments").ranks
    if len(ranks) > 1:
        raise AttributionError(f"category_segments takes one rank's events, got ranks {[r.rank for r in ranks]}")
    return ranks[0] if ranks else None


def _slice_lines(*, rank: int, tid: int, cat: str, names, start, end, base: int):
    """Complete events of one added track, yielded in chunks of ``CHUNK_ROWS`` lines."""
    start = np.asarray(start, dtype=np.int64)
    end = np.asarray(end, dtype=np.int64)
    names = _json_texts(pd.Series(names, dtype="category"))
    for lo in range(0, len(start), CHUNK_ROWS):
        part = slice(lo, lo + CHUNK_ROWS)
        yield "\n,".join((f'{{"ph": "X", "pid": {rank}, "tid": {tid}, "ts": ' + us_text(start[part] - base)
                           + ', "dur": ' + us_text(end[part] - start[part]) + ', "name": ' + names[part]
                           + f', "cat": "{cat}"}}').tolist())


def _added_lines(attribution, *, tracks: pd.DataFrame, base: int):

    tid_of = {(r.rank, r.label): r.tid for r in tracks[tracks["lane"] == "sl"].itertuples(index=False)}
    path = critical_path(attribution)
    for rank in attribution.working:
        windows = rank.windows
        yield from _slice_lines(rank=rank.rank, tid=tid_of[(rank.rank, "sl: steps")], cat="sl_step",
                                names=[f"step {s}" for s in windows["step"]], start=windows["start_ns"],
                                end=windows["end_ns"], base=base)
        segments = category_segments(rank)
        yield from _slice_lines(rank=rank.rank, tid=tid_of[(rank.rank, "sl: categories")], cat="sl_category",
                                names=segments["label"], start=segments["start_ns"], end=segments["end_ns"],
                                base=base)
        bubble_s, bubble_e = rank.bubble
        yield from _slice_lines(rank=rank.rank, tid=tid_of[(rank.rank, "sl: pipeline bubbles")], cat="sl_bubble",
                                names=["bubble"] * len(bubble_s), start=bubble_s, end=bubble_e, base=base)
        mine = path[path["rank"] == rank.rank]  # the chain is on the aligned clock: back to this rank's
        recorded = mine["start_ns"].to_numpy(np.int64) + mine["offset_ns"].to_numpy(np.int64)
        yield from _slice_lines(rank=rank.rank, tid=tid_of[(rank.rank, "sl: critical path")],
                                cat="sl_critical_path", names=("step " + mine["step"].astype(str) + ": "
                                                               + mine["label"].astype(str)).to_numpy(),
                                start=recorded, end=recorded + mine["dur_ns"].to_numpy(np.int64), base=base)


def collective_flows(source) -> pd.DataFrame:
    """Flow arrows of the merged trace: one row per (instance, waiting member) with the source (last arriver)
    and target calls' rank, lane, device, stream and recorded start_ns. Empty when nothing matches.
    ``source``: an ``Attribution``, a ``TraceSet`` or an events table."""

    attribution = attribute(source, caller="collective_flows")
    events = attribution.events
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # uneven call counts: matched as far as possible, said by the core
            matched = match_collectives(attribution)
    except AttributionError:
        return pd.DataFrame()
    matched = matched[matched["members"] > 1].copy()
    if matched.empty:
        return pd.DataFrame()
    matched["start_ns"] = matched["start_ns"] + matched["offset_ns"]  # back to the rank's recorded clock
    calls = events[["rank", "lane", "device", "stream", "start_ns", "dur_ns", "category"]].astype(
        {"lane": str, "category": str, "rank": np.int64}).drop_duplicates(["rank", "start_ns", "dur_ns", "category"])
    located = matched.merge(calls, how="inner", on=["rank", "start_ns", "dur_ns", "category"])
    key = ["group", "category", "instance"]
    src = located[located["is_last"]][key + ["rank", "lane", "device", "stream", "start_ns"]]
    dst = located[~located["is_last"]][key + ["rank", "lane", "device", "stream", "start_ns"]]
    return src.merge(dst, on=key, suffixes=("_src", "_dst")).reset_index(drop=True)


def _flow_lines(attribution, *, tracks: pd.DataFrame, base: int) -> list[str]:
    flows = collective_flows(attribution)
    if flows.empty:
        return []
    key = ["rank", "lane", "device", "stream"]
    lookup = tracks[key + ["tid"]]
    out = []
    for end in ("src", "dst"):
        cols = {f"{k}_{end}": k for k in key}
        tid = flows[list(cols)].rename(columns=cols).merge(lookup, how="left", on=key)["tid"].to_numpy()
        flows[f"tid_{end}"] = tid
    names = ('"' + flows["category"].to_numpy().astype(str).astype(object) + " "
             + np.array([json.dumps(str(g))[1:-1] for g in flows["group"]], dtype=object) + "#"
             + _int_text(flows["instance"]) + '"')
    ids = _int_text(np.arange(1, len(flows) + 1))
    for phase, end, extra in (("s", "src", ""), ("f", "dst", ', "bp": "e"')):
        lines = (f'{{"ph": "{phase}", "id": ' + ids + ', "pid": ' + _int_text(flows[f"rank_{end}"])
                 + ', "tid": ' + _int_text(flows[f"tid_{end}"]) + ', "ts": '
            + us_text(flows[f"start_ns_{end}"].to_numpy() - base) + ', "name": ' + names
            + ', "cat": "sl_collective"' + extra + "}")
        out.extend(lines.tolist())
    return out
