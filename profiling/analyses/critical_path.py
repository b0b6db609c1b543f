"""The critical path of each step across ranks: the chain of work (and waiting) that decided when it ended.

One clock. Every time here is on the aligned clock of ``collectives.match_collectives``
(``ClockAlignment.ENDS``): rank r's recorded time ``t`` reads ``t - offset_r`` with ``offset_r`` the median
difference of its collectives' ends from the lowest rank's (0 for every rank of a trace without collectives).
``p2p.match_p2p`` aligns with the same offsets, so a receive's wait and its send's start are on this clock
too. The chain carries ``offset_ns`` per row: the rank's recorded time is ``start_ns + offset_ns``.

What a rank is doing at each ns is the breakdown's partition (``attribution``, ``partition.LABELS``
priority: compute > exposed collectives > copies > bubble > p2p > sync > idle), refined where a
communication label covers the ns:

- a collective category ``c`` (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, barrier,
  other_comm): ``"c wait"`` where the ns lies in a matched call's wait ``[arrival, arrival + wait_ns)`` and
  in no other matched call's transfer of ``c``, ``"c transfer"`` where it lies in a transfer, ``"c unmatched"``
  where no matched call of ``c`` covers it (``match_collectives`` did not pair it);
- p2p (the ``p2p_send``/``p2p_recv`` labels): ``"p2p transfer"`` inside a receive's transfer part
  (``match_p2p``; an unmatched receive is all transfer), else ``"p2p wait"`` inside a receive's wait, else
  ``"p2p send"`` (a send with no receive of this rank around it), ``"p2p unmatched"`` (a receive
  ``match_p2p`` does not hold: not a pipeline dim);
- every other label keeps its name: ``compute``, ``memcpy_h2d``, ``memcpy_d2h``, ``memcpy_d2d``, ``memset``,
  ``bubble``, ``sync``, ``idle``.

*Busy* (``busy`` column, ``BUSY_LABELS``): compute, copies, memset, every transfer, ``p2p send`` and the
unmatched comm labels -- the rank was doing that work, so the path runs through it. The others (``c wait``,
``p2p wait``, ``bubble``, ``sync``, ``idle``) are waiting: where the walk knows whom the rank waited for (a
matched collective's last arriver, a matched receive's sender) it jumps to that rank; elsewhere the wait
stays on the path on its rank (*idle on path*: ``idle``, ``sync``, an annotation ``bubble``, a skipped wait).

The walk, per step s:

1. Start: among the ranks with a window for s (``RankAttribution.attributed_windows``, aligned), the one
   whose window ends last (ties: the lowest rank), at that end.
2. On rank r at time t, walk back through r's labelled timeline until the first *jump segment* met, at
   J = min(its end, t) with ``window start of r < J``: emit r's runs of ``[J, t)`` and continue on the rank
   the segment waits for, at J. Without one, emit ``[window start of r, t)`` and stop: the path starts there
   (a rank without a window for s, or reached at or before its window start, stops the walk where it was
   reached).
3. Jump segments of r: its ``c wait`` segments, each waiting for the last arriver (``is_last``) of the
   matched call of ``c`` whose wait ``[arrival, arrival + wait_ns)`` covers it, and its ``bubble`` /
   ``p2p wait`` segments inside a matched receive's wait ``[start, start + wait_ns)``, waiting for the
   sender. The walk usually meets a wait at its end -- the last arrival (the call's arrival on that rank),
   the send's start (``match_p2p`` clips it to the receive) -- but where the end of a wait was hidden under
   higher-priority work (compute on another stream) it meets the wait earlier, at time t, and jumps there:
   at t this rank was blocked on that one, so what that one was doing at t is what the path waited for.
   Targets must be other ranks with work; waits of an unmatched call, or of a bubble from ``sl:pp``
   annotations, are no jump segments and stay on the path (idle on path).
4. Ties, deterministic: a segment covered by waits for several ranks waits for the lowest of them. A jump
   to a (rank, time) the walk already jumped to in this step is skipped (the next earlier jump segment is
   taken, the skipped wait stays on the path), so the walk always ends.

The emitted pieces tile ``[path start, path end)`` exactly in integer ns, each row one rank and one label
(checked). ``dim`` is the parallel dimension (``dim`` column of the comm rows: tp, cp, dp, pp, ep, world,
unknown) of the rank's rows of the run's category covering it (several: the first by name); "" for
non-communication labels.

API: ``critical_path(source)`` -> the chain (``CHAIN_COLUMNS``, all steps, kept on the attribution);
``critical_path_summary(chain, by=...)`` -> totals per step and ``by`` (default rank, label, dim:
``SUMMARY_COLUMNS``) with their share of the step's path; ``describe(summary, step)`` -> one line ("step 3,
path 12.1 ms: 41% rank 7 compute, 18% rank 2 tp all-reduce transfer, ...").
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np
import pandas as pd

from ..attribution.core import attribute
from ..base import intervals as iv
from ..base.errors import AttributionError
from ..base.schema import COMM_CATEGORIES
from ..matching.collectives import COLLECTIVE_CATEGORIES, match_collectives
from ..matching.messages import p2p_messages
from ..matching.p2p import match_p2p
from ..table.partition import LABELS, segment_owners

__all__ = ["BUSY_LABELS", "CHAIN_COLUMNS", "PATH_LABELS", "SUMMARY_COLUMNS", "Resolution", "Via", "critical_path",
           "critical_path_summary", "describe"]


class Resolution(str, enum.Enum):
    TRANSFER = "transfer"
    WAIT = "wait"
    SEND = "send"            # p2p: a send with no receive around it
    UNMATCHED = "unmatched"  # a communication call the matching did not pair
    NONE = ""                # not communication


class Via(str, enum.Enum):
    """How the walk reached a rank's stretch of the path."""

    END = "end"                # the step's end on its slowest rank
    COLLECTIVE = "collective"  # a collective's wait, to the instance's last arriver
    P2P = "p2p"                # a receive's wait, to the sender


