"""Cross-rank view of collectives: match instances, split wait vs transfer, name stragglers, align clocks.

Matching. A collective instance is one call on every member of a process group. Instances are matched by
(process group, sequence number) when the trace records ``seq``, else by order: the k-th call of a category on
a group on one rank meets the k-th on every other rank. The group key is the ``pg_name``, else the
``pg_ranks`` text, else "" (one anonymous group: traces without process-group args, such as torch 2.13's gloo
ones; where a rank's trace lists it in several groups this mixes their calls, and a ``TraceWarning`` says so). One
row per rank and instance is used: the GPU kernel on ranks attributed on GPUs, else the outermost CPU comm op on
its thread -- and of a collective posted on one thread and run on a backend worker thread (``gloo:all_reduce`` on
a ``pt_gloo_runloop`` thread), the run, with its post's group (``linking.worker_span_pairs``).
Point-to-point sends and receives are not collectives (a send meets one receive, not the other sends) and are
left out; the time a pipeline stage waits in receives is ``bubbles``' business.

Clock alignment (``ClockAlignment.ENDS``, the default). A collective completes on all members at about the
same true time, so for rank r and reference rank r0 (the lowest rank) the offset is

    offset_r = median over instances shared with r0 of (end_r - end_r0)

and every time of rank r is read as ``t - offset_r``. The residual skew is the per-instance spread
``max_r(end_r - offset_r) - min_r(...)``; ``clock_offsets`` reports it (median and max) so a user can see how
far to trust the alignment. ``ClockAlignment.NONE`` keeps the recorded clocks.

Wait vs transfer, per instance k and rank r (aligned times, arrival a_r = start of the rank's call):

    last_k = max_r a_r          wait_r = clip(last_k - a_r, 0, dur_r)          transfer_r = dur_r - wait_r

so the transfer is what the slowest-arriving rank sees, and the rest of each rank's time is waiting for it.
The straggler of a step is the rank whose late arrivals caused the most waiting (sum over the instances it
arrived last of the waits of the others), counted only in groups whose members are in one pipeline stage
(``cross_stage`` False). A group across stages -- Megatron's MODEL_PARALLEL_GROUP (the grad norm), the embedding
tie of the first and last stage, a world barrier or loss all-reduce of a pipelined job -- has its members arrive
apart by the schedule (the last stage waits out the first stage's cool-down, every step), which no slow rank
causes: counted, it names the first stage whatever rank is slow. A rank's stage is its place in its pipeline
(``pipeline_stages``); in a pipelined job a group none of whose ranks has a known stage counts as across stages
by its dim (pp, mp, embed, world). A job with one stage has no group across stages.
"""

from __future__ import annotations

import enum
import warnings

import numpy as np
import pandas as pd

from ..base.errors import AttributionError, TraceWarning
from ..base.schema import COMM_CATEGORIES, P2P_CATEGORIES
from ..table.dims import group_keys
from ..table.kinds import Lane
from ..table.linking import span_kinds, worker_span_pairs
from ..table.rows import step_of
from ..table.survey import surveyed
from . import messages
from .links import parse_ranks

COLLECTIVE_CATEGORIES = tuple(c for c in COMM_CATEGORIES if c not in P2P_CATEGORIES)


class ClockAlignment(str, enum.Enum):
    NONE = "none"
    ENDS = "ends"



def comm_calls(source) -> pd.DataFrame:
    """One row per communication call per rank: rank, step, category, group, dim, seq, start_ns, end_ns, dur_ns.

    ``source``: a ``TraceSet``, an events table or an ``Attribution``; the calls are its ranks' work rows of
    the collective categories, in the windows the attribution gives them."""
    frames = []
    for rank in surveyed(source, caller="comm_calls").working:
        if rank.lanes == Lane.CPU.value:
            calls = _cpu_calls(rank.work(_CALL_COLUMNS + ("name",), categories=COLLECTIVE_CATEGORIES))
            calls = calls.drop(columns="name")
        else:
            calls = rank.work(_CALL_COLUMNS, categories=COLLECTIVE_CATEGORIES)
        if calls.empty:
            continue
        windows = rank.windows
        start = calls["start_ns"].to_numpy()
        step = step_of(start, windows)
        frames.append(pd.DataFrame({
            "rank": calls["rank"].to_numpy().astype(np.int64), "step": step,
            "category": calls["category"].astype(str).to_numpy(),
            "group": group_keys(calls["pg_name"], calls["pg_ranks"]), "dim": calls["dim"].astype(str).to_numpy(),
            "seq": calls["seq"].to_numpy(),
            "start_ns": start, "end_ns": start + calls["dur_ns"].to_numpy(), "dur_ns": calls["dur_ns"].to_numpy()}))
    if not frames:
        return pd.DataFrame(columns=["rank", "step", "category", "group", "dim", "seq", "start_ns", "end_ns",
                                     "dur_ns"])
    return pd.concat(frames, ignore_index=True)


