"""The ``pipeline`` scenario of ``what_if``: other micro-batch counts, chunks or schedules for a measured pipeline.

The measured per-stage forward / backward costs and the p2p transfer (see ``what_if``'s docstring) are fed to the
schedule generators of ``shardline.job.pipeline`` -- the one representation of a schedule, pure Python below
both halves, which the training engine executes too -- and the prediction is the measured step plus
simulated(new) - simulated(measured).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from shardline.job.errors import ScheduleError
from shardline.job.pipeline.schedule import build_schedule, validate
from shardline.job.pipeline.simulate import split_ops

from ..base import intervals as iv
from ..matching.p2p import pipelines_of
from ..matching.pipelines import BubbleMethod, rank_pipelines
from ..table.rows import step_of
from .scenario import SCHEDULES, Context, Keep, Method, Scenario, ScenarioError

# --- the pipeline scenario -------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Pipe:
    """One measured pipeline: its ranks, shape, the median cost per stage (F, B) and the transfer."""

    source: str
    ranks: tuple[int, ...]
    p: int
    m: int
    v: int
    schedule: str
    forward: dict
    backward: dict
    transfer: float
    notes: list


def pipeline_rows(context: Context, scenario: Scenario) -> list[dict]:
    """``pipeline``: every rank of a measured pipeline, and the step, get ``simulate(new) - simulate(measured)``
    added to their measured time (module docstring)."""
    pipes = _annotated_pipe(context) or _p2p_pipes(context)
    if not pipes:
        raise ScenarioError("pipeline: this trace holds no pipeline to measure (no sl:pp annotations, no "
                            "torch.distributed.pipelining names, no p2p pipeline matched across ranks)")
    rows, deltas = [], []
    for pipe in pipes:
        delta, note = _pipeline_delta(pipe, scenario)
        deltas.append((delta, note))
        table = context.breakdown[context.breakdown["rank"].isin(pipe.ranks)]
        rows += [{"step": step, "rank": rank, "method": Method.SIMULATION.value, "measured_ns": measured,
                  "predicted_ns": measured + delta, "note": note}
                 for rank, step, measured in zip(table["rank"].tolist(), table["step"].tolist(),
                                                 table["step_ns"].tolist())]
    delta, note = max(deltas)
    rows += [{"step": int(step), "rank": -1, "method": Method.SIMULATION.value, "measured_ns": int(measured),
              "predicted_ns": int(measured) + delta, "note": note} for step, measured in context.path.items()]
    return rows


def _pipeline_delta(pipe: _Pipe, scenario: Scenario) -> tuple[int, str]:
    """(simulate(scenario's configuration) - simulate(measured one), the note saying what was assumed)."""
    notes = list(pipe.notes)
    measured = pipe.schedule if pipe.schedule in SCHEDULES else ("interleaved" if pipe.v > 1 else "1f1b")
    if measured != pipe.schedule:
        notes.append(f"measured schedule {pipe.schedule or 'unknown'!r} simulated as {measured}")
    schedule = scenario.schedule or measured
    if scenario.schedule is None and scenario.v is not None:  # a chunk count names its family
        schedule = "interleaved" if scenario.v > 1 else ("1f1b" if measured == "interleaved" else measured)
    v = scenario.v or (pipe.v if schedule == "interleaved" else 1)
    if v > 1 and schedule != "interleaved":
        raise ScenarioError(f"pipeline: v={v} needs schedule=interleaved (got schedule={schedule})")
    m = scenario.m or pipe.m
    scale = pipe.m / m if scenario.keep is Keep.BATCH else 1.0
    old = _makespan(measured, pipe, m=pipe.m, v=pipe.v, scale=1.0)
    new = _makespan(schedule, pipe, m=m, v=v, scale=scale)
    notes.append(f"{pipe.source}: p={pipe.p} m={pipe.m} v={pipe.v} {measured} -> m={m} v={v} {schedule}; "
                 f"transfer {pipe.transfer:.0f} ns; simulated {old:.0f} -> {new:.0f} ns")
    if m != pipe.m:
        notes.append("global batch kept: F, B, transfer x m/m'" if scenario.keep is Keep.BATCH else
                     f"micro-batch size kept: the global batch grows x{m / pipe.m:g}")
    if v != pipe.v:
        notes.append(f"each rank's layers split evenly into {v} chunks")
    return int(round(new - old)), "; ".join(notes)


def _makespan(kind: str, pipe: _Pipe, *, m: int, v: int, scale: float) -> float:
    """Makespan of schedule ``kind`` (p, m, v) with the pipe's stage costs (x ``scale``): a rank runs its ops
    in order, a compute op costs its stage's F or B, a batch of sends and receives is posted at once and done
    ``transfer`` after both ends of each of its receives were posted (rendezvous, as ``match_p2p`` measures a
    transfer: the receive's time after its send started)."""
    p = pipe.p
    try:
        schedule = validate(build_schedule(kind, n_ranks=p, n_microbatches=m, n_chunks=v))
    except ScheduleError as exc:
        raise ScenarioError(f"pipeline: cannot build {kind} with p={p}, m={m}, v={v}: {exc}") from None
    cost = {"F": _stage_costs(pipe.forward, pipe, v), "B": _stage_costs(pipe.backward, pipe, v)}
    transfer = pipe.transfer * scale
    ops = [split_ops(program) for program in schedule.actions]
    posted: dict = {}
    at, clock = [0] * len(ops), [0.0] * len(ops)
    while any(at[r] < len(ops[r]) for r in range(len(ops))):
        moved = False
        for r, mine in enumerate(ops):
            while at[r] < len(mine):
                batch = mine[at[r]][1]
                if batch[0].kind.is_compute:
                    clock[r] += scale * cost["F" if batch[0].kind.code == "F" else "B"][batch[0].stage]
                else:
                    for action in batch:
                        posted.setdefault(action, clock[r])
                    receives = [a for a in batch if a.kind.is_recv]
                    if any(a.partner() not in posted for a in receives):
                        break
                    clock[r] = max([clock[r]] + [max(posted[a], posted[a.partner()]) + transfer for a in receives])
                at[r] += 1
                moved = True
        if not moved:  # validate() proved it cannot happen
            raise AssertionError(f"the {kind} schedule stalled in the what-if timing")
    return max(clock)


def _stage_costs(costs: dict, pipe: _Pipe, v: int) -> np.ndarray:
    """Cost of each of the p v stages: the measured stage's where the chunking is the measured one, else each
    rank's per-micro-batch total (over its measured chunks) split evenly into v."""
    p = pipe.p
    if v == pipe.v and all(s in costs for s in range(p * v)):
        return np.array([costs[s] for s in range(p * v)], dtype=float)
    missing = [s for s in range(p) if not any(c % p == s for c in costs)]
    if missing:
        raise ScenarioError(f"pipeline: no measured cost for the stage(s) of ranks at positions {missing}")
    total = [sum(cost for c, cost in costs.items() if c % p == s) for s in range(p)]
    return np.array([total[s % p] / v for s in range(p * v)], dtype=float)


def _mode(values) -> object:
    return pd.Series(list(values)).mode().iloc[0]


def _annotated_pipe(context: Context) -> list[_Pipe]:
    """The pipeline of the ranks measured from action rows (``sl:pp`` annotations, torch.distributed.
    pipelining): per stage the median F and B (+ W) over every rank holding it."""

    measured = {r: pipe for r, pipe in rank_pipelines(context.attribution)[0].items()
                if pipe.method in (BubbleMethod.ANNOTATIONS, BubbleMethod.TORCH_PIPELINING)}
    if not measured:
        return []
    batches = pd.concat([pipe.batches for pipe in measured.values()], ignore_index=True)
    actions = pd.concat([pipe.actions for pipe in measured.values()], ignore_index=True)
    median = (actions["end_ns"] - actions["start_ns"]).groupby([actions["action"], actions["stage"]]).median()
    forward = median.get("F", pd.Series(dtype=float)).to_dict()
    backward = median.get("B", pd.Series(dtype=float)).to_dict()
    notes = []
    if "W" in median.index.get_level_values(0):
        for stage, cost in median["W"].items():
            backward[stage] = backward.get(stage, 0.0) + cost
        notes.append("W folded into B")
    transfer, note = _median_transfer(context, tuple(measured))
    method = next(iter(measured.values())).method.value
    return [_Pipe(method, tuple(sorted(measured)), int(_mode(batches["p"])), int(_mode(batches["m"])),
                  int(_mode(batches["v"])), str(_mode(batches["schedule"])), forward, backward, transfer,
                  notes + ([note] if note else []))]


def _median_transfer(context: Context, ranks: tuple[int, ...]) -> tuple[float, str]:
    """The median transfer of the matched receives of ``ranks`` (0 and a note without any)."""
    receives = context.receives
    mine = receives[receives["rank"].isin(ranks).to_numpy() & (receives["method"] == "matched").to_numpy()]
    if mine.empty:
        return 0.0, "no matched p2p: transfer taken as 0"
    return float((mine["end_ns"] - mine["start_ns"] - mine["wait_ns"]).median()), ""


def _p2p_pipes(context: Context) -> list[_Pipe]:
    """The pipelines ``match_p2p`` found whose ranks are all measured from their receive waits: shape from
    ``Context.bubbles``, per-stage F and B from the compute between p2p markers (module docstring)."""

    attribution = context.attribution
    if context.receives.empty:
        return []
    shapes = context.bubbles()  # the bubbles' own warnings: given to their callers
    shapes = shapes[shapes["method"] == "p2p_matched"]
    pipes = []
    for pipe in pipelines_of(attribution):
        rows = shapes[shapes["rank"].isin(pipe.ranks) & (shapes["p"] > 0)]
        if len(pipe.ranks) < 2 or not set(pipe.ranks) <= set(rows["rank"]):
            continue
        p, (m, v) = len(pipe.ranks), (int(_mode(rows[c])) for c in ("m", "v"))
        spans = pd.concat([_p2p_spans(context, pipe.ranks, r) for r in pipe.ranks], ignore_index=True)
        forward, backward, notes = _split_costs(spans, p=p, v=v)
        transfer, note = _median_transfer(context, pipe.ranks)
        schedule = str(_mode(rows["schedule"]))
        if v == 1 and m > 1:
            schedule = _one_chunk_schedule(context, pipe.ranks, m=m)
        pipes.append(_Pipe("p2p_matched", pipe.ranks, p, m, v, schedule, forward, backward, transfer,
                           notes + ([note] if note else [])))
    return pipes


def _one_chunk_schedule(context: Context, ranks: tuple[int, ...], *, m: int) -> str:
    """GPipe or 1F1B, from the last stage: GPipe receives all m activations before it sends its first gradient,
    1F1B one (the first stage cannot tell them apart when m <= p: both run every forward first)."""

    messages = context.messages
    last = messages[(messages["rank"] == ranks[-1]).to_numpy() & (messages["peer"] == ranks[-2]).to_numpy()]
    windows = context.attribution.rank(ranks[-1]).attributed_windows
    step = step_of(last["start_ns"].to_numpy(np.int64), windows)
    votes = []
    for k in np.unique(step[step >= 0]):  # one vote per step
        mine = last[step == k]
        grads = mine.loc[mine["kind"] == "send", "start_ns"]
        acts = mine.loc[mine["kind"] == "recv", "end_ns"]
        if len(grads):
            votes.append("gpipe" if int((acts <= grads.min()).sum()) >= m else "1f1b")
    return str(_mode(votes)) if votes else "1f1b"


def _p2p_spans(context: Context, ranks: tuple[int, ...], rank: int) -> pd.DataFrame:
    """The compute of one rank between consecutive p2p markers of a step (``position``, ``kind`` F, B or FB,
    ``compute_ns``): a receive's end starts an action, a send's start ends one (module docstring)."""

    p, position = len(ranks), ranks.index(rank)
    messages = context.messages
    mine = messages[(messages["rank"] == rank).to_numpy() & messages["peer"].isin(ranks).to_numpy()]
    peer = mine["peer"].map(ranks.index).to_numpy(np.int64)
    send = (mine["kind"] == "send").to_numpy()
    down = np.where(send, (peer - position) % p == 1, (position - peer) % p == 1) if p > 2 else \
        np.where(send, peer > position, peer < position)
    time = np.where(send, mine["start_ns"].to_numpy(np.int64), mine["end_ns"].to_numpy(np.int64))
    order = np.lexsort((~send, time))  # at one time a send (an end) before a receive (a start)
    time, send, forward = time[order], send[order], down[order]
    windows = context.attribution.rank(rank).attributed_windows
    step = step_of(time, windows)
    compute = context.attribution.rank(rank).label_sets.get("compute", iv.EMPTY)
    # Consecutive markers of one step; a span from a send to a receive holds no action (the rank waited).
    same = (step[1:] == step[:-1]) & (step[1:] >= 0) & ~(send[:-1] & ~send[1:])
    lo, hi = time[:-1][same], time[1:][same]
    first_kind = np.where(send[:-1], forward[1:], forward[:-1])[same]  # a send-send span: the later send's
    mixed = (~send[:-1] & send[1:] & (forward[:-1] != forward[1:]))[same]
    # The head of each step: from its window's start to its first marker, where that is a send.
    first = np.flatnonzero(np.concatenate([[True], step[1:] != step[:-1]]) & send & (step >= 0))
    start = windows.set_index("step")["start_ns"]
    lo = np.concatenate([lo, start.reindex(step[first]).to_numpy(np.int64)])
    hi = np.concatenate([hi, time[first]])
    kind = np.where(np.concatenate([mixed, np.zeros(len(first), bool)]), "FB",
                    np.where(np.concatenate([first_kind, forward[first]]), "F", "B"))
    busy = iv.window_totals(compute, lo=lo, hi=hi)
    return pd.DataFrame({"position": position, "kind": kind, "compute_ns": busy})[busy > 0]


def _split_costs(spans: pd.DataFrame, *, p: int, v: int) -> tuple[dict, dict, list]:
    """Per stage (position + chunk x p) the median F and B: from the one-action spans, a two-action span's
    median less the known half, else split by the other stages' median B/F ratio (2 without any)."""
    median = spans.groupby(["position", "kind"])["compute_ns"].median()
    forward, backward, pending, notes = {}, {}, [], []
    for s in range(p):
        f, b, fb = (float(median[(s, k)]) if (s, k) in median.index else None for k in ("F", "B", "FB"))
        if f is None and b is not None and fb is not None:
            f = fb - b
        if b is None and f is not None and fb is not None:
            b = fb - f
        if f is None or b is None:
            if fb is None:
                raise ScenarioError(f"pipeline: no compute measured between the p2p messages of stage {s}")
            pending.append((s, fb))
            continue
        forward[s], backward[s] = f, b
    ratios = [backward[s] / forward[s] for s in forward if forward[s] > 0]
    ratio = float(np.median(ratios)) if ratios else 2.0
    for s, fb in pending:
        forward[s], backward[s] = fb / (1 + ratio), fb * ratio / (1 + ratio)
        notes.append(f"stage {s}: F and B split by B/F = {ratio:.3g}" + ("" if ratios else " (assumed)"))
    chunks = {s + c * p: cost for s, cost in forward.items() for c in range(v)}
    return chunks, {s + c * p: cost for s, cost in backward.items() for c in range(v)}, notes