_PLAIN = ("compute", "memcpy_h2d", "memcpy_d2h", "memcpy_d2d", "memset", "bubble", "sync", "idle")
_COMM_RES = (Resolution.TRANSFER, Resolution.WAIT, Resolution.UNMATCHED)
_P2P_RES = (Resolution.TRANSFER, Resolution.WAIT, Resolution.SEND, Resolution.UNMATCHED)
#: Every label of the chain, in a fixed order.
PATH_LABELS = ("compute", *(f"{c} {r.value}" for c in COLLECTIVE_CATEGORIES for r in _COMM_RES),
               *(f"p2p {r.value}" for r in _P2P_RES), *_PLAIN[1:])
_ID = {label: i for i, label in enumerate(PATH_LABELS)}
#: The labels on which the path's rank was working (see the module docstring); the rest are waiting.
BUSY_LABELS = tuple(label for label in PATH_LABELS
                    if not label.endswith(" wait") and label not in ("bubble", "sync", "idle"))
_BUSY = np.array([label in BUSY_LABELS for label in PATH_LABELS])
_RESOLUTION = np.array([label.split(" ")[1] if " " in label else "" for label in PATH_LABELS], dtype=object)
_K = {label: k for k, label in enumerate(LABELS)}
#: Label id of each owner (index into LABELS) before the comm refinement (comm: its unmatched label).
_BASE = np.array([_ID.get(label, _ID.get(f"{label} unmatched", _ID["p2p unmatched"])) for label in LABELS],
                 dtype=np.int16)

CHAIN_COLUMNS = ("step", "rank", "label", "category", "resolution", "dim", "busy", "start_ns", "end_ns", "dur_ns",
                 "offset_ns", "via", "from_rank")
SUMMARY_COLUMNS = ("step", "rank", "label", "dim", "dur_ns", "share", "path_ns")


# --- one rank's labelled timeline ---------------------------------------------------------------------------------

