"""The Llama family: the dense model vs a hand-written functional Llama, and every sharded layout vs the dense model
built from the same seed (float64, real gloo ranks), with grouped-query attention both below and above tp.

Tolerances: ``torch.equal`` for initial weights (a slice, no arithmetic) and for recomputation; float64
``assert_close`` defaults wherever a cross-rank or regrouped sum sits between us and the reference.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from shardline.plugins.errors import ContractError, LayoutError
from shardline.plugins.grid import Grid, ParallelDims
from shardline.plugins.layers.roles import RoleKind, role_of, sum_sequence_parallel_gradients, tie_key
from shardline.plugins.layers.rotary import RopeScaling, rotary_frequencies
from shardline.plugins.layers.sequence_parallel import local_positions
from shardline.plugins.models.llama import Llama, LlamaConfig
from shardline.plugins.pipeline.partition import TiedWeight, build_stages, partition_layers
from shardline.plugins.testing import run_ranks

F64 = torch.float64
SEED = 7
BASE = dict(vocab_size=37, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=48)  # 37: padded at tp=2
# n_kv_head=2: the KV heads split at tp=2 (untied, no bias); n_kv_head=1: each KV head replicated on both TP
# ranks (tied, Qwen2's q/k/v bias, Llama-3 rope scaling: head_dim 8 at theta 1e4 has wavelengths 6.3, 63, 628,
# 6283, i.e. kept, blended and scaled frequencies against original length 64).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
VARIANTS = {
    "kv2-untied": dict(n_kv_head=2),
    "kv1-tied-bias-llama3": dict(n_kv_head=1, tie_embeddings=True, qkv_bias=True, rope_scaling=LLAMA3),
}
# (tp, cp, sp, pp)
LAYOUTS = [(2, 1, "none", 1), (2, 1, "megatron", 1), (1, 2, "ring", 1), (1, 2, "ulysses", 1), (1, 1, "none", 2),
           (2, 1, "none", 2), (2, 2, "ring", 1)]
CHECKPOINTED = {(2, 1, "megatron", 1), (1, 2, "ring", 1)}  # the recompute replays collectives


def _cfg(variant: str, **extra) -> LlamaConfig:
    return LlamaConfig(**{**BASE, **VARIANTS[variant], **extra})


def _batch(cfg, *, ignored: bool, b: int = 2):
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen)
    if ignored:  # unevenly spread over the CP shards; not under pp (micro-batch means would weigh them)
        targets[0, 2:5] = -100
    return ids, targets


@functools.cache
def _dense(variant: str, ignored: bool):
    cfg = _cfg(variant)
    model = Llama(cfg, seed=SEED, dtype=F64)
    ids, targets = _batch(cfg, ignored=ignored)
    logits = model(ids)
    loss = model.loss(logits, targets)
    loss.backward()
    return model, logits.detach(), loss.detach()


def test_config_validation_names_every_bad_field():
    with pytest.raises(ContractError) as err:
        LlamaConfig(vocab_size=0, seq_len=8, n_layer=1, n_head=4, d_model=16, d_ff=8, n_kv_head=3, dropout=2.0)
    text = str(err.value)
    assert "vocab_size=0" in text and "n_head=4 is not divisible by n_kv_head=3" in text and "dropout=2.0" in text
    with pytest.raises(ContractError, match=r"head_dim=3 must be even"):
        LlamaConfig(vocab_size=5, seq_len=8, n_layer=1, n_head=2, d_model=6, d_ff=8)
    with pytest.raises(ContractError, match=r"rope_type='dynamic'"):
        LlamaConfig(**BASE, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ContractError, match=r"high_freq_factor=1.0 must exceed low_freq_factor=4.0"):
        RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0, original_max_position_embeddings=64)
    cfg = _cfg("kv1-tied-bias-llama3")
    assert cfg.head_dim == 8 and cfg.rope_scaling == RopeScaling(**{k: v for k, v in LLAMA3.items()})
    assert LlamaConfig(**BASE).n_kv_head == 4


def test_llama3_frequency_scaling_keeps_blends_and_scales_by_wavelength():
    plain = rotary_frequencies(8, theta=1e4)
    scaled = rotary_frequencies(8, theta=1e4, scaling=RopeScaling(**{k: v for k, v in LLAMA3.items()}))
    torch.testing.assert_close(plain, torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=F64))
    assert scaled[0] == plain[0]  # wavelength 6.3 < 64/4: kept
    # wavelength 62.8 is between 64/4 and 64/1: t = (64/62.8 - 1)/(4 - 1), f' = (1-t) f/8 + t f
    t = (64 / (2 * torch.pi / 0.1) - 1) / 3
    torch.testing.assert_close(scaled[1], torch.tensor((1 - t) * 0.1 / 8 + t * 0.1, dtype=F64))
    torch.testing.assert_close(scaled[2:], plain[2:] / 8)  # wavelength > 64: divided by the factor


def _rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, pos, freq):
    ang = pos[:, None].to(F64) * freq  # [s, d/2]
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _functional_loss(params: dict, ids, targets, cfg: LlamaConfig):
    """The same Llama written out with torch on the dense model's parameters (our layers unused)."""
    b, s = ids.shape
    h, kvh, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    freq = rotary_frequencies(hd, theta=cfg.rope_theta, scaling=cfg.rope_scaling)
    pos = torch.arange(s)
    x = params["embedding.wte.weight"][ids]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(cfg.n_layer):
        p = {k[len(f"blocks.{i}."):]: v for k, v in params.items() if k.startswith(f"blocks.{i}.")}
        a = _rms(x, p["attn_norm.weight"], cfg.rms_norm_eps)
        proj = {n: a @ p[f"qkv.{n}_weight"].T + (p[f"qkv.{n}_bias"] if cfg.qkv_bias else 0) for n in "qkv"}
        q = _rope(proj["q"].view(b, s, h, hd).transpose(1, 2), pos, freq)
        k = _rope(proj["k"].view(b, s, kvh, hd).transpose(1, 2), pos, freq)
        v = proj["v"].view(b, s, kvh, hd).transpose(1, 2)
        outs = []
        for head in range(h):  # q head i reads kv head i // (h / kvh)
            j = head // (h // kvh)
            att = (q[:, head] @ k[:, j].transpose(-1, -2) / hd**0.5).masked_fill(causal, float("-inf"))
            outs.append(torch.softmax(att, -1) @ v[:, j])
        x = x + torch.cat(outs, dim=-1) @ p["o_proj.weight"].T
        a = _rms(x, p["mlp_norm.weight"], cfg.rms_norm_eps)
        x = x + (F.silu(a @ p["gate_up.gate_weight"].T) * (a @ p["gate_up.up_weight"].T)) @ p["down.weight"].T
    x = _rms(x, params["head.ln_f.weight"], cfg.rms_norm_eps)
    head_w = params["embedding.wte.weight"] if cfg.tie_embeddings else params["head.weight"]
    return F.cross_entropy((x @ head_w.T).flatten(0, 1), targets.flatten(), ignore_index=-100)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dense_llama_equals_the_functional_llama_and_its_gradients(variant):
    cfg = _cfg(variant)
    model = Llama(cfg, seed=SEED, dtype=F64)
    with torch.no_grad():  # non-trivial norms (initialised to one)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=F64) / 4)
    ids, targets = _batch(cfg, ignored=True)
    loss = model(ids, targets)
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    ref = _functional_loss(params, ids, targets, cfg)
    grads = torch.autograd.grad(ref, [params[n] for n in names])
    torch.testing.assert_close(loss, ref.detach())  # same math, different op grouping: f64 default
    for name, g in zip(names, grads):
        torch.testing.assert_close(model.get_parameter(name).grad, g, msg=name)


