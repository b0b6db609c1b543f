"""The pipeline engine on real gloo ranks, float64, against one process running the whole model on the whole batch."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as torch_f
from torch import nn

from shardline.job.annotations import pp_action_name, pp_batch_name
from shardline.job.pipeline.schedule import (
    Schedule,
    build_schedule,
    gpipe,
    one_f_one_b,
    simulate,
    validate,
)
from shardline.plugins.errors import ContractError, LayoutError, RankFailedError, ScheduleError
from shardline.plugins.grid import Grid, ParallelDims
from shardline.plugins.pipeline import MemoryAccounting, PipelineEngine, PipelineHooks
from shardline.plugins.pipeline.partition import (
    TiedWeight,
    build_stages,
    partition_layers,
    stages_of_rank,
)
from shardline.plugins.testing import run_ranks

VOCAB, DIM, BATCH = 11, 6, 8
DT = torch.float64


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, dtype=DT)

    def forward(self, ids):
        return self.emb(ids)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM, dtype=DT)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Head(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.norm = nn.LayerNorm(DIM, dtype=DT)
        self.weight = weight

    def forward(self, x):
        return self.norm(x) @ self.weight.T


def loss_fn(logits, targets):
    return torch_f.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def sum_loss_fn(logits, targets):
    return torch_f.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")


LOSSES = {"mean": loss_fn, "sum": sum_loss_fn}


def make_layers(n_stages: int, *, shared_head: bool) -> nn.ModuleList:
    """Embedding, 2 n_stages - 2 blocks, head (2 layers per stage). The head's weight starts equal to the
    embedding's: the same Parameter for the reference (``shared_head``), an equal copy for a pipeline."""
    torch.manual_seed(0)
    embed = Embed()
    blocks = [Block() for _ in range(2 * n_stages - 2)]
    weight = embed.emb.weight if shared_head else nn.Parameter(embed.emb.weight.detach().clone())
    return nn.ModuleList([embed, *blocks, Head(weight)])


def make_batch(seq: int, index: int):
    gen = torch.Generator().manual_seed(100 + index)
    ids = torch.randint(VOCAB, (BATCH, seq), generator=gen)
    return ids, torch.randint(VOCAB, (BATCH, seq), generator=gen)


def reference(n_stages: int, seqs: tuple[int, ...], reduction: str = "mean"):
    """One process, whole model, whole batch: the loss and every gradient, per batch."""
    layers = make_layers(n_stages, shared_head=False)
    out = []
    for index, seq in enumerate(seqs):
        layers.zero_grad(set_to_none=True)
        x, targets = make_batch(seq, index)
        for layer in layers:
            x = layer(x)
        loss = LOSSES[reduction](x, targets)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in layers.named_parameters()}))
    return out


def _my_layers(layers, n_stages, rank, world):
    partition = partition_layers(layers, n_stages)
    mine = set(stages_of_rank(range(n_stages), rank=rank, n_ranks=world))
    return partition, {i for i in range(len(layers)) if partition.stage_of_layer(i) in mine}


def _run_engine(rank, world, kind, m, v, seqs, reduction, transport):
    n_stages = world * v
    layers = make_layers(n_stages, shared_head=False)
    partition, mine = _my_layers(layers, n_stages, rank, world)
    stages = stages_of_rank(build_stages(layers, partition), rank=rank, n_ranks=world)
    schedule = build_schedule(kind, n_ranks=world, n_microbatches=m, n_chunks=v)
    engine = PipelineEngine(stages, schedule=schedule, pp_rank=rank, loss_fn=LOSSES[reduction],
                            loss_reduction=reduction)
    if transport == "coalesced":  # the path other backends (NCCL) take, run on gloo: the only CPU cover it has
        engine._links = None
    out = []
    for index, seq in enumerate(seqs):
        layers.zero_grad(set_to_none=True)
        ids, targets = make_batch(seq, index)
        loss = engine.run_batch(ids, targets)
        grads = {n: p.grad.clone() for n, p in layers.named_parameters() if int(n.split(".")[0]) in mine}
        out.append((loss, grads))
    return out


