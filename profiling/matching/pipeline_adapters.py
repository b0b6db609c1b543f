"""Adapters from third-party pipeline engines' annotations to the rows ``bubbles`` measures.

``bubbles`` measures a bubble as a batch window minus the stage's forward/backward compute spans. shardline's
engine records those spans directly (``sl:pp:*``); other engines record spans that *include* the receive wait.
An adapter returns the same two frames as ``bubbles.pp_rows`` -- (batches, actions) -- with each compute span cut
down to its compute part, so the existing measurement applies unchanged.

torch.distributed.pipelining (torch 2.13, ``torch/distributed/pipelining/schedules.py``):

- multi-stage runtime schedules (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``, the zero-bubble and DualPipeV
  schedules, any ``_PipelineScheduleRuntime``) wrap every action in ``record_function(f"PP:{action}")`` where
  ``_Action.__repr__`` is ``{stage}{type}{microbatch}``: ``PP:0F1``, ``PP:1B0``, ``PP:2I3``, ``PP:2W3``,
  ``PP:1RECV_F2``, ``PP:0SEND_B1``, ``PP:1REDUCE_GRAD``. ``F`` and ``B``/``I`` first wait for the receive the
  matching ``RECV_F``/``RECV_B`` action posted; that wait lasts until the posted receive completes (the end of the
  p2p-receive rows that start inside the ``RECV_*`` span), so the compute part is ``[max(start, done), end)``.
- ``ScheduleGPipe`` (and the forward-only schedule) wrap each micro-batch in ``Forward {i}`` / ``Backward {i}``,
  which post and wait for the receive first, compute, then post the sends: the wait is
  ``[span start, end of the last p2p-receive row starting in the span)`` and the blocking send ops nested in the
  span are p2p too.
- ``Schedule1F1B`` records no span of its own in this torch version (nothing to adapt: ``p2p`` measures it
  from its send/recv rows alone).

DualPipeV and the zero-bubble schedules also run two actions of two stages as one span,
``PP:(0F3;3B1)OVERLAP_F_B`` (the sub-actions get no span of their own): both take the whole span, which waits
for the first sub-action's posted receive (a wait for the second one's, inside the span, is not visible).

Mapping: ``F -> F``, ``B`` (full backward) and ``I`` (backward input) ``-> B``, ``W -> W``; the other actions are
communication or bookkeeping and only widen the batch window. The schedule: ``dualpipev`` when a rank holds
stages r and 2p-1-r (``shardline.job.pipeline.theory``, where the ideal of each schedule lives, has no closed
form for it: ``ideal_fraction`` is NaN), ``interleaved`` (``looped_bfs`` when every F ends before the first B)
for other multi-stage ranks, else ``gpipe`` / ``1f1b``.
A batch ends where a (stage, forward micro-batch) pair repeats. p: the process-group size of the rank's p2p
rows when the trace records it, else ``p_default``; ``m``: the distinct forward micro-batches of a stage in the
batch; ``v``: the distinct stages of the rank.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ..base import intervals as iv
from ..base.schema import P2P_CATEGORIES
from ..table.pipeline_rows import NO_ACTIONS, NO_BATCHES, THIRD_PARTY_PP_PATTERN  # noqa: F401  (any row an adapter reads)

#: Names torch.distributed.pipelining records (the ``PP:`` actions and the single-stage spans).
TORCH_PP_PATTERN = r"^PP:(?P<stage>\d+)(?P<kind>F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)" \
                   r"(?P<microbatch>\d*)$"
TORCH_SINGLE_PATTERN = r"^(?P<kind>Forward|Backward) (?P<microbatch>\d+)$"
#: DualPipeV and the zero-bubble schedules run an F and a B of two stages in one span,
#: ``PP:(0F3;3B1)OVERLAP_F_B`` (``_Action.__repr__`` of an action with ``sub_actions``).
TORCH_OVERLAP_PATTERN = r"^PP:\((?P<subs>[^()]*)\)OVERLAP_F_B$"
_SUB_ACTION = re.compile(r"^(?P<stage>\d+)(?P<kind>F|I|B|W)(?P<microbatch>\d*)$")

_COMPUTE = {"F": "F", "B": "B", "I": "B", "W": "W", "Forward": "F", "Backward": "B"}
_RECV_FOR = {"RECV_F": "F", "RECV_B": "B"}  # the action whose input a posted receive carries


def has_torch_pipelining(events: pd.DataFrame) -> bool:
    return bool(events["name"].astype(str).str.match(THIRD_PARTY_PP_PATTERN).any())


def torch_pipelining_rows(events: pd.DataFrame, lanes: str, *, p_default: int = -1,
                          stage_default: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(batches, actions) of one rank's events (all its rows) in ``bubbles.pp_rows``' columns; both empty when
    the rank has no torch.distributed.pipelining span on ``lanes``. ``stage_default`` is the stage of a
    single-stage schedule (whose names carry none); ``p_default`` the pipeline size when no p2p row records it."""

    lane = events["lane"].astype(str).to_numpy()
    for kind in dict.fromkeys((lanes, "cpu")):  # a GPU rank may carry the spans only on its host threads
        ev = events[lane == kind]
        spans = _spans(ev, stage_default)
        if len(spans):
            break
    else:
        return NO_BATCHES.copy(), NO_ACTIONS.copy()
    start = ev["start_ns"].to_numpy(np.int64)
    end = start + ev["dur_ns"].to_numpy(np.int64)
    category = ev["category"].astype(str).to_numpy()
    recv = (category == "p2p_recv")
    # Blocking send ops only (host ops, nested in a span); a send's async lifetime overlaps later compute.
    send = (category == "p2p_send") & (ev["cat"].astype(str).to_numpy() == "cpu_op")
    p2p = pd.DataFrame({"start_ns": start, "end_ns": end, "recv": recv})[recv | send]
    pg = ev["pg_size"].to_numpy()[np.isin(category, P2P_CATEGORIES)]
    p = int(pg[pg > 0].max()) if (pg > 0).any() else int(p_default)
    actions = _compute_pieces(spans, p2p)
    batches = _batches(spans, p=p)
    actions = actions.assign(rank=int(ev["rank"].iloc[0]) if len(ev) else -1)
    batches = batches.assign(rank=int(ev["rank"].iloc[0]) if len(ev) else -1)
    return (batches[list(NO_BATCHES.columns)].astype(NO_BATCHES.dtypes.to_dict()),
            actions[list(NO_ACTIONS.columns)].astype(NO_ACTIONS.dtypes.to_dict()))