def test_pipeline_layers_compose_to_forward_and_tied_names_resolve():
    model = Llama(_cfg("kv1-tied-bias-llama3"), seed=SEED, dtype=F64)
    ids, _ = _batch(model.config, ignored=False)
    x = ids
    layers = model.pipeline_layers()
    assert len(layers) == BASE["n_layer"] + 2
    for layer in layers:
        x = layer(x)
        assert isinstance(x, torch.Tensor)
    assert torch.equal(x, model(ids))  # the same ops in the same order: exact
    (first, second), = model.tied_parameters()
    assert model.get_parameter(first) is model.get_parameter(second)
    untied = Llama(_cfg("kv2-untied"), seed=SEED, dtype=F64)
    assert untied.tied_parameters() == [] and untied.head.weight is not untied.embedding.wte.weight


def test_activation_checkpointing_recomputes_blocks_and_keeps_gradients_exact():
    dense, _, _ = _dense("kv2-untied", True)
    model = Llama(_cfg("kv2-untied", activation_checkpointing=True), seed=SEED, dtype=F64)
    calls = []
    model.blocks[0].qkv.register_forward_hook(lambda *_: calls.append(1))
    model(*_batch(model.config, ignored=True)).backward()
    assert len(calls) == 2  # forward, then the recompute in backward
    for (name, p), (_, q) in zip(model.named_parameters(), dense.named_parameters()):
        assert torch.equal(p.grad, q.grad), name  # the recompute replays identical ops: exact


