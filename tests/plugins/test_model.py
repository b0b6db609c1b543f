"""The reference GPT: dense model vs a hand-written functional transformer, and every sharded layout vs the dense
model built from the same seed (float64, real gloo ranks).

Tolerances: ``torch.equal`` for initial weights (a slice, no arithmetic) and for layer-by-layer composition;
float64 ``assert_close`` defaults wherever a cross-rank or regrouped sum sits between us and the reference; the
bf16 test states its noise floor where it is used.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardline.plugins.errors import ContractError, LayoutError
from shardline.plugins.grid import Grid, ParallelDims
from shardline.plugins.layers.roles import RoleKind, role_of
from shardline.plugins.layers.sequence_parallel import local_positions
from shardline.plugins.models.gpt import GPT, GPTConfig
from shardline.plugins.testing import run_ranks

F64 = torch.float64
CFG = GPTConfig(vocab_size=37, seq_len=16, n_layer=2, n_head=4, d_model=16)  # 37: padded at tp=2
SEED = 7
LAYOUTS = [(2, 1, "none"), (2, 1, "megatron"), (1, 2, "ring"), (1, 2, "ulysses"), (2, 2, "ring")]


def _batch(cfg=CFG, b=2):
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen)
    targets[0, 2:5] = -100  # ignored tokens, unevenly spread over the CP shards
    return ids, targets


def _dense(cfg=CFG, dtype=F64):
    model = GPT(cfg, seed=SEED, dtype=dtype)
    ids, targets = _batch(cfg)
    logits = model(ids)
    loss = model.loss(logits, targets)
    loss.backward()
    return model, logits.detach(), loss.detach()


def test_config_validation_names_every_bad_field():
    with pytest.raises(ContractError) as err:
        GPTConfig(vocab_size=0, seq_len=8, n_layer=1, n_head=3, d_model=10, dropout=1.5)
    text = str(err.value)
    assert "vocab_size=0" in text and "dropout=1.5" in text
    with pytest.raises(ContractError, match=r"d_model=10 is not divisible by n_head=3"):
        GPTConfig(vocab_size=5, seq_len=8, n_layer=1, n_head=3, d_model=10)
    assert GPTConfig(vocab_size=5, seq_len=8, n_layer=1, n_head=2, d_model=10).d_ff == 40


def _functional_loss(params: dict, ids, targets, cfg: GPTConfig):
    """The same GPT written out with torch.nn.functional on the dense model's parameters (our layers unused)."""
    b, s = ids.shape
    d, h, hd = cfg.d_model, cfg.n_head, cfg.head_dim
    x = params["embedding.wte.weight"][ids] + params["embedding.wpe"][:s]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(cfg.n_layer):
        p = {k[len(f"blocks.{i}."):]: v for k, v in params.items() if k.startswith(f"blocks.{i}.")}
        a = F.layer_norm(x, (d,), p["ln1.weight"], p["ln1.bias"], cfg.layer_norm_eps)
        qkv = (a @ p["qkv.weight"].T + p["qkv.bias"]).view(b, s, h, 3, hd)  # per head: q, k, v
        q, k, v = (qkv[:, :, :, j].transpose(1, 2) for j in range(3))
        att = torch.softmax((q @ k.transpose(-1, -2) / hd**0.5).masked_fill(causal, float("-inf")), -1) @ v
        x = x + att.transpose(1, 2).reshape(b, s, d) @ p["proj.weight"].T + p["proj.bias"]
        a = F.layer_norm(x, (d,), p["ln2.weight"], p["ln2.bias"], cfg.layer_norm_eps)
        x = x + F.gelu(a @ p["fc1.weight"].T + p["fc1.bias"], approximate="tanh") @ p["fc2.weight"].T \
            + p["fc2.bias"]
    x = F.layer_norm(x, (d,), params["head.ln_f.weight"], params["head.ln_f.bias"], cfg.layer_norm_eps)
    logits = x @ params["embedding.wte.weight"].T
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def test_dense_gpt_equals_the_functional_transformer_and_its_gradients():
    model, _, loss = _dense()
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    ref = _functional_loss(params, *_batch(), CFG)
    grads = torch.autograd.grad(ref, [params[n] for n in names])
    torch.testing.assert_close(loss, ref.detach())  # same math, different op grouping: f64 default
    for name, g in zip(names, grads):
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, g, msg=name)


def test_pipeline_layers_compose_to_forward_and_tied_names_resolve_to_one_parameter():
    model = GPT(CFG, seed=SEED, dtype=F64)
    ids, _ = _batch()
    layers = model.pipeline_layers()
    assert len(layers) == CFG.n_layer + 2
    x = ids
    for layer in layers:
        x = layer(x)
        assert isinstance(x, torch.Tensor)  # plain tensors between stages
    assert torch.equal(x, model(ids))  # the same ops in the same order: exact
    (first, second), = model.tied_parameters()
    assert model.get_parameter(first) is model.get_parameter(second)
    untied = GPT(GPTConfig(**{**CFG.__dict__, "tie_embeddings": False}), seed=SEED, dtype=F64)
    assert untied.tied_parameters() == []
    assert untied.head.weight is not untied.embedding.wte.weight


