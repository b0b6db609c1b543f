"""Point-to-point messages of a trace set and the pipelines they form (the matching across ranks is ``p2p``).

Messages (one row per send or receive per rank, ``p2p_messages``). On a rank attributed on GPUs: each p2p
kernel (``ncclDevKernel_SendRecv``, ``ncclKernel_SendRecv_*``, ...), its peer, size and group from its own args
or, where the kernel has none, from the CPU op with the same External id (``record_param_comms``). On a CPU
rank: each outermost c10d/``record_param_comms`` op together with the transport spans (``gloo:send``,
``gloo:recv`` ...) that start inside it on its thread -- an ``irecv``'s ``gloo:recv`` lasts from the post to
the completion, past the op that posted it -- so a message runs from the op's start to the last end of its
rows. The peer is the global rank (torch records ``Dst Rank`` / ``Src Rank`` as global ranks).

The pipeline (``pipeline_stages``). Ranks joined by p2p messages form a pipeline group (a connected component
of the send/recv peers). Its stage order is the recorded process group's rank order when one group text
covers exactly these ranks (``Process Group Ranks``: Megatron's and torch's pipeline groups list the ranks by
stage); otherwise it is read from the ring of peers: the first stage is the rank whose first message of a
step is a send (every other stage first waits for input), and the next stage is where a stage's first send
goes. Ranks that only pass messages one way around a cycle (ring attention, a ring benchmark) are an exchange,
not a pipeline, and keep their receives as p2p (with a warning). Where no message records its peer (gloo
traced without ``record_shapes``) a group of two ranks is still a pipeline (each rank's peer is the other); a
larger one cannot be matched and its receives stay p2p, with a ``TraceWarning`` naming the ranks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from ..base.schema import P2P_CATEGORIES
from ..table.kinds import Lane
from ..table.rows import is_in, step_of
from .links import parse_ranks
from .matched import matching_of

MESSAGE_COLUMNS = ("rank", "step", "kind", "peer", "group", "start_ns", "end_ns", "dur_ns", "bytes", "row")
_ROW_COLUMNS = ("rank", "lane", "cat", "stream", "category", "dim", "start_ns", "dur_ns", "external_id", "peer",
                "msg_bytes", "pg_name", "pg_ranks")
#: The parallel dims whose send/recv can be a pipeline's: a ring-attention (cp) or expert (ep) exchange cannot.
PIPELINE_DIMS = ("pp", "world", "unknown", "")


# --- messages ---------------------------------------------------------------------------------------------------

def p2p_messages(source) -> pd.DataFrame:
    """One row per p2p send or receive per rank (``MESSAGE_COLUMNS``; see the module docstring), in (rank,
    start) order, of the groups that can be a pipeline's (``dim`` pp, world or unknown: the send/recv of ring
    attention over a cp group or of an ep exchange are not pipeline traffic). ``kind`` is "send" or "recv",
    ``peer`` the global peer rank (-1 unknown), ``row`` the events-table position of the message's first row
    (its kernel, or its outermost CPU op)."""

    survey, matching = matching_of(source, caller="p2p_messages")
    if matching.messages is None:
        matching.messages = _messages(survey)
    return matching.messages


def _messages(attribution) -> pd.DataFrame:

    events = attribution.events
    if not _has_p2p(events):  # most traces: nothing to do
        return _empty_messages()
    frames = []
    for rank in attribution.working:
        if rank.rank < 0:  # rows whose rank the trace could not tell (NCCL-log lines): no peer to meet
            continue
        rows = rank.work(list(_ROW_COLUMNS), categories=P2P_CATEGORIES)
        rows = rows[rows["dim"].astype(str).isin(PIPELINE_DIMS).to_numpy()]
        if rows.empty:
            continue
        frame = _cpu_messages(rows) if rank.lanes == Lane.CPU.value else _gpu_messages(rows, events, rank.rank)
        frame["step"] = step_of(frame["start_ns"].to_numpy(), rank.attributed_windows)
        frames.append(frame)
    if not frames:
        return _empty_messages()
    out = pd.concat(frames, ignore_index=True)
    out["dur_ns"] = out["end_ns"] - out["start_ns"]
    return out[list(MESSAGE_COLUMNS)].sort_values(["rank", "start_ns"], kind="stable").reset_index(drop=True)


def _has_p2p(events: pd.DataFrame) -> bool:

    return bool(len(events)) and bool(is_in(events["category"], P2P_CATEGORIES).any())


def _empty_messages() -> pd.DataFrame:
    types = {"kind": object, "group": object}
    return pd.DataFrame({c: np.empty(0, dtype=types.get(c, np.int64)) for c in MESSAGE_COLUMNS})


def _group_text(rows: pd.DataFrame) -> np.ndarray:
    ranks = rows["pg_ranks"].astype(str).to_numpy()
    name = rows["pg_name"].astype(str).to_numpy()
    return np.where(ranks != "", ranks, name)


def _cpu_messages(rows: pd.DataFrame) -> pd.DataFrame:
    """Outermost comm ops per thread, each with the p2p rows starting inside it (see the module docstring)."""
    is_op = rows["cat"].astype(str).isin(("cpu_op", "Operator")).to_numpy()
    # Thread, start, the op before a transport span starting with it, the longer first.
    order = np.lexsort((-rows["dur_ns"].to_numpy(), ~is_op, rows["start_ns"].to_numpy(), rows["stream"].to_numpy()))
    rows, is_op = rows.iloc[order], is_op[order]
    stream = rows["stream"].to_numpy()
    start = rows["start_ns"].to_numpy(np.int64)
    end = start + rows["dur_ns"].to_numpy(np.int64)
    # A row inside the current op of its thread joins that op's message; any other row opens a message (a
    # transport span opens one only without an op around it, and takes no other row in).
    leader = np.zeros(len(rows), dtype=bool)
    owner = np.zeros(len(rows), dtype=np.int64)
    current = -1
    for i in range(len(rows)):  # one pass over a rank's p2p rows (a few per message)
        if not (current >= 0 and is_op[current] and stream[i] == stream[current] and start[i] <= end[current]):
            leader[i], current = True, i
        owner[i] = current
    _, groups = np.unique(owner, return_inverse=True)
    frame = pd.DataFrame({"group_id": groups, "start": start, "end": end,
                          "peer": rows["peer"].to_numpy(np.int64), "bytes": rows["msg_bytes"].to_numpy(np.int64),
                          "group": _group_text(rows), "category": rows["category"].astype(str).to_numpy(),
                          "row": rows.index.to_numpy(np.int64), "leader": leader})
    heads = frame[frame["leader"]].set_index("group_id")
    agg = frame.groupby("group_id").agg(start_ns=("start", "min"), end_ns=("end", "max"), peer=("peer", "max"),
                                        bytes=("bytes", "max"), group=("group", "max"))
    return pd.DataFrame({
        "rank": int(rows["rank"].iloc[0]), "kind": np.where(heads["category"] == "p2p_send", "send", "recv"),
        "peer": agg["peer"].to_numpy(), "group": agg["group"].to_numpy(), "start_ns": agg["start_ns"].to_numpy(),
        "end_ns": agg["end_ns"].to_numpy(), "bytes": agg["bytes"].to_numpy(), "row": heads["row"].to_numpy()})


def _gpu_messages(rows: pd.DataFrame, events: pd.DataFrame, rank: int) -> pd.DataFrame:
    """The rank's p2p GPU rows, their missing peer/size/group taken from the CPU op with their External id."""
    rows = rows[rows["lane"].astype(str).to_numpy() == Lane.GPU.value]
    start = rows["start_ns"].to_numpy(np.int64)
    peer = rows["peer"].to_numpy(np.int64).copy()
    nbytes = rows["msg_bytes"].to_numpy(np.int64).copy()
    group = _group_text(rows).astype(object)
    external = rows["external_id"].to_numpy(np.int64)
    if ((peer < 0) | (nbytes < 0) | (group == "")).any() and (external >= 0).any():
        ops = events[(events["rank"].to_numpy() == rank) & (events["lane"].astype(str).to_numpy() == "cpu")
                     & np.isin(events["external_id"].to_numpy(), external[external >= 0])]
        ops = ops[ops["category"].astype(str).isin(P2P_CATEGORIES).to_numpy()]
        if len(ops):
            by_id = pd.DataFrame({"peer": ops["peer"].to_numpy(np.int64), "bytes": ops["msg_bytes"].to_numpy(np.int64),
                                  "group": _group_text(ops)}, index=ops["external_id"].to_numpy())
            by_id = by_id.groupby(level=0).agg({"peer": "max", "bytes": "max", "group": "max"})
            hit = by_id.reindex(external)
            found = hit["peer"].notna().to_numpy()
            peer = np.where((peer < 0) & found, hit["peer"].fillna(-1).to_numpy(np.int64), peer)
            nbytes = np.where((nbytes < 0) & found, hit["bytes"].fillna(-1).to_numpy(np.int64), nbytes)
            group = np.where((group == "") & found, hit["group"].fillna("").to_numpy(object), group)
    return pd.DataFrame({"rank": rank, "kind": np.where(rows["category"].astype(str) == "p2p_send", "send", "recv"),
                         "peer": peer, "group": group, "start_ns": start,
                         "end_ns": start + rows["dur_ns"].to_numpy(np.int64), "bytes": nbytes,
                         "row": rows.index.to_numpy(np.int64)})