@pytest.mark.parametrize(("world", "kind", "m", "v", "reduction", "transport"), [
    (2, "gpipe", 4, 1, "mean", "gloo"), (2, "1f1b", 4, 1, "mean", "gloo"), (2, "interleaved", 4, 2, "mean", "gloo"),
    (4, "gpipe", 4, 1, "mean", "gloo"), (4, "1f1b", 8, 1, "mean", "gloo"), (4, "interleaved", 4, 2, "mean", "gloo"),
    (4, "interleaved", 8, 2, "mean", "gloo"),  # m > p: the steady state with Megatron's four-way batches
    (2, "1f1b", 2, 1, "sum", "gloo"),  # a summed loss is not rescaled by 1/m
    (1, "interleaved", 2, 2, "mean", "gloo"),  # one rank, two chunks: neighbouring stages hand over locally
    (2, "1f1b", 4, 1, "mean", "coalesced"), (4, "interleaved", 8, 2, "mean", "coalesced"),
])
def test_engine_matches_whole_model_reference_across_sequence_lengths(world, kind, m, v, reduction, transport):
    # Shapes travel with the activations: the sequence shortens, stays (gloo posts a receive of the previous
    # batch's shape before the header arrives), and grows back.
    seqs = (5, 3, 3, 5)
    results = run_ranks(_run_engine, world, kind, m, v, seqs, reduction, transport, timeout=60)
    expected = reference(world * v, seqs, reduction)
    for batch, (ref_loss, ref_grads) in enumerate(expected):
        seen = set()
        for rank in range(world):
            loss, grads = results[rank][batch]
            # float64 behind a reduction (micro-batch sums vs one batch mean): float64 defaults of assert_close.
            torch.testing.assert_close(loss, ref_loss)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[name], msg=lambda s, n=name: f"{n}: {s}")
                seen.add(name)
        assert seen == set(ref_grads)  # every parameter's gradient was checked on exactly the rank that owns it


