"""Zero-bubble schedules on the engine (gloo ranks, float64): W executed, gradients equal to the dense model's,
in-flight counted until W as ``simulate`` counts it, and each stage's gradient boundary at its last B or W.

The model is shardline's reference GPT (its linears, head and embedding split their backward), cut into ``pp``
stages for ZB-H1 and ZB-H2 (loop placement) or ``2 pp`` for ZB-V and DualPipeV (V placement: rank 0 hosts the
embedding and the head). With a grid (pp2 x tp2) each rank builds only its stages, by the schedule's placement.
The reference is the same GPT in one process on the whole batch; tied embeddings keep one Parameter per process,
so under the loop placement its two uses sit on two ranks and their gradients are summed (``TiedWeight``).
"""

from __future__ import annotations

import pytest
import torch

from shardline.job.pipeline.schedule import Schedule, build_schedule, simulate
from shardline.plugins.errors import RankFailedError
from shardline.plugins.grid import Grid, ParallelDims
from shardline.plugins.pipeline import MemoryAccounting, PipelineEngine, PipelineHooks
from shardline.plugins.pipeline.backend import AutogradBackend
from shardline.plugins.pipeline.partition import TiedWeight, build_stages, partition_layers, stages_of_rank
from shardline.plugins.testing import run_ranks

DT = torch.float64
VOCAB, SEQ, BATCH = 13, 6, 4


def _config():
    from shardline.plugins.models.gpt import GPTConfig

    return GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=8, d_ff=20, tie_embeddings=True)


def _batch():
    gen = torch.Generator().manual_seed(7)
    return torch.randint(VOCAB, (BATCH, SEQ), generator=gen), torch.randint(VOCAB, (BATCH, SEQ), generator=gen)


def _dense():
    from shardline.plugins.models.gpt import GPT

    gpt = GPT(_config(), seed=3, dtype=DT)
    loss = gpt(*_batch())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in gpt.named_parameters()}