def _slice_like(dense: torch.Tensor, shard: torch.Tensor, role, *, tp: int, tp_rank: int) -> torch.Tensor:
    """The part of a dense tensor a TP shard holds (padding the vocabulary dim to a multiple of tp first)."""
    if role.kind is not RoleKind.SHARDED:
        return dense
    pad = shard.shape[role.dim] * tp - dense.shape[role.dim]
    if pad:
        dense = F.pad(dense, [0, 0] * (dense.dim() - 1 - role.dim) + [0, pad])
    return dense.chunk(tp, role.dim)[tp_rank]


def _sharded_worker(rank, world, variant, tp, cp, sp, pp, checkpointing):
    from shardline.job.pipeline.schedule import one_f_one_b
    from shardline.plugins.pipeline import PipelineEngine

    grid = Grid.build(ParallelDims(world, tp=tp, cp=cp, pp=pp, sp=sp))
    cfg = _cfg(variant, activation_checkpointing=checkpointing)
    model = Llama(cfg, grid=grid, seed=SEED, dtype=F64)
    # Under Megatron-SP the n_kv_head=1 variant syncs as the strategy does: hooks installed from the declared
    # roles (summing during backward); the other calls the model's explicit sum after backward.
    hooks = sp == "megatron" and cfg.n_kv_head == 1
    if hooks:
        assert sum_sequence_parallel_gradients(model, group=grid.group("tp")) == 2 * cfg.n_layer + 1
    logits = None
    if pp == 1:
        hosted = {id(p) for p in model.parameters()}
        ids, targets = model.shard_batch(*_batch(cfg, ignored=True))
        logits = model(ids)
        loss = model.loss(logits, targets)
        loss.backward()
        logits = logits.detach()
    else:
        layers = model.pipeline_layers()
        stages = build_stages(layers, partition_layers(layers, pp))
        mine = stages[grid.rank("pp")]
        hosted = {id(p) for p in mine.parameters()}
        engine = PipelineEngine(mine, schedule=one_f_one_b(pp, 2), pp_rank=grid.rank("pp"), loss_fn=model.loss,
                                group=grid.group("pp"))
        loss = engine.run_batch(*_batch(cfg, ignored=False))
        if cfg.tie_embeddings:  # built per rank: the first stage's embedding and the last's head are the copies
            copy = (model.embedding.wte.weight if grid.is_first_stage else
                    model.head.weight if grid.is_last_stage else None)
            TiedWeight(copy, grid.group("embed")).sync_grads()
    # a tied copy is compared as the weight it copies (the dense model names it once)
    named = [(tie_key(p) or n, p) for n, p in model.named_parameters() if id(p) in hosted]
    before = {n: p.grad.clone() for n, p in named}
    if not hooks:
        model.allreduce_sequence_parallel_grads()
    model.allreduce_context_parallel_grads()
    return dict(loss=loss.detach(), logits=logits, init={n: p.detach().clone() for n, p in named},
                grads={n: p.grad for n, p in named}, before=before, roles={n: role_of(p) for n, p in named},
                tp_rank=grid.rank("tp"), cp_rank=grid.rank("cp"), hooks=hooks)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("tp", "cp", "sp", "pp"), LAYOUTS, ids=[f"tp{t}-cp{c}-{s}-pp{p}" for t, c, s, p in LAYOUTS])
