"""Point-to-point messages across ranks: find the pipeline, match each receive with its send, split the wait.

A pipeline traced with nothing but NCCL or gloo send/recv (Megatron, DeepSpeed's pipeline engine, torch's
``Schedule1F1B``, a hand-written loop) still tells where a stage waits for its upstream: a receive that is
posted (or whose NCCL kernel starts spinning) before the peer has sent cannot complete until it does. This
module turns the p2p rows of an :class:`~shardline.profiling.attribution.Attribution` into messages, matches
them across ranks and splits every receive into

    wait      [receive start, the matched send's start)  -- the upstream has not sent yet: pipeline *bubble*
    transfer  the rest of the receive                    -- the data moving: *p2p transfer*

Messages and the pipeline they form are ``messages``' (``p2p_messages``, ``pipeline_stages``).

Matching. The k-th send from rank a to rank b meets the k-th receive on b from a (NCCL and gloo deliver in
order per pair); the times of both are read on one clock with the offsets ``collectives.match_collectives``
derives from the collectives in the trace (none when it has no collectives, e.g. one host). A pair whose send
and receive counts differ is matched up to the smaller count, with a warning.

A send is not split: a blocking send that waits for its receiver to post (gloo's rendezvous, an NCCL send
kernel spinning for its peer) waits on a busy downstream stage, which is back-pressure, not an empty pipeline;
that time stays ``p2p_send``.

One rank's trace (the peer's is not in the set). The split is then an estimate, labelled ``estimated``: the
transfer takes ``bytes / link bandwidth`` (``bandwidth.collective_bandwidth``'s link for the call, per
direction) and the rest of the receive is the wait. A receive with neither a match nor a size stays
``unmatched`` (all transfer).

Per message (``match_p2p``): ``method`` ("matched" | "estimated" | "unmatched"), ``wait_ns``,
``transfer_ns`` (they sum to ``dur_ns``), and the matched send's ``send_start_ns`` on the receiver's clock.
"""
from __future__ import annotations

import enum
import warnings

import numpy as np
import pandas as pd

from ..base import intervals as iv
from ..base.errors import AttributionError, TraceWarning
from .bandwidth import collective_bandwidth
from .collectives import match_collectives
from .matched import MatchedP2P, Matching, matching_of
from .messages import Pipeline, p2p_messages, pipeline_stages


class SplitMethod(str, enum.Enum):
    MATCHED = "matched"        # the peer's send is in the trace set: exact on one clock
    ESTIMATED = "estimated"    # one rank's trace: transfer from message size and link bandwidth
    UNMATCHED = "unmatched"    # neither: the whole receive is transfer


# --- matching and the split ---------------------------------------------------------------------------------------

def match_p2p(source) -> pd.DataFrame:
    """``p2p_messages`` with ``stage``, ``pipeline`` (index into the pipelines), ``method``, ``wait_ns``,
    ``transfer_ns`` and ``send_start_ns`` (receives; -1 for sends and where unknown). Warnings of the
    inference are issued as ``TraceWarning``. Kept on the attribution."""

    matched = _matched(source, caller="match_p2p")
    for note in matched.notes:
        warnings.warn(note, TraceWarning, stacklevel=2)
    return matched.table


def pipelines_of(source) -> list[Pipeline]:
    """The pipeline groups ``match_p2p`` found (stage order included)."""

    return list(_matched(source, caller="pipelines_of").pipelines)


def _matched(source, *, caller: str) -> MatchedP2P:
    """The :class:`MatchedP2P` of ``source``'s matching, computed on first use and kept in it."""
    survey, matching = matching_of(source, caller=caller)
    if matching.p2p is None:
        matching.p2p = _match(survey, matching)
    return matching.p2p