#: What ``comm_calls`` reads of the work rows.
_CALL_COLUMNS = ("rank", "category", "pg_name", "pg_ranks", "dim", "seq", "stream", "start_ns", "dur_ns")

#: Dims of groups across pipeline stages by what they are, in a pipelined job (used where a group's ranks have
#: no known stage): the pipeline group, Megatron's tp x pp group, the embedding tie, the world.
CROSS_STAGE_DIMS = frozenset({"pp", "mp", "embed", "world"})


def pipeline_stages(source) -> dict[int, int]:
    """Per rank, its pipeline stage: its place in its pipeline (``messages.pipeline_stages``: the sends' and receives'
    process group, else their peers), else in the largest pipeline group (``dim`` pp) holding it that lists its
    ranks (a smaller pp group -- DeepSpeed's pair of neighbouring stages, a first/last embedding pair a layout
    names pp -- numbers no stage). Empty where the trace shows neither.

    ``source``: a ``TraceSet``, an events table or an ``Attribution``."""

    attribution = surveyed(source, caller="pipeline_stages")
    pipes, _, _ = messages.pipeline_stages(messages.p2p_messages(attribution))
    stages = {rank: stage for pipe in pipes for stage, rank in enumerate(pipe.ranks)}
    events = attribution.events
    texts = events.loc[(events["dim"] == "pp").to_numpy(), "pg_ranks"].astype(str).unique()
    lists = sorted((lst for lst in map(parse_ranks, texts) if lst is not None and len(lst) > 1),
                   key=len, reverse=True)
    for ranks in lists:
        for stage, rank in enumerate(ranks):
            stages.setdefault(rank, stage)
    return stages


def _pipelined(attribution, stages: dict[int, int]) -> bool:
    """Does the job have more than one pipeline stage: a rank past stage 0, a pp group of two or more, the
    layout's pp, or a tp x pp group (mp) larger than every tp group."""
    if any(stages.values()) or int((attribution.layout or {}).get("pp", 1)) > 1:
        return True
    events = attribution.events
    size = events["pg_size"].to_numpy()

    def largest(dim: str) -> int:
        mask = (events["dim"] == dim).to_numpy()
        return int(size[mask].max()) if mask.any() else 0

    return largest("pp") > 1 or largest("mp") > max(largest("tp"), 1)


def within_stage(matched: pd.DataFrame) -> pd.DataFrame:
    """The matched calls of groups within one pipeline stage (``cross_stage`` False; all where the column is not
    there): the ones a straggler is named by."""
    return matched[~matched["cross_stage"].to_numpy(dtype=bool)] if "cross_stage" in matched else matched


def stage_peers(matched: pd.DataFrame, rank: int) -> set[int]:
    """The ranks that share a group within one pipeline stage with ``rank`` (``cross_stage`` False): the ranks
    doing its work (its tp, cp and dp peers), which a straggler's time is compared with. Empty when it has none."""
    if "cross_stage" not in matched or matched.empty:
        return set()
    within = within_stage(matched)
    groups = set(within.loc[within["rank"] == rank, "group"])
    return {int(r) for r in within.loc[within["group"].isin(groups), "rank"].unique()} - {rank}


def _cross_stage(calls: pd.DataFrame, stages: dict[int, int], pipelined: bool) -> np.ndarray:
    """Per call: whether its group's members are in more than one pipeline stage (by their stages; a group none
    of whose ranks has a known stage, by its dim, in a pipelined job)."""
    if not pipelined:
        return np.zeros(len(calls), dtype=bool)
    cross = {}
    for group, part in calls.groupby("group", sort=False):
        known = {stages[r] for r in part["rank"].unique().tolist() if r in stages}
        cross[group] = len(known) > 1 if known else bool(part["dim"].isin(CROSS_STAGE_DIMS).any())
    return calls["group"].map(cross).fillna(False).to_numpy(dtype=bool)


