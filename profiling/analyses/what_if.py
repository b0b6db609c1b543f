"""What-if: the step time per rank and per step under a scenario, predicted from one measured trace.

``what_if(source, scenario)`` (``present.scenarios``: it gives this module's ``predict`` the ``Context`` it
builds) -> one row per (step, rank) and scenario (``RESULT_COLUMNS``): ``measured_ns``,
``predicted_ns``, ``saved_ns = measured - predicted`` and the ``method`` (:class:`Method`) that gave it; ``rank``
-1 is the whole step, whose measured time is the step's critical path length (``critical_path``, on the
aligned clock). ``note`` says which assumption applies ("" where none does). Every number is integer ns.

Methods:

- *exact bound on the attribution* (per rank): the rank's step minus the time of its own breakdown the scenario
  removes, exactly, on its partition (``attribution``). It ignores what other ranks do, so it bounds that rank's
  step from below where the scenario only removes time.
- *critical-path replay* (per step): the chain's length with the scenario applied to its segments, the chain
  kept as it is. Another chain may become the critical one, so the replay is floored at the longest *work*
  (compute, copies, memsets: what none of these scenarios shortens) of a rank in the step; the note says
  where the floor applies. The no_straggler scenario leaves the straggler's own work out of the floor.
- *simulation* (pipelines): the measured per-stage costs fed into the schedule the scenario names.

Scenarios (:class:`Scenario`, or its text ``kind[:key=value,...]``):

- ``overlap`` (``category=``/``dim=``: only those; ``+`` joins several): communication perfectly hidden under
  compute. Per rank: step - exposed communication (the breakdown's exposed comm columns, so every wait inside a
  communication call too: the most the rank could gain). Per step: the path minus its communication *work*
  segments (``c transfer``, ``c unmatched``, ``p2p transfer``, ``p2p send``, ``p2p unmatched``). Its waits
  (``c wait``, ``p2p wait``, ``bubble``) stay: a wait is a rank blocked on another's late arrival, and hiding
  data movement under compute does not make that rank arrive sooner.
- ``comm_faster:k=K`` (with ``category=``/``dim=``): data moves K times faster; waiting does not change. Per rank:
  step - (1 - 1/K) x exposed transfer, the exposed time of the rank's comm rows outside the waits of their matched
  calls (``match_collectives``; receives: ``match_p2p``); the overlapped part stays hidden. Per step: the path's
  communication work segments shrink to 1/K.
- ``no_straggler[:rank=R]`` (default: per step, ``collectives.stragglers``'): R arrives on time. Per other rank r:
  step - r's exposed waits *for R* (waits of matched collectives whose last arriver is R, of receives whose sender
  is R, less r's compute). Per step: every maximal stretch ``[a, b)`` of the path on R is cut back to what the
  median other rank needed for the same span, ``(b - a)`` minus its exposed waits for R inside it (never
  lengthened); the other ranks are R's peers within its pipeline stage (``collectives.stage_peers``: another
  stage does other work in that span) where it has any. R's own row gets the step's saving.
- ``no_host_bound``: no host-bound idle (``idle.idle_sets``' ``idle_host_bound``). Per rank: step -
  ``idle_host_bound``. Per step: the path's ``idle`` segments lose exactly their host-bound part.
- ``no_idle[:cause=pageable|sync|dataloader|host_bound]`` (default ``pageable``): no idle of that cause
  (``idle.idle_sets``' ``idle_<cause>``; ``pageable``: ``idle.pageable_idle``, the GPU idle while the host was
  blocked in a copy from or to pageable memory). Per rank: step - that idle. Per step: the path's ``idle``
  segments lose exactly that part.
- ``pipeline[:m=M,v=V,schedule=gpipe|1f1b|interleaved,keep=microbatch|batch]``: another micro-batch count,
  chunk count or schedule (unnamed: as measured), by simulation (below); every rank of the pipeline and the
  step get the same change.

Pipelines. Per stage, the median F and B durations: from the action rows (``bubbles.rank_pipelines``: ``sl:pp``
annotations, torch.distributed.pipelining through the adapters; W is folded into B), else, for a pipeline seen
through p2p only, from the compute between the rank's p2p markers: a receive's end starts an action, a send's
start ends one, of the kind its direction says (downstream: F, upstream: B). A span from a receive to the next
send of the same kind, from a send to the next send, or from a receive to the next receive is one action; a
receive-to-send span of two kinds is one F and one B (their sum known: the known half is subtracted, and where
neither is known the B/F ratio of the other stages splits it, 2 without any). The transfer is the median
transfer of the matched receives (``match_p2p``), 0 without any. The predicted step is the measured step plus
``simulate(new) - simulate(measured configuration)``, so what the model does not hold (the optimizer, a closing
all-reduce) is carried over as measured. ``keep=microbatch`` (default): the micro-batch size stays, each micro-
batch costs what it did and the global batch grows m'/m; ``keep=batch``: the global batch stays and F, B and the
transfer scale by m/m' (linear in the micro-batch size, optimistic for small ones). A new ``v`` splits each
rank's per-micro-batch cost evenly over its v chunks. The schedules are ``plugins.pipeline.schedule``'s (the
one import of the training side here, made on use: the schedules are data both halves share, pure Python);
the timing walks their ops as ``plugins.pipeline.simulate`` does -- sends posted and not waited on -- with one
cost per stage and rendezvous receives: done ``transfer`` after both ends were posted (how ``match_p2p``
measures a transfer). The measured schedule of a one-chunk p2p pipeline is read off its last stage (GPipe
receives every activation before its first gradient send, 1F1B one), where the first stage cannot tell.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..attribution.idle import cause_set, pageable_idle
from ..base import intervals as iv
from ..base.schema import COMM_CATEGORIES, P2P_CATEGORIES
from ..matching.collectives import stage_peers, stragglers
from ..table.partition import LABELS
from .scenario import Context, Keep, Method, Scenario, ScenarioError, ScenarioKind
from .what_if_pipeline import pipeline_rows

__all__ = ["RESULT_COLUMNS", "Context", "Keep", "Method", "Scenario", "ScenarioError", "ScenarioKind", "predict"]

RESULT_COLUMNS = ("step", "rank", "scenario", "method", "measured_ns", "predicted_ns", "saved_ns", "note")
#: Breakdown columns of work besides compute that no scenario here removes (the floor of a replay).
_WORK_COLUMNS = ("memcpy_h2d", "memcpy_d2h", "memcpy_d2d", "memset")
#: Chain labels of communication work (the rest of the communication labels are waiting).
_WORK_SUFFIXES = (" transfer", " unmatched")


def predict(context: Context, scenario) -> pd.DataFrame:
    """Predicted step times of the attribution of ``context`` (a :class:`Context`, see ``Context.build``)
    under ``scenario`` (a :class:`Scenario`, its text, or a list of them): ``RESULT_COLUMNS``, per scenario by
    step, the whole step (rank -1) first. ``present.scenarios.what_if`` is the entry point for a trace set."""
    many = scenario if isinstance(scenario, list | tuple) else [scenario]
    frames = [_predict(context, s if isinstance(s, Scenario) else Scenario.parse(s)) for s in many]
    if not frames:
        raise ScenarioError("what_if: no scenario given")
    return pd.concat(frames, ignore_index=True)


def _predict(context: Context, scenario: Scenario) -> pd.DataFrame:
    attribution = context.attribution
    if scenario.kind is ScenarioKind.PIPELINE:
        return _frame(pipeline_rows(context, scenario), scenario)
    if scenario.kind is ScenarioKind.NO_STRAGGLER:
        return _frame(_straggler_rows(context, scenario), scenario)
    ranks = {}
    chain = context.chain
    if scenario.kind in (ScenarioKind.NO_HOST_BOUND, ScenarioKind.NO_IDLE):
        cause = "host_bound" if scenario.kind is ScenarioKind.NO_HOST_BOUND else scenario.cause
        ranks = _idle_of_ranks(context, cause)
        path_saved = _idle_on_path(context, cause)
        note = f"the path's idle loses its {cause.replace('_', '-')} part"
    else:
        transfer_only = scenario.kind is ScenarioKind.COMM_FASTER
        share = 1.0 - 1.0 / scenario.k if transfer_only else 1.0
        for rank in attribution.working:
            windows = rank.attributed_windows
            exposed = iv.window_totals(_exposed_comm(context, rank, scenario, transfer_only=transfer_only),
                                       lo=windows["start_ns"].to_numpy(), hi=windows["end_ns"].to_numpy())
            ranks.update({(rank.rank, int(s)): share * float(e) for s, e in zip(windows["step"], exposed)})
        work = chain["busy"].to_numpy() & chain["category"].isin(scenario.selected()).to_numpy() \
            & (chain["label"].str.endswith(_WORK_SUFFIXES) | (chain["label"] == "p2p send")).to_numpy()
        if scenario.dims:
            work &= chain["dim"].isin(scenario.dims).to_numpy()
        path_saved = (share * chain["dur_ns"].where(work, 0)).groupby(chain["step"]).sum()
        note = ("rank rows: every exposed communication ns, its waits too" if not transfer_only else
                f"transfer x 1/{scenario.k:g}, waits unchanged")
    return _frame(_combine(context, ranks, path_saved, note=note), scenario)


def _frame(rows: list[dict], scenario: Scenario) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=[c for c in RESULT_COLUMNS if c != "scenario"])
    frame.insert(2, "scenario", str(scenario))
    frame = frame.astype({"step": np.int64, "rank": np.int64, "measured_ns": np.int64, "predicted_ns": np.int64})
    frame["saved_ns"] = frame["measured_ns"] - frame["predicted_ns"]
    frame["note"] = frame["note"].fillna("").astype(str)
    return frame.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)[list(RESULT_COLUMNS)]


def _combine(context: Context, saved: dict, path_saved: pd.Series, *, note: str,
             exclude: frozenset = frozenset()) -> list[dict]:
    """Rank rows (bound: step - saved; the (rank, step) pairs in ``exclude``: a replay, given the step's saving)
    and step rows (replay: path - path_saved, floored at the longest work of a rank not excluded)."""
    table = context.breakdown
    pairs = pd.MultiIndex.from_arrays([table["rank"], table["step"]])
    work = table[["compute", *_WORK_COLUMNS]].sum(axis=1).where(~pairs.isin(list(exclude)), -1)
    longest = work.groupby(table["step"]).max()
    worker = table.loc[work.groupby(table["step"]).idxmax(), ["step", "rank"]].set_index("step")["rank"]
    rows = []
    for rank, step, measured in zip(table["rank"].tolist(), table["step"].tolist(), table["step_ns"].tolist()):
        if (rank, step) in saved:
            rows.append({"step": step, "rank": rank, "measured_ns": measured, "note": "",
                         "method": (Method.REPLAY if (rank, step) in exclude else Method.BOUND).value,
                         "predicted_ns": int(round(measured - saved[(rank, step)]))})
    for step, measured in context.path.items():
        replay = int(round(measured - float(path_saved.get(step, 0.0))))
        floor = int(longest.get(step, -1))
        text = note if floor <= replay else \
            f"{note}; the replay ({replay} ns) is below rank {int(worker[step])}'s own work: floored there"
        rows.append({"step": int(step), "rank": -1, "method": Method.REPLAY.value, "measured_ns": int(measured),
                     "predicted_ns": max(replay, floor), "note": text})
    return rows


# --- communication sets of one rank (its own clock) ---------------------------------------------------------------

def _exposed_comm(context: Context, rank, scenario: Scenario, *, transfer_only: bool) -> iv.IntervalSet:
    """The rank's exposed time of the scenario's communication: per category c the ns its partition gives to c
    (c's rows of the chosen dims less every label above c), without the waits of c (outside any transfer of c)
    when ``transfer_only``."""
    sets = rank.label_sets
    comm = rank.work(["category", "dim", "start_ns", "dur_ns"], categories=COMM_CATEGORIES) if scenario.dims \
        else None
    out = []
    for category in scenario.selected():
        if category not in sets:
            continue
        mine = sets[category]
        if comm is not None:
            rows = comm[(comm["category"].astype(str) == category).to_numpy()
                        & comm["dim"].astype(str).isin(scenario.dims).to_numpy()]
            start = rows["start_ns"].to_numpy(np.int64)
            mine = iv.intersect(mine, iv.union(start, start + rows["dur_ns"].to_numpy(np.int64)))
        if transfer_only:
            wait, transfer = _wait_transfer(context, rank.rank, category)
            mine = iv.subtract(mine, iv.subtract(wait, transfer))
        higher = [sets[label] for label in LABELS[:LABELS.index(category)] if label in sets]
        out.append(iv.subtract(mine, iv.merge(*higher)) if higher else mine)
    return iv.merge(*out) if out else iv.EMPTY


def _wait_transfer(context: Context, rank: int, category: str, *, waits_for: int | None = None):
    """(wait set, transfer set) of the rank's matched calls of ``category`` (receives for p2p) on its own
    clock; ``waits_for``: only the waits for that rank (the last arriver, the sender)."""
    if category in P2P_CATEGORIES:
        mine = context.receives[context.receives["rank"] == rank]
        if waits_for is not None:
            mine = mine[mine["peer"] == waits_for]
        start = mine["start_ns"].to_numpy(np.int64)
    else:
        calls = context.calls
        mine = calls[(calls["rank"] == rank).to_numpy() & (calls["category"] == category).to_numpy()]
        if waits_for is not None:
            mine = mine[mine["last_rank"] == waits_for]
        start = mine["start_ns"].to_numpy(np.int64) + context.offsets.get(rank, 0)
    mid = start + mine["wait_ns"].to_numpy(np.int64)
    end = (mine["end_ns"].to_numpy(np.int64) - mine["start_ns"].to_numpy(np.int64)) + start
    return iv.union(start, mid), iv.union(mid, end)


def _waits_for(context: Context, rank, straggler: int) -> iv.IntervalSet:
    """The rank's exposed waits for ``straggler``: its collectives' waits whose last arriver it is and its
    receives' waits on its sends, less the rank's compute (own clock)."""
    categories = sorted(set(context.calls["category"]) - {""}) + ["p2p_recv"]
    waits = iv.merge(*[_wait_transfer(context, rank.rank, c, waits_for=straggler)[0] for c in categories])
    return iv.subtract(waits, rank.label_sets.get("compute", iv.EMPTY))


# --- scenarios on the path ----------------------------------------------------------------------------------------

def _idle_set(context: Context, number: int, cause: str):
    rank = context.attribution.rank(number)
    if cause == "pageable":
        return pageable_idle(context.attribution, rank)
    return cause_set(context.attribution, rank, f"idle_{cause}")


def _idle_of_ranks(context: Context, cause: str) -> dict:
    """(rank, step) -> the ns of ``cause``'s idle in that rank's step window."""
    table = context.breakdown
    if cause != "pageable":
        return dict(zip(zip(table["rank"], table["step"]), table[f"idle_{cause}"].astype(float)))
    out = {}
    for rank in context.attribution.working:
        step_no, lo, hi = rank.window_bounds
        totals = iv.window_totals(_idle_set(context, rank.rank, cause), lo=lo, hi=hi)
        out.update({(rank.rank, int(s)): float(t) for s, t in zip(step_no.tolist(), totals.tolist())})
    return out


def _idle_on_path(context: Context, cause: str) -> pd.Series:
    """Per step, the idle of ``cause`` (``_idle_set``) under the path's ``idle`` segments."""

    chain = context.chain
    saved = np.zeros(len(chain), dtype=np.int64)
    idle = (chain["label"] == "idle").to_numpy()
    for number in np.unique(chain["rank"].to_numpy()[idle]).tolist():  # the ranks on the path
        on = np.flatnonzero(idle & (chain["rank"].to_numpy() == number))
        removed = _idle_set(context, number, cause)
        shift = chain["offset_ns"].to_numpy(np.int64)[on]
        saved[on] = iv.window_totals(removed, lo=chain["start_ns"].to_numpy(np.int64)[on] + shift,
                                     hi=chain["end_ns"].to_numpy(np.int64)[on] + shift)
    return pd.Series(saved).groupby(chain["step"].to_numpy()).sum()


def _straggler_rows(context: Context, scenario: Scenario) -> list[dict]:
    """``no_straggler``: per step the straggler R (given, or ``stragglers``'), each other rank's bound
    (step - its exposed waits for R) and the path replay (module docstring)."""

    chosen = _straggler_of_steps(context, scenario)
    working = {r.rank: r for r in context.attribution.working}
    has_step = {r: set(rank.attributed_windows["step"].tolist()) for r, rank in working.items()}
    waits = {(r, s): _waits_for(context, working[r], s) for s in set(chosen.values()) for r in working if r != s}
    saved, path_saved, peers_of = {}, {}, {}
    for number, rank in working.items():
        windows = rank.attributed_windows
        culprit = windows["step"].map(chosen).fillna(number).to_numpy(np.int64)
        for straggler in set(culprit.tolist()) - {number}:  # one straggler per step: a handful
            mine = windows[culprit == straggler]
            totals = iv.window_totals(waits[(number, straggler)], lo=mine["start_ns"].to_numpy(),
                                      hi=mine["end_ns"].to_numpy())
            saved.update({(number, int(s)): float(t) for s, t in zip(mine["step"], totals)})
    for step, rows in context.chain.groupby("step", sort=True):
        straggler = chosen.get(int(step))
        if straggler is None:
            continue
        on = rows["rank"].to_numpy() == straggler
        stretch = np.cumsum(np.concatenate([[True], on[1:] != on[:-1]]))[on]
        start, end = rows["start_ns"].to_numpy()[on], rows["end_ns"].to_numpy()[on]
        if straggler not in peers_of:  # its pipeline stage's ranks, where it has any; one straggler a step
            peers_of[straggler] = stage_peers(context.calls, straggler)
        peers = peers_of[straggler]
        others = [r for r in working if r != straggler and int(step) in has_step[r] and (not peers or r in peers)]
        cut = 0
        for k in np.unique(stretch):  # a handful of stretches per step
            a, b = int(start[stretch == k][0]), int(end[stretch == k][-1])
            needed = [(b - a) - int(iv.window_totals(waits[(r, straggler)], lo=[a + context.offsets.get(r, 0)],
                                                     hi=[b + context.offsets.get(r, 0)])[0]) for r in others]
            cut += max(0, (b - a) - int(np.median(needed))) if needed else 0
        path_saved[int(step)] = cut
        if int(step) in has_step.get(straggler, ()):
            saved[(straggler, int(step))] = float(cut)
    rows = _combine(context, saved, pd.Series(path_saved, dtype=float), exclude=frozenset(
        (r, s) for s, r in chosen.items()), note="its stretches of the path cut to the median other rank")
    for row in rows:
        if row["step"] in chosen:
            straggler = chosen[row["step"]]
            mine = {-1: f": {row['note']}", straggler: ": given the step's saving"}.get(row["rank"], "")
            row["note"] = f"straggler rank {straggler}{mine}"
    return rows


def _straggler_of_steps(context: Context, scenario: Scenario) -> dict[int, int]:
    """Step -> the straggler: the scenario's rank on every step, else ``collectives.stragglers``' per step."""
    steps = sorted(int(s) for s in context.path.index)
    if scenario.rank is not None:
        if scenario.rank not in {r.rank for r in context.attribution.working}:
            raise ScenarioError(f"no_straggler: rank {scenario.rank} has no work in this trace (ranks "
                                f"{[r.rank for r in context.attribution.working]})")
        return dict.fromkeys(steps, scenario.rank)
    if context.calls.empty:
        raise ScenarioError("no_straggler: this trace has no matched collectives to name a straggler by; give "
                            "rank=R")

    table = stragglers(context.calls)
    return {int(s): int(r) for s, r, w in zip(table["step"], table["straggler_rank"], table["caused_wait_ns"])
            if int(s) in steps and w > 0}