def _match(attribution, matching: Matching) -> MatchedP2P:
    messages = p2p_messages(attribution)
    pipelines, messages, notes = pipeline_stages(messages)
    n = len(messages)
    out = messages.assign(stage=-1, pipeline=-1, method=SplitMethod.UNMATCHED.value,
                          wait_ns=np.zeros(n, np.int64), transfer_ns=messages["dur_ns"].to_numpy(np.int64),
                          send_start_ns=np.full(n, -1, np.int64))
    if n == 0:
        return MatchedP2P(out, tuple(pipelines), tuple(notes))
    for k, pipe in enumerate(pipelines):
        on = out["rank"].isin(pipe.ranks).to_numpy()
        out.loc[on, "pipeline"] = k
        out.loc[on, "stage"] = out.loc[on, "rank"].map({r: pipe.ranks.index(r) for r in pipe.ranks})
    offsets = _clock_offsets(attribution, matching)
    shift = out["rank"].map(offsets).fillna(0).to_numpy(np.int64)
    aligned = out["start_ns"].to_numpy(np.int64) - shift
    in_set = set(out["rank"].tolist())
    kind, rank, peer = out["kind"].to_numpy(), out["rank"].to_numpy(), out["peer"].to_numpy()
    send_start = np.full(n, -1, np.int64)  # on the receiver's clock
    matched = np.zeros(n, dtype=bool)
    order = np.argsort(aligned, kind="stable")
    all_receives = _pairs(kind, rank, peer, order, want="recv")
    for (src, dst), positions in _pairs(kind, rank, peer, order, want="send").items():
        receives = all_receives.get((src, dst), np.empty(0, np.int64))
        if not len(receives):
            continue
        k = min(len(positions), len(receives))
        if len(positions) != len(receives):
            notes.append(f"rank {src} sends {len(positions)} messages to rank {dst}, which receives "
                         f"{len(receives)}; matched in order up to {k}")
        recv_at = receives[:k]
        send_start[recv_at] = aligned[positions[:k]] + shift[recv_at]
        matched[recv_at] = True
        matched[positions[:k]] = True
    is_recv = kind == "recv"
    start = out["start_ns"].to_numpy(np.int64)
    dur = out["dur_ns"].to_numpy(np.int64)
    wait = np.where(matched, np.clip(send_start - start, 0, dur), 0)
    method = np.where(matched, SplitMethod.MATCHED.value, SplitMethod.UNMATCHED.value).astype(object)
    # A receive whose sender is not in the set (one rank's trace: any peer) gets the size/bandwidth estimate.
    outside = np.array([(p >= 0 and p not in in_set) or (p < 0 and len(in_set) == 1) for p in peer.tolist()],
                       dtype=bool)
    lonely = is_recv & ~matched & outside
    if lonely.any():
        estimate = _estimated_transfer(attribution, matching, out[lonely])
        ok = estimate >= 0
        idx = np.flatnonzero(lonely)[ok]
        wait[idx] = np.clip(dur[idx] - estimate[ok], 0, dur[idx])
        method[idx] = SplitMethod.ESTIMATED.value
    wait = np.where(is_recv, wait, 0)
    out["wait_ns"] = wait
    out["transfer_ns"] = dur - wait
    out["send_start_ns"] = np.where(is_recv & matched, send_start, -1)
    out["method"] = method
    return MatchedP2P(out, tuple(pipelines), tuple(notes))


def _pairs(kind, rank, peer, order, *, want: str) -> dict[tuple[int, int], np.ndarray]:
    """Positions of the ``want`` messages per directed pair (sender, receiver), in aligned-time order."""
    sel = order[(kind[order] == want) & (peer[order] >= 0)]
    if want == "send":
        keys = zip(rank[sel].tolist(), peer[sel].tolist())
    else:
        keys = zip(peer[sel].tolist(), rank[sel].tolist())
    pairs: dict[tuple[int, int], list[int]] = {}
    for key, position in zip(keys, sel.tolist()):
        pairs.setdefault(key, []).append(position)
    return {key: np.array(value, dtype=np.int64) for key, value in pairs.items()}


def _clock_offsets(attribution, matching: Matching) -> dict[int, int]:
    """Per-rank clock offsets from the matched collectives (none without collectives), kept in ``matching``."""

    if matching.clock_offsets is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TraceWarning)
                matched = match_collectives(attribution)
        except AttributionError:
            matching.clock_offsets = {}
        else:
            matching.clock_offsets = {int(r): int(o) for r, o in matched.groupby("rank")["offset_ns"].first().items()}
    return matching.clock_offsets


def _estimated_transfer(attribution, matching: Matching, receives: pd.DataFrame) -> np.ndarray:
    """Transfer time (ns) of ``receives`` from their size and their link's bandwidth per direction (the row
    ``collective_bandwidth`` gives the same call: same rank and start); -1 where either is unknown."""

    if matching.p2p_bandwidth is None:
        matching.p2p_bandwidth = collective_bandwidth(attribution)
    table = matching.p2p_bandwidth
    out = np.full(len(receives), -1, dtype=np.int64)
    if table.empty:
        return out
    calls = table[table["category"] == "p2p_recv"].drop_duplicates(["rank", "start_ns"])
    calls = calls.set_index(["rank", "start_ns"])
    key = pd.MultiIndex.from_arrays([receives["rank"].to_numpy(np.int64), receives["start_ns"].to_numpy(np.int64)])
    gbps = calls["link_gbps"].astype(float).reindex(key).to_numpy()
    nbytes = receives["bytes"].to_numpy(np.float64)
    nbytes = np.where(nbytes > 0, nbytes, calls["bytes"].astype(float).reindex(key).to_numpy())
    ok = (nbytes > 0) & np.isfinite(gbps) & (gbps > 0)
    out[ok] = np.round(nbytes[ok] / gbps[ok]).astype(np.int64)  # bytes / (GB/s) = ns
    return out


# --- the bubble set -----------------------------------------------------------------------------------------------

def wait_set(matched: pd.DataFrame, rank: int) -> iv.IntervalSet:
    """The rank's receive waits (``[start, start + wait_ns)``) as an interval set: its p2p bubble."""
    mine = matched[(matched["rank"] == rank) & (matched["wait_ns"] > 0)]
    start = mine["start_ns"].to_numpy(np.int64)
    return iv.union(start, start + mine["wait_ns"].to_numpy(np.int64))
