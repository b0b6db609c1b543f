"""Proving a schedule sound (:func:`validate`) and predicting its timing (:func:`simulate`), with one event loop.

Execution model (what :class:`~shardline.plugins.pipeline.engine.PipelineEngine` does). A rank runs its actions
in order. A maximal run of consecutive send/recv actions is one *batch*: all of its operations are posted
together (``batch_isend_irecv``, a NCCL group), then the rank waits.

- **Validation** uses the strictest semantics any backend may have: a batch completes only once *every*
  operation in it has had its partner posted (the partner's rank has reached the partner's batch). A schedule
  that completes under this rendezvous semantics cannot deadlock on gloo (whose sends are asynchronous) nor on
  NCCL (whose sends may block until the matching receive is posted, and which serialises the operations between
  one pair of ranks): completion order is the same on both ends of every pair.
- **Timing** (:func:`simulate`) follows what the engine does: sends are posted and not waited on, and a send's
  bytes travel as soon as it is posted (eager, as gloo's asynchronous sends do), so a receive completes at
  ``max(its own posting, its partner's posting + t_comm)``: a receive posted after the data arrived waits for
  nothing. (Under a rendezvous transport the transfer would start only once both are posted,
  ``max(both) + t_comm``; the model does not price that.) Compute actions take ``t_forward``, ``t_backward``
  or ``t_weight`` (three separate costs: with a split backward ``t_backward`` is the input-gradient half only).

Definitions: ``busy_r`` is rank ``r``'s compute time, ``idle_r = makespan - busy_r``, and the bubble fraction is
``sum_r idle_r / (p * makespan)``. Under unit costs (F = B = 1, no comm) GPipe and 1F1B give
``makespan = 2 (m + p - 1)`` and bubble ``(p - 1) / (m + p - 1)``.

Memory (in flight on a rank). A (stage, micro-batch) pair holds its activations from its forward until its
backward is complete: until its B when the backward is not split, until its W when it is (the schedule has a W
for that pair). Between B and W a split backward no longer needs the whole saved graph, only what the
weight gradients read (each layer's input and its output gradient), so that stretch is counted in two ways:

- ``peak_in_flight`` counts such a pair as fully held (an integer, one per pair from F to W): the conservative
  count, in which the zero-bubble schedules meet their papers' bounds (``p`` micro-batches for ZB-H1 and
  ZB-V, ``2 p - 1`` for ZB-H2, ``PP + 1`` chunks for DualPipeV).
- ``peak_held`` weighs a pair between B and W by ``w_held_fraction`` (a parameter of :func:`simulate`, default
  1.0, which makes it equal to ``peak_in_flight``): the share of a micro-batch's activation memory that W still
  reads, for a caller that knows it for its model.

Both are maxima over each rank's program order, so they do not depend on the costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ScheduleError
from .actions import Action, ActionKind, Schedule

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


@dataclass(frozen=True)
class Timed:
    """One executed compute action on one rank."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    """Timing of a schedule. Lists are indexed by rank; ``peak_in_flight``/``peak_held`` per the module docstring."""

    makespan: float
    busy: list[float]
    idle: list[float]
    bubble_fraction: float
    peak_in_flight: list[int]
    timeline: list[Timed]
    peak_held: list[float] = field(default_factory=list)


def split_ops(program: tuple[Action, ...]) -> list[tuple[int, list[Action]]]:
    """A rank's program as executed: each compute action alone, each maximal run of send/recv actions as one
    batch; every op with the step index of its first action. The engine runs exactly these ops."""
    ops: list[tuple[int, list[Action]]] = []
    for step, action in enumerate(program):
        if not action.kind.is_compute and ops and not ops[-1][1][0].kind.is_compute:
            ops[-1][1].append(action)
        else:
            ops.append((step, [action]))
    return ops


def _check_counts(schedule: Schedule) -> None:
    """Every (stage, mb) has one F and one B (and at most one W), in the order F < B < W on its rank."""
    uses_w = any(a.kind is W for prog in schedule.actions for a in prog)
    for rank, program in enumerate(schedule.actions):
        position: dict[Action, int] = {}
        for step, action in enumerate(program):
            if action in position:
                raise ScheduleError(f"rank {rank}, step {step}: {action} repeats the action at step "
                                    f"{position[action]}")
            position[action] = step
        for stage in schedule.stages_of_rank(rank):
            for mb in range(schedule.n_microbatches):
                _check_compute_order(schedule, rank, stage, mb, position, uses_w)
                _check_dataflow(schedule, rank, stage, mb, position)


def _check_compute_order(schedule, rank, stage, mb, position, uses_w) -> None:
    f, b, w = (position.get(Action(k, stage, mb)) for k in (F, B, W))
    if schedule.forward_only:  # an evaluation schedule: exactly one forward per (stage, micro-batch)
        if f is None:
            raise ScheduleError(f"rank {rank}: stage {stage} micro-batch {mb} lacks {Action(F, stage, mb)} "
                                "(a forward-only schedule needs exactly one forward per (stage, micro-batch))")
        return
    if f is None or b is None or (uses_w and w is None):
        missing = [str(Action(k, stage, mb)) for k, s in ((F, f), (B, b), (W, w)) if s is None
                   and (k is not W or uses_w)]
        raise ScheduleError(f"rank {rank}: stage {stage} micro-batch {mb} lacks {missing} "
                            f"(every (stage, micro-batch) needs exactly one forward and one backward)")
    if b < f:
        raise ScheduleError(f"rank {rank}, step {b}: backward {Action(B, stage, mb)} comes before its forward "
                            f"at step {f}")
    if w is not None and w < b:
        raise ScheduleError(f"rank {rank}, step {w}: {Action(W, stage, mb)} comes before its backward at "
                            f"step {b}")


def _check_dataflow(schedule, rank, stage, mb, position) -> None:
    """The receive feeding a compute comes before it, the send of its result after it; local edges need none."""
    last = schedule.n_stages - 1
    f = position[Action(F, stage, mb)]
    edges = [(ActionKind.RECV_ACT, stage > 0, f, "before", "forward"),
             (ActionKind.SEND_ACT, stage < last, f, "after", "forward")]
    if not schedule.forward_only:
        b = position[Action(B, stage, mb)]
        edges += [(ActionKind.RECV_GRAD, stage < last, b, "before", "backward"),
                  (ActionKind.SEND_GRAD, stage > 0, b, "after", "backward")]
    for kind, has_peer, anchor, where, what in edges:
        action = Action(kind, stage, mb)
        remote = has_peer and schedule.rank_of_stage(action.peer_stage) != rank
        at = position.get(action)
        if remote and at is None:
            raise ScheduleError(f"rank {rank}, step {anchor}: {what} of stage {stage} micro-batch {mb} needs "
                                f"{action} {where} it, and the rank has none")
        if not remote and at is not None:
            raise ScheduleError(f"rank {rank}, step {at}: {action} has no remote peer (stage "
                                f"{action.peer_stage} is {'absent' if not has_peer else 'on this rank'})")
        if remote and (at > anchor if where == "before" else at < anchor):
            raise ScheduleError(f"rank {rank}, step {at}: {action} must come {where} the {what} "
                                f"at step {anchor}")


def _check_channels(schedule: Schedule) -> None:
    """On every ordered pair of ranks, the k-th send of one end is the partner of the k-th recv of the other."""
    sends: dict[tuple[int, int], list[tuple[int, Action]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, Action]]] = {}
    for rank, program in enumerate(schedule.actions):
        for step, a in enumerate(program):
            if a.kind.is_send:
                sends.setdefault((rank, schedule.rank_of_stage(a.peer_stage)), []).append((step, a))
            elif a.kind.is_recv:
                recvs.setdefault((schedule.rank_of_stage(a.peer_stage), rank), []).append((step, a))
    for (src, dst) in sorted(set(sends) | set(recvs)):
        out, inc = sends.get((src, dst), []), recvs.get((src, dst), [])
        for k in range(max(len(out), len(inc))):
            if k >= len(out) or k >= len(inc) or out[k][1].partner() != inc[k][1]:
                send = f"rank {src} step {out[k][0]} {out[k][1]}" if k < len(out) else f"rank {src}: nothing"
                recv = f"rank {dst} step {inc[k][0]} {inc[k][1]}" if k < len(inc) else f"rank {dst}: nothing"
                raise ScheduleError(f"send/recv order mismatch on channel rank {src} -> rank {dst} at message "
                                    f"{k}: {send} vs {recv} (the k-th send must meet the k-th recv)")


class _Memory:
    """Per-rank activation count: pairs between F and B (``full``) and between B and W (``after_b``)."""

    def __init__(self, schedule: Schedule, w_fraction: float):
        self.split = [{(a.stage, a.microbatch) for a in program if a.kind is W} for program in schedule.actions]
        self.full = [set() for _ in schedule.actions]
        self.after_b = [set() for _ in schedule.actions]
        self.w_fraction = w_fraction
        self.peak = [0] * schedule.n_ranks
        self.peak_held = [0.0] * schedule.n_ranks

    def step(self, rank: int, action: Action) -> None:
        key = (action.stage, action.microbatch)
        if action.kind is F:
            self.full[rank].add(key)
        elif action.kind is B:
            self.full[rank].discard(key)
            if key in self.split[rank]:
                self.after_b[rank].add(key)
        else:
            self.after_b[rank].discard(key)
        full, after = len(self.full[rank]), len(self.after_b[rank])
        self.peak[rank] = max(self.peak[rank], full + after)
        self.peak_held[rank] = max(self.peak_held[rank], full + self.w_fraction * after)


def _run(schedule: Schedule, *, strict: bool, costs: dict, t_comm: float, w_fraction: float = 1.0):
    """Event loop shared by validate and simulate; returns (pc, ops, clock per rank, timeline, memory)."""
    ops = [split_ops(program) for program in schedule.actions]
    posted: dict[Action, float] = {}
    pc = [0] * schedule.n_ranks
    clock = [0.0] * schedule.n_ranks
    timeline: list[Timed] = []
    memory = _Memory(schedule, w_fraction)
    progress = True
    while progress:
        progress = False
        for rank in range(schedule.n_ranks):
            while pc[rank] < len(ops[rank]):
                _, batch = ops[rank][pc[rank]]
                head = batch[0]
                if head.kind.is_compute:
                    cost = costs[head.kind]
                    timeline.append(Timed(rank, head, clock[rank], clock[rank] + cost))
                    clock[rank] += cost
                    memory.step(rank, head)
                else:
                    for a in batch:
                        posted.setdefault(a, clock[rank])
                    waits_on = [a.partner() for a in batch if strict or a.kind.is_recv]
                    if any(p not in posted for p in waits_on):
                        break
                    clock[rank] = max([clock[rank]] + [posted[p] + t_comm for p in waits_on])
                pc[rank] += 1
                progress = True
    return pc, ops, clock, timeline, memory


def _deadlock_message(schedule: Schedule, pc, ops) -> str:
    lines = []
    for rank, at in enumerate(pc):
        if at < len(ops[rank]):
            step, batch = ops[rank][at]
            head = batch[0]
            lines.append(f"rank {rank} blocked at step {step} on [{' '.join(map(str, batch))}] "
                         f"({head.kind.value} of micro-batch {head.microbatch} at stage {head.stage}"
                         + (f", peer stage {head.peer_stage}" if head.peer_stage is not None else "") + ")")
    return f"schedule {schedule.name!r} deadlocks under blocking point-to-point: " + "; ".join(lines)


def validate(schedule: Schedule) -> Schedule:
    """Prove ``schedule`` sound or raise :class:`ScheduleError` naming the rank, step and actions; returns it.

    Checks: every (stage, micro-batch) has exactly one F before its B on the rank hosting the stage (and, if
    the schedule splits backward, one W after its B; a forward-only schedule has exactly one F and nothing
    else); every remote data edge has its recv before the consuming
    compute and its send after the producing one; on each ordered pair of ranks the sends and recvs meet in the
    same order; and executing it with blocking (rendezvous) point-to-point terminates.
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"validate expects a Schedule, got {type(schedule).__name__}")
    _check_counts(schedule)
    _check_channels(schedule)
    pc, ops, _, _, _ = _run(schedule, strict=True, costs={F: 1.0, B: 1.0, W: 1.0}, t_comm=0.0)
    if any(at < len(rank_ops) for at, rank_ops in zip(pc, ops)):
        raise ScheduleError(_deadlock_message(schedule, pc, ops))
    return schedule


