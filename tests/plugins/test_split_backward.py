"""Split backward (B = input gradient, W = weight gradients later) in the layers shardline builds, on gloo ranks in
float64: gradients equal the unsplit backward's at tp2, Megatron-SP (with activation checkpointing) and cp2; the
split is not hollow (no weight-gradient GEMM in B, every split weight accumulated once, at W); what is not split
(norms, learned positions, a replicated K/V head, a user's own module) takes its whole backward in B."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardline.plugins.errors import ContractError
from shardline.plugins.grid import Grid, ParallelDims
from shardline.plugins.layers.split_backward import WeightGradStore, deferring_weight_grads, linear
from shardline.plugins.testing import run_ranks

DT = torch.float64
_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "index_add", "embedding_dense_backward")


class _Gemms(TorchDispatchMode):
    """Outputs of every GEMM-like op (and the embedding's scatter-add) run inside it."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__.rstrip("_") in _GEMMS and isinstance(out, torch.Tensor):
            self.outputs.append(out.detach().clone())
        return out


def _models(grid, checkpointing):
    from shardline.plugins.models.gpt import GPT, GPTConfig
    from shardline.plugins.models.llama import Llama, LlamaConfig

    gpt = GPTConfig(vocab_size=13, seq_len=8, n_layer=1, n_head=2, d_model=12, d_ff=20, tie_embeddings=False,
                    activation_checkpointing=checkpointing)
    # one KV head on tp2: its rows are all-gathered each forward (a computed weight: not split)
    llama = LlamaConfig(vocab_size=13, seq_len=8, n_layer=1, n_head=4, n_kv_head=1, d_model=16, d_ff=20,
                        qkv_bias=True, activation_checkpointing=checkpointing)
    return {"gpt": lambda: GPT(gpt, grid=grid, seed=5, dtype=DT),
            "llama": lambda: Llama(llama, grid=grid, seed=5, dtype=DT)}


def _expected_split(family: str, name: str, tp: int) -> bool:
    """Which parameters defer their gradient to W, by the layer rules (not by asking the code)."""
    if name.endswith(("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "ln_f.weight", "ln_f.bias", "wpe",
                      "norm.weight")):
        return False
    if family == "llama" and tp > 1 and (".k_" in name or ".v_" in name):
        return False  # replicated KV head (1 KV head on 2 TP ranks)
    return True


def _worker(rank, world, tp, cp, sp, checkpointing):
    grid = Grid.build(ParallelDims(world, tp=tp, cp=cp, sp=sp))
    gen = torch.Generator().manual_seed(9)
    ids, targets = (torch.randint(13, (2, 8), generator=gen) for _ in range(2))
    out = {}
    for family, make in _models(grid, checkpointing).items():
        model = make()
        local_ids, local_targets = model.shard_batch(ids, targets)
        model(local_ids, local_targets).backward()
        unsplit = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        when: dict[str, list[str]] = {n: [] for n, _ in model.named_parameters()}
        phase = ["F"]
        for n, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _p, n=n, when=when, phase=phase: when[n].append(phase[0]))
        store = WeightGradStore()
        with deferring_weight_grads(store):
            loss = model(local_ids, local_targets)
            phase[0] = "B"
            with _Gemms() as in_b:
                loss.backward()
        pending = store.pending
        phase[0] = "W"
        with _Gemms() as in_w:
            store.run()
        split = {n: p.grad.clone() for n, p in model.named_parameters()}
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        out[family] = dict(unsplit=unsplit, split=split, when=when, pending=pending, shapes=shapes,
                           in_b=in_b.outputs, in_w=in_w.outputs)
    return out


LAYOUTS = [(2, 1, "none"), (2, 1, "megatron"), (1, 2, "ring")]


@pytest.mark.parametrize(("tp", "cp", "sp"), LAYOUTS, ids=[f"tp{t}-cp{c}-{s}" for t, c, s in LAYOUTS])
def test_split_backward_equals_the_unsplit_one_and_is_not_hollow(tp, cp, sp):
    checkpointing = sp == "megatron"  # the recompute in B must rebuild the graph its F built (split mode on)
    for res in run_ranks(_worker, tp * cp, tp, cp, sp, checkpointing, timeout=90):
        for family, r in res.items():
            deferred = {n for n in r["when"] if _expected_split(family, n, tp)}
            # one deferred item per split op: GPT's embedding, qkv, proj (+ its bias add), fc1, fc2 (+ bias), head;
            # Llama's embedding, q (k, v too when not replicated), o_proj, gate, up, down, head
            assert r["pending"] == {"gpt": 8, "llama": 7 if tp > 1 else 9}[family]
            for name, phases in r["when"].items():
                # every gradient accumulated exactly once: a split one at W, the rest in B
                assert phases == (["W"] if name in deferred else ["B"]), (family, name, phases)
                torch.testing.assert_close(r["split"][name], r["unsplit"][name], rtol=1e-12, atol=1e-14,
                                           msg=lambda s, f=family, n=name: f"{f} {n}: {s}")
            weights = [r["split"][n] for n in deferred if len(r["shapes"][n]) == 2]
            for grad in weights:
                # W computed each split weight's gradient (a GEMM or scatter-add whose output is it) ...
                assert any(o.shape == grad.shape and torch.allclose(o, grad, rtol=1e-12, atol=0) for o in r["in_w"])
                # ... and B computed none of them
                assert not any(o.shape == grad.shape and torch.allclose(o, grad, rtol=1e-9, atol=0)
                               for o in r["in_b"])


def test_a_store_runs_once_and_the_mode_takes_only_a_store():
    w = torch.nn.Parameter(torch.ones(3, 2, dtype=DT))
    store = WeightGradStore()
    with deferring_weight_grads(store):
        linear(torch.ones(4, 2, dtype=DT, requires_grad=True), w).sum().backward()
    assert w.grad is None and store.pending == 1
    assert store.run() == 1
    torch.testing.assert_close(w.grad, torch.full((3, 2), 4.0, dtype=DT))  # dA = dy^T x: 4 rows of ones
    with pytest.raises(ContractError, match="WeightGradStore.run called twice"):
        store.run()
    with pytest.raises(ContractError, match="needs a WeightGradStore or None, got list"):
        with deferring_weight_grads([]):
            pass