def _slice_like(dense: torch.Tensor, shard: torch.Tensor, *, tp: int, tp_rank: int) -> torch.Tensor:
    """The part of a dense tensor a TP shard holds (padding the vocabulary dim to a multiple of tp first)."""
    if not getattr(shard, "tensor_model_parallel", False):
        return dense
    dim = shard.partition_dim
    pad = shard.shape[dim] * tp - dense.shape[dim]
    if pad:
        widths = [0, 0] * (dense.dim() - 1 - dim) + [0, pad]
        dense = F.pad(dense, widths)
    return dense.chunk(tp, dim)[tp_rank]


def _sharded_worker(rank, world, tp, cp, sp, checkpointing):
    grid = Grid.build(ParallelDims(world, tp=tp, cp=cp, sp=sp))
    cfg = GPTConfig(**{**CFG.__dict__, "activation_checkpointing": checkpointing})
    model = GPT(cfg, grid=grid, seed=SEED, dtype=F64)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, targets = model.shard_batch(*_batch())
    logits = model(ids)
    loss = model.loss(logits, targets)
    loss.backward()
    before_sync = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.allreduce_sequence_parallel_grads()
    model.allreduce_context_parallel_grads()
    attrs = {n: (role_of(p).kind is RoleKind.SHARDED, -1 if role_of(p).dim is None else role_of(p).dim)
             for n, p in model.named_parameters()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    return dict(loss=loss.detach(), logits=logits.detach(), init=init, grads=grads, before=before_sync,
                attrs=attrs, tp_rank=grid.rank("tp"), cp_rank=grid.rank("cp"))


def _as_param(t: torch.Tensor, attrs) -> torch.Tensor:
    t.tensor_model_parallel, t.partition_dim = attrs
    return t


@pytest.mark.parametrize(("tp", "cp", "sp"), LAYOUTS, ids=[f"tp{t}-cp{c}-{s}" for t, c, s in LAYOUTS])
def test_sharded_gpt_loss_logits_and_every_gradient_equal_the_dense_gpt(tp, cp, sp):
    # activation checkpointing rides along where the recompute replays collectives (SP and ring)
    checkpointing = (tp, cp, sp) in ((2, 1, "megatron"), (2, 2, "ring"))
    results = run_ranks(_sharded_worker, tp * cp, tp, cp, sp, checkpointing)
    dense, dense_logits, dense_loss = _dense()
    dense_params = dict(dense.named_parameters())
    for res in results:
        tr, pos = res["tp_rank"], local_positions(CFG.seq_len, n=cp, rank=res["cp_rank"])
        torch.testing.assert_close(res["loss"], dense_loss)  # cross-rank sums: f64 default
        want = _slice_like(dense_logits[:, pos], _as_param(res["logits"].clone(), (True, 2)), tp=tp, tp_rank=tr)
        torch.testing.assert_close(res["logits"], want)  # padded vocab columns included (zero weight rows)
        assert set(res["grads"]) == set(dense_params)
        for name, dense_p in dense_params.items():
            shard = _as_param(res["init"][name], res["attrs"][name])
            assert torch.equal(shard, _slice_like(dense_p.detach(), shard, tp=tp, tp_rank=tr)), name  # exact
            want = _slice_like(dense_p.grad, shard, tp=tp, tp_rank=tr)
            torch.testing.assert_close(res["grads"][name], want, msg=name)  # summed over ranks: f64 default
        if sp == "megatron":  # forgetting the TP sync of replicated, sequence-fed params gives wrong grads
            for name in ("blocks.0.ln1.weight", "head.ln_f.bias", "embedding.wpe", "blocks.1.fc2.bias"):
                assert not torch.allclose(res["before"][name], dense_params[name].grad), name
        if cp > 1:  # before the CP sum each rank holds only its tokens' share
            assert not torch.allclose(res["before"]["blocks.0.fc1.weight"],
                                      _slice_like(dense_params["blocks.0.fc1.weight"].grad,
                                                  _as_param(res["init"]["blocks.0.fc1.weight"],
                                                            res["attrs"]["blocks.0.fc1.weight"]),
                                                  tp=tp, tp_rank=tr))


def test_activation_checkpointing_recomputes_blocks_and_keeps_gradients_exact():
    dense, _, _ = _dense()
    cfg = GPTConfig(**{**CFG.__dict__, "activation_checkpointing": True})
    model = GPT(cfg, seed=SEED, dtype=F64)
    calls = []
    model.blocks[0].qkv.register_forward_hook(lambda *_: calls.append(1))
    ids, targets = _batch()
    model(ids, targets).backward()
    assert len(calls) == 2  # forward, then the recompute in backward
    for (name, p), (_, q) in zip(model.named_parameters(), dense.named_parameters()):
        assert torch.equal(p.grad, q.grad), name  # the recompute replays identical ops: exact


def _layout_error_worker(rank, world):
    messages = []
    for cfg_kw, dims_kw in ((dict(n_head=2, d_model=16), dict(tp=4)),
                            (dict(d_ff=18), dict(tp=4)),
                            (dict(n_head=2, d_model=16), dict(tp=1, cp=4, sp="ulysses")),
                            (dict(seq_len=12), dict(cp=4, sp="ring"))):
        cfg = GPTConfig(**{**CFG.__dict__, **cfg_kw})
        try:
            GPT(cfg, grid=Grid.build(ParallelDims(world, **dims_kw)))
        except LayoutError as exc:
            messages.append(str(exc))
    return messages


def test_layouts_the_config_cannot_fill_raise_layout_error_naming_both_numbers():
    messages = run_ranks(_layout_error_worker, 4)[0]
    assert len(messages) == 4
    assert "n_head=2" in messages[0] and "tp=4" in messages[0]
    assert "d_ff=18" in messages[1] and "tp=4" in messages[1]
    assert "n_head/tp=2" in messages[2] and "cp=4" in messages[2]
    assert "seq_len=12" in messages[3] and "2*cp=8" in messages[3]


def _bf16_worker(rank, world):
    grid = Grid.build(ParallelDims(world, tp=world, sp="megatron"))
    model = GPT(CFG, grid=grid, seed=SEED, dtype=torch.bfloat16)
    ids, targets = _batch()
    logits = model(ids)
    loss = model.loss(logits, targets)
    loss.backward()
    model.allreduce_sequence_parallel_grads()
    return loss.detach(), logits.detach().float(), model.blocks[1].fc2.weight.grad.float(), grid.rank("tp")


BF16_U = 2.0**-8  # bf16 unit roundoff (8 significant bits)


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def test_bf16_sharded_gpt_stays_within_the_bf16_noise_floor_of_the_float64_model():
    dense64, logits64, loss64 = _dense()
    # Noise floor, measured once on this model: the *dense* bf16 model's own relative error against float64 is
    # ~1.8u on the logits, ~0.01u on the loss, ~2u on a last-block weight gradient (u = 2**-8). The sharded
    # bf16 model must stay within a few u as well: 4u for logits and loss, 8u for gradients (two reductions
    # more). A wrong collective or slice gives O(1) relative errors.
    for loss, logits, grad, tr in run_ranks(_bf16_worker, 2):
        assert loss.dtype == torch.float32
        assert abs(loss.double() - loss64).item() / loss64.item() <= 4 * BF16_U
        want_logits = F.pad(logits64, (0, 1)).chunk(2, -1)[tr]  # vocab 37 padded to 38 at tp=2
        assert _rel(logits, want_logits) <= 4 * BF16_U
        assert _rel(grad, dense64.blocks[1].fc2.weight.grad.chunk(2, 1)[tr]) <= 8 * BF16_U


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dense_gpt_on_cuda_in_bf16_matches_the_cpu_float64_model_within_the_bf16_noise_floor():
    dense64, logits64, loss64 = _dense()
    model = GPT(CFG, seed=SEED, dtype=torch.bfloat16, device="cuda")
    ids, targets = (t.cuda() for t in _batch())
    logits = model(ids)
    loss = model.loss(logits, targets)
    loss.backward()
    # Same noise floor as the CPU bf16 test: 4u on logits and loss (u = 2**-8); CUDA bf16 matmuls accumulate
    # in fp32 like the CPU kernels.
    assert abs(loss.double().cpu() - loss64).item() / loss64.item() <= 4 * BF16_U
    assert _rel(logits.float().cpu(), logits64) <= 4 * BF16_U


def _dropout_worker(rank, world):
    grid = Grid.build(ParallelDims(world, tp=world))
    model = GPT(GPTConfig(**{**CFG.__dict__, "dropout": 0.25}), grid=grid, seed=SEED, dtype=F64)
    torch.manual_seed(123)  # the same seed on every rank, as seed_everything does
    x = model.pipeline_layers()[0](_batch()[0])
    for block in model.blocks:
        x = block(x)
    return x.detach()


def test_dropout_masks_on_replicated_activations_agree_across_tp_ranks():
    first, second = run_ranks(_dropout_worker, 2)
    assert torch.equal(first, second)  # replicated hidden state, identical masks: bitwise equal across TP
    dense = GPT(GPTConfig(**{**CFG.__dict__, "dropout": 0.25}), seed=SEED, dtype=F64).eval()
    x = dense.embedding(_batch()[0])
    for block in dense.blocks:
        x = block(x)
    assert not torch.allclose(first, x)  # dropout did act: the training-mode output differs from eval mode
