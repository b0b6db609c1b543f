"""Tier 2: TP collectives and layers on real gloo ranks, float64, against single-process references.

Workers return raw tensors; every reference is computed here in the parent from the definition (collectives) or
from the dense layer's weights with plain ``torch.nn.functional`` (layers). Tolerance rule, stated at each assert:
``torch.equal`` where no cross-rank sum is involved, ``assert_close`` float64 defaults behind a reduction.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardline.plugins.errors import LayoutError
from shardline.plugins.grid import Grid, ParallelDims
from shardline.plugins.layers.roles import declare_module
from shardline.plugins.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    split_to_tp,
    vocab_parallel_cross_entropy,
)
from shardline.plugins.testing import run_ranks

B, S, IN, OUT, VOCAB = 2, 8, 6, 12, 11  # VOCAB=11 is padded at tp=2 and tp=4
SEED = 1234
F64 = torch.float64


def _rand(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _tp_group(world: int):
    return Grid.build(ParallelDims(world, tp=world)).group("tp")


# ---------------------------------------------------------------- collectives

_OPS = {
    "copy": (copy_to_tp, {}),
    "reduce": (reduce_from_tp, {}),
    "split": (split_to_tp, {}),
    "gather": (gather_from_tp, {}),
    "gather_seq": (gather_from_sequence, {"dim": 1}),
    "reduce_scatter_seq": (reduce_scatter_to_sequence, {"dim": 1}),
}
_IN_SHAPE = {"copy": (B, S, 4), "reduce": (B, S, 4), "split": (B, S, 8), "gather": (B, S, 2),
             "gather_seq": (B, 2, 4), "reduce_scatter_seq": (B, S, 4)}


def _collectives_worker(rank, world):
    group = _tp_group(world)
    out = {}
    for name, (fn, kw) in _OPS.items():
        # split takes a replicated input; every other op gets a different input per rank
        x = _rand(0 if name == "split" else 10 + rank, *_IN_SHAPE[name]).requires_grad_()
        y = fn(x, group=group, **kw)
        y.backward(_rand(100 + rank, *y.shape))
        out[name] = (y.detach(), x.grad)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_collective_pairs_forward_and_backward_match_their_definitions(world):
    results = run_ranks(_collectives_worker, world)
    xs = {n: [_rand(0 if n == "split" else 10 + r, *_IN_SHAPE[n]) for r in range(world)] for n in _OPS}
    for r, res in enumerate(results):
        def g(name, rr):  # the upstream gradient rank rr fed, shaped like its output
            return _rand(100 + rr, *results[rr][name][0].shape)

        y, dx = res["copy"]
        assert torch.equal(y, xs["copy"][r])  # identity: exact
        torch.testing.assert_close(dx, sum(g("copy", k) for k in range(world)))  # all-reduce: f64 default
        y, dx = res["reduce"]
        torch.testing.assert_close(y, sum(xs["reduce"]))  # all-reduce: f64 default
        assert torch.equal(dx, g("reduce", r))  # identity: exact
        y, dx = res["split"]
        assert torch.equal(y, xs["split"][0].chunk(world, -1)[r])  # a slice: exact
        assert torch.equal(dx, torch.cat([g("split", k) for k in range(world)], -1))  # all-gather: exact
        y, dx = res["gather"]
        assert torch.equal(y, torch.cat(xs["gather"], -1))  # all-gather: exact
        assert torch.equal(dx, g("gather", r).chunk(world, -1)[r])  # a slice: exact
        y, dx = res["gather_seq"]
        assert torch.equal(y, torch.cat(xs["gather_seq"], 1))  # all-gather along seq: exact
        torch.testing.assert_close(dx, sum(g("gather_seq", k) for k in range(world)).chunk(world, 1)[r])
        y, dx = res["reduce_scatter_seq"]
        torch.testing.assert_close(y, sum(xs["reduce_scatter_seq"]).chunk(world, 1)[r])  # reduce: f64 default
        assert torch.equal(dx, torch.cat([g("reduce_scatter_seq", k) for k in range(world)], 1))  # exact


# ---------------------------------------------------------------- layers


def _build(cls, *args, group, **kw):
    return cls(*args, group=group, generator=torch.Generator().manual_seed(SEED), dtype=F64, **kw)


def _seq(t, world, rank, sp):
    return t.chunk(world, 1)[rank].contiguous() if sp else t


def _layers_worker(rank, world, sp):
    group = _tp_group(world)
    out = {}
    x, gy = _rand(1, B, S, IN), _rand(2, B, S, OUT)
    for gather in (False, True):
        col = _build(ColumnParallelLinear, IN, OUT, group=group, gather_output=gather, sequence_parallel=sp)
        xi = _seq(x, world, rank, sp).clone().requires_grad_()
        y = col(xi)
        y.backward(gy if gather else gy.chunk(world, -1)[rank])
        out[f"col{gather}"] = (y.detach(), xi.grad, col.weight.detach(), col.weight.grad, col.bias.detach(),
                               col.bias.grad)
    xr, gr = _rand(3, B, S, OUT), _rand(4, B, S, IN)
    for parallel_in in ((True, False) if not sp else (True,)):
        row = _build(RowParallelLinear, OUT, IN, group=group, input_is_parallel=parallel_in, sequence_parallel=sp)
        xi = (xr.chunk(world, -1)[rank] if parallel_in else xr).clone().requires_grad_()
        y = row(xi)
        y.backward(_seq(gr, world, rank, sp))
        local_bias_grad = row.bias.grad.clone()
        n_synced = allreduce_sequence_parallel_grads(row, group=group)
        out[f"row{parallel_in}"] = (y.detach(), xi.grad, row.weight.detach(), row.weight.grad, row.bias.detach(),
                                    local_bias_grad, row.bias.grad, n_synced)
    emb = VocabParallelEmbedding(VOCAB, IN, group=group, sequence_parallel=sp,
                                 generator=torch.Generator().manual_seed(SEED), dtype=F64)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(5))
    e = emb(ids)
    e.backward(_seq(_rand(6, B, S, IN), world, rank, sp))
    out["emb"] = (e.detach(), emb.weight.detach(), emb.weight.grad, emb.padded_num_embeddings)
    return out


def _dense(cls, *args, **kw):
    return _build(cls, *args, group=None, **kw)


def _shard_of(full, world, rank, dim):
    return full.chunk(world, dim)[rank]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_parallel_layers_equal_the_matching_slices_of_the_dense_layer(world, sp):
    results = run_ranks(_layers_worker, world, sp)
    x, gy = _rand(1, B, S, IN).requires_grad_(), _rand(2, B, S, OUT)
    col = _dense(ColumnParallelLinear, IN, OUT)
    y_ref = F.linear(x, col.weight, col.bias)  # the reference: plain F.linear on the dense weights
    dx_ref, dw_ref, db_ref = torch.autograd.grad(y_ref, (x, col.weight, col.bias), gy)
    xr, gr = _rand(3, B, S, OUT).requires_grad_(), _rand(4, B, S, IN)
    row = _dense(RowParallelLinear, OUT, IN)
    yr_ref = F.linear(xr, row.weight, row.bias)
    dxr_ref, dwr_ref, dbr_ref = torch.autograd.grad(yr_ref, (xr, row.weight, row.bias), gr)
    for r, res in enumerate(results):
        for gather in (False, True):
            y, dx, w, dw, b, db = res[f"col{gather}"]
            assert torch.equal(w, _shard_of(col.weight.detach(), world, r, 0))  # init is a slice: exact
            assert torch.equal(b, _shard_of(col.bias.detach(), world, r, 0))
            expected_y = y_ref.detach() if gather else _shard_of(y_ref.detach(), world, r, -1)
            torch.testing.assert_close(y, expected_y)  # one local matmul, same order: f64 default
            torch.testing.assert_close(dx, _seq(dx_ref, world, r, sp))  # all-reduced/reduce-scattered: f64
            torch.testing.assert_close(dw, _shard_of(dw_ref, world, r, 0))  # sum over tokens: f64 default
            torch.testing.assert_close(db, _shard_of(db_ref, world, r, 0))
        for parallel_in in ((True, False) if not sp else (True,)):
            y, dx, w, dw, b, local_db, db, n_synced = res[f"row{parallel_in}"]
            assert torch.equal(w, _shard_of(row.weight.detach(), world, r, 1))  # init is a slice: exact
            assert torch.equal(b, row.bias.detach())  # replicated bias: exact
            torch.testing.assert_close(y, _seq(yr_ref.detach(), world, r, sp))  # summed over ranks: f64
            expected_dx = _shard_of(dxr_ref, world, r, -1) if parallel_in else dxr_ref
            torch.testing.assert_close(dx, expected_dx)  # f64 default
            torch.testing.assert_close(dw, _shard_of(dwr_ref, world, r, 1))
            torch.testing.assert_close(db, dbr_ref)  # after the SP sync (no-op without SP): f64 default
            assert n_synced == (1 if sp else 0)
            if sp:  # the classic bug: the local bias grad covers only this rank's tokens
                assert not torch.allclose(local_db, dbr_ref)
                torch.testing.assert_close(local_db, gr.chunk(world, 1)[r].sum((0, 1)))
        _check_embedding(res["emb"], world, r, sp)


def _check_embedding(res, world, rank, sp):
    e, w, dw, padded = res
    dense = _dense(VocabParallelEmbedding, VOCAB, IN)
    assert padded == -(-VOCAB // world) * world
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(5))
    weight = dense.weight.detach().requires_grad_()
    e_ref = F.embedding(ids, weight)
    (dw_ref,) = torch.autograd.grad(e_ref, weight, _rand(6, B, S, IN))
    pad = padded - VOCAB
    assert torch.equal(w, _shard_of(F.pad(dense.weight.detach(), (0, 0, 0, pad)), world, rank, 0))  # exact
    # the sum over ranks has one nonzero term per token (only the owner looks it up): exact
    assert torch.equal(e, _seq(e_ref.detach(), world, rank, sp))
    # grads accumulate only this rank's rows; padded rows stay zero: a sum over tokens, f64 default
    torch.testing.assert_close(dw, _shard_of(F.pad(dw_ref, (0, 0, 0, pad)), world, rank, 0))


# ---------------------------------------------------------------- cross-entropy and the SP-grad bug


def _ce_worker(rank, world):
    group = _tp_group(world)
    logits, target, padded = _ce_inputs(world)
    local = logits.chunk(world, -1)[rank].clone().requires_grad_()
    losses = {}
    for reduction in ("mean", "sum"):
        loss = vocab_parallel_cross_entropy(local, target, group=group, ignore_index=-100, vocab_size=VOCAB,
                                            reduction=reduction)
        (grad,) = torch.autograd.grad(loss, local)
        losses[reduction] = (loss.detach(), grad)
    return losses


def _ce_inputs(world):
    padded = -(-VOCAB // world) * world
    logits = _rand(7, B, S, padded) * 3
    logits[..., VOCAB:] = 50.0  # padding columns hold junk that must not leak into the loss
    target = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(8))
    target[0, :3] = -100
    return logits, target, padded


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy_equals_torch_cross_entropy(world):
    results = run_ranks(_ce_worker, world)
    logits, target, padded = _ce_inputs(world)
    for reduction in ("mean", "sum"):
        full = logits[..., :VOCAB].clone().requires_grad_()
        ref = F.cross_entropy(full.flatten(0, 1), target.flatten(), ignore_index=-100, reduction=reduction)
        (dref,) = torch.autograd.grad(ref, full)
        dref = F.pad(dref, (0, padded - VOCAB))  # padded columns get no gradient
        for r, res in enumerate(results):
            loss, grad = res[reduction]
            torch.testing.assert_close(loss, ref.detach())  # all-reduced max/sum-exp: f64 default
            torch.testing.assert_close(grad, dref.chunk(world, -1)[r])  # local softmax - onehot: f64 default


def _sp_bug_worker(rank, world):
    """LayerNorm -> Column(SP) -> Row(SP) on a sequence-sharded input: LN grads before/after the TP sync."""
    group = _tp_group(world)
    model = _sp_stack(group)
    x = _rand(9, B, S, IN).chunk(world, 1)[rank]
    model(x).backward(_rand(10, B, S, IN).chunk(world, 1)[rank])
    ln = model[0]
    before = (ln.weight.grad.clone(), ln.bias.grad.clone())
    allreduce_sequence_parallel_grads(model, group=group)
    return before, (ln.weight.grad, ln.bias.grad)


def _sp_stack(group):
    ln = torch.nn.LayerNorm(IN, dtype=F64)
    with torch.no_grad():
        ln.weight.copy_(1 + _rand(11, IN) / 4)
        ln.bias.copy_(_rand(12, IN))
    declare_module(ln, sequence_parallel=group is not None)
    gen = torch.Generator().manual_seed(SEED)
    col = ColumnParallelLinear(IN, OUT, group=group, sequence_parallel=True, generator=gen, dtype=F64)
    row = RowParallelLinear(OUT, IN, group=group, sequence_parallel=True, generator=gen, dtype=F64)
    return torch.nn.Sequential(ln, col, torch.nn.GELU(), row)


def test_megatron_sp_layernorm_grads_are_wrong_without_the_tp_allreduce_and_right_with_it():
    world = 2
    results = run_ranks(_sp_bug_worker, world)
    dense = _sp_stack(None)
    dense(_rand(9, B, S, IN)).backward(_rand(10, B, S, IN))
    for before, after in results:
        for local, synced, ref in zip(before, after, (dense[0].weight.grad, dense[0].bias.grad)):
            assert not torch.allclose(local, ref)  # forgetting the sync: a partial sum, wrong
            torch.testing.assert_close(synced, ref)  # summed over TP: f64 default


# ---------------------------------------------------------------- errors (no ranks needed for shape checks)


def _errors_worker(rank, world):
    group = _tp_group(world)
    messages = []
    for make in (lambda: ColumnParallelLinear(4, 6, group=group),
                 lambda: RowParallelLinear(6, 4, group=group),
                 lambda: RowParallelLinear(8, 4, group=group, input_is_parallel=False, sequence_parallel=True)):
        try:
            make()
        except LayoutError as exc:
            messages.append(str(exc))
    return messages


def test_indivisible_features_raise_layout_error_naming_both_numbers():
    messages = run_ranks(_errors_worker, 4)[0]
    assert len(messages) == 3
    assert "out_features=6" in messages[0] and "tp=4" in messages[0]
    assert "in_features=6" in messages[1] and "tp=4" in messages[1]
    assert "input_is_parallel=False" in messages[2]


# ---------------------------------------------------------------- trace annotations (the profiler's contract)


def _annotations_worker(rank, world):
    from torch.profiler import ProfilerActivity, profile

    from shardline.plugins.layers.sequence_parallel import ring_attention

    tp_group = _tp_group(world)
    cp_group = Grid.build(ParallelDims(world, cp=world, sp="ring")).group("cp")
    col = _build(ColumnParallelLinear, IN, OUT, group=tp_group, sequence_parallel=True)
    row = _build(RowParallelLinear, OUT, IN, group=tp_group, sequence_parallel=True)
    qkv = [_rand(20 + i, 1, 2, 4, 4).requires_grad_() for i in range(3)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        row(col(_rand(1, B, S // world, IN))).sum().backward()
        reduce_from_tp(_rand(2, 3), group=tp_group)
        ring_attention(*qkv, group=cp_group).sum().backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("sl:")})


def test_collectives_are_annotated_with_the_shared_comm_names():
    from shardline.job.annotations import COMM_RE, comm_name

    names = run_ranks(_annotations_worker, 2)[0]
    assert all(COMM_RE.match(n) for n in names)  # every sl: name parses with the profiler's own pattern
    expected = {comm_name("tp", "all_gather"), comm_name("tp", "reduce_scatter"), comm_name("tp", "all_reduce"),
                comm_name("cp", "p2p_send"), comm_name("cp", "p2p_recv")}
    assert expected <= set(names)


def test_vocab_padding_rounds_up_to_a_multiple_of_tp_and_logs_once(caplog):
    from shardline.plugins.layers.tensor_parallel import pad_vocab

    with caplog.at_level("INFO", logger="shardline.plugins.layers.tp_vocab"):
        assert [pad_vocab(1001, tp=8) for _ in range(3)] == [1008] * 3
        assert pad_vocab(1000, tp=8) == 1000  # already a multiple: nothing to say
    records = [r for r in caplog.records if "1001" in r.getMessage()]
    assert len(records) == 1 and "1008" in records[0].getMessage()
