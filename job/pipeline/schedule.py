"""Pipeline schedules as data: generators for GPipe, 1F1B and interleaved 1F1B, plus the contract names.

This module is pure Python (no torch). It is the public face of the schedule layer: the types live in
:mod:`~shardline.job.pipeline.actions`, :func:`validate`/:func:`simulate` in
:mod:`~shardline.job.pipeline.simulate` and :func:`render` in :mod:`~shardline.job.pipeline.render`;
all are importable from here.

Every generator first decides each rank's order of compute actions, then :func:`lower` inserts the
communication: the receive a compute needs goes right before it, the send of its result right after it, so
the comms between two consecutive computes form one batch (posted together, see ``simulate``). That
grouping is what makes 1F1B's steady state safe: ``[send act i, recv grad j]`` on rank r meets
``[send grad j, recv act i]`` on rank r+1 as two posted batches instead of two blocked sends.

With ``p`` ranks and ``m`` micro-batches (unit costs F = B = 1, no communication):

- ``gpipe``: all forwards, then all backwards. Makespan ``2 (m + p - 1)``; ``m`` micro-batches in flight.
- ``one_f_one_b``: rank ``r`` runs ``w = min(p - 1 - r, m)`` warm-up forwards, then alternates one forward
  and one backward, then drains ``w`` backwards. Same makespan as GPipe, at most ``p - r`` in flight.
- ``interleaved_one_f_one_b`` (Megatron's schedule): ``v`` chunks per rank, chunk ``c`` of rank ``r`` is
  stage ``c p + r``. Micro-batches go in groups of ``p``; within a group every chunk runs in turn. The k-th
  forward on a rank is chunk ``(k // p) % v`` of micro-batch ``(k // (p v)) p + k % p``, backwards likewise with
  chunks reversed; warm-up is ``min((p - r - 1) 2 + (v - 1) p, v m)`` forwards. Makespan ``2 (v m + p - 1)``
  when each chunk action costs 1, so the bubble is ``(p - 1) / (v m + p - 1)``. Requires ``m % p == 0``:
  the group structure is what keeps a rank's next forward input ready, and a ragged last group would need a
  different warm-up per group (not implemented; the error says so).
- ``zb_h1``, ``zb_h2``, ``zbv``, ``dualpipev``: the zero-bubble schedules with a split backward (B then W),
  generated in :mod:`~shardline.job.pipeline.zero_bubble` (``zbv`` and ``dualpipev`` on two chunks per rank in
  a V, ``placement="v"``), which documents their bubble and memory.
- ``forward_only`` (evaluation): every rank runs the forwards of its stages, micro-batch by micro-batch, with
  the transfers between them and no backward. Validation, prediction and a model's
  evaluation loss run on the same engine as training, with the same transport and shape headers.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from ..errors import ScheduleError
from .actions import Action, ActionKind, Schedule, parse_action
from .render import render, render_png, render_text
from .simulate import SimulationResult, Timed, simulate, validate
from .zero_bubble import dualpipev, lower_ordered, zb_h1, zb_h2, zb_v

__all__ = ["Action", "ActionKind", "Schedule", "ScheduleKind", "SimulationResult", "Timed", "build_schedule",
           "dualpipev", "forward_only", "gpipe", "interleaved_one_f_one_b", "lower", "lower_ordered", "one_f_one_b",
           "parse_action", "render", "render_png", "render_text", "simulate", "validate", "zb_h1", "zb_h2", "zb_v"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


class ScheduleKind(str, enum.Enum):
    """Schedule families; values are the names used in traces (``pp_batch_name``)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    FORWARD_ONLY = "forward_only"
    ZB_H1 = "zb_h1"
    ZB_H2 = "zb_h2"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"


