"""An op that sends and also waits for an edge's first shape header must post its sends first.

Found in review: the engine waited for the incoming header before posting the op's sends (gloo) or the op's
data (the coalesced path NCCL uses), while the peer needed those sends to produce the header: a hang on a
schedule validate() accepts. The built-in schedules never put a send and a lead receive in one op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardline.job.pipeline.actions import Schedule
from shardline.job.pipeline.simulate import validate
from shardline.plugins.pipeline import PipelineEngine
from shardline.plugins.testing import run_ranks

DT = torch.float64
DIM = 4


def _stage(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, DIM, dtype=DT), nn.Tanh())


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _batch(index: int, seq: int = 3, batch: int = 2):
    gen = torch.Generator().manual_seed(10 + index)
    return torch.randn(batch, seq, DIM, generator=gen, dtype=DT), torch.randn(batch, seq, DIM, generator=gen, dtype=DT)


# A valid (validate() accepts it) depth-first interleaved schedule on 2 ranks x 2 chunks, one micro-batch: rank 0
# sends stage 0's output and receives stage 2's input in ONE op, as Megatron's warm-up pattern
# "F, then [send its output, recv the next forward's input]" does.
DEPTH_FIRST = """schedule custom ranks=2 stages=4 microbatches=1
r0: F0@0 SA0@0 RA0@2 F0@2 SA0@2 RG0@2 B0@2 SG0@2 RG0@0 B0@0
r1: RA0@1 F0@1 SA0@1 RA0@3 F0@3 B0@3 SG0@3 RG0@1 B0@1 SG0@1
"""


def _run_depth_first(rank, world, transport):
    schedule = Schedule.from_text(DEPTH_FIRST)
    stages = {s: _stage(s) for s in schedule.stages_of_rank(rank)}
    engine = PipelineEngine(stages, schedule=schedule, pp_rank=rank, loss_fn=_mse, timeout_s=3)
    if transport == "coalesced":  # the NCCL path (batch_isend_irecv, headers first), run on gloo
        engine._links = None
    return engine.run_batch(*_batch(0)).item()


@pytest.mark.parametrize("transport", ["gloo", "coalesced"])
def test_valid_schedule_with_a_send_and_a_lead_receive_in_one_op_runs(transport):
    validate(Schedule.from_text(DEPTH_FIRST))  # the schedule is sound under validate's rendezvous semantics
    losses = run_ranks(_run_depth_first, 2, transport, timeout=30)
    inputs, targets = _batch(0)
    dense = inputs
    for stage in range(4):
        dense = _stage(stage)(dense)
    assert losses[0] == losses[1]
    assert losses[0] == pytest.approx(_mse(dense, targets).item(), rel=1e-12)