def _cpu_calls(calls: pd.DataFrame) -> pd.DataFrame:
    """A CPU-lane rank's calls (``calls`` with a ``name`` column): the outermost comm op of each call on its thread
    (c10d op > record_param_comms > gloo:*), not a backend span that starts inside an op of its thread and outlasts
    it (an ``irecv``'s ``gloo:recv`` lifetime: the op's transport), and of a collective posted on one thread and run
    on a backend worker thread (gloo, MPI, UCC), the run only (``linking.worker_span_pairs``; the run took its
    post's group and collective in classify): counting the post too counted every such collective twice."""
    if calls.empty:
        return calls
    start = calls["start_ns"].to_numpy().astype(np.int64)
    end = start + calls["dur_ns"].to_numpy().astype(np.int64)
    kinds = span_kinds(calls["name"])
    kinds[calls["category"].isin(P2P_CATEGORIES).to_numpy() & (kinds == 1)] = 2  # a send/recv span runs inline
    found = worker_span_pairs(calls["rank"].to_numpy(), calls["stream"].to_numpy(), start, end,
                              calls["category"].astype(str).to_numpy(), kinds,
                              group_keys(calls["pg_name"], calls["pg_ranks"]))
    keep = ~found.nested
    keep[found.posts] = False
    keep[found.transports] = False
    keep[found.extra_runs] = False
    return calls[keep]


def match_collectives(source, *, clock: ClockAlignment = ClockAlignment.ENDS) -> pd.DataFrame:
    """Matched calls, one row per (instance, rank), with aligned times, wait_ns, transfer_ns, is_last and
    cross_stage (the group's members are in more than one pipeline stage; see the module docstring).

    ``source``: a ``TraceSet``, an events table or an ``Attribution``."""
    attribution = surveyed(source, caller="match_collectives")
    calls = comm_calls(attribution)
    if calls.empty:
        raise AttributionError("no communication calls to match in this trace")
    _warn_mixed_anonymous(calls, attribution)
    calls["instance"] = _instance_ids(calls)
    calls = calls[calls["instance"] >= 0]
    offsets = _offsets(calls) if ClockAlignment(clock) is ClockAlignment.ENDS else {}
    shift = calls["rank"].map(offsets).fillna(0).astype(np.int64).to_numpy()
    calls["offset_ns"] = shift
    calls["start_ns"] = calls["start_ns"] - shift
    calls["end_ns"] = calls["end_ns"] - shift
    key = ["group", "category", "instance"]
    last = calls.groupby(key)["start_ns"].transform("max").to_numpy()
    calls["members"] = calls.groupby(key)["rank"].transform("size").to_numpy()
    calls["wait_ns"] = np.clip(last - calls["start_ns"].to_numpy(), 0, calls["dur_ns"].to_numpy())
    calls["transfer_ns"] = calls["dur_ns"] - calls["wait_ns"]
    # The last arriver of each instance (ties: the lowest rank): first row after sorting by arrival, descending.
    by_arrival = calls.sort_values(key + ["start_ns", "rank"], ascending=[True, True, True, False, True])
    calls["is_last"] = False
    calls.loc[by_arrival.index[~by_arrival.duplicated(key)], "is_last"] = True
    stages = pipeline_stages(attribution)
    calls["cross_stage"] = _cross_stage(calls, stages, _pipelined(attribution, stages))
    return calls.sort_values(key + ["rank"]).reset_index(drop=True)


