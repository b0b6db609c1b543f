"""Bubble theory per schedule: the one place the closed forms live (the engine's docs, the planner and the
profiler read them from here).

Model: ``p`` ranks, ``m`` micro-batches, ``v`` chunks (stages) per rank; every rank does the same work per
micro-batch, ``f`` forward, ``b`` input-gradient backward and ``w`` weight-gradient backward, summed over its
chunks (so one chunk costs ``f / v`` ...); communication is free. A full backward is ``b + w`` (``w = 0`` when
the backward is not split). Per rank::

    busy      = m (f + b + w)
    bubble    = the schedule's closed form below
    makespan  = busy + bubble
    fraction  = bubble / makespan

=============  ==========================  =====================================================
schedule       bubble (time, per rank)     fraction
=============  ==========================  =====================================================
gpipe          (p - 1)(f + b + w)          (p - 1) / (m + p - 1)
1f1b           (p - 1)(f + b + w)          (p - 1) / (m + p - 1)
interleaved    (p - 1)(f + b + w) / v      (p - 1) / (v m + p - 1)
looped_bfs     (p - 1)(f + b + w) / v      (p - 1) / (v m + p - 1)
forward_only   (p - 1) f                   (p - 1) / (m + p - 1)      (busy = m f; one chunk per rank)
zb_h1          (p - 1)(f + b - w)          bubble / makespan          (one chunk; m >= p)
zb_h2          max(0, (p-1)(f + b - 2 w))  bubble / makespan          (one chunk; post-validated step)
zbv            max(0,(p-1)(f+b-2w)) / 2    bubble / makespan          (v = 2; post-validated step)
dualpipev      (p - 1)(f + 2 b - w) / 2    bubble / makespan          (v = 2; F&B run as F then B + W)
=============  ==========================  =====================================================

Zero-bubble rows (split backward; ``b`` is the input gradient alone, the ZB paper's notation). ZB-H1 and ZB-H2
are Qi et al. (2024)'s closed forms. ZB-H2's and ZB-V's count each rank from its own first action to its own
last (their parallelogram), which is the step's bubble only when the optimizer step's synchronisation is
post-validated; with it kept the step is longer (``(p - 1) f`` idle per rank for ZB-H2 at ``f = b = w``,
``(p - 1) f / 2`` for ZB-V: see :mod:`~shardline.job.pipeline.zero_bubble`). ZB-V's row is ZB-H2's form at
chunk costs ``f / 2, b / 2, w / 2``: the paper states zero at ``f = b = w``, which this gives; at other costs
the row is that extension, which the simulator reproduces at ``f = b = 2 w``. DualPipeV's is the DualPipe README's
``(PP/2 - 1)(F&B + B - 3 W)`` with ``PP = 2 p`` stages, chunk costs ``F = f / 2``, the README's full backward
``B = (b + w) / 2``, ``W = w / 2``, and ``F&B = F + B`` (nothing overlapped): ``(p - 1)(f + 2 b - w) / 2``.

GPipe and 1F1B differ in the activations held (m against at most p), not in the bubble; interleaving cuts the
fill and drain of each rank to one chunk's worth per stage ahead of it (Megatron's interleaved 1F1B), and the
breadth-first loop (torch's ``ScheduleLoopedBFS``) has the same fill and drain. For these five the fraction
does not depend on the costs, only on ``p``, ``m`` and ``v``.

The zero-bubble fractions depend on the costs, which :func:`bubble_fraction` takes for that reason, and on the
weight-gradient cost above all: their rows refuse ``w = 0`` (the default, which means an unsplit backward) rather
than answer for a split nobody priced, and :func:`has_closed_form` counts them only when asked with
``split=True``, so a caller that cannot give ``w`` (the profiler reading a trace's schedule name) sees no closed
form for them, as for any schedule without one here.

Bad sizes or an unknown schedule raise :class:`~shardline.job.errors.ScheduleError` naming the value.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

from ..errors import ScheduleError

__all__ = ["bubble_fraction", "bubble_time", "closed_form_schedules", "has_closed_form", "makespan"]


def _flush(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """GPipe and 1F1B: the first micro-batch's forward crosses p - 1 stages before the last one starts, and the
    last backward crosses them again after the last stage ends."""
    del m, v
    return (p - 1) * (f + b + w)


def _interleaved(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Interleaved 1F1B and the breadth-first loop: the fill and drain cross p - 1 chunks of 1/v of a rank's
    work each."""
    del m
    return (p - 1) * (f + b + w) / v