def test_sharded_llama_loss_logits_and_every_gradient_equal_the_dense_llama(tp, cp, sp, pp, variant):
    results = run_ranks(_sharded_worker, tp * cp * pp, variant, tp, cp, sp, pp, (tp, cp, sp, pp) in CHECKPOINTED)
    dense, dense_logits, dense_loss = _dense(variant, pp == 1)
    dense_params = dict(dense.named_parameters())
    seen = set()
    for res in results:
        tr = res["tp_rank"]
        torch.testing.assert_close(res["loss"], dense_loss)  # cross-rank sums: f64 default
        if res["logits"] is not None:
            pos = local_positions(BASE["seq_len"], n=cp, rank=res["cp_rank"])
            want = dense_logits[:, pos]
            if tp > 1:  # vocab-sharded, padded to a multiple of tp
                want = F.pad(want, (0, -(-BASE["vocab_size"] // tp) * tp - BASE["vocab_size"])).chunk(tp, 2)[tr]
            torch.testing.assert_close(res["logits"], want)  # padded vocab columns included (zero weight rows)
        for name, grad in res["grads"].items():
            role, shard, dense_p = res["roles"][name], res["init"][name], dense_params[name]
            assert torch.equal(shard, _slice_like(dense_p.detach(), shard, role, tp=tp, tp_rank=tr)), name  # exact
            want = _slice_like(dense_p.grad, shard, role, tp=tp, tp_rank=tr)
            torch.testing.assert_close(grad, want, msg=lambda m, n=name: f"{n}: {m}")  # f64 default
            seen.add(name)
        if (tp, cp, sp) == (2, 1, "none"):
            # Nothing to synchronise at plain TP: even the replicated KV heads' gradients (n_kv_head=1) are
            # dense slices straight out of backward (the weight's reduce-scatter summed the sharing ranks).
            for name, grad in res["before"].items():
                torch.testing.assert_close(grad, res["grads"][name], rtol=0, atol=0)
        if sp == "megatron" and not res["hooks"]:  # forgetting the TP sync of sequence-replicated params: wrong
            for name in ("blocks.0.attn_norm.weight", "head.ln_f.weight"):
                assert role_of(dense_params[name]).kind is RoleKind.REPLICATED  # dense: no sequence split
                assert res["roles"][name].kind is RoleKind.SEQUENCE_REPLICATED
                assert not torch.allclose(res["before"][name], dense_params[name].grad), name
    assert seen == set(dense_params)  # every parameter was compared on the ranks that host it


def test_qkv_parameters_are_plain_column_shards_at_both_gqa_regimes():
    # n_kv_head=2 at tp=2 splits whole heads; n_kv_head=1 at tp=2 stores half of the one head's rows per rank.
    results = run_ranks(_roles_worker, 2)
    for roles in results:
        for name, role in roles.items():
            if ".qkv." in name or ".gate_up." in name:
                assert role.kind is RoleKind.SHARDED and role.dim == 0, name
            if name.endswith("o_proj.weight") or name.endswith("down.weight"):
                assert role.kind is RoleKind.SHARDED and role.dim == 1, name


def _roles_worker(rank, world):
    grid = Grid.build(ParallelDims(world, tp=world))
    out = {}
    for variant in VARIANTS:
        model = Llama(_cfg(variant), grid=grid, seed=SEED, dtype=F64)
        out.update({f"{variant}/{n}": role_of(p) for n, p in model.named_parameters()})
        k = model.blocks[0].qkv.k_weight
        assert k.shape == (8 * _cfg(variant).n_kv_head // 2, 32), (variant, k.shape)
    return out


def test_layouts_the_config_cannot_take_are_refused_before_any_process_group_naming_every_number():
    def refused(dims, **cfg_kw):
        with pytest.raises(LayoutError) as err:
            Llama.check_layout(LlamaConfig(**{**BASE, **cfg_kw}), dims)
        return str(err.value)

    text = refused(ParallelDims(8, tp=8), n_kv_head=2)  # no group exists in this process
    assert "n_head=4 is not divisible by tp=8" in text
    assert "n_kv_head=2 < tp=8" not in text  # 8 % 2 == 0: replication is fine; head_dim=8 divisible by 4
    text = refused(ParallelDims(4, tp=4), n_head=6, d_model=48, n_kv_head=3, d_ff=50, vocab_size=3)
    assert "n_head=6 is not divisible by tp=4" in text and "n_kv_head=3 and tp=4: neither divides" in text
    assert "d_ff=50 is not divisible by tp=4" in text and "vocab_size=3 is smaller than tp=4" in text
    text = refused(ParallelDims(4, tp=4), n_kv_head=1, d_model=24)  # head_dim 6, replicated on 4 ranks
    assert "tp/n_kv_head=4" in text and "head_dim=6 divisible by 4" in text
    text = refused(ParallelDims(8, pp=8), n_layer=2)
    assert "n_layer=2" in text and "pp=8" in text
    text = refused(ParallelDims(4, cp=4, sp="ulysses"), n_head=2, d_model=16)
    assert "n_head/tp=2" in text and "cp=4" in text
    text = refused(ParallelDims(4, cp=4, sp="ring"), seq_len=12)
    assert "seq_len=12" in text and "2*cp=8" in text
    Llama.check_layout(_cfg("kv1-tied-bias-llama3"), ParallelDims(4, tp=2, pp=2))  # fits: no error


def _constructor_refuses(rank, world):
    try:
        Llama(LlamaConfig(**{**BASE, "n_head": 6, "n_kv_head": 3, "d_model": 48}),
              grid=Grid.build(ParallelDims(world, tp=2)))
    except LayoutError as exc:
        return str(exc)
    return None


def test_the_constructor_refuses_too():
    message = run_ranks(_constructor_refuses, 2)[0]
    assert message is not None and "Llama does not fit layout" in message
    assert "n_kv_head=3 and tp=2: neither divides" in message


def test_the_llama_classes_are_exported():
    import shardline.plugins as plugins

    assert plugins.Llama is Llama and plugins.LlamaConfig is LlamaConfig and plugins.RopeScaling is RopeScaling