def simulate(schedule: Schedule, *, t_forward: float = 1.0, t_backward: float = 2.0, t_comm: float = 0.0,
             t_weight: float = 1.0, w_held_fraction: float = 1.0) -> SimulationResult:
    """Timing of ``schedule`` (validated first) under the engine's execution model; see the module docstring.

    ``t_backward`` is the cost of a B action (the input-gradient half when the schedule has W actions, which
    cost ``t_weight``). ``w_held_fraction`` (in ``[0, 1]``) is the share of a micro-batch's activations still
    held between its B and its W, for ``peak_held``.
    """
    bad = {k: v for k, v in dict(t_forward=t_forward, t_backward=t_backward, t_comm=t_comm,
                                 t_weight=t_weight).items() if not v >= 0}
    if not 0.0 <= w_held_fraction <= 1.0:
        bad["w_held_fraction"] = w_held_fraction
    if bad:
        raise ScheduleError(f"simulate needs non-negative costs and w_held_fraction in [0, 1], got {bad}")
    validate(schedule)
    _, _, clock, timeline, memory = _run(schedule, strict=False,
                                         costs={F: t_forward, B: t_backward, W: t_weight}, t_comm=t_comm,
                                         w_fraction=w_held_fraction)
    makespan = max(clock) if clock else 0.0
    busy = [0.0] * schedule.n_ranks
    for item in timeline:
        busy[item.rank] += item.end - item.start
    idle = [makespan - b for b in busy]
    bubble = sum(idle) / (schedule.n_ranks * makespan) if makespan > 0 else 0.0
    return SimulationResult(makespan=makespan, busy=busy, idle=idle, bubble_fraction=bubble,
                            peak_in_flight=memory.peak, timeline=timeline, peak_held=memory.peak_held)