def _spans(ev: pd.DataFrame, stage_default: int) -> pd.DataFrame:
    """The pipeline spans of one lane kind's rows: start, end, kind, stage, microbatch, single, group. An
    ``OVERLAP_F_B`` span gives one row per sub-action, all with its interval and one ``group`` number (they
    run one after the other inside it: the span waits for the first one's receive, see ``_compute_pieces``)."""
    names = ev["name"].astype(str)
    start = ev["start_ns"].to_numpy(np.int64)
    end = start + ev["dur_ns"].to_numpy(np.int64)
    parts = []
    multi = names.str.extract(TORCH_PP_PATTERN)
    hit = multi["kind"].notna().to_numpy()
    parts.append(pd.DataFrame({
        "start_ns": start[hit], "end_ns": end[hit], "kind": multi["kind"][hit].to_numpy(),
        "stage": multi["stage"][hit].astype(int).to_numpy(),
        "microbatch": pd.to_numeric(multi["microbatch"][hit], errors="coerce").fillna(-1).astype(int).to_numpy(),
        "single": False}))
    single = names.str.extract(TORCH_SINGLE_PATTERN)
    hit = single["kind"].notna().to_numpy()
    parts.append(pd.DataFrame({
        "start_ns": start[hit], "end_ns": end[hit], "kind": single["kind"][hit].to_numpy(),
        "stage": stage_default, "microbatch": single["microbatch"][hit].astype(int).to_numpy(), "single": True}))
    overlap = names.str.extract(TORCH_OVERLAP_PATTERN)
    for position in np.flatnonzero(overlap["subs"].notna().to_numpy()):  # one iteration per overlapped pair
        for sub in str(overlap["subs"].iloc[position]).split(";"):
            found = _SUB_ACTION.match(sub.strip())
            if found is None or found["microbatch"] == "":
                continue
            parts.append(pd.DataFrame({"start_ns": [start[position]], "end_ns": [end[position]],
                                       "kind": [found["kind"]], "stage": [int(found["stage"])],
                                       "microbatch": [int(found["microbatch"])], "single": [False],
                                       "group": [int(position)]}))
    spans = pd.concat(parts, ignore_index=True)
    if "group" not in spans:
        spans["group"] = np.nan
    # A span of its own is its own group; the sub-actions of an overlapped span share the span's.
    own = spans["group"].isna().to_numpy()
    spans["group"] = np.where(own, -1 - np.arange(len(spans)), spans["group"].fillna(0)).astype(np.int64)
    return spans.sort_values(["start_ns", "group"], kind="stable").reset_index(drop=True)