def _run_tied(rank, world, pp, steps):
    """A pp-stage pipeline per data-parallel replica (dp = world / pp), tied embedding synced over "embed"."""
    grid = Grid.build(ParallelDims(world, pp=pp))
    stage, replica = grid.rank("pp"), grid.coords["dp"]
    layers = make_layers(pp, shared_head=False)
    partition, _ = _my_layers(layers, pp, stage, pp)
    stages = build_stages(layers, partition)
    engine = PipelineEngine(stages[stage], schedule=one_f_one_b(pp, 4), pp_rank=stage, loss_fn=loss_fn,
                            group=grid.group("pp"))
    weight = layers[0].emb.weight if stage == 0 else layers[-1].weight if stage == pp - 1 else None
    tied = TiedWeight(weight, grid.group("embed"))
    optimizer = torch.optim.SGD(stages[stage].parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(engine.run_batch(*make_batch(4, 10 * replica + step)))  # each replica its own data
        tied.sync_grads()
        optimizer.step()
    return replica, stage, losses, None if weight is None else weight.detach().clone()


def _reference_training(n_stages, replica, steps):
    layers = make_layers(n_stages, shared_head=True)
    optimizer = torch.optim.SGD(layers.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x, targets = make_batch(4, 10 * replica + step)
        for layer in layers:
            x = layer(x)
        loss = loss_fn(x, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses, layers[0].emb.weight.detach()


@pytest.mark.parametrize(("world", "pp"), [(2, 2), (4, 4), (4, 2)])
def test_tied_embeddings_stay_identical_and_match_a_shared_weight(world, pp):
    steps = 2
    results = run_ranks(_run_tied, world, pp, steps, timeout=60)
    for replica in range(world // pp):
        ends = {stage: (losses, w) for r, stage, losses, w in results if r == replica and stage in (0, pp - 1)}
        (first_losses, first), (last_losses, last) = ends[0], ends[pp - 1]
        # Both copies received the same summed gradient (one all-reduce result) and ran the same SGD arithmetic.
        assert torch.equal(first, last)
        ref_losses, ref_weight = _reference_training(pp, replica, steps)
        assert not torch.equal(first, make_layers(pp, shared_head=True)[0].emb.weight)  # it did train
        # float64 behind reductions in another order (micro-batches, the all-reduce): assert_close defaults.
        torch.testing.assert_close(first, ref_weight)
        for losses in (first_losses, last_losses):  # the loss reaches every rank of the pipeline
            torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))


def _run_memory(rank, world, kind, m):
    layers = make_layers(world, shared_head=False)
    partition, _ = _my_layers(layers, world, rank, world)
    stages = build_stages(layers, partition)
    schedule = build_schedule(kind, n_ranks=world, n_microbatches=m)
    engine = PipelineEngine(stages[rank], schedule=schedule, pp_rank=rank, loss_fn=loss_fn,
                            memory=MemoryAccounting.SAVED_TENSORS)
    ids, targets = make_batch(16, 0)
    engine.run_batch(ids[:1].repeat(m, 1), targets[:1].repeat(m, 1))  # micro-batch size 1 whatever m is
    return engine.stats.peak_saved_bytes, engine.stats.peak_in_flight


def test_first_stage_activation_memory_flat_for_1f1b_linear_for_gpipe():
    world, ms = 2, (1, 2, 4, 8)
    peaks = {(kind, m): run_ranks(_run_memory, world, kind, m, timeout=60)[0] for kind in ("gpipe", "1f1b")
             for m in ms}
    per_microbatch = peaks["gpipe", 1][0]
    assert per_microbatch > 0
    for m in ms:
        # Micro-batches have identical shapes, so bytes are exact multiples of one micro-batch's activations.
        assert peaks["gpipe", m] == (m * per_microbatch, m)
        bound = simulate(one_f_one_b(world, m)).peak_in_flight[0]
        assert bound == min(world, m)
        assert peaks["1f1b", m] == (bound * per_microbatch, bound)


class _Recorder(PipelineHooks):
    def __init__(self):
        self.calls = []

    def before_batch(self, *, n_microbatches):
        self.calls.append(("before_batch", n_microbatches))

    def after_batch(self, *, loss):
        self.calls.append(("after_batch",))

    def before_forward(self, *, stage, microbatch):
        self.calls.append(("F", stage, microbatch))

    def before_backward(self, *, stage, microbatch, last):
        self.calls.append(("B", stage, microbatch, last))


def _run_hooks_and_stats(rank, world):
    layers = make_layers(world, shared_head=False)
    partition, _ = _my_layers(layers, world, rank, world)
    schedule = one_f_one_b(world, 4)
    hooks = _Recorder()
    engine = PipelineEngine(build_stages(layers, partition)[rank], schedule=schedule, pp_rank=rank,
                            loss_fn=loss_fn, hooks=hooks)
    engine.run_batch(*make_batch(3, 0))
    names = [r[0] for r in engine.stats.records]
    return hooks.calls, names, engine.stats.bubble_fraction


def test_hooks_follow_the_schedule_and_stats_record_every_action():
    world = 2
    schedule = one_f_one_b(world, 4)
    results = run_ranks(_run_hooks_and_stats, world, timeout=60)
    for rank, (calls, names, bubble) in enumerate(results):
        compute = [a for a in schedule.actions[rank] if a.kind.is_compute]
        assert calls[0] == ("before_batch", 4) and calls[-1] == ("after_batch",)
        assert [c[:3] for c in calls[1:-1]] == [(a.kind.value, a.stage, a.microbatch) for a in compute]
        assert [c[3] for c in calls[1:-1] if c[0] == "B"] == [False, False, False, True]
        assert [n for n in names if n != "wait"] == [a.kind.value for a in schedule.actions[rank]]
        assert 0.0 <= bubble < 1.0


def _run_bad(rank, world, case):
    layers = make_layers(world, shared_head=False)
    stages = build_stages(layers, partition_layers(layers, world))
    if case == "batch":
        engine = PipelineEngine(stages[rank], schedule=gpipe(world, 3), pp_rank=rank, loss_fn=loss_fn)
        engine.run_batch(*make_batch(2, 0))
    elif case == "stages":
        PipelineEngine(stages, schedule=gpipe(world, 2), pp_rank=rank, loss_fn=loss_fn)
    elif case == "mismatch":  # rank 1 runs a second batch that rank 0 never starts
        engine = PipelineEngine(stages[rank], schedule=gpipe(world, 2), pp_rank=rank, loss_fn=loss_fn,
                                timeout_s=0.5)
        for index in range(rank + 1):
            engine.run_batch(*make_batch(2, index))
        time.sleep(1.5)  # rank 0 stays up, so rank 1 meets its deadline rather than a closed connection
    elif case == "reduction":
        PipelineEngine(stages[rank], schedule=gpipe(world, 2), pp_rank=rank, loss_fn=loss_fn,
                       loss_reduction="median")
    elif case == "ragged":  # stage 0 returns a shorter sequence for its second micro-batch
        class Ragged(nn.Module):
            calls = 0

            def forward(self, x):
                Ragged.calls += 1
                return stages[0](x)[:, : 3 - (Ragged.calls + 1) % 2]  # micro-batch 0 whole, 1 cut short

        engine = PipelineEngine(Ragged() if rank == 0 else stages[1], schedule=gpipe(world, 2), pp_rank=rank,
                                loss_fn=loss_fn, timeout_s=2)
        engine.run_batch(*make_batch(3, 0))
    elif case == "retry":  # rank 1's second batch fails half-way; it must not run a third over its leftovers
        engine = PipelineEngine(stages[rank], schedule=gpipe(world, 2), pp_rank=rank, loss_fn=loss_fn,
                                timeout_s=0.5)
        engine.run_batch(*make_batch(2, 0))
        if rank == 1:
            with pytest.raises(ScheduleError):
                engine.run_batch(*make_batch(2, 1))
            # the failed batch's activations, graphs and micro-batches are not kept alive
            assert engine._state == {} and engine._micro_in is None and engine._micro_tgt is None
            engine.run_batch(*make_batch(2, 2))
        time.sleep(1.5)
    elif case == "annotations":
        PipelineEngine(stages[rank], schedule=gpipe(world, 2), pp_rank=rank, loss_fn=loss_fn,
                       annotations="sometimes")
    elif case == "deadlock":
        text = ("schedule hand ranks=2 stages=2 microbatches=2\n"
                "r0: F0 SA0 F1 RG0 B0 SA1 RG1 B1\nr1: RA0 F0 RA1 F1 B0 SG0 B1 SG1\n")
        PipelineEngine(stages[rank], schedule=Schedule.from_text(text), pp_rank=rank, loss_fn=loss_fn)


@pytest.mark.parametrize(("case", "error", "pattern"), [
    ("batch", LayoutError, r"(inputs|targets) batch size \(8,\) is not divisible by n_microbatches=3"),
    ("stages", ContractError, r"got 2 stage modules in chunk order but this rank hosts stages \[[01]\]"),
    ("mismatch", ScheduleError, r"rank 1 waited more than 0.5 s for the shape header of RA0@1 from rank 0"),
    ("reduction", ContractError, r"loss_reduction='median' is not one of \['mean', 'sum'\]"),
    ("deadlock", ScheduleError, r"schedule 'hand' deadlocks .* rank 0 blocked at step 3 on \[RG0@0\]"),
    ("ragged", ContractError, r"stage 0 output \(4, 2, 6\) torch.float64 for micro-batch 1, but \(4, 3, 6\)"),
    ("retry", ContractError, r"rank 1: an earlier run_batch failed after posting messages"),
    ("annotations", ContractError, r"annotations='sometimes' is not one of \['when_profiling', 'always'\]"),
])
def test_bad_input_raises_our_errors_with_the_values(case, error, pattern):
    # Either rank may be the first to report; each names its own values.
    with pytest.raises(RankFailedError, match=rf"rank [01]: {error.__name__}: {pattern}"):
        run_ranks(_run_bad, 2, case, timeout=60)


def _run_profiled(rank, world):
    layers = make_layers(world, shared_head=False)
    partition, _ = _my_layers(layers, world, rank, world)
    engine = PipelineEngine(build_stages(layers, partition)[rank], schedule=one_f_one_b(world, 2), pp_rank=rank,
                            loss_fn=loss_fn)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.run_batch(*make_batch(3, 0))
    return sorted({e.name for e in prof.events() if e.name.startswith("sl:")})


def _annotation_names(schedule, rank: int) -> set[str]:
    expected = {pp_batch_name(schedule.name, p=schedule.n_ranks, m=schedule.n_microbatches, v=schedule.n_chunks)}
    for a in schedule.actions[rank]:
        expected.add(pp_action_name(a.kind.value, stage=a.stage, microbatch=a.microbatch))
        if a.kind.is_recv:
            expected.add(pp_action_name("wait", stage=a.stage, microbatch=a.microbatch))
    return expected


def test_every_action_and_every_receive_wait_is_annotated_in_a_real_trace():
    world = 2
    schedule = one_f_one_b(world, 2)
    for rank, names in enumerate(run_ranks(_run_profiled, world, timeout=60)):
        assert set(names) == _annotation_names(schedule, rank)


def _run_annotated(rank, world, annotations):
    import shardline.plugins.pipeline.engine as engine_module

    entered = []

    class Recorder:  # stands in for record_function; this forked worker's patch dies with it
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            entered.append(self.name)

        def __exit__(self, *exc):
            return False

    engine_module.record_function = Recorder
    layers = make_layers(world, shared_head=False)
    partition, _ = _my_layers(layers, world, rank, world)
    options = {} if annotations is None else {"annotations": annotations}
    engine = PipelineEngine(build_stages(layers, partition)[rank], schedule=one_f_one_b(world, 2), pp_rank=rank,
                            loss_fn=loss_fn, **options)
    engine.run_batch(*make_batch(3, 0))
    return set(entered)


@pytest.mark.parametrize("annotations", [None, "always"])
def test_no_record_function_without_a_profiler_unless_asked_for(annotations):
    # record_function costs tens of microseconds per action even when nothing records it (see Annotations).
    world = 2
    schedule = one_f_one_b(world, 2)
    for rank, names in enumerate(run_ranks(_run_annotated, world, annotations, timeout=60)):
        assert names == (set() if annotations is None else _annotation_names(schedule, rank))


def _gpt(seed=0):
    from shardline.plugins.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=13, seq_len=8, n_layer=2, n_head=2, d_model=8, tie_embeddings=True)
    return GPT(config, seed=seed, dtype=DT)


def _run_gpt(rank, world):
    grid = Grid.build(ParallelDims(world, pp=world))
    gpt = _gpt()
    layers = gpt.pipeline_layers()
    stages = build_stages(layers, partition_layers(layers, world))
    engine = PipelineEngine(stages[rank], schedule=one_f_one_b(world, 2), pp_rank=rank, loss_fn=gpt.loss,
                            group=grid.group("pp"))
    ids, targets = make_batch(8, 0)
    loss = engine.run_batch(ids % 13, targets % 13)
    # The tied weight is one Parameter in this process, but only one of its two uses ran here.
    TiedWeight(gpt.embedding.wte.weight if rank in (0, world - 1) else None, grid.group("embed")).sync_grads()
    mine = {id(p) for p in stages[rank].parameters()}
    return loss, {n: p.grad.clone() for n, p in gpt.named_parameters() if id(p) in mine}


def test_reference_gpt_pipeline_layers_run_on_the_engine():
    world = 2
    results = run_ranks(_run_gpt, world, timeout=60)
    gpt = _gpt()
    ids, targets = make_batch(8, 0)
    loss = gpt(ids % 13, targets % 13)
    loss.backward()
    expected = {n: p.grad for n, p in gpt.named_parameters()}
    seen = set()
    for rank_loss, grads in results:
        torch.testing.assert_close(rank_loss, loss.detach())  # float64 defaults: micro-batch sums reordered
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], msg=lambda s, n=name: f"{n}: {s}")
            seen.add(name)
    assert seen == set(expected)