def _forward_fill(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Forward only (evaluation): the fill of the forwards, no backward to drain."""
    del m, v, b, w
    return (p - 1) * f


def _equal_cost_fraction(p: int, m: int, v: int) -> float:
    """``(p - 1) / (v m + p - 1)``, the share the schedules above idle whatever their costs (written as one
    division so the value is the correctly rounded quotient)."""
    return (p - 1) / (v * m + p - 1)


def _zb_h1(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """ZB-H1 (Qi et al., 2024): 1F1B's fill and drain, less the W actions moved into them."""
    del m, v
    return (p - 1) * (f + b - w)


def _zb_h2(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """ZB-H2 (Qi et al., 2024), per rank over its own span; ZB-V the same at half-rank chunk costs."""
    del m
    return max(0.0, (p - 1) * (f + b - 2 * w)) / v


def _dualpipev(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """DualPipeV (DualPipe README) with chunk costs f/2, b/2, w/2 and an F&B pair run as F then B then W."""
    del m, v
    return (p - 1) * (f + 2 * b - w) / 2


#: schedule name -> bubble time per rank ``(p, m, v, f, b, w) -> time``.
_BUBBLE_TIME: dict[str, Callable[[int, int, int, float, float, float], float]] = {
    "gpipe": _flush,
    "1f1b": _flush,
    "interleaved": _interleaved,
    "looped_bfs": _interleaved,
    "forward_only": _forward_fill,
    "zb_h1": _zb_h1,
    "zb_h2": _zb_h2,
    "zbv": _zb_h2,
    "dualpipev": _dualpipev,
}
#: The schedules whose fraction does not depend on the costs: ``_equal_cost_fraction``. (A zero-bubble entry,
#: whose fraction does, is left out of this set.)
_COST_FREE = frozenset({"gpipe", "1f1b", "interleaved", "looped_bfs", "forward_only"})
#: The schedules with one chunk per rank (``v`` must be 1).
_ONE_CHUNK = frozenset({"gpipe", "1f1b", "forward_only", "zb_h1", "zb_h2"})
#: The V-shaped schedules, two chunks per rank (``v`` must be 2).
_TWO_CHUNKS = frozenset({"zbv", "dualpipev"})
#: The split-backward (zero-bubble) schedules: their closed forms need ``w > 0``.
_SPLIT = frozenset({"zb_h1", "zb_h2", "zbv", "dualpipev"})


def closed_form_schedules() -> tuple[str, ...]:
    """The schedule names this module has a closed form for."""
    return tuple(_BUBBLE_TIME)


def has_closed_form(schedule: str, *, v: int = 1, split: bool = False) -> bool:
    """Whether ``schedule`` with ``v`` chunks per rank has a closed form here (the one-chunk schedules have none
    at ``v > 1``, the V-shaped ones none but at ``v = 2``). The zero-bubble schedules count only with ``split``:
    a caller saying it will pass the weight-gradient cost ``w``."""
    name = getattr(schedule, "value", schedule)
    return (name in _BUBBLE_TIME and (v == 1 or name not in _ONE_CHUNK) and (v == 2 or name not in _TWO_CHUNKS)
            and (split or name not in _SPLIT))


def _check(schedule: str, p: int, m: int, v: int, costs: tuple[float, float, float]) -> str:
    name = getattr(schedule, "value", schedule)
    if name not in _BUBBLE_TIME:
        raise ScheduleError(f"no bubble closed form for schedule {schedule!r}; known: {sorted(_BUBBLE_TIME)}")
    bad = [f"{k}={x!r}" for k, x in (("p", p), ("m", m), ("v", v))
           if not isinstance(x, numbers.Integral) or isinstance(x, bool) or x < 1]
    bad += [f"{k}={x!r}" for k, x in zip("fbw", costs)
            if not isinstance(x, numbers.Real) or isinstance(x, bool) or not x >= 0]
    if bad:
        raise ScheduleError(f"bubble theory of {name!r} needs integer p, m, v >= 1 and costs >= 0: {', '.join(bad)}")
    if name in _ONE_CHUNK and v != 1:
        raise ScheduleError(f"schedule {name!r} has one chunk per rank; got v={v}")
    if name in _TWO_CHUNKS and v != 2:
        raise ScheduleError(f"schedule {name!r} has two chunks per rank in a V; got v={v}")
    if name in _SPLIT and not costs[2] > 0:
        raise ScheduleError(f"schedule {name!r} splits the backward: its closed form needs the weight-gradient "
                            f"cost w > 0, got w={costs[2]!r}")
    return name


def bubble_time(schedule: str, *, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0,
                w: float = 0.0) -> float:
    """The idle time per rank of ``schedule`` (table in the module docstring), in the unit of the costs."""
    name = _check(schedule, p, m, v, (f, b, w))
    return float(_BUBBLE_TIME[name](p, m, v, f, b, w))


def makespan(schedule: str, *, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0, w: float = 0.0) -> float:
    """Busy plus ``bubble_time``: the time from the first forward's start to the last action's end (busy is
    ``m (f + b + w)``, ``m f`` for ``forward_only``)."""
    name = _check(schedule, p, m, v, (f, b, w))
    busy = m * f if name == "forward_only" else m * (f + b + w)
    return busy + bubble_time(name, p=p, m=m, v=v, f=f, b=b, w=w)


def bubble_fraction(schedule: str, *, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0,
                    w: float = 0.0) -> float:
    """``bubble_time / makespan``: the share of the makespan each rank idles, e.g. ``(p - 1) / (v m + p - 1)``
    for 1F1B and interleaved 1F1B (independent of the costs; the zero-bubble forms are not)."""
    name = _check(schedule, p, m, v, (f, b, w))
    if name in _COST_FREE:
        return _equal_cost_fraction(p, m, v)
    total = makespan(name, p=p, m=m, v=v, f=f, b=b, w=w)
    return bubble_time(name, p=p, m=m, v=v, f=f, b=b, w=w) / total if total > 0 else 0.0