# --- the pipeline -------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Pipeline:
    """One pipeline group: ``ranks`` in stage order (stage = position); ``order_from`` says how the order was
    found ("process group", "peers", "two ranks")."""

    ranks: tuple[int, ...]
    order_from: str

    def stage(self, rank: int) -> int:
        return self.ranks.index(rank)


def pipeline_stages(messages: pd.DataFrame) -> tuple[list[Pipeline], pd.DataFrame, list[str]]:
    """(the pipelines, the messages with every resolvable ``peer`` filled in, warnings) of ``p2p_messages``."""
    notes: list[str] = []
    if messages.empty:
        return [], messages, notes
    messages = messages.copy()
    ranks = sorted(set(messages["rank"].tolist()))
    known = messages["peer"].to_numpy() >= 0
    if not known.any():
        if len(ranks) == 1:  # one rank's trace: nothing to match (``match_p2p`` estimates)
            return [], messages, notes
        if len(ranks) != 2:
            notes.append(f"p2p messages on ranks {ranks} record no peer (gloo traced without record_shapes?): "
                         "with more than two ranks the receives cannot be matched; their time stays p2p")
            return [], messages, notes
        other = {ranks[0]: ranks[1], ranks[1]: ranks[0]}
        messages["peer"] = messages["rank"].map(other).to_numpy(np.int64)
        return [Pipeline(tuple(_order(messages, ranks)), "two ranks")], messages, notes
    unknown = sorted(set(messages.loc[~known, "rank"].tolist()))
    if unknown:
        notes.append(f"ranks {unknown} have p2p messages without a recorded peer; those are not matched")
    edges = messages[known]
    components = _components(edges["rank"].to_numpy(), edges["peer"].to_numpy())
    pipelines = []
    for members in components:
        if _one_way_ring(edges[edges["rank"].isin(members)], members):
            notes.append(f"ranks {members} pass p2p messages around a one-way ring (ring attention, a ring "
                         "benchmark), not a pipeline: their receives stay p2p")
            continue
        groups = set(edges.loc[edges["rank"].isin(members), "group"].tolist())
        listed = [parse_ranks(str(text)) for text in groups]
        exact = [lst for lst in listed if lst is not None and sorted(lst) == sorted(members)]
        if exact:
            pipelines.append(Pipeline(tuple(exact[0]), "process group"))
        else:
            pipelines.append(Pipeline(tuple(_order(edges[edges["rank"].isin(members)], sorted(members))), "peers"))
    return pipelines, messages, notes


