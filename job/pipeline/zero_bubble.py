"""Zero-bubble pipeline schedules as data: ZB-H1, ZB-H2, ZB-V and DualPipeV (pure Python, no torch).

They split each backward into B (the input gradient, which the previous stage waits for) and W (the weight
gradient, which nobody waits for), and place the W actions where 1F1B would idle. Notation in this module: ``F``,
``B`` and ``W`` are the costs of one F, B and W *action* (one chunk of one micro-batch), ``B`` being the
input-gradient half only (the zero-bubble paper's notation); ``p`` ranks, ``m`` micro-batches.

- :func:`zb_h1` (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", ZB-H1): 1F1B's warm-up and memory (at most
  ``p`` micro-batches held on a rank, counting one as held from its F until its W), each rank deferring ``r`` of
  its W actions to the drain. Bubble ``(p - 1)(F + B - W)`` per rank, against 1F1B's ``(p - 1)(F + B + W)``: a
  third of it when ``F = B = W``.
- :func:`zb_h2` (ZB-H2): up to ``2 p - 1`` micro-batches held on a rank (the paper's peak memory), so the later
  ranks run ``F B`` pairs while rank 0's deep warm-up floods them with forwards, and the W actions fill the
  rest. The paper's bubble ``(p - 1)(F + B - 2 W)`` (zero when ``F = B = W``) counts each rank from its own first
  action to its own last: the schedule is a parallelogram, rank ``r`` starting ``r F`` late. That skew is hidden
  only when the next step's forwards may start before this step's last W, which the paper buys by validating
  the optimizer step after the fact (rolling it back if clipping or a non-finite gradient says so). **With the
  optimizer step's synchronisation kept** (gradient clipping's global norm and the non-finite check before the
  step, as shardline does) the step runs from rank 0's first F to the last rank's last W, and at ``F = B = W``
  every rank idles ``(p - 1) F`` in it: a fraction ``(p - 1) / (3 m + p - 1)``, against 1F1B's
  ``(p - 1) / (m + p - 1)`` and ZB-H1's ``(p - 1) / (3 m + p - 1)`` too (the same fill, without the memory).
  :func:`simulate` measures that synchronised step (its ``makespan - busy``); the paper's count is a rank's
  span less its busy time.
- :func:`zb_v` (ZB-V, section 6 of the same paper): two chunks per rank in a V (``placement="v"``: rank ``r``
  hosts stages ``r`` and ``2 p - 1 - r``) and 1F1B's activation memory: at most ``2 p`` chunk-micro-batches
  held on a rank, each chunk half of a rank's layers, so ``p`` micro-batches' worth. Zero bubble in the paper's
  per-rank count at ``F = B = W``; like ZB-H2 a parallelogram, so with the step's synchronisation kept each rank
  idles the fill ``(p - 1) F`` (``F`` one chunk's forward). Needs exactly two chunks.
- :func:`dualpipev` (DeepSeek's DualPipeV, the "cut-in-half" V-shaped DualPipe, from the DualPipe repository):
  the same V placement; its steady state pairs the forward of one chunk with the full backward of the other
  (DualPipe's ``F&B``), which on hardware that overlaps them hides one's communication under the other's
  compute. The IR has no compound action: **on a device with nothing to overlap, an ``F&B`` runs as the
  forward, then the backward (B and its W back to back)**, and that is the order this generator writes, so
  ``F&B = F + B + W`` here. Holds at most ``2 p + 1`` chunk-micro-batches on a rank (the README's ``PP + 1``).
  Needs ``m >= 2 p``.

Communication. Every generator decides each rank's order of compute actions; :func:`lower_ordered` then inserts
the transfers: a send right after the compute that produces it, a receive in the consumer rank's first batch
at or after the time the data is ready (no later than right before its consumer), in the ASAP timing of the
orders at the generator's ``costs`` (F, B, W per action, default all 1), and in the order the sends went on each
pair of ranks. The order of the computes does not depend on ``costs``; where the receives sit does, so lower
for the costs the schedule will run at (a receive posted for other costs may wait early). :func:`validate`
proves each schedule deadlock-free under rendezvous semantics; the tests do so over a grid of ``(p, m)``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .. import placement as _placement
from ..errors import ScheduleError
from .actions import Action, ActionKind, Schedule

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
SA, RA, SG, RG = ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD

__all__ = ["dualpipev", "lower_ordered", "zb_h1", "zb_h2", "zb_v"]


def _check_costs(costs) -> tuple[float, float, float]:
    values = tuple(costs) if isinstance(costs, (tuple, list)) else ()
    if len(values) != 3 or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0
                                   for c in values):
        raise ScheduleError(f"costs={costs!r} must be three positive numbers (F, B, W per action)")
    return tuple(float(c) for c in values)


def _check_sizes(name: str, **sizes: int) -> None:
    bad = [f"{k}={v!r}" for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad:
        raise ScheduleError(f"{name} needs integer sizes >= 1: " + ", ".join(bad))


def lower_ordered(compute: Sequence[Sequence[Action]], *, n_stages: int, n_microbatches: int, name: str,
                  placement: str = "loop", costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> Schedule:
    """Insert the sends and receives implied by per-rank compute orders (see the module docstring).

    A remote edge produces one message: ``F(s, i)`` sends its output to stage ``s + 1``, ``B(s, i)`` its input
    gradient to stage ``s - 1``. Its send goes in the batch right after the producer. Its receive goes in the
    first batch of the consumer's rank that comes, in the timing where every action starts as soon as its rank
    and its input allow (at ``costs`` = (F, B, W) per action), at or after the message is ready, and at the
    latest right before the consumer; then earlier still where a later message on the same ordered pair of
    ranks is received first (messages between two ranks are matched in the order they are sent). Posting the
    receive when the data is ready, not when it is needed, keeps a rank from blocking in a send that its peer
    would only match after waiting on that rank (a rendezvous deadlock that deep warm-ups otherwise hit). The
    order of the computes does not depend on ``costs``; where the receives sit does, and a schedule lowered
    for other costs than it runs at may wait at a receive it posted early.
    """
    n_ranks = len(compute)
    last = n_stages - 1

    def home(stage: int) -> int:
        return _placement.stage_rank(stage, pp=n_ranks, style=placement)

    position = {}
    for rank, order in enumerate(compute):
        for index, action in enumerate(order):
            if home(action.stage) != rank:
                raise ScheduleError(f"rank {rank}: {action} acts on stage {action.stage}, which lives on rank "
                                    f"{home(action.stage)} under placement {placement!r}")
            position[action] = index
    ends = _eager_ends(compute, position, n_stages=n_stages, costs=_check_costs(costs))
    # slot j of a rank = the batch right before its compute j (slot len = after its last compute); its time is
    # the end of compute j - 1 in the eager timing.
    sends: list[list[list[Action]]] = [[[] for _ in range(len(order) + 1)] for order in compute]
    channel: dict[tuple[int, int], list[tuple[Action, int]]] = {}  # (src, dst) -> [(recv action, latest slot)]
    for rank, order in enumerate(compute):
        for index, action in enumerate(order):
            s, mb = action.stage, action.microbatch
            if action.kind is F and s < last and home(s + 1) != rank:
                send, recv, consumer = Action(SA, s, mb), Action(RA, s + 1, mb), Action(F, s + 1, mb)
            elif action.kind is B and s > 0 and home(s - 1) != rank:
                send, recv, consumer = Action(SG, s, mb), Action(RG, s - 1, mb), Action(B, s - 1, mb)
            else:
                continue
            if consumer not in position:
                raise ScheduleError(f"rank {rank}: {action} sends to {consumer}, which no rank runs")
            sends[rank][index + 1].append(send)
            dst, ready = home(consumer.stage), ends[rank][index]
            slot = next(j for j in range(position[consumer] + 1)
                        if j == position[consumer] or (j > 0 and ends[dst][j - 1] >= ready))
            channel.setdefault((rank, dst), []).append((recv, slot))
    recvs: list[list[list[Action]]] = [[[] for _ in range(len(order) + 1)] for order in compute]
    for (_, dst), messages in channel.items():
        # messages are in send order (ranks' programs run in order); pull each receive to at most the slot of
        # the next one so that the receives come in that order too.
        latest = len(compute[dst])
        placed = []
        for recv, slot in reversed(messages):
            latest = min(latest, slot)
            placed.append((latest, recv))
        for slot, recv in reversed(placed):
            recvs[dst][slot].append(recv)
    programs = []
    for rank, order in enumerate(compute):
        program: list[Action] = []
        for slot in range(len(order) + 1):
            program += sends[rank][slot] + recvs[rank][slot]
            if slot < len(order):
                program.append(order[slot])
        programs.append(program)
    return Schedule(programs, n_stages=n_stages, n_microbatches=n_microbatches, name=name, placement=placement)


def _eager_ends(compute: Sequence[Sequence[Action]], position: dict, *, n_stages: int,
                costs: tuple[float, float, float]) -> list[list[float]]:
    """End time of every compute action at ``costs`` (F, B, W) when each starts as soon as its rank is free and
    its input (the producing F of the stage before, the producing B of the stage after) has ended."""
    ends: list[list[float]] = [[] for _ in compute]
    cost = dict(zip((F, B, W), costs))
    owner = {action: rank for rank, order in enumerate(compute) for action in order}
    progress = True
    while progress:
        progress = False
        for rank, order in enumerate(compute):
            while len(ends[rank]) < len(order):
                action = order[len(ends[rank])]
                s, mb = action.stage, action.microbatch
                producer = (Action(F, s - 1, mb) if action.kind is F and s > 0 else
                            Action(B, s + 1, mb) if action.kind is B and s < n_stages - 1 else None)
                start = ends[rank][-1] if ends[rank] else 0.0
                if producer is not None:
                    if producer not in owner:
                        raise ScheduleError(f"rank {rank}: {action} needs {producer}, which no rank runs")
                    done = ends[owner[producer]]
                    if position[producer] >= len(done):
                        break
                    start = max(start, done[position[producer]])
                ends[rank].append(start + cost[action.kind])
                progress = True
    stuck = [f"rank {r} at {order[len(ends[r])]}" for r, order in enumerate(compute) if len(ends[r]) < len(order)]
    if stuck:
        raise ScheduleError("compute orders wait on each other in a cycle: " + "; ".join(stuck))
    return ends


class _Counters:
    """Per-stage next micro-batch of F and B, and the FIFO of micro-batches whose W is pending."""

    def __init__(self, n_microbatches: int):
        self.m = n_microbatches
        self.next_f: dict[int, int] = {}
        self.next_b: dict[int, int] = {}
        self.pending_w: deque[tuple[int, int]] = deque()
        self.order: list[Action] = []

    def forward(self, stage: int) -> None:
        mb = self.next_f.get(stage, 0)
        self.order.append(Action(F, stage, mb))
        self.next_f[stage] = mb + 1

    def backward(self, stage: int, *, split: bool = True) -> None:
        """B of the stage's next micro-batch; its W joins the pending queue (``split``) or follows at once."""
        mb = self.next_b.get(stage, 0)
        self.order.append(Action(B, stage, mb))
        self.next_b[stage] = mb + 1
        if split:
            self.pending_w.append((stage, mb))
        else:
            self.order.append(Action(W, stage, mb))

    def weight_of(self, stage: int) -> None:
        """The oldest pending W of ``stage``."""
        mb = min(mb for s, mb in self.pending_w if s == stage)
        self.pending_w.remove((stage, mb))
        self.order.append(Action(W, stage, mb))

    def weight(self, count: int = 1) -> None:
        """The oldest ``count`` pending W actions."""
        for _ in range(count):
            stage, mb = self.pending_w.popleft()
            self.order.append(Action(W, stage, mb))