def _check_sizes(**sizes: int) -> None:
    bad = [f"{k}={v!r}" for k, v in sizes.items()
           if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad:
        raise ScheduleError("schedule sizes must be integers >= 1: " + ", ".join(bad))


def lower(compute: Sequence[Sequence[Action]], *, n_stages: int, n_microbatches: int,
          name: str) -> Schedule:
    """Insert the sends and receives implied by per-rank compute orders (see the module docstring)."""
    n_ranks = len(compute)
    last = n_stages - 1
    programs = []
    for rank, order in enumerate(compute):
        program: list[Action] = []
        for action in order:
            s, mb = action.stage, action.microbatch
            remote_prev = s > 0 and (s - 1) % n_ranks != rank
            remote_next = s < last and (s + 1) % n_ranks != rank
            if action.kind is F:
                program += [Action(ActionKind.RECV_ACT, s, mb)] if remote_prev else []
                program += [action] + ([Action(ActionKind.SEND_ACT, s, mb)] if remote_next else [])
            elif action.kind is B:
                program += [Action(ActionKind.RECV_GRAD, s, mb)] if remote_next else []
                program += [action] + ([Action(ActionKind.SEND_GRAD, s, mb)] if remote_prev else [])
            else:
                program.append(action)
        programs.append(program)
    return Schedule(programs, n_stages=n_stages, n_microbatches=n_microbatches, name=name)


def gpipe(n_stages: int, n_microbatches: int) -> Schedule:
    """GPipe: every rank (one stage each) runs all forwards in order, then all backwards in order."""
    _check_sizes(n_stages=n_stages, n_microbatches=n_microbatches)
    mbs = range(n_microbatches)
    compute = [[Action(F, r, i) for i in mbs] + [Action(B, r, i) for i in mbs] for r in range(n_stages)]
    return lower(compute, n_stages=n_stages, n_microbatches=n_microbatches, name=ScheduleKind.GPIPE.value)


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): warm-up ``min(p - 1 - r, m)`` forwards, one-forward-one-backward, drain."""
    _check_sizes(n_stages=n_stages, n_microbatches=n_microbatches)
    p, m = n_stages, n_microbatches
    compute = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action(F, r, i) for i in range(warmup)]
        for k in range(m - warmup):
            order += [Action(F, r, warmup + k), Action(B, r, k)]
        order += [Action(B, r, i) for i in range(m - warmup, m)]
        compute.append(order)
    return lower(compute, n_stages=p, n_microbatches=m, name=ScheduleKind.ONE_F_ONE_B.value)


def interleaved_one_f_one_b(n_ranks: int, n_microbatches: int, n_chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B over ``n_ranks * n_chunks`` stages; ``n_microbatches % n_ranks == 0``."""
    _check_sizes(n_ranks=n_ranks, n_microbatches=n_microbatches, n_chunks=n_chunks)
    p, m, v = n_ranks, n_microbatches, n_chunks
    if m % p:
        raise ScheduleError(f"interleaved_one_f_one_b needs n_microbatches={m} to be a multiple of "
                            f"n_ranks={p} (micro-batches run in groups of p; use m in {{{p}, {2 * p}, ...}} "
                            f"or a non-interleaved schedule)")
    total = m * v

    def unit(k: int, *, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    programs = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        fwd = [Action(F, c * p + r, mb) for c, mb in (unit(k, backward=False) for k in range(total))]
        bwd = [Action(B, c * p + r, mb) for c, mb in (unit(k, backward=True) for k in range(total))]
        programs.append(_megatron_program(fwd, bwd, warmup=warmup, n_ranks=p, n_stages=p * v))
    return Schedule(programs, n_stages=p * v, n_microbatches=m, name=ScheduleKind.INTERLEAVED.value)


def _megatron_program(fwd: list[Action], bwd: list[Action], *, warmup: int, n_ranks: int,
                      n_stages: int) -> list[Action]:
    """One rank's interleaved program with Megatron's communication pattern.

    Warm-up: ``F`` then ``[send its output, recv the next forward's input]``; steady state: the pair ``F B``
    then one batch ``[send F's output, send B's input grad, recv next F's input, recv next B's output grad]``;
    cool-down: ``B`` then ``[send its input grad, recv the next B's output grad]``. The receive for the first
    backward rides with the last warm-up batch. Posting the next backward's receive early, in the same batch as
    the sends, is what keeps opposite-direction gradient sends from meeting head-on (the plain
    recv-before/send-after lowering deadlocks here under rendezvous semantics once m > p).
    """
    total = len(fwd)

    def comm(kind: ActionKind, action: Action | None) -> list[Action]:
        if action is None:
            return []
        s = action.stage
        peer = s + (1 if kind in (ActionKind.SEND_ACT, ActionKind.RECV_GRAD) else -1)
        if not 0 <= peer < n_stages or peer % n_ranks == s % n_ranks:
            return []
        return [Action(kind, s, action.microbatch)]

    def at(seq: list[Action], k: int) -> Action | None:
        return seq[k] if 0 <= k < len(seq) else None

    sa, sg, ra, rg = ActionKind.SEND_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_ACT, ActionKind.RECV_GRAD
    first_rg = comm(rg, at(bwd, 0))
    program = comm(ra, at(fwd, 0)) + (first_rg if warmup == 0 else [])
    for k in range(warmup):
        program += [fwd[k], *comm(sa, fwd[k]), *comm(ra, at(fwd, k + 1))]
        program += first_rg if k == warmup - 1 else []
    for k in range(total - warmup):
        f, b = fwd[warmup + k], bwd[k]
        program += [f, b, *comm(sa, f), *comm(sg, b), *comm(ra, at(fwd, warmup + k + 1)),
                    *comm(rg, at(bwd, k + 1))]
    for k in range(total - warmup, total):
        program += [bwd[k], *comm(sg, bwd[k]), *comm(rg, at(bwd, k + 1))]
    return program


def forward_only(n_ranks: int, n_microbatches: int, n_chunks: int = 1) -> Schedule:
    """Evaluation: rank ``r`` runs ``F(c p + r, i)`` for every micro-batch ``i`` and chunk ``c`` in that order.
    With one chunk that is GPipe's forward phase (makespan ``m + p - 1`` at unit cost). With ``v > 1`` chunks a
    micro-batch finishes its pass before the next starts on a rank: the chunk-by-chunk order (all micro-batches
    through chunk 0 first) deadlocks under rendezvous point-to-point, which ``validate`` proves."""
    _check_sizes(n_ranks=n_ranks, n_microbatches=n_microbatches, n_chunks=n_chunks)
    p, m, v = n_ranks, n_microbatches, n_chunks
    compute = [[Action(F, c * p + r, i) for i in range(m) for c in range(v)] for r in range(p)]
    return lower(compute, n_stages=p * v, n_microbatches=m, name=ScheduleKind.FORWARD_ONLY.value)


def build_schedule(kind: ScheduleKind | str, *, n_ranks: int, n_microbatches: int, n_chunks: int | None = None
                   ) -> Schedule:
    """One entry point over the generators (``kind`` as the enum or its value). ``n_chunks`` defaults to 2 for
    the V-shaped ``zbv`` and ``dualpipev`` (the only count they run) and to 1 for the others."""
    try:
        kind = ScheduleKind(kind)
    except ValueError:
        raise ScheduleError(f"unknown schedule kind {kind!r}; expected one of "
                            f"{[k.value for k in ScheduleKind]}") from None
    if kind in (ScheduleKind.ZBV, ScheduleKind.DUALPIPEV):
        generator = zb_v if kind is ScheduleKind.ZBV else dualpipev
        return generator(n_ranks, n_microbatches, 2 if n_chunks is None else n_chunks)
    n_chunks = 1 if n_chunks is None else n_chunks
    if kind is ScheduleKind.INTERLEAVED:
        return interleaved_one_f_one_b(n_ranks, n_microbatches, n_chunks)
    if kind is ScheduleKind.FORWARD_ONLY:
        return forward_only(n_ranks, n_microbatches, n_chunks)
    if n_chunks != 1:
        raise ScheduleError(f"schedule {kind.value!r} has one chunk per rank; got n_chunks={n_chunks}")
    generator = {ScheduleKind.GPIPE: gpipe, ScheduleKind.ONE_F_ONE_B: one_f_one_b, ScheduleKind.ZB_H1: zb_h1,
                 ScheduleKind.ZB_H2: zb_h2}[kind]
    return generator(n_ranks, n_microbatches)