def test_a_parameter_free_stage_declares_its_device():
    # The strategy's stage wrappers hold no parameters; the engine must not assume CPU for them.
    from shardline.plugins.pipeline.engine import PipelineEngine

    class Wrapper(torch.nn.Module):
        pipeline_device = torch.device("meta")

        def forward(self, x):
            return x

    from shardline.plugins.pipeline.backend import AutogradBackend

    engine = PipelineEngine.__new__(PipelineEngine)
    engine.stages = {0: Wrapper(), 1: torch.nn.Linear(2, 2)}
    engine.backend = AutogradBackend(engine.stages)  # the default backend the engine builds
    assert engine._device_of(0) == torch.device("meta")
    assert engine._device_of(1) == torch.device("cpu")


def _run_forward_only(rank, world, m, v, seqs, transport):
    n_stages = world * v
    layers = make_layers(n_stages, shared_head=False)
    partition, _ = _my_layers(layers, n_stages, rank, world)
    stages = stages_of_rank(build_stages(layers, partition), rank=rank, n_ranks=world)
    engine = PipelineEngine(stages, schedule=build_schedule("forward_only", n_ranks=world, n_microbatches=m,
                                                            n_chunks=v), pp_rank=rank, loss_fn=loss_fn)
    if transport == "coalesced":
        engine._links = None
    out = []
    with torch.no_grad():
        for index, seq in enumerate(seqs):
            out.append((engine.run_batch(*make_batch(seq, index)), engine.stats.peak_in_flight))
    return out, [p.grad for p in layers.parameters() if p.grad is not None]