def zb_h1(n_ranks: int, n_microbatches: int, *, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> Schedule:
    """ZB-H1: 1F1B's warm-up (``p - 1 - r`` forwards on rank ``r``) and memory (at most ``p`` micro-batches held
    from F to W on any rank); in the steady state each ``F B`` pair is followed by a W once the rank holds ``p``,
    so rank ``r`` defers ``r`` W actions; the drain runs ``B W`` pairs, then the deferred W actions. Bubble
    ``(p - 1)(F + B - W)`` per rank for ``m >= p`` (Qi et al., 2024; ``B`` the input gradient alone), against
    1F1B's ``(p - 1)(F + B + W)``. ``costs`` (F, B, W) only places the receives (see :func:`lower_ordered`)."""
    _check_sizes("zb_h1", n_ranks=n_ranks, n_microbatches=n_microbatches)
    p, m = n_ranks, n_microbatches
    compute = []
    for r in range(p):
        c = _Counters(m)
        warmup = min(p - 1 - r, m)
        for _ in range(warmup):
            c.forward(r)
        for _ in range(m - warmup):
            c.forward(r)
            c.backward(r)
            if c.next_f[r] - (c.next_b[r] - len(c.pending_w)) >= p:  # holding p: free one before the next F
                c.weight()
        for _ in range(warmup):
            c.backward(r)
            c.weight()
        c.weight(len(c.pending_w))
        compute.append(c.order)
    return lower_ordered(compute, n_stages=p, n_microbatches=m, name="zb_h1", costs=costs)


def zb_h2(n_ranks: int, n_microbatches: int, *, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> Schedule:
    """ZB-H2: every rank may hold ``2 p - 1`` micro-batches (the paper's peak memory, reached on every rank once
    ``m >= 2 p - 1``). The order is list-scheduled at ``F = B = W``: a free rank runs the oldest B whose gradient
    has arrived, else its next F if the input has arrived and it holds fewer than ``2 p - 1``, else its oldest
    pending W. Rank 0 so runs ``2 p - 1`` forwards before its first backward arrives, the later ranks run ``F B``
    pairs while the forwards flood in, and the W actions fill what would idle.

    Bubble, ``F = B = W`` (the paper's setting for the handcrafted schedules), ``m >= 2 p - 1``: each rank runs
    without a gap from its first action to its last, the paper's zero bubble, and the paper's
    ``(p - 1)(F + B - 2 W)`` per rank measured that way also holds at ``F = B = 2 W``. But rank ``r`` starts
    ``r F`` after rank 0 (the fill a forward needs to reach it), so the step is a parallelogram; the paper hides
    the skew by letting the next step's forwards start before this step's last W, which needs its post-validated
    optimizer step. **With the optimizer step's synchronisation kept** (gradient clipping's global norm and the
    non-finite check before the step, as shardline does), the step runs from rank 0's first F to rank
    ``p - 1``'s last W and each rank idles ``(p - 1) F`` in it at ``F = B = W`` and at ``F = B = 2 W``: at
    ``F = B = W`` that is ZB-H1's ``(p - 1)(F + B - W)``, so with the synchronisation kept ZB-H2 buys nothing
    over ZB-H1 there for its doubled memory (at ``F = B = 2 W`` it idles ``(p - 1) F`` against ZB-H1's
    ``(p - 1) 3 F / 2``). :func:`simulate` measures this synchronised step. ``costs`` (F, B, W) only places the
    receives (see :func:`lower_ordered`)."""
    _check_sizes("zb_h2", n_ranks=n_ranks, n_microbatches=n_microbatches)
    p, m = n_ranks, n_microbatches
    return _greedy_one_stage(p, m, [2 * p - 1] * p, "zb_h2", costs)


def _v_stages(p: int, r: int) -> tuple[int, int]:
    """Rank ``r``'s two stages under the V placement: (down the ranks, back up)."""
    first, second = _placement.stages_of_rank(r, n_stages=2 * p, pp=p, style="v")
    return first, second


def _check_two_chunks(name: str, n_chunks: int) -> None:
    if n_chunks != 2:
        raise ScheduleError(f"{name} runs exactly two chunks per rank in a V (stages r and 2p-1-r on rank r); "
                            f"got n_chunks={n_chunks}")


def zb_v(n_ranks: int, n_microbatches: int, n_chunks: int = 2, *,
         costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> Schedule:
    """ZB-V over ``2 p`` stages in a V: rank ``r`` runs ``2 (p - r) - 1`` forwards of its first chunk, then
    ``r`` pairs of forwards (second chunk, first chunk), then ``p - r`` triples ``F B W`` of its second chunk;
    the steady state alternates ``F B W`` of the first chunk (its F while any is left) with ``F B W`` of the
    second; the drain runs ``r`` pairs of B (first chunk, second chunk) with their W deferred, then ``p - r``
    times a B of the first chunk and the oldest pending W of that chunk, then the pending W actions, the second
    chunk's first. With fewer than ``2 p - 1`` micro-batches the same order is written for ``2 p - 1`` and the
    actions of the micro-batches that do not exist are dropped (torch's ``ScheduleZBVZeroBubble`` pads the same
    way).

    Memory: at most ``2 p`` chunk-micro-batches held on a rank from F to W (1F1B's ``p`` micro-batches of a
    whole stage, each chunk being half of one). Bubble: see the module docstring. ``costs`` (F, B, W per chunk
    action) only places the receives (see :func:`lower_ordered`)."""
    _check_sizes("zb_v", n_ranks=n_ranks, n_microbatches=n_microbatches, n_chunks=n_chunks)
    _check_two_chunks("zb_v", n_chunks)
    p, m = n_ranks, n_microbatches
    n = max(m, 2 * p - 1)
    compute = []
    for r in range(p):
        down, up = _v_stages(p, r)
        c = _Counters(n)
        for _ in range(2 * (p - r) - 1):
            c.forward(down)
        for _ in range(r):
            c.forward(up)
            c.forward(down)
        for _ in range(p - r):
            c.forward(up)
            c.backward(up, split=False)
        while c.next_f.get(up, 0) < c.next_f[down] or c.next_f[down] < n:
            if c.next_f[down] < n:
                c.forward(down)
            c.backward(down, split=False)
            c.forward(up)
            c.backward(up, split=False)
        for _ in range(r):
            c.backward(down)
            c.backward(up)
        for _ in range(p - r):
            c.backward(down)
            c.weight_of(down)
        while any(stage == up for stage, _ in c.pending_w):
            c.weight_of(up)
        c.weight(len(c.pending_w))
        compute.append([a for a in c.order if a.microbatch < m])
    return lower_ordered(compute, n_stages=2 * p, n_microbatches=m, name="zb_v", placement="v",
                         costs=costs)


def dualpipev(n_ranks: int, n_microbatches: int, n_chunks: int = 2, *,
              costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> Schedule:
    """DualPipeV over ``2 p`` stages in a V (rank ``r``: stage ``r`` going down, ``2 p - 1 - r`` coming back).

    Per rank ``r``, in the repository's eight steps: ``2 (p - 1 - r)`` forwards of the first chunk;
    ``r + 1`` pairs of forwards (first chunk, second chunk); ``p - 1 - r`` times a split B of the second chunk,
    the oldest pending W, a forward of the second chunk; ``m - 2 p + r + 1`` times ``F&B`` twice (forward of
    the first chunk with the full backward of the second, then forward of the second with the full backward
    of the first); ``p - 1 - r`` times a full backward of the second chunk and an ``F&B`` (forward of the
    second, full backward of the first); ``r + 1`` pairs of backwards (second chunk, first chunk), full in the
    first half and split in the second; ``p - 1 - r`` times a pending W and a split backward of the first
    chunk; the ``r + 1`` W actions left. ``F&B`` is written as F then the full backward (see the module
    docstring), a full backward as B then its W at once. Needs ``m >= 2 p``.

    Published (DualPipe README, *PP* = ``2 p`` stages, ``B`` the *full* backward of a chunk, ``F&B`` one
    overlapped pair): bubble ``(PP/2 - 1)(F&B + B - 3 W)``, activations ``PP + 1`` chunks per device. This
    order holds exactly ``PP + 1 = 2 p + 1`` chunk-micro-batches from F to W on every rank, and :func:`simulate`
    finds its bubble under that form with ``F&B = F + B + W`` (nothing overlapped) at the costs the tests
    check. ``costs`` (F, B, W per chunk action) only places the receives (see :func:`lower_ordered`).
    """
    _check_sizes("dualpipev", n_ranks=n_ranks, n_microbatches=n_microbatches, n_chunks=n_chunks)
    _check_two_chunks("dualpipev", n_chunks)
    p, m = n_ranks, n_microbatches
    if m < 2 * p:
        raise ScheduleError(f"dualpipev needs n_microbatches >= 2 * n_ranks: got n_microbatches={m} with "
                            f"n_ranks={p} (use m >= {2 * p})")
    compute = []
    for r in range(p):
        down, up = _v_stages(p, r)
        c = _Counters(m)
        for _ in range(2 * (p - 1 - r)):
            c.forward(down)
        for _ in range(r + 1):
            c.forward(down)
            c.forward(up)
        for _ in range(p - 1 - r):
            c.backward(up)
            c.weight()
            c.forward(up)
        for _ in range(m - 2 * p + r + 1):
            c.forward(down)
            c.backward(up, split=False)
            c.forward(up)
            c.backward(down, split=False)
        for _ in range(p - 1 - r):
            c.backward(up, split=False)
            c.forward(up)
            c.backward(down, split=False)
        split = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            c.backward(up, split=split)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            c.backward(down, split=split)
        for _ in range(p - 1 - r):
            c.weight()
            c.backward(down)
        c.weight(len(c.pending_w))
        compute.append(c.order)
    return lower_ordered(compute, n_stages=2 * p, n_microbatches=m, name="dualpipev", placement="v",
                         costs=costs)


def _greedy_one_stage(p: int, m: int, caps: list[int], name: str, costs) -> Schedule:
    """List-schedule one stage per rank at unit costs: a free rank runs the oldest ready B, else the next F if
    its input is there and it holds fewer than its cap, else the oldest pending W, else it waits."""
    f_end: dict[tuple[int, int], int] = {}
    b_end: dict[tuple[int, int], int] = {}
    nf, nb = [0] * p, [0] * p
    pending = [deque() for _ in range(p)]
    done_w = [0] * p
    free = [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while any(len(o) < 3 * m for o in orders):
        for r in range(p):
            if free[r] > t:
                continue
            k = nb[r]
            if k < nf[r] and (r == p - 1 or b_end.get((r + 1, k), t + 1) <= t):
                orders[r].append(Action(B, r, k))
                b_end[(r, k)] = t + 1
                nb[r] += 1
                pending[r].append(k)
            elif nf[r] < m and nf[r] - done_w[r] < caps[r] and (r == 0 or f_end.get((r - 1, nf[r]), t + 1) <= t):
                orders[r].append(Action(F, r, nf[r]))
                f_end[(r, nf[r])] = t + 1
                nf[r] += 1
            elif pending[r]:
                orders[r].append(Action(W, r, pending[r].popleft()))
                done_w[r] += 1
            else:
                continue
            free[r] = t + 1
        t += 1
    return lower_ordered(orders, n_stages=p, n_microbatches=m, name=name, costs=costs)
