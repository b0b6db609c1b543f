"""How the engine's sends and receives travel: its per-rank plan, the shape header, and the gloo transport.

Plan. :func:`build_plan` turns a rank's program into the ops the engine executes (``split_ops``: each compute
alone, each run of send/recv actions as one batch) and works out, once, what does not change between batches:
annotation names, the group rank at the other end, which backward is a stage's last, which message leads an edge.

Shape header. The first activation sent over each edge ``s - 1 -> s`` in a batch goes with a header of
``2 + MAX_DIMS`` int64s: ``ndim, dtype index, dims..., 0...``. The receiver allocates from it, so the
sequence length may change from batch to batch; micro-batches of one batch have one shape (the engine checks).

gloo transport (:class:`GlooLinks`). gloo moves a message only once both ends have posted it, and does not
coalesce ops, so on gloo the engine posts to the process group directly and differs from the schedule only in
*when* receives are posted, never in their order:

- Receives are posted in program order, up to ``RECV_AHEAD`` beyond the ones the current op needs, as soon
  as their shape is known: a message then moves while the receiver computes, instead of after it asks. A
  posted receive blocks nothing, and an op posts its sends before it waits for any lead header (the peer may
  need them to produce it), so ``validate``'s deadlock proof holds; since each rank posts receives in
  program order and sends in program order, every message meets the receive the schedule pairs it with.
- The lead message of an edge (the activation of the micro-batch the receiver takes first) travels on a tag of
  its own, with its header on another, and the receiver posts both receives before the batch starts, the data
  one with the shape the previous batch's header gave (speculation). The receiver always checks the header
  before using the data. When the shape changed, the sender, which knows the receiver speculated with the
  previous shape, first sends a throw-away message of that size into the speculative receive and then the
  real one, which the receiver posts once it has read the header. Unchanged shapes (the common case) thus
  cost no round trip; changed ones cost one, and a mismatch is never silent.
- The batch loss goes from the last stage's rank to each other rank point to point on a tag of its own; the
  receivers post before the batch starts, so it is there when they finish.

Both ends keep the previous batch's lead shape per edge in step (each updates it from the same header), so
after a batch that failed half-way they may disagree; the engine refuses to run another batch then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardline.job.annotations import pp_action_name
from shardline.job.pipeline.actions import Action, ActionKind, Schedule
from shardline.job.pipeline.simulate import split_ops
from shardline.plugins.errors import ContractError

MAX_DIMS = 8
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
DATA_TAG, HEADER_TAG, LOSS_TAG = 0, 1, 2
_LEAD_TAG_BASE = 16
#: gloo: receives posted beyond those the current op needs (one is enough to keep a 1F1B pipeline's next message
#: moving; each costs one buffer the size of the message held early).
RECV_AHEAD = 1


def lead_tags(stage: int) -> tuple[int, int]:
    """(data tag, header tag) of the lead message into ``stage``."""
    return _LEAD_TAG_BASE + 2 * stage, _LEAD_TAG_BASE + 2 * stage + 1


@dataclass(frozen=True, slots=True)
class Step:
    """One action of this rank's program with what does not change between batches worked out once."""

    action: Action
    kind: ActionKind
    stage: int
    microbatch: int
    index: int  # position in the rank's program
    name: str  # pp_action_name of the action
    wait_name: str  # pp_action_name("wait", ...) for a receive's wait
    is_send: bool
    is_recv: bool
    peer: int  # group rank at the other end (-1 for compute)
    last: bool  # a B or W that is its stage's final one of the batch (the gradient accumulation boundary)
    lead: bool  # gloo: the lead message of its edge (see the module docstring)
    what: str  # how a timeout names it