@pytest.mark.parametrize(("world", "m", "v", "transport"), [
    (2, 1, 1, "gloo"), (2, 4, 1, "gloo"), (4, 8, 1, "gloo"), (2, 4, 2, "gloo"), (4, 4, 2, "gloo"),
    (1, 2, 2, "gloo"), (2, 4, 1, "coalesced"), (4, 4, 2, "coalesced"),
])
def test_forward_only_schedule_on_the_engine_gives_the_whole_model_loss(world, m, v, transport):
    # Evaluation is a schedule (F actions and their transfers) on the training engine: same transport, same
    # shape headers (the sequence length changes between batches), the loss on every rank, no gradient.
    seqs = (5, 3, 5)
    results = run_ranks(_run_forward_only, world, m, v, seqs, transport, timeout=60)
    expected = reference(world * v, seqs)
    for rank, (losses, grads) in enumerate(results):
        assert grads == []
        for batch, (loss, peak) in enumerate(losses):
            torch.testing.assert_close(loss, expected[batch][0])  # float64 behind micro-batch means: defaults
            # an output is held only until it is sent or handed over: at most one per local stage
            assert peak <= v, (rank, batch, peak)


def test_forward_only_schedule_validates_and_has_gpipe_forward_makespan():
    for p, m in ((2, 1), (2, 4), (4, 8), (3, 5)):
        schedule = build_schedule("forward_only", n_ranks=p, n_microbatches=m)
        assert schedule.forward_only and not build_schedule("1f1b", n_ranks=p, n_microbatches=m).forward_only
        assert simulate(schedule).makespan == m + p - 1  # unit cost: GPipe's forward phase
    chunked = build_schedule("forward_only", n_ranks=2, n_microbatches=4, n_chunks=2)
    assert [a.token(with_stage=True) for a in chunked[0] if a.kind.is_compute][:3] == ["F0@0", "F0@2", "F1@0"]
    # A forward-only program missing micro-batch 1's forward is refused, naming it.
    broken = Schedule([[a for a in build_schedule("forward_only", n_ranks=1, n_microbatches=2)[0]
                        if a.microbatch == 0]], n_stages=1, n_microbatches=2, name="broken")
    with pytest.raises(ScheduleError, match=r"stage 0 micro-batch 1 lacks \['F1'\]|lacks F"):
        validate(broken)


