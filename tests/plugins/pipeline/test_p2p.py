"""The gloo transport's lead-message protocol (p2p.GlooLinks) on an in-process model of gloo's matching.

The model keeps gloo's rules that the protocol relies on: a message moves once both its send and its receive are
posted, sends and receives meet first-come first-served per (sender, receiver, tag), and a receive of a
different byte count than the send it meets is an error (gloo raises; it never truncates or pads).
"""

from __future__ import annotations

from collections import defaultdict, deque

import pytest
import torch

from shardline.job.pipeline.actions import ActionKind
from shardline.job.pipeline.schedule import interleaved_one_f_one_b, one_f_one_b
from shardline.plugins.pipeline.p2p import GlooLinks, build_plan, lead_tags


class _Work:
    def __init__(self):
        self.done = False

    def wait(self, timeout=None):
        if not self.done:  # single-threaded model: an unmatched wait would block forever
            raise RuntimeError("nothing has met this operation")
        return True


class _Wire:
    """gloo's matching for every rank of one group: per (src, dst, tag) queues of unmatched sends and receives."""

    def __init__(self):
        self.sends, self.recvs = defaultdict(deque), defaultdict(deque)
        self.log: list[tuple[str, int, int, int]] = []  # (op, rank, peer, tag) in posting order

    def post(self, op, rank, peer, tag, tensor):
        self.log.append((op, rank, peer, tag))
        key = (rank, peer, tag) if op == "send" else (peer, rank, tag)
        work = _Work()
        mine, theirs = (self.sends, self.recvs) if op == "send" else (self.recvs, self.sends)
        if theirs[key]:
            other, other_work = theirs[key].popleft()
            src, dst = (tensor, other) if op == "send" else (other, tensor)
            if src.numel() * src.element_size() != dst.numel() * dst.element_size():
                raise RuntimeError(f"gloo: message of {src.numel() * src.element_size()} bytes met a receive of "
                                   f"{dst.numel() * dst.element_size()}")
            dst.reshape(-1).view(torch.uint8).copy_(src.contiguous().reshape(-1).view(torch.uint8))
            work.done = other_work.done = True
        else:
            mine[key].append((tensor if op == "recv" else tensor.clone(), work))
        return work


class _PG:
    def __init__(self, wire: _Wire, rank: int):
        self.wire, self.rank = wire, rank

    def send(self, tensors, dst, tag):
        return self.wire.post("send", self.rank, dst, tag, tensors[0])

    def recv(self, tensors, src, tag):
        return self.wire.post("recv", self.rank, src, tag, tensors[0])


def _links(wire, schedule, rank):
    def wait(work, what):
        work.wait()

    plan = build_plan(schedule, rank)
    return GlooLinks(_PG(wire, rank), plan=plan, loss_rank=schedule.rank_of_stage(schedule.n_stages - 1),
                     has_last_stage=schedule.n_stages - 1 in schedule.stages_of_rank(rank), wait=wait), plan


def _step(plan, kind):
    return next(st for _, op, _ in plan for st in op if st.kind is kind and st.lead)


def test_unchanged_shapes_cost_no_round_trip_and_changes_are_caught_even_at_equal_size():
    schedule = one_f_one_b(2, 1)
    wire = _Wire()
    (sender, send_plan), (receiver, recv_plan) = _links(wire, schedule, 0), _links(wire, schedule, 1)
    send, recv = _step(send_plan, ActionKind.SEND_ACT), _step(recv_plan, ActionKind.RECV_ACT)
    data_tag, _ = lead_tags(recv.stage)
    # (6, 4) has the bytes of (4, 6): only the header tells them apart. A dtype change is a shape change too.
    shapes = [((4, 6), torch.float32), ((4, 6), torch.float32), ((6, 4), torch.float32), ((2, 6), torch.float32),
              ((2, 6), torch.float32), ((2, 6), torch.float64), ((4, 6), torch.float32)]
    round_trips, stand_ins = [], []
    for batch, (shape, dtype) in enumerate(shapes):
        wire.log.clear()
        receiver.begin(lambda stage: torch.device("cpu"))
        sender.begin(lambda stage: torch.device("cpu"))
        before = len(wire.log)
        pending = []
        activation = torch.arange(torch.Size(shape).numel(), dtype=dtype).reshape(shape) + 100 * batch
        sender.send(send, activation, pending)
        sent = [entry for entry in wire.log[before:] if entry[3] == data_tag]
        stand_ins.append(len(sent) - 1)
        mark = len(wire.log)
        assert receiver.resolve_lead(recv, torch.device("cpu")) == (shape, dtype)
        round_trips.append(sum(op == "recv" for op, *_ in wire.log[mark:]))
        work, received = receiver.take(recv)
        work.wait()
        assert received.dtype == dtype and torch.equal(received, activation)  # exact: a copy, no arithmetic
        assert all(work.done for work, _ in pending)
        receiver.send_loss(torch.tensor(float(batch), dtype=torch.float64), 2, 1, pending)
        assert sender.receive_loss().item() == batch
    # The first batch has nothing to speculate with; after it, a receive is posted before the header arrives and
    # only a changed shape (a stand-in message fills the speculative receive) costs a receive after it.
    assert round_trips == [1, 0, 1, 1, 0, 1, 1]
    assert stand_ins == [0, 0, 1, 1, 0, 1, 1]


def test_lead_receives_are_posted_before_the_batch_and_data_receives_in_program_order():
    schedule = interleaved_one_f_one_b(2, 4, 2)
    wire = _Wire()
    links, plan = _links(wire, schedule, 1)
    links.begin(lambda stage: torch.device("cpu"))
    leads = {st.stage for _, op, _ in plan for st in op if st.is_recv and st.lead}
    assert leads == {1, 3}  # one lead per edge into this rank: stages 1 (from 0) and 3 (from 2)
    posted = [tag for op, _, _, tag in wire.log if op == "recv"]
    assert sorted(posted) == sorted(lead_tags(s)[1] for s in leads)  # headers only: no shape known yet
    # Every other receive rides DATA_TAG, in program order: the leads are each edge's first activation.
    program = [a for a in schedule.actions[1] if a.kind.is_recv]
    first = {}
    for a in program:
        if a.kind is ActionKind.RECV_ACT:
            first.setdefault(a.stage, a)
    data = [st.action for _, op, _ in plan for st in op if st.is_recv and not st.lead]
    assert data == [a for a in program if a not in first.values()]


@pytest.mark.parametrize("rank", [0, 1])
def test_the_sender_and_receiver_agree_on_each_edges_lead(rank):
    schedule = interleaved_one_f_one_b(2, 4, 2)
    receiver = 1 - rank
    sends = {(st.stage + 1, st.microbatch) for _, op, _ in build_plan(schedule, rank) for st in op
             if st.kind is ActionKind.SEND_ACT and st.lead}
    first_recv = {}
    for a in schedule.actions[receiver]:
        if a.kind is ActionKind.RECV_ACT:
            first_recv.setdefault(a.stage, a.microbatch)
    assert sends == set(first_recv.items())