def build_plan(schedule: Schedule, rank: int) -> list[tuple[bool, tuple[Step, ...], int]]:
    """``split_ops`` of the rank's program (what ``validate`` proved), each op ``(is_compute, steps, n_recv)``,
    ``n_recv`` counting the receives that are not leads in the program up to and including that op."""
    program = schedule.actions[rank]
    grad_kinds = (ActionKind.BACKWARD, ActionKind.WEIGHT)
    last_backward = {a.stage: step for step, a in enumerate(program) if a.kind in grad_kinds}
    lead_mb = {}  # receiving stage -> micro-batch of its first RA, from the receiver's own program
    for receiver in range(schedule.n_ranks):
        for a in reversed(schedule.actions[receiver]):
            if a.kind is ActionKind.RECV_ACT:
                lead_mb[a.stage] = a.microbatch

    def step_of(index: int, a: Action) -> Step:
        peer = -1 if a.kind.is_compute else schedule.rank_of_stage(a.peer_stage)
        receiving = {ActionKind.SEND_ACT: a.stage + 1, ActionKind.RECV_ACT: a.stage}.get(a.kind)
        return Step(a, a.kind, a.stage, a.microbatch, index,
                    pp_action_name(a.kind.value, stage=a.stage, microbatch=a.microbatch),
                    pp_action_name("wait", stage=a.stage, microbatch=a.microbatch), a.kind.is_send, a.kind.is_recv,
                    peer, a.kind in grad_kinds and last_backward[a.stage] == index,
                    receiving is not None and lead_mb.get(receiving) == a.microbatch, f"{a} from rank {peer}")

    plan, n_recv = [], 0
    for step, batch in split_ops(program):
        steps = tuple(step_of(step + i, a) for i, a in enumerate(batch))
        n_recv += sum(st.is_recv and not st.lead for st in steps)
        plan.append((batch[0].kind.is_compute, steps, n_recv))
    return plan


def encode_header(tensor: torch.Tensor, *, device) -> torch.Tensor:
    if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
        raise ContractError(f"activation of shape {tuple(tensor.shape)} dtype {tensor.dtype} cannot be sent: at "
                            f"most {MAX_DIMS} dims and a dtype in {DTYPES}")
    values = [tensor.dim(), DTYPES.index(tensor.dtype), *tensor.shape] + [0] * (MAX_DIMS - tensor.dim())
    return torch.tensor(values, dtype=torch.int64, device=device or tensor.device)


def decode_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = header.tolist()
    return tuple(values[2:2 + values[0]]), DTYPES[values[1]]


def empty_header(device=None) -> torch.Tensor:
    return torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=device)


Pending = list[tuple[dist.Work, torch.Tensor]]  # posted sends with the tensors they read, waited at batch end
Wait = Callable[[dist.Work, str], None]