def _one_way_ring(edges: pd.DataFrame, members: list[int]) -> bool:
    """Do these ranks only pass messages one way around a cycle through all of them (each sends to one rank
    and hears from one other, never back)? A pipeline's neighbours talk both ways (activations, gradients) or
    form a chain (forward only); a one-way ring is an exchange such as ring attention's."""
    if len(members) < 3:
        return False
    pairs = set()
    for rank, peer, kind in zip(edges["rank"].tolist(), edges["peer"].tolist(), edges["kind"].tolist()):
        pairs.add((rank, peer) if kind == "send" else (peer, rank))
    if any((b, a) in pairs for a, b in pairs):
        return False
    out = {a: b for a, b in pairs}
    if len(out) != len(members) or len(pairs) != len(members):
        return False
    seen, node = set(), members[0]
    while node not in seen:
        seen.add(node)
        node = out.get(node, node)
    return len(seen) == len(members)


def _components(a: np.ndarray, b: np.ndarray) -> list[list[int]]:
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for x, y in zip(a.tolist(), b.tolist()):
        parent[find(x)] = find(y)
    groups: dict[int, list[int]] = {}
    for x in list(parent):
        groups.setdefault(find(x), []).append(x)
    return sorted(sorted(g) for g in groups.values())


def _order(messages: pd.DataFrame, members: list[int]) -> list[int]:
    """Stage order from the ring of peers: the first stage opens its first step with a send; each next stage is
    where the previous one's first send goes (falls back to rank order where the chain breaks)."""
    first_step = messages.groupby("rank")["step"].transform("min")
    opening = messages[messages["step"] == first_step].sort_values(["rank", "start_ns"]).groupby("rank").first()
    starters = [r for r in members if r in opening.index and opening.loc[r, "kind"] == "send"]
    first = starters[0] if len(starters) == 1 else members[0]
    sends = messages[messages["kind"] == "send"].sort_values("start_ns")
    first_dest = sends.groupby("rank")["peer"].first().to_dict()
    order = [first]
    while len(order) < len(members):
        nxt = first_dest.get(order[-1], -1)
        if nxt in order or nxt not in members:
            order += [r for r in members if r not in order]
            break
        order.append(int(nxt))
    return order