def _run_counting_backend(rank, world, kind):
    from shardline.plugins.pipeline.backend import AutogradBackend

    class Counting(AutogradBackend):
        def __init__(self, stages):
            super().__init__(stages)
            self.calls = []

        def forward(self, stage, x):
            self.calls.append(("F", stage))
            return super().forward(stage, x)

        def backward(self, stage, output, grad, *, last):
            self.calls.append(("B", stage))
            super().backward(stage, output, grad, last=last)

        def end_batch(self, *, loss, forward_only):
            self.calls.append(("end", forward_only))

    layers = make_layers(world, shared_head=False)
    partition, _ = _my_layers(layers, world, rank, world)
    stages = stages_of_rank(build_stages(layers, partition), rank=rank, n_ranks=world)
    schedule = build_schedule(kind, n_ranks=world, n_microbatches=4)
    backend = Counting({rank: stages[0]})
    engine = PipelineEngine(stages, schedule=schedule, pp_rank=rank, loss_fn=loss_fn, backend=backend)
    context = torch.no_grad() if schedule.forward_only else torch.enable_grad()
    with context:
        loss = engine.run_batch(*make_batch(3, 0))
    return backend.calls, loss


@pytest.mark.parametrize("kind", ["1f1b", "forward_only"])
def test_the_engine_computes_every_stage_through_its_backend(kind):
    # The seam: every F and B action of the rank's program is one backend call, in program order, then one
    # end_batch after the loss exchange (told whether the batch was forward-only).
    results = run_ranks(_run_counting_backend, 2, kind, timeout=60)
    reference_loss = reference(2, (3,))[0][0]
    for rank, (calls, loss) in enumerate(results):
        program = build_schedule(kind, n_ranks=2, n_microbatches=4)[rank]
        expected = [(a.kind.value, a.stage) for a in program if a.kind.is_compute]
        assert calls == [*expected, ("end", kind == "forward_only")]
        torch.testing.assert_close(loss, reference_loss)  # float64 behind micro-batch means: defaults