class GlooLinks:
    """One engine's point-to-point traffic over a gloo group (see the module docstring). Per batch: ``begin``,
    then ``resolve_lead`` / ``post_recvs`` / ``send`` / ``take`` as the ops come, then the loss."""

    def __init__(self, pg: dist.ProcessGroup, *, plan, loss_rank: int, has_last_stage: bool, wait: Wait):
        self.pg, self._wait, self.loss_rank, self._has_last = pg, wait, loss_rank, has_last_stage
        steps = [st for _, op, _ in plan for st in op]
        self._recvs = tuple(st for st in steps if st.is_recv and not st.lead)  # DATA_TAG receives, program order
        self._lead_in = {st.stage: st for st in steps if st.is_recv and st.lead}
        self._shape_in: dict[int, tuple] = {}  # receiving stage -> (shape, dtype) of the last lead received
        self._shape_out: dict[int, tuple] = {}  # receiving stage -> ((shape, dtype), header) of the last lead sent

    def begin(self, device_of: Callable[[int], torch.device]) -> None:
        """Before the batch's first op: the receives of the loss, of every lead header and speculative lead."""
        self.posted: dict[int, tuple[dist.Work, torch.Tensor]] = {}  # by Step.index
        self._cursor = 0  # the next DATA_TAG receive to post
        self._leads = {}
        for stage, st in self._lead_in.items():
            data_tag, header_tag = lead_tags(stage)
            header = empty_header()
            spec = None
            if stage in self._shape_in:
                shape, dtype = self._shape_in[stage]
                buffer = torch.empty(shape, dtype=dtype, device=device_of(stage))
                spec = (self.pg.recv([buffer], st.peer, data_tag), buffer)
            self._leads[stage] = (self.pg.recv([header], st.peer, header_tag), header, spec)
        self._loss = None
        if not self._has_last:
            buffer = torch.empty((), dtype=torch.float64)
            self._loss = (self.pg.recv([buffer], self.loss_rank, LOSS_TAG), buffer)

    def resolve_lead(self, st: Step, device: torch.device) -> tuple[tuple[int, ...], torch.dtype]:
        """Wait for the lead header of ``st``'s edge; make sure a receive of the shape it names is posted."""
        work, header, spec = self._leads.pop(st.stage)
        self._wait(work, f"the shape header of {st.action} from rank {st.peer}")
        shape, dtype = decode_header(header)
        self._shape_in[st.stage] = (shape, dtype)
        if spec is not None and (tuple(spec[1].shape), spec[1].dtype) == (shape, dtype):
            self.posted[st.index] = spec
            return shape, dtype
        if spec is not None:  # the shape changed: the sender put a throw-away message into the speculative receive
            self._wait(spec[0], f"the previous shape's stand-in for {st.action} from rank {st.peer}")
        buffer = torch.empty(shape, dtype=dtype, device=device)
        self.posted[st.index] = (self.pg.recv([buffer], st.peer, lead_tags(st.stage)[0]), buffer)
        return shape, dtype

    def post_recvs(self, n_recv: int, make_buffer: Callable[[Step, bool], torch.Tensor | None], *,
                   ahead: bool = False) -> None:
        """Post DATA_TAG receives in program order until ``n_recv`` are posted; ``ahead``: only while their
        shapes are known (``make_buffer(step, required)`` returns None for one that is not)."""
        recvs = self._recvs
        while self._cursor < min(n_recv, len(recvs)):
            st = recvs[self._cursor]
            tensor = make_buffer(st, not ahead)
            if tensor is None:
                return
            self.posted[st.index] = (self.pg.recv([tensor], st.peer, DATA_TAG), tensor)
            self._cursor += 1

    def send(self, st: Step, tensor: torch.Tensor, pending: Pending) -> None:
        if not st.lead:
            pending.append((self.pg.send([tensor], st.peer, DATA_TAG), tensor))
            return
        receiving = st.stage + 1
        data_tag, header_tag = lead_tags(receiving)
        current = (tuple(tensor.shape), tensor.dtype)
        previous, header = self._shape_out.get(receiving, (None, None))
        if previous != current:  # (the previous batch's header was sent and waited for: it can be sent again)
            header = encode_header(tensor, device=torch.device("cpu"))
        pending.append((self.pg.send([header], st.peer, header_tag), header))
        if previous is not None and previous != current:
            stand_in = torch.empty(previous[0], dtype=previous[1])  # fills the receiver's speculative receive
            pending.append((self.pg.send([stand_in], st.peer, data_tag), stand_in))
        self._shape_out[receiving] = (current, header)
        pending.append((self.pg.send([tensor], st.peer, data_tag), tensor))

    def take(self, st: Step) -> tuple[dist.Work, torch.Tensor]:
        return self.posted.pop(st.index)

    def send_loss(self, loss: torch.Tensor, n_ranks: int, rank: int, pending: Pending) -> None:
        pending += [(self.pg.send([loss], peer, LOSS_TAG), loss) for peer in range(n_ranks) if peer != rank]

    def receive_loss(self) -> torch.Tensor:
        work, loss = self._loss
        self._wait(work, f"the batch loss from rank {self.loss_rank}")
        return loss
