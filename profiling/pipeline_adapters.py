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
- ``Schedule1F1B`` records no span of its own in this torch version (nothing to adapt: its waits stay p2p).

Mapping: ``F -> F``, ``B`` (full backward) and ``I`` (backward input) ``-> B``, ``W -> W``; the other actions are
communication or bookkeeping and only widen the batch window. A batch ends where a (stage, forward micro-batch)
pair repeats. p: the process-group size of the rank's p2p rows when the trace records it, else ``p_default``;
``m``: the distinct forward micro-batches of a stage in the batch; ``v``: the distinct stages of the rank.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from shardline.profiling import intervals as iv

#: Names torch.distributed.pipelining records (the ``PP:`` actions and the single-stage spans).
TORCH_PP_PATTERN = r"^PP:(?P<stage>\d+)(?P<kind>F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)" \
                   r"(?P<microbatch>\d*)$"
TORCH_SINGLE_PATTERN = r"^(?P<kind>Forward|Backward) (?P<microbatch>\d+)$"
#: Any row an adapter reads (the selector a survey of pipeline rows can use).
THIRD_PARTY_PP_PATTERN = r"^(PP:\d|Forward \d|Backward \d)"

_COMPUTE = {"F": "F", "B": "B", "I": "B", "W": "W", "Forward": "F", "Backward": "B"}
_RECV_FOR = {"RECV_F": "F", "RECV_B": "B"}  # the action whose input a posted receive carries
P2P_CATEGORIES = ("p2p_recv", "p2p_send")


def has_torch_pipelining(events: pd.DataFrame) -> bool:
    return bool(events["name"].astype(str).str.match(THIRD_PARTY_PP_PATTERN).any())


def torch_pipelining_rows(events: pd.DataFrame, lanes: str, *, p_default: int = -1,
                          stage_default: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(batches, actions) of one rank's events (all its rows) in ``bubbles.pp_rows``' columns; both empty when
    the rank has no torch.distributed.pipelining span on ``lanes``. ``stage_default`` is the stage of a
    single-stage schedule (whose names carry none); ``p_default`` the pipeline size when no p2p row records it."""
    from shardline.profiling.bubbles import _NO_ACTIONS, _NO_BATCHES

    lane = events["lane"].astype(str).to_numpy()
    for kind in dict.fromkeys((lanes, "cpu")):  # a GPU rank may carry the spans only on its host threads
        ev = events[lane == kind]
        names = ev["name"].astype(str)
        multi = names.str.extract(TORCH_PP_PATTERN)
        single = names.str.extract(TORCH_SINGLE_PATTERN)
        is_multi, is_single = multi["kind"].notna().to_numpy(), single["kind"].notna().to_numpy()
        if is_multi.any() or is_single.any():
            break
    else:
        return _NO_BATCHES.copy(), _NO_ACTIONS.copy()
    start = ev["start_ns"].to_numpy(np.int64)
    end = start + ev["dur_ns"].to_numpy(np.int64)
    spans = pd.DataFrame({
        "start_ns": np.concatenate([start[is_multi], start[is_single]]),
        "end_ns": np.concatenate([end[is_multi], end[is_single]]),
        "kind": np.concatenate([multi["kind"][is_multi].to_numpy(), single["kind"][is_single].to_numpy()]),
        "stage": np.concatenate([multi["stage"][is_multi].astype(int).to_numpy(),
                                 np.full(int(is_single.sum()), stage_default)]),
        "microbatch": np.concatenate([
            pd.to_numeric(multi["microbatch"][is_multi], errors="coerce").fillna(-1).astype(int).to_numpy(),
            single["microbatch"][is_single].astype(int).to_numpy()]),
        "single": np.concatenate([np.zeros(int(is_multi.sum()), bool), np.ones(int(is_single.sum()), bool)]),
    }).sort_values("start_ns", kind="stable").reset_index(drop=True)
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
    return (batches[list(_NO_BATCHES.columns)].astype(_NO_BATCHES.dtypes.to_dict()),
            actions[list(_NO_ACTIONS.columns)].astype(_NO_ACTIONS.dtypes.to_dict()))


def _compute_pieces(spans: pd.DataFrame, p2p: pd.DataFrame) -> pd.DataFrame:
    """Each compute span minus its receive wait and its nested p2p ops, as F/B/W rows (one per piece)."""
    p_start, p_end, p_recv = (p2p[c].to_numpy() for c in ("start_ns", "end_ns", "recv"))
    posted: dict[tuple[str, int, int], int] = {}  # (action, stage, mb) -> completion of its posted receive
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
        schedule = "gpipe" if gpipe else ("1f1b" if v == 1 else "interleaved")
        rows.append({"start_ns": int(group["start_ns"].min()), "end_ns": int(group["end_ns"].max()),
                     "schedule": schedule, "p": p, "m": m, "v": v})
    return pd.DataFrame(rows, columns=["start_ns", "end_ns", "schedule", "p", "m", "v"])