def _compute_pieces(spans: pd.DataFrame, p2p: pd.DataFrame) -> pd.DataFrame:
    """Each compute span minus its receive wait and its nested p2p ops, as F/B/W rows (one per piece)."""
    p_start, p_end, p_recv = (p2p[c].to_numpy() for c in ("start_ns", "end_ns", "recv"))
    posted: dict[tuple[str, int, int], int] = {}  # (action, stage, mb) -> completion of its posted receive
    group_ready: dict[int, int] = {}
    rows = []
    for span in spans.itertuples(index=False):  # one iteration per pipeline action, not per event
        inside = (p_start >= span.start_ns) & (p_start < span.end_ns)
        if span.kind in _RECV_FOR:
            done = p_end[inside & p_recv]
            if len(done):
                posted[(_RECV_FOR[span.kind], span.stage, span.microbatch)] = int(done.max())
            continue
        action = _COMPUTE.get(span.kind)
        if action is None:
            continue
        if span.single:  # the span posts and waits for its own receive first
            done = p_end[inside & p_recv]
            ready = int(done.max()) if len(done) else span.start_ns
        else:
            ready = posted.pop((action, span.stage, span.microbatch), span.start_ns)
            if span.group >= 0:  # an overlapped pair waits only for its first action's input, as far as we see
                ready = group_ready.setdefault(span.group, ready)
        nested = inside & (p_end <= span.end_ns)
        busy = iv.subtract(iv.union([max(ready, span.start_ns)], [span.end_ns]),
                           iv.union(p_start[nested], p_end[nested]))
        for lo, hi in zip(*busy):
            rows.append((int(lo), int(hi), action, int(span.stage), int(span.microbatch)))
    return pd.DataFrame(rows, columns=["start_ns", "end_ns", "action", "stage", "microbatch"])


def _batches(spans: pd.DataFrame, *, p: int) -> pd.DataFrame:
    """Batch windows: a new batch starts at the span where a (stage, forward micro-batch) pair repeats."""
    seen: set[tuple[int, int]] = set()
    batch_no = np.zeros(len(spans), np.int64)
    number = 0
    for i, span in enumerate(spans.itertuples(index=False)):
        if _COMPUTE.get(span.kind) == "F":
            key = (span.stage, span.microbatch)
            if key in seen:
                number, seen = number + 1, set()
            seen.add(key)
        batch_no[i] = number
    rows = []
    for _, group in spans.groupby(batch_no, sort=True):
        fwd = group[group["kind"].map(_COMPUTE) == "F"]
        bwd = group[group["kind"].map(_COMPUTE) == "B"]
        v = max(int(group["stage"].nunique()), 1)
        m = int(fwd.groupby("stage")["microbatch"].nunique().max()) if len(fwd) else 0
        gpipe = len(bwd) == 0 or (len(fwd) and fwd["end_ns"].max() <= bwd["start_ns"].min())
        stages = sorted(group["stage"].unique().tolist())
        if v == 2 and p > 0 and stages[0] + stages[1] == 2 * p - 1:  # stages r and 2p-1-r: the V of DualPipeV
            schedule = "dualpipev"
        elif v > 1:
            schedule = "looped_bfs" if gpipe else "interleaved"
        else:
            schedule = "gpipe" if gpipe else "1f1b"
        rows.append({"start_ns": int(group["start_ns"].min()), "end_ns": int(group["end_ns"].max()),
                     "schedule": schedule, "p": p, "m": m, "v": v})
    return pd.DataFrame(rows, columns=["start_ns", "end_ns", "schedule", "p", "m", "v"])