class _Order(PipelineHooks):
    """Which parameters have a gradient after each B and each W (names), and each hook's ``last``."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def _seen(self):
        return frozenset(n for n, p in self.model.named_parameters() if p.grad is not None)

    def after_backward(self, *, stage, microbatch, last):
        self.calls.append(("B", stage, microbatch, last, self._seen()))

    def after_weight(self, *, stage, microbatch, last):
        self.calls.append(("W", stage, microbatch, last, self._seen()))


def _run(rank, world, kind, m, tp):
    from shardline.plugins.models.gpt import GPT

    pp = world // tp
    grid = Grid.build(ParallelDims(world, tp=tp, pp=pp)) if tp > 1 else None
    schedule = build_schedule(kind, n_ranks=pp, n_microbatches=m)
    pp_rank = rank // tp
    gpt = GPT(_config(), seed=3, dtype=DT, grid=grid, chunks=schedule.n_chunks, placement=schedule.placement)
    layers = gpt.pipeline_layers()
    stages = stages_of_rank(build_stages(layers, partition_layers(len(layers), schedule.n_stages)), rank=pp_rank,
                            n_ranks=pp, style=schedule.placement)
    hooks = _Order(gpt)
    group = None
    if grid is not None:
        group = grid.group("pp")
    elif world > 1:
        group = torch.distributed.group.WORLD
    engine = PipelineEngine(stages, schedule=schedule, pp_rank=pp_rank, loss_fn=gpt.loss, group=group,
                            hooks=hooks, memory=MemoryAccounting.SAVED_TENSORS)
    loss = engine.run_batch(*_batch())
    hosted = schedule.stages_of_rank(pp_rank)
    if schedule.placement == "loop":  # the tied weight's two uses ran on the first rank and the last
        ends = {schedule.rank_of_stage(0), schedule.rank_of_stage(schedule.n_stages - 1)}
        embed = grid.group("embed") if grid is not None else torch.distributed.new_group(sorted(ends))
        tied = None
        if 0 in hosted:
            tied = gpt.embedding.wte.weight
        elif schedule.n_stages - 1 in hosted:
            tied = gpt.head.weight
        TiedWeight(tied, embed).sync_grads()
    mine = {id(p) for s in stages for p in s.parameters()}
    named = [("embedding.wte.weight" if n == "head.weight" else n, p) for n, p in gpt.named_parameters()]
    grads = {n: p.grad.clone() for n, p in named if id(p) in mine}
    shapes = {n: tuple(p.shape) for n, p in named if id(p) in mine}
    tp_rank = grid.rank("tp") if grid is not None else 0
    return dict(loss=loss, grads=grads, shapes=shapes, calls=hooks.calls, peak=engine.stats.peak_in_flight,
                records=[r[0] for r in engine.stats.records], tp_rank=tp_rank, pp_rank=pp_rank)


def _dense_slice(dense: torch.Tensor, shape: tuple[int, ...], tp: int, tp_rank: int) -> torch.Tensor:
    """The TP shard of a dense gradient: the one dim whose length differs, vocabulary padded to a multiple of tp."""
    if tuple(dense.shape) == shape:
        return dense
    dim = next(d for d in range(dense.dim()) if dense.shape[d] != shape[d])
    pad = shape[dim] * tp - dense.shape[dim]
    if pad:
        dense = torch.nn.functional.pad(dense, [0, 0] * (dense.dim() - 1 - dim) + [0, pad])
    return dense.chunk(tp, dim)[tp_rank]


CASES = [("zb_h1", 2, 4, 1), ("zb_h2", 2, 4, 1), ("zbv", 2, 4, 1), ("dualpipev", 2, 4, 1), ("zb_h1", 4, 2, 2),
         ("zbv", 4, 4, 2)]  # the last two build only their stages (the V: embedding and head on rank 0)


@pytest.mark.parametrize(("kind", "world", "m", "tp"), CASES, ids=[f"{k}-pp{w // t}-tp{t}" for k, w, _, t in CASES])
def test_zero_bubble_schedule_matches_the_dense_model(kind, world, m, tp):
    results = run_ranks(_run, world, kind, m, tp, timeout=90)
    dense_loss, dense_grads = _dense()
    schedule = build_schedule(kind, n_ranks=world // tp, n_microbatches=m)
    sim = simulate(schedule)
    seen = set()
    for res in results:
        torch.testing.assert_close(res["loss"], dense_loss)  # micro-batch sums reordered: float64 defaults
        for name, grad in res["grads"].items():
            want = _dense_slice(dense_grads[name], res["shapes"][name], tp, res["tp_rank"])
            torch.testing.assert_close(grad, want, msg=lambda s, n=name: f"{n}: {s}")
            seen.add(name)
        program = schedule.actions[res["pp_rank"]]
        # every F, B and W of the program ran, in order (W included: the engine no longer refuses it)
        assert [r for r in res["records"] if r in ("F", "B", "W")] == [a.kind.value for a in program
                                                                          if a.kind.is_compute]
        # in flight from F until W, exactly as the simulator counts it (its peak for this rank)
        assert res["peak"] == sim.peak_in_flight[res["pp_rank"]]
        # Split: after each B, the pair's linear weights have no gradient yet unless an earlier W gave one;
        # the stage's last W (not its last B) carries the gradient boundary.
        calls = res["calls"]
        last_w = {s: max(i for i, c in enumerate(calls) if c[0] == "W" and c[1] == s) for _, s, *_ in calls}
        assert [c[3] for c in calls] == [i == last_w[c[1]] for i, c in enumerate(calls)]
        first_b = next(c for c in calls if c[0] == "B")
        assert not any(n.endswith(("fc1.weight", "qkv.weight", "wte.weight")) for n in first_b[4])
    assert seen == set(dense_grads)


class _OwnBackward(AutogradBackend):
    def backward(self, stage, output, grad, *, last):
        super().backward(stage, output, grad, last=last)


def test_a_backend_with_its_own_backward_must_say_how_w_runs():
    # (DeepSpeed's backend is such a backend: it must place ZeRO's reduction and the boundary at W first.)
    assert AutogradBackend({}).runs_weight_actions and not _OwnBackward({}).runs_weight_actions
    with pytest.raises(RankFailedError, match=r"rank 0: ScheduleError: rank 0, step \d+: W0@0 is a split weight "
                                               r"backward, but backend _OwnBackward overrides backward and not weight"):
        run_ranks(_run_own_backend, 1, timeout=60)


def _run_own_backend(rank, world):
    stage = torch.nn.Linear(2, 2, dtype=DT)
    schedule = Schedule.from_text("schedule split ranks=1 stages=1 microbatches=1\nr0: F0 B0 W0\n")
    PipelineEngine(stage, schedule=schedule, pp_rank=0, loss_fn=lambda y, t: y.sum(), backend=_OwnBackward({0: stage}))


def _run_memory(rank, world, program):
    from shardline.plugins.layers.tensor_parallel import ColumnParallelLinear

    torch.manual_seed(0)
    stage = ColumnParallelLinear(4, 6, group=None, bias=False, dtype=DT)
    schedule = Schedule.from_text(f"schedule mem ranks=1 stages=1 microbatches=2\nr0: {program}\n")
    engine = PipelineEngine(stage, schedule=schedule, pp_rank=0, loss_fn=lambda y, t: (y * t).sum(),
                            memory=MemoryAccounting.SAVED_TENSORS)
    inputs, targets = torch.randn(4, 4, dtype=DT), torch.randn(4, 6, dtype=DT)
    engine.run_batch(inputs, targets)
    return engine.stats.peak_saved_bytes, engine.stats.peak_in_flight, stage.weight.grad.clone(), inputs, targets


@pytest.mark.parametrize(("program", "in_flight", "held_bytes"), [
    ("F0 B0 W0 F1 B1 W1", 1, 96), ("F0 B0 F1 B1 W0 W1", 2, 192), ("F0 F1 B0 B1 W0 W1", 2, 192), ("F0 B0 F1 B1", 1, 0)])
def test_what_w_holds_after_b_counts_as_in_flight(program, in_flight, held_bytes):
    # One linear stage y = x A^T, loss sum(y * t), micro-batches of 2 rows. Autograd saves nothing but resident
    # tensors here (x and t are slices of the caller's batch, A a parameter). After a split B the store keeps x
    # (resident) and dy = t / 2 (the loss is a mean over 2 micro-batches), a new 2 x 6 float64 tensor of 96 bytes,
    # until W: so each micro-batch between B and W holds 96 bytes, and the unsplit schedule holds none.
    (peak, held, grad, inputs, targets), = run_ranks(_run_memory, 1, program, timeout=60)
    assert held == in_flight
    assert peak == held_bytes
    torch.testing.assert_close(grad, targets.T @ inputs / 2)  # dA = sum_i t_i^T x_i, mean over 2 micro-batches


def test_v_placement_cuts_the_model_so_rank_0_holds_the_embedding_and_the_head():
    from types import SimpleNamespace

    from shardline.job.stages import hosted_stages
    from shardline.plugins.models.decoder import hosted_layers

    # 6 layers (embedding, 4 blocks, head) cut uniformly into 4 stages: [0], [1, 2], [3], [4, 5] (k * 6 // 4).
    # The V puts stages 0 and 3 on rank 0, stages 1 and 2 on rank 1; the loop puts 0, 2 and 1, 3.
    assert hosted_stages(6, pp=2, chunks=2, pp_rank=0, style="v") == {0: range(0, 1), 3: range(4, 6)}
    assert hosted_stages(6, pp=2, chunks=2, pp_rank=1, style="v") == {1: range(1, 3), 2: range(3, 4)}
    assert hosted_stages(6, pp=2, chunks=2, pp_rank=0) == {0: range(0, 1), 2: range(3, 4)}
    grid = SimpleNamespace(dims=SimpleNamespace(pp=2), rank=lambda axis: 0)
    assert hosted_layers(6, grid, chunks=2, placement="v") == {0, 4, 5}
    assert hosted_layers(6, grid, chunks=2) == {0, 3}
    assert stages_of_rank("abcd", rank=0, n_ranks=2, style="v") == ["a", "d"]
    assert stages_of_rank("abcd", rank=1, n_ranks=2, style="v") == ["b", "c"]
    schedule = build_schedule("zbv", n_ranks=2, n_microbatches=4)
    assert [schedule.stages_of_rank(r) for r in (0, 1)] == [[0, 3], [1, 2]]


def _plain_stages():
    torch.manual_seed(1)
    return [torch.nn.Sequential(torch.nn.Linear(5, 5, dtype=DT), torch.nn.Tanh()) for _ in range(2)]


def _run_plain(rank, world):
    stages = _plain_stages()
    engine = PipelineEngine(stages[rank], schedule=build_schedule("zb_h1", n_ranks=2, n_microbatches=4), pp_rank=rank,
                            loss_fn=lambda y, t: ((y - t) ** 2).mean())
    x, t = torch.randn(8, 5, dtype=DT, generator=torch.Generator().manual_seed(2)), torch.zeros(8, 5, dtype=DT)
    loss = engine.run_batch(x, t)
    return loss, [p.grad.clone() for p in stages[rank].parameters()], [r[0] for r in engine.stats.records]


def test_modules_that_do_not_split_take_their_whole_backward_in_b():
    # torch's own nn.Linear does not split: each W is empty, and the gradients are still the whole model's.
    results = run_ranks(_run_plain, 2, timeout=60)
    stages = _plain_stages()
    x = torch.randn(8, 5, dtype=DT, generator=torch.Generator().manual_seed(2))
    loss = (stages[1](stages[0](x)) ** 2).mean()
    loss.backward()
    for rank, (rank_loss, grads, records) in enumerate(results):
        torch.testing.assert_close(rank_loss, loss.detach())
        for grad, p in zip(grads, stages[rank].parameters()):
            torch.testing.assert_close(grad, p.grad)
        assert records.count("W") == 4