def _warn_mixed_anonymous(calls: pd.DataFrame, attribution) -> None:
    """Calls without a process group (torch 2.13's gloo records none: no ``record_param_comms``, no group args)
    all fall into one anonymous group matched by order. That is right where each rank calls collectives on one
    group; where a rank's trace lists it in several groups of two or more ranks (``distributedInfo.pg_config``),
    the k-th calls of different groups are taken for one instance, so their wait, transfer and straggler figures
    mix groups: say so, naming the ranks and their groups."""
    anonymous = sorted(int(r) for r in calls.loc[calls["group"] == "", "rank"].unique())
    mixed = []
    for rank in anonymous:
        info = (attribution.metadata.get(rank) or {}).get("distributedInfo")
        config = info.get("pg_config") if isinstance(info, dict) else None
        groups = [g for g in config or [] if isinstance(g, dict) and len(g.get("ranks") or []) > 1]
        if len(groups) > 1:
            mixed.append((rank, groups))
    if not mixed:
        return
    rank, groups = mixed[0]
    where = attribution.files.get(rank, f"rank {rank}")
    named = ", ".join(f"{_group_label(g)} {g['ranks']}" for g in groups[:4])
    others = f" (and ranks {[r for r, _ in mixed[1:]][:8]})" if len(mixed) > 1 else ""
    warnings.warn(f"{where}: rank {rank}'s collective calls carry no process group (no record_param_comms or group "
                  f"args; torch's gloo records none), but its trace lists it in {len(groups)} groups ({named}){others}:"
                  " they are matched by order in one anonymous group, so their wait, transfer and straggler "
                  "figures mix different groups' calls", TraceWarning, stacklevel=3)


def _group_label(group: dict) -> str:
    """A ``pg_config`` entry's description, or "group NAME" where torch wrote none ("undefined")."""
    desc = group.get("pg_desc")
    return str(desc) if desc and desc != "undefined" else f"group {group.get('pg_name')}"


def _instance_ids(calls: pd.DataFrame) -> np.ndarray:
    """Instance number within (group, category): the seq when every call has one, else the call order."""
    has_seq = (calls["seq"] >= 0).all()
    if has_seq:
        return calls["seq"].to_numpy()
    ordered = calls.sort_values("start_ns")
    order = ordered.groupby(["group", "category", "rank"]).cumcount().reindex(calls.index).to_numpy()
    counts = calls.groupby(["group", "category", "rank"]).size()
    spread = counts.groupby(level=["group", "category"]).agg(["min", "max"])
    uneven = spread[spread["min"] != spread["max"]]
    if len(uneven):
        warnings.warn(f"ranks issued different numbers of calls for {list(uneven.index)[:5]}; matched by order "
                      "up to the smallest count only", TraceWarning, stacklevel=3)
        limit = calls.set_index(["group", "category"]).index.map(spread["min"]).to_numpy()
        order = np.where(order < limit, order, -1)
    return order


def _offsets(calls: pd.DataFrame) -> dict[int, int]:
    """Per rank, the offset of its clock from the lowest rank's: the median, over the instances two ranks share,
    of the difference of their ends (a collective ends at the same moment on every member), chained through
    the ranks between where a rank shares no group with the lowest one (a DP peer of a TP peer of rank 0).

    In integers throughout: absolute ns times (~1.7e18) in a float would be rounded to 256 ns. Each instance
    pairs its members with its lowest-rank member; from the lowest rank the offsets spread over those pairs,
    the pair sharing the most instances first, each rank taking its offset from the first rank that reaches
    it (fewest hops). A rank no pair reaches keeps 0."""
    ref = int(calls["rank"].min())
    instance = calls.groupby(["group", "category", "instance"], sort=False).ngroup().to_numpy()
    rows = pd.DataFrame({"i": instance, "r": calls["rank"].to_numpy().astype(np.int64),
                         "e": calls["end_ns"].to_numpy().astype(np.int64)}).drop_duplicates(["i", "r"])
    anchor = rows.groupby("i")["r"].transform("min").to_numpy()
    anchor_end = rows.set_index(["i", "r"])["e"]
    rows["a"] = anchor
    rows["d"] = rows["e"].to_numpy() - anchor_end.loc[list(zip(rows["i"], anchor))].to_numpy()
    pairs = rows[rows["r"] != rows["a"]].groupby(["a", "r"])["d"].agg(["median", "size"]).reset_index()
    pairs = pairs.sort_values(["size", "a", "r"], ascending=[False, True, True], kind="stable")
    edges: dict[int, list[tuple[int, float]]] = {}
    for a, r, d in zip(pairs["a"].tolist(), pairs["r"].tolist(), pairs["median"].tolist()):
        edges.setdefault(a, []).append((r, d))  # offset(r) = offset(a) + d
        edges.setdefault(r, []).append((a, -d))
    offsets = {ref: 0.0}
    frontier = [ref]
    while frontier:  # breadth first: fewest hops from the lowest rank
        following = []
        for rank in frontier:
            for other, d in edges.get(rank, ()):
                if other not in offsets:
                    offsets[other] = offsets[rank] + d
                    following.append(other)
        frontier = following
    return {int(r): int(np.round(offsets.get(int(r), 0.0))) for r in np.unique(rows["r"].to_numpy())}