# --- Megatron-core's NVTX phase ranges (Nsight Systems exports) -------------------------------------------------

#: Megatron-core's schedules push ``nvtx_range_push(suffix="warmup" | "steady" | "cooldown")`` inside
#: ``forward_backward_pipelining_with_interleaving`` / ``..._without_interleaving`` (megatron/core/
#: pipeline_parallel/schedules.py); ``megatron.core.utils.nvtx_range_push`` names a range
#: ``f"{module}.{function}.{suffix}"``, e.g.
#: ``megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving.warmup``.
MEGATRON_PHASE_PATTERN = r"^(?:.*\.)?(?P<function>forward_backward_\w+)\.(?P<phase>warmup|steady|cooldown)$"
_MEGATRON_SCHEDULE = {"forward_backward_pipelining_without_interleaving": "1f1b",
                      "forward_backward_pipelining_with_interleaving": "interleaved"}


def megatron_phases(events: pd.DataFrame, lanes: str) -> pd.DataFrame:
    """Megatron's phase ranges of one rank (``start_ns, end_ns, phase, schedule``), on the clock of ``lanes``.

    The ranges are host-side (NVTX). On a GPU rank each is moved onto the GPU as the GPU work it launched:
    ``[first start, last end)`` of the GPU rows whose launch call (same ``correlation``) started inside the
    range; a range that launched nothing keeps its host times. Empty when the rank has no such range."""
    names = events["name"].astype(str)
    found = names.str.extract(MEGATRON_PHASE_PATTERN)
    hit = found["phase"].notna().to_numpy() & (events["lane"].astype(str).to_numpy() == "cpu")
    if not hit.any():
        return pd.DataFrame({"start_ns": np.empty(0, np.int64), "end_ns": np.empty(0, np.int64),
                             "phase": np.empty(0, object), "schedule": np.empty(0, object)})
    start = events["start_ns"].to_numpy(np.int64)[hit]
    end = start + events["dur_ns"].to_numpy(np.int64)[hit]
    if lanes == "gpu":
        start, end = _launched_span(events, start, end)
    order = np.argsort(start, kind="stable")
    return pd.DataFrame({"start_ns": start[order], "end_ns": end[order],
                         "phase": found["phase"].to_numpy()[hit][order],
                         "schedule": found["function"].map(_MEGATRON_SCHEDULE).fillna("").to_numpy()[hit][order]})


def _launched_span(events: pd.DataFrame, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each host range [start, end) as the GPU span of the work launched inside it (host times where none)."""
    lane = events["lane"].astype(str).to_numpy()
    corr = events["correlation"].to_numpy(np.int64)
    t = events["start_ns"].to_numpy(np.int64)
    host = (lane == "cpu") & (corr >= 0)
    gpu = (lane == "gpu") & (corr >= 0)
    launches = pd.DataFrame({"corr": corr[host], "t": t[host]}).drop_duplicates("corr")
    work = pd.DataFrame({"corr": corr[gpu], "start": t[gpu],
                         "end": t[gpu] + events["dur_ns"].to_numpy(np.int64)[gpu]})
    work = work.merge(launches, on="corr", how="inner").sort_values("t")
    if work.empty:
        return start, end
    launched_at = work["t"].to_numpy()
    lo = np.searchsorted(launched_at, start, side="left")
    hi = np.searchsorted(launched_at, end, side="left")
    starts, ends = work["start"].to_numpy(), work["end"].to_numpy()
    out_start, out_end = start.copy(), end.copy()
    for k in np.flatnonzero(hi > lo):  # one iteration per phase range (three per step)
        out_start[k] = int(starts[lo[k]:hi[k]].min())
        out_end[k] = int(ends[lo[k]:hi[k]].max())
    return out_start, out_end