@dataclasses.dataclass
class _Timeline:
    """One rank on the aligned clock: labelled runs (maximal stretches of one label, category and dim) and
    its jump segments (the waits the walk follows to another rank) in time order."""

    rank: int
    offset: int
    run_start: np.ndarray
    run_end: np.ndarray
    run_label: np.ndarray
    run_owner: np.ndarray
    run_dim: np.ndarray
    jump_start: np.ndarray
    jump_end: np.ndarray
    jump_target: np.ndarray
    jump_via: np.ndarray
    windows: dict

    def jump(self, t: int, lo: int, visited: set) -> tuple[int, int]:
        """(index, time J) of the latest usable jump segment met walking back from t, J = min(its end, t) with
        lo < J; (-1, lo) without one."""
        k = int(np.searchsorted(self.jump_start, t, side="left")) - 1
        while k >= 0:
            at = min(int(self.jump_end[k]), t)
            if at <= lo:
                break
            if (int(self.jump_target[k]), at) not in visited:
                return k, at
            k -= 1
        return -1, lo

    def piece(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        """The runs over ``[lo, hi)``, clipped to it (empty when hi <= lo)."""
        i0 = int(np.searchsorted(self.run_end, lo, side="right"))
        i1 = int(np.searchsorted(self.run_start, hi, side="left")) if hi > lo else i0
        take = slice(i0, max(i0, i1))
        return {"start_ns": np.maximum(self.run_start[take], lo), "end_ns": np.minimum(self.run_end[take], hi),
                "label": self.run_label[take], "owner": self.run_owner[take], "dim": self.run_dim[take]}


def _spans(start: np.ndarray, mid: np.ndarray, end: np.ndarray) -> tuple[iv.IntervalSet, iv.IntervalSet]:
    """(wait set, transfer set) of calls ``[start, end)`` split at ``mid``."""
    return iv.union(start, mid), iv.union(mid, end)


def _timeline(rank, *, offset: int, calls: pd.DataFrame, receives: pd.DataFrame, span: tuple[int, int],
              dims: dict[str, int], ranks: list[int]) -> _Timeline:
    """The labelled runs and jump segments of one ``RankAttribution``, from its label sets and its own rows of
    ``match_collectives`` (``calls``, aligned times) and ``match_p2p`` (``receives``, its own clock); ``span``:
    aligned bounds every walk stays in (the runs cover them), ``dims``: the dim vocabulary, filled here."""
    sets = {label: s for label, s in rank.label_sets.items() if label in _K}
    windows = rank.attributed_windows
    # Wait and transfer sets on the rank's own clock (the matched tables are aligned / raw respectively).
    c_start = calls["start_ns"].to_numpy(np.int64) + offset
    c_mid = c_start + calls["wait_ns"].to_numpy(np.int64)
    c_end = calls["end_ns"].to_numpy(np.int64) + offset
    c_cat = calls["category"].to_numpy(object)
    split = {c: _spans(c_start[c_cat == c], c_mid[c_cat == c], c_end[c_cat == c]) for c in set(c_cat)}
    r_start = receives["start_ns"].to_numpy(np.int64)
    r_mid = r_start + receives["wait_ns"].to_numpy(np.int64)
    r_end = receives["end_ns"].to_numpy(np.int64)
    p2p_wait, p2p_transfer = _spans(r_start, r_mid, r_end)
    points = iv.distinct(np.concatenate(
        [a for s in sets.values() for a in s]
        + [windows["start_ns"].to_numpy(np.int64), windows["end_ns"].to_numpy(np.int64),
           np.array(span, np.int64) + offset, c_start, c_mid, c_end, r_start, r_mid, r_end]), scratch=True)
    owner = segment_owners(sets, points)
    seg = points[:-1]
    label = _BASE[owner]
    for c, (wait, transfer) in split.items():
        on = owner == _K[c]
        t_cov, w_cov = iv.covers(transfer, seg[on]), iv.covers(wait, seg[on])
        label[on] = np.where(t_cov, _ID[f"{c} transfer"], np.where(w_cov, _ID[f"{c} wait"], _ID[f"{c} unmatched"]))
    on = (owner == _K["p2p_send"]) | (owner == _K["p2p_recv"])
    if on.any():
        t_cov, w_cov = iv.covers(p2p_transfer, seg[on]), iv.covers(p2p_wait, seg[on])
        rest = np.where(owner[on] == _K["p2p_send"], _ID["p2p send"], _ID["p2p unmatched"])
        label[on] = np.where(t_cov, _ID["p2p transfer"], np.where(w_cov, _ID["p2p wait"], rest))
    dim = _segment_dims(rank, owner, seg, dims)
    change = np.flatnonzero((label[1:] != label[:-1]) | (owner[1:] != owner[:-1]) | (dim[1:] != dim[:-1])) + 1
    first = np.concatenate([[0], change])
    run_start = points[first] - offset
    waits = {"c_start": c_start, "c_mid": c_mid, "c_cat": c_cat, "c_last": calls["last_rank"].to_numpy(np.int64),
             "r_start": r_start, "r_mid": r_mid, "r_peer": receives["peer"].to_numpy(np.int64),
             "r_ok": receives["method"].to_numpy(object) == "matched"}
    jumps = _jumps(rank.rank, offset, points, label, waits, ranks=ranks)
    return _Timeline(
        rank=rank.rank, offset=offset, run_start=run_start, run_end=np.append(run_start[1:], points[-1] - offset),
        run_label=label[first], run_owner=owner[first], run_dim=dim[first], **jumps,
        windows={int(s): (int(a) - offset, int(b) - offset) for s, a, b in windows.itertuples(index=False)})


def _segment_dims(rank, owner: np.ndarray, seg: np.ndarray, dims: dict[str, int]) -> np.ndarray:
    """Per segment: the code (in ``dims``) of the dim of the rank's comm rows of the segment's category that
    cover it, the first by name where several do; 0 ("") elsewhere."""
    out = np.zeros(len(seg), dtype=np.int32)
    comm = rank.work(["category", "dim", "start_ns", "dur_ns"], categories=COMM_CATEGORIES)
    if comm.empty:
        return out
    category = comm["category"].astype(str).to_numpy()
    dim = comm["dim"].astype(str).to_numpy()
    start = comm["start_ns"].to_numpy(np.int64)
    end = start + comm["dur_ns"].to_numpy(np.int64)
    for c, d in sorted(set(zip(category.tolist(), dim.tolist()))):  # a handful of (category, dim) pairs
        mine = (category == c) & (dim == d)
        on = np.flatnonzero((owner == _K[c]) & (out == 0))
        hit = on[iv.covers(iv.union(start[mine], end[mine]), seg[on])]
        out[hit] = dims.setdefault(d, len(dims))
    return out


def _jumps(rank: int, offset: int, points: np.ndarray, label: np.ndarray, waits: dict[str, np.ndarray], *,
           ranks: list[int]) -> dict[str, np.ndarray]:
    """The jump segments of one rank (module docstring, rule 3), aligned, in time order: the wait segments
    (``c wait`` of a collective, ``bubble`` / ``p2p wait`` of a receive) with the rank they wait for -- of
    the calls of ``c`` (the receives) whose wait covers the segment, the lowest last arriver (sender) that is
    another rank with work. Consecutive segments with one target and kind are joined."""
    seg = points[:-1]
    target = np.full(len(seg), -1, dtype=np.int64)
    via = np.zeros(len(seg), dtype=np.int8)
    c_start, c_mid, c_last, c_cat = waits["c_start"], waits["c_mid"], waits["c_last"], waits["c_cat"]
    r_start, r_mid, r_peer, r_ok = waits["r_start"], waits["r_mid"], waits["r_peer"], waits["r_ok"]
    # Per (category, target) one union of waits (a handful of each); the lowest target is written last.
    pairs = {(c, int(x)) for c, x in zip(c_cat.tolist(), c_last.tolist())} | {("p2p", int(x)) for x in r_peer[r_ok]}
    for c, x in sorted(pairs, key=lambda pair: (pair[0], -pair[1])):
        if x == rank or x not in ranks:
            continue
        if c == "p2p":
            mine, lo, hi = r_ok & (r_peer == x), r_start, r_mid
            waiting = (label == _ID["bubble"]) | (label == _ID["p2p wait"])
        else:
            mine, lo, hi = (c_cat == c) & (c_last == x), c_start, c_mid
            waiting = label == _ID[f"{c} wait"]
        on = np.flatnonzero(waiting)
        hit = on[iv.covers(iv.union(lo[mine], hi[mine]), seg[on])]
        target[hit] = x
        via[hit] = c != "p2p"
    jump = target >= 0
    if not jump.any():
        return {"jump_start": _NONE, "jump_end": _NONE, "jump_target": _NONE, "jump_via": _NONE}
    k = np.flatnonzero(jump)
    first = np.concatenate([[True], (k[1:] != k[:-1] + 1) | (target[k[1:]] != target[k[:-1]])
                            | (via[k[1:]] != via[k[:-1]])])
    last = np.append(first[1:], True)
    return {"jump_start": points[k[first]] - offset, "jump_end": points[k[last] + 1] - offset,
            "jump_target": target[k[first]], "jump_via": via[k[first]]}


_NONE = np.empty(0, np.int64)


# --- the walk -----------------------------------------------------------------------------------------------------

def critical_path(source) -> pd.DataFrame:
    """The critical path of every step (``CHAIN_COLUMNS``, rows in (step, start) order; rules in the module
    docstring): ``label`` one of ``PATH_LABELS``, ``category`` the breakdown label under it, ``resolution``
    its ``Resolution`` value, ``busy`` whether the label is in ``BUSY_LABELS``, times on the aligned clock
    (recorded time = ``start_ns + offset_ns``), ``via`` the ``Via`` value that brought the walk to the row's
    stretch and ``from_rank`` the rank it came from (-1 at the step's end).

    ``source``: a ``TraceSet``, an events table or an ``Attribution``; computed once per attribution, a copy
    is returned."""
    attribution = attribute(source, caller="critical_path")
    return attribution.derived(_chain).copy()


def _chain(attribution) -> pd.DataFrame:
    # Rows of an unknown rank (-1: NCCL-log lines whose communicator the log never placed) meet nobody.
    working = [r for r in attribution.working if r.rank >= 0 and len(r.attributed_windows)]
    if not working:
        return _empty_chain()
    calls = _matched_calls(attribution)
    receives = _matched_receives(attribution)
    offsets = {int(r): int(o) for r, o in calls.groupby("rank")["offset_ns"].first().items()}
    windows = [(r.rank, r.attributed_windows) for r in working]
    lo = min(int((w["start_ns"] - offsets.get(r, 0)).min()) for r, w in windows if len(w))
    hi = max(int((w["end_ns"] - offsets.get(r, 0)).max()) for r, w in windows if len(w))
    if hi <= lo:  # nothing but empty windows: no path
        return _empty_chain()
    dims = {"": 0}
    lines = {r.rank: _timeline(r, offset=offsets.get(r.rank, 0), calls=calls[calls["rank"] == r.rank],
                               receives=receives[receives["rank"] == r.rank], span=(lo, hi), dims=dims,
                               ranks=[w.rank for w in working])
             for r in working}
    steps = sorted({s for line in lines.values() for s in line.windows})
    frames = [_walk(lines, step) for step in steps]
    chain = pd.concat(frames, ignore_index=True) if frames else _empty_chain()
    vocabulary = np.array(sorted(dims, key=dims.get), dtype=object)
    chain["dim"] = vocabulary[chain["dim"].to_numpy(np.int64)]
    return chain[list(CHAIN_COLUMNS)]


def _matched_calls(attribution) -> pd.DataFrame:
    """``match_collectives`` (ENDS alignment) with each instance's last arriver, or none without collectives."""
    try:
        matched = match_collectives(attribution)
    except AttributionError:  # no collective calls: nothing to align with or jump along
        return pd.DataFrame({"rank": np.empty(0, np.int64), "category": np.empty(0, object),
                             "start_ns": np.empty(0, np.int64), "end_ns": np.empty(0, np.int64),
                             "wait_ns": np.empty(0, np.int64), "offset_ns": np.empty(0, np.int64),
                             "last_rank": np.empty(0, np.int64)})
    key = ["group", "category", "instance"]
    last = matched[matched["is_last"]].set_index(key)["rank"]
    matched["last_rank"] = last.reindex(pd.MultiIndex.from_frame(matched[key])).to_numpy(np.int64)
    return matched


def _matched_receives(attribution) -> pd.DataFrame:
    """The receives of ``match_p2p`` (on each receiver's own clock), or none without p2p."""

    if p2p_messages(attribution).empty:
        return pd.DataFrame({"rank": np.empty(0, np.int64), "start_ns": np.empty(0, np.int64),
                             "end_ns": np.empty(0, np.int64), "wait_ns": np.empty(0, np.int64),
                             "peer": np.empty(0, np.int64), "method": np.empty(0, object)})
    matched = match_p2p(attribution)
    return matched[matched["kind"] == "recv"]


def _walk(lines: dict[int, _Timeline], step: int) -> pd.DataFrame:
    """The chain of one step (rules 1-4 of the module docstring)."""
    ends = {r: line.windows[step][1] for r, line in lines.items() if step in line.windows}
    t = max(ends.values())
    rank = min(r for r, end in ends.items() if end == t)
    via, came_from = Via.END, -1
    visited: set[tuple[int, int]] = set()
    pieces = []
    while True:
        line = lines[rank]
        lo = line.windows.get(step, (t, t))[0]
        k, stop = line.jump(t, lo, visited)
        stop = stop if k >= 0 else min(lo, t)
        piece = line.piece(stop, t)
        piece.update(rank=rank, offset_ns=line.offset, via=via.value, from_rank=came_from)
        pieces.append(piece)
        if k < 0:
            break
        visited.add((int(line.jump_target[k]), stop))
        via = Via.COLLECTIVE if line.jump_via[k] else Via.P2P
        rank, t, came_from = int(line.jump_target[k]), stop, rank
    pieces.reverse()
    n = [len(p["start_ns"]) for p in pieces]
    label = np.concatenate([p["label"] for p in pieces]).astype(np.int64)
    chain = pd.DataFrame({
        "step": step, "rank": np.repeat([p["rank"] for p in pieces], n),
        "label": np.array(PATH_LABELS, dtype=object)[label],
        "category": np.array(LABELS, dtype=object)[np.concatenate([p["owner"] for p in pieces]).astype(np.int64)],
        "resolution": _RESOLUTION[label], "dim": np.concatenate([p["dim"] for p in pieces]), "busy": _BUSY[label],
        "start_ns": np.concatenate([p["start_ns"] for p in pieces]),
        "end_ns": np.concatenate([p["end_ns"] for p in pieces]),
        "offset_ns": np.repeat([p["offset_ns"] for p in pieces], n),
        "via": np.repeat([p["via"] for p in pieces], n), "from_rank": np.repeat([p["from_rank"] for p in pieces], n)})
    chain["dur_ns"] = chain["end_ns"] - chain["start_ns"]
    start, end = chain["start_ns"].to_numpy(), chain["end_ns"].to_numpy()
    if len(chain) and not ((start[1:] == end[:-1]).all() and (end > start).all()):  # by construction
        raise AssertionError(f"critical path of step {step} does not tile its window: {chain.head(10)}")
    return chain


def _empty_chain() -> pd.DataFrame:
    types = {"label": object, "category": object, "resolution": object, "dim": object, "via": object,
             "busy": bool}
    return pd.DataFrame({c: np.empty(0, dtype=types.get(c, np.int64)) for c in CHAIN_COLUMNS})


# --- totals -------------------------------------------------------------------------------------------------------

def critical_path_summary(chain: pd.DataFrame, *, by: tuple[str, ...] = ("rank", "label", "dim")) -> pd.DataFrame:
    """Per step and ``by`` (columns of the chain): ``dur_ns`` on the path, ``share`` of the step's path
    length ``path_ns``; rows by step, then the longest first (ties: by the ``by`` columns ascending)."""
    by = list(by)
    missing = [c for c in by if c not in chain.columns]
    if missing:
        raise AttributionError(f"critical_path_summary: by={missing} are not chain columns ({list(chain.columns)})")
    if chain.empty:
        return pd.DataFrame({c: pd.Series(dtype=chain[c].dtype if c in chain else float)
                             for c in ["step", *by, "dur_ns", "share", "path_ns"]})
    out = chain.groupby(["step", *by], as_index=False, sort=True)["dur_ns"].sum()
    out["path_ns"] = out.groupby("step")["dur_ns"].transform("sum")
    out["share"] = out["dur_ns"] / out["path_ns"]
    out = out.sort_values(["step", "dur_ns", *by], ascending=[True, False, *[True] * len(by)], kind="stable")
    return out[["step", *by, "dur_ns", "share", "path_ns"]].reset_index(drop=True)


def describe(summary: pd.DataFrame, step: int, *, top: int = 4) -> str:
    """One line of a step's path: its length and its ``top`` largest parts ("41% rank 7 compute, 18% rank 2
    tp all-reduce transfer, ..."), the rest as "other". Reads the columns of ``summary`` that it has (rank,
    dim, label)."""
    rows = summary[summary["step"] == step]
    if rows.empty:
        raise AttributionError(f"describe: step {step} is not in the summary (steps {sorted(set(summary['step']))})")
    parts = []
    for row in rows.head(top).itertuples(index=False):  # a handful of rows
        words = [f"{100 * row.share:.0f}%"]
        if "rank" in rows:
            words.append(f"rank {row.rank}")
        if "dim" in rows and row.dim not in ("", "unknown"):
            words.append(str(row.dim))
        if "label" in rows:
            words.append(str(row.label).replace("_", "-"))
        parts.append(" ".join(words))
    rest = float(rows["share"].iloc[top:].sum())
    if len(rows) > top and rest > 0:
        parts.append(f"{100 * rest:.0f}% other")
    return f"step {step}, path {_span(int(rows['path_ns'].iloc[0]))}: " + ", ".join(parts)


def _span(ns: int) -> str:
    for scale, unit in ((1_000_000_000, "s"), (1_000_000, "ms"), (1_000, "µs")):
        if abs(ns) >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns} ns"