def clock_offsets(matched: pd.DataFrame) -> pd.DataFrame:
    """Per rank: the applied offset and the residual skew of aligned ends (median and max over instances)."""
    key = ["group", "category", "instance"]
    spread = matched.groupby(key)["end_ns"].agg(lambda s: int(s.max() - s.min()))
    per_rank = matched.groupby("rank").agg(offset_ns=("offset_ns", "first"), instances=("instance", "size"))
    per_rank["residual_skew_median_ns"] = float(spread.median())
    per_rank["residual_skew_max_ns"] = int(spread.max())
    return per_rank.reset_index()


def wait_transfer(matched: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, category): time in collectives split into waiting and transfer, and the wait fraction."""
    out = matched.groupby(["rank", "category"], as_index=False).agg(
        calls=("instance", "size"), dur_ns=("dur_ns", "sum"), wait_ns=("wait_ns", "sum"),
        transfer_ns=("transfer_ns", "sum"))
    out["wait_fraction"] = out["wait_ns"] / out["dur_ns"].where(out["dur_ns"] > 0)
    return out


def stragglers(matched: pd.DataFrame) -> pd.DataFrame:
    """Per step: the rank whose late arrivals caused the most waiting in others, with that wait, in the groups
    within one pipeline stage (``cross_stage`` False, where the column is there): a step whose collectives all
    cross stages has no row."""
    matched = within_stage(matched)
    key = ["group", "category", "instance"]
    late = matched.loc[matched["is_last"].to_numpy(dtype=bool), key + ["step", "rank"]]
    per = late.groupby(["step", "rank"], as_index=False).agg(times_last=("instance", "size"))
    # What a straggler costs a waiting rank is the time it spent waiting for it: the union of its waits in the
    # instances the straggler arrived last in, not their sum (calls in flight together -- async collectives, a
    # second stream, gloo's two worker threads -- wait through the same time).
    waits = matched.loc[~matched["is_last"].to_numpy(dtype=bool) & (matched["wait_ns"].to_numpy() > 0),
                        key + ["rank", "start_ns", "wait_ns"]]
    waits = waits.merge(late.rename(columns={"rank": "straggler"}), on=key)
    caused = _union_ns(waits.assign(end_ns=waits["start_ns"] + waits["wait_ns"]), ["step", "straggler", "rank"])
    caused = caused.groupby(["step", "straggler"]).sum()
    at = pd.MultiIndex.from_frame(per[["step", "rank"]].rename(columns={"rank": "straggler"}))
    per["caused_wait_ns"] = caused.reindex(at).fillna(0).to_numpy().astype(np.int64)
    per = per[["step", "rank", "caused_wait_ns", "times_last"]]
    best = per.sort_values(["step", "caused_wait_ns", "rank"], ascending=[True, False, True])
    return best.groupby("step", as_index=False).first().rename(columns={"rank": "straggler_rank"})


def _union_ns(frame: pd.DataFrame, by: list[str]) -> pd.Series:
    """Per ``by`` group: the length of the union of the intervals ``[start_ns, end_ns)`` of its rows."""
    if frame.empty:
        return pd.Series(dtype=np.int64, index=pd.MultiIndex.from_arrays([[]] * len(by), names=by))
    f = frame.sort_values(by + ["start_ns"]).reset_index(drop=True)
    groups = f.groupby(by, sort=False)
    reach = groups["end_ns"].cummax()  # the furthest end so far in the group
    before = reach.groupby([f[c] for c in by], sort=False).shift(1)
    segment = (before.isna() | (f["start_ns"] > before)).cumsum()  # a new run of overlapping intervals
    runs = f.assign(segment=segment.to_numpy(), reach=reach.to_numpy()).groupby(by + ["segment"], sort=False).agg(
        lo=("start_ns", "min"), hi=("reach", "max"))
    return (runs["hi"] - runs["lo"]).groupby(level=by).sum()
