"""MoE block: float64 parity on real gloo ranks against a dense single-process MoE written here as a plain loop
over tokens and experts (every expert in one process), and the unit pieces against closed forms.

Each rank's tokens come from its dp coordinate (replicated over TP, as attention leaves them); the loss of dp
rank d is ``sum(y_d * G_d) + aux_d``. The reference computes, per dp rank, its outputs, its aux loss and every
gradient with the dense weights, dropping in capacity mode exactly the (token, choice) slots the definition
drops: per *source* rank (the TP rank's share of the tokens when etp=1 and tp>1), each expert keeps the first
``C = ceil(cf * N * k / E)`` slots in (choice, token) order. Tolerance rule: float64 defaults (every compared
number is behind a reduction or an exchange of sums); ``torch.equal`` for counts and split sizes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardline.plugins.errors import ContractError, LayoutError
from shardline.plugins.grid import Grid, ParallelDims
from shardline.plugins.layers.moe import (
    MoEBlock,
    MoEConfig,
    dispatch_plan,
    grouped_matmul,
    is_expert_parameter,
)
from shardline.plugins.testing import run_ranks

F64 = torch.float64
H, E, K, T = 8, 4, 2, 8  # hidden, experts, top-k, tokens per dp rank

# name -> (ParallelDims kwargs, MoEConfig kwargs, hand-written groups: ep, edp)
CASES = {
    "ep2_dropless": (dict(ep=2), dict(ffn=6, router="softmax_topk", renormalize=True, shared_ffn=4,
                                      shared_gate=True, aux_loss_coef=0.1, z_loss_coef=0.01),
                     [[0, 1]], [[0], [1]]),
    "ep2_capacity": (dict(ep=2), dict(ffn=6, router="topk_softmax", capacity_factor=0.5, aux_loss_coef=0.1),
                     [[0, 1]], [[0], [1]]),
    "tp2_ep2_on_tp_pair": (dict(tp=2, ep=2), dict(ffn=6, capacity_factor=1.0, shared_ffn=4, z_loss_coef=0.01),
                           [[0, 1]], [[0], [1]]),
    "ep2_tp2_etp1_dropless": (dict(tp=2, ep=2), dict(ffn=6, renormalize=True, shared_ffn=4, aux_loss_coef=0.1),
                              [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    "ep2_tp2_etp1_capacity": (dict(tp=2, ep=2), dict(ffn=6, router="topk_softmax", capacity_factor=0.5,
                                                     aux_loss_coef=0.1, z_loss_coef=0.01),
                              [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    "ep2_tp2_etp2_capacity": (dict(tp=2, ep=2, etp=2), dict(ffn=6, capacity_factor=0.75, shared_ffn=4,
                                                            shared_gate=True, aux_loss_coef=0.1),
                              [[0, 2], [1, 3]], [[0], [1], [2], [3]]),
    # Megatron-SP: each TP rank holds its half of the tokens. etp1: dispatched as they are (the router sees this
    # rank's tokens, so its balance and z losses are means over them, not the dp rank's: left out here); etp2:
    # gathered, then split back.
    "sp_ep2_tp2_etp1_capacity": (dict(tp=2, ep=2, sp="megatron"), dict(ffn=6, capacity_factor=0.5, shared_ffn=4),
                                 [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    "sp_ep2_tp2_etp2_dropless": (dict(tp=2, ep=2, etp=2, sp="megatron"), dict(ffn=6, shared_ffn=4,
                                                                              aux_loss_coef=0.1),
                                 [[0, 2], [1, 3]], [[0], [1], [2], [3]]),
}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _dense_weights(cfg: dict) -> dict:
    g = _gen(7)
    w = {"router": torch.randn(E, H, generator=g, dtype=F64),
         "gate": torch.randn(E, H, cfg["ffn"], generator=g, dtype=F64) * 0.5,
         "up": torch.randn(E, H, cfg["ffn"], generator=g, dtype=F64) * 0.5,
         "down": torch.randn(E, cfg["ffn"], H, generator=g, dtype=F64) * 0.5}
    if cfg.get("shared_ffn"):
        s = cfg["shared_ffn"]
        w.update(s_gate=torch.randn(H, s, generator=g, dtype=F64), s_up=torch.randn(H, s, generator=g, dtype=F64),
                 s_down=torch.randn(s, H, generator=g, dtype=F64), s_g=torch.randn(1, H, generator=g, dtype=F64))
    return w


def _inputs(dp: int, d: int):
    return torch.randn(T, H, generator=_gen(100 + d), dtype=F64), torch.randn(T, H, generator=_gen(200 + d),
                                                                                 dtype=F64)


# --- the dense reference: a loop over tokens and experts ----------------------------------------------------------

def _route_token(logits_t, cfg):
    probs = torch.softmax(logits_t, dim=0)
    if cfg.get("router", "softmax_topk") == "softmax_topk":
        w, idx = torch.topk(probs, K)
        if cfg.get("renormalize"):
            w = w / w.sum()
    else:
        top, idx = torch.topk(logits_t, K)
        w = torch.exp(top - top.max()) / torch.exp(top - top.max()).sum()
    return w, [int(i) for i in idx], probs


def _kept(chosen, sources, cfg):
    """Which (token, j) slots survive: per source chunk, each expert keeps its first C slots in (j, token)
    order."""
    keep = {}
    for chunk in sources:
        cap = math.inf if cfg.get("capacity_factor") is None else math.ceil(
            cfg["capacity_factor"] * len(chunk) * K / E)
        used = [0] * E
        for j in range(K):
            for t in chunk:
                e = chosen[t][j]
                keep[(t, j)] = used[e] < cap
                used[e] += 1
    return keep


def _dense_rank(w: dict, x, grad_out, cfg, sources):
    """Outputs, loss and gradients of one dp rank's tokens through the dense MoE."""
    w = {k: v.clone().requires_grad_() for k, v in w.items()}
    x = x.clone().requires_grad_()
    ys, chosen, all_probs, all_logits, weights = [], [], [], [], []
    for t in range(T):
        logits_t = w["router"] @ x[t]
        wt, idx, probs = _route_token(logits_t, cfg)
        chosen.append(idx)
        weights.append(wt)
        all_probs.append(probs)
        all_logits.append(logits_t)
    keep = _kept(chosen, sources, cfg)
    for t in range(T):
        y = torch.zeros(H, dtype=F64)
        for j, e in enumerate(chosen[t]):
            if keep[(t, j)]:
                hidden = F.silu(x[t] @ w["gate"][e]) * (x[t] @ w["up"][e])
                y = y + weights[t][j] * (hidden @ w["down"][e])
        if cfg.get("shared_ffn"):
            s = (F.silu(x[t] @ w["s_gate"]) * (x[t] @ w["s_up"])) @ w["s_down"]
            if cfg.get("shared_gate"):
                s = torch.sigmoid(w["s_g"][0] @ x[t]) * s
            y = y + s
        ys.append(y)
    y = torch.stack(ys)
    counts = [sum(1 for t in range(T) for e in chosen[t] if e == ex) for ex in range(E)]
    mean_prob = torch.stack(all_probs).mean(0)
    balance = E * sum(counts[ex] / T * mean_prob[ex] for ex in range(E))
    z = sum(torch.logsumexp(lg, 0) ** 2 for lg in all_logits) / T
    loss = (y * grad_out).sum() + cfg.get("aux_loss_coef", 0.0) * balance + cfg.get("z_loss_coef", 0.0) * z
    loss.backward()
    dropped = {s: sum(1 for t in chunk for j in range(K) if not keep[(t, j)]) for s, chunk in enumerate(sources)}
    sent = {s: [sum(1 for t in chunk for j in range(K) if keep[(t, j)] and chosen[t][j] == ex) for ex in range(E)]
            for s, chunk in enumerate(sources)}
    return {"y": y.detach(), "dx": x.grad, "grads": {k: v.grad for k, v in w.items()}, "counts": counts,
            "dropped": dropped, "sent": sent, "loss": float(loss.detach())}


# --- the ranks ----------------------------------------------------------------------------------------------------

def _recording(original, calls: list):
    """``dist.all_to_all_single`` that first notes (input splits, output splits, the group's ranks)."""
    def call(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        calls.append((list(input_split_sizes or []), list(output_split_sizes or []),
                      dist.get_process_group_ranks(group)))
        return original(output, input, output_split_sizes, input_split_sizes, group=group, **kw)
    return call


def _moe_worker(rank, world, names):
    out = {}
    grids = {}
    for name in names:
        dims_kw, cfg_kw, _, _ = CASES[name]
        dims = ParallelDims(world, **dims_kw)
        key = tuple(sorted(dims_kw.items()))
        grid = grids[key] = grids.get(key) or Grid.build(dims)
        cfg = MoEConfig(hidden=H, experts=E, top_k=K, **cfg_kw)
        sp = dims.sp.value == "megatron"
        block = MoEBlock(cfg, grid=grid, dtype=F64, sequence_parallel=sp)
        dense = _dense_weights(cfg_kw)
        local, e0 = E // dims.ep, grid.rank("ep") * (E // dims.ep)
        f = cfg.ffn // dims.etp
        f0 = grid.rank("tp") * f if dims.etp > 1 else 0
        with torch.no_grad():
            block.router_weight.copy_(dense["router"])
            block.experts.w_gate.copy_(dense["gate"][e0:e0 + local, :, f0:f0 + f])
            block.experts.w_up.copy_(dense["up"][e0:e0 + local, :, f0:f0 + f])
            block.experts.w_down.copy_(dense["down"][e0:e0 + local, f0:f0 + f, :])
            if block.shared is not None:
                block.shared.w_gate.copy_(dense["s_gate"])
                block.shared.w_up.copy_(dense["s_up"])
                block.shared.w_down.copy_(dense["s_down"])
                if block.shared.gate is not None:
                    block.shared.gate.copy_(dense["s_g"])
        x, g = _inputs(dims.dp, dims.coords(rank)["dp"])
        if sp:  # this TP rank's contiguous half of the tokens
            x, g = (v.chunk(dims.tp)[grid.rank("tp")].contiguous() for v in (x, g))
        x.requires_grad_()
        calls, original = [], dist.all_to_all_single
        dist.all_to_all_single = _recording(original, calls)
        try:
            result = block(x.reshape(2, -1, H))  # any leading shape: tokens are the flattened rows
            loss = (result.output.reshape(g.shape) * g).sum() + result.aux_loss
            loss.backward()
        finally:
            dist.all_to_all_single = original
        out[name] = {
            "y": result.output.detach().reshape(g.shape), "dx": x.grad, "stats": result.stats, "calls": calls,
            "grads": {n: p.grad for n, p in block.named_parameters()},
            "expert_numel": sum(p.numel() for p in block.parameters() if is_expert_parameter(p)),
            "groups": {a: grid.ranks(a) for a in ("ep", "edp")},
            "descs": [getattr(grid.group(a), "group_desc", None) for a in ("ep", "edp")]}
    return out


def _sources(dims: ParallelDims, d: int):
    """The (source rank -> tokens it dispatches) chunks of dp rank d."""
    ranks = [dims.rank_of(tp=t, dp=d) for t in range(dims.tp)]
    if dims.tp > 1 and dims.etp == 1:  # with or without SP, each TP rank dispatches its share
        n = T // dims.tp
        return ranks, [list(range(t * n, (t + 1) * n)) for t in range(dims.tp)]
    return ranks, [list(range(T)) for _ in ranks]


_OURS = {"router": "router_weight", "s_gate": "shared.w_gate", "s_up": "shared.w_up", "s_down": "shared.w_down",
         "s_g": "shared.gate"}


def _check(world, names, results):
    for name in names:
        dims_kw, cfg_kw, ep_groups, edp_groups = CASES[name]
        dims = ParallelDims(world, **dims_kw)
        dense = _dense_weights(cfg_kw)
        local, f = E // dims.ep, cfg_kw["ffn"] // dims.etp
        total_grads = {k: torch.zeros_like(v) for k, v in dense.items()}
        sent, any_dropped = {}, 0
        for d in range(dims.dp):
            x, g = _inputs(dims.dp, d)
            ranks, chunks = _sources(dims, d)
            ref = _dense_rank(dense, x, g, cfg_kw, chunks)
            sp, n = dims.sp.value == "megatron", T // dims.tp
            if sp and dims.etp == 1:  # router and shared expert saw this rank's tokens: partial gradients
                for k in ("router", "s_gate", "s_up", "s_down"):
                    torch.testing.assert_close(sum(results[r][name]["grads"][_OURS[k]] for r in ranks),
                                               ref["grads"][k])
            for k in total_grads:
                if ref["grads"][k] is not None:
                    total_grads[k] += ref["grads"][k]
            for s, r in enumerate(ranks):
                res = results[r][name]
                assert res["groups"]["ep"] in ep_groups and res["groups"]["edp"] in edp_groups, (name, r)
                assert res["descs"] == ["sl:ep", "sl:edp"]  # the profiler's naming contract
                rows = slice(s * n, (s + 1) * n) if sp else slice(0, T)
                torch.testing.assert_close(res["y"], ref["y"][rows])
                torch.testing.assert_close(res["dx"], ref["dx"][rows])  # without SP, replicated: the full gradient
                if not (sp and dims.etp == 1):
                    for k in ("router", "s_gate", "s_up", "s_down", "s_g"):
                        if k in dense and ref["grads"][k] is not None:
                            torch.testing.assert_close(res["grads"][_OURS[k]], ref["grads"][k])
                if not (sp and dims.etp == 1):  # (under SP with etp1 the router counts this rank's tokens)
                    assert list(res["stats"].tokens_per_expert) == ref["counts"], (name, r)
                assert res["stats"].dropped == ref["dropped"][s], (name, r)
                any_dropped += ref["dropped"][s]
                sent[r] = ref["sent"][s]
        if cfg_kw.get("capacity_factor") is not None:
            assert any_dropped > 0, name  # the capacity case really drops
        for r in range(world):
            res = results[r][name]
            # each rank holds 1/(ep*etp) of the expert parameters
            assert res["expert_numel"] == 3 * E * H * cfg_kw["ffn"] // (dims.ep * dims.etp)
            # expert gradients summed over the edp group are the dense gradients of the experts this rank holds
            c = dims.expert_coords(r)
            e0, f0 = c["ep"] * local, c["etp"] * f
            if c["edp"] == 0:
                edp = next(grp for grp in edp_groups if r in grp)
                for ours, theirs in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down")):
                    got = sum(results[q][name]["grads"][f"experts.{ours}"] for q in edp)
                    want = total_grads[theirs][e0:e0 + local]
                    want = want[:, f0:f0 + f] if theirs == "down" else want[:, :, f0:f0 + f]
                    torch.testing.assert_close(got, want)
            # the collective record: all_to_all on the EP group, split sizes = the routed counts
            group = next(grp for grp in ep_groups if r in grp)
            assert [c[2] for c in res["calls"]] == [group] * 5, (name, r)  # counts, dispatch, combine, 2 backward
            per_dest = [sum(sent[r][j * local:(j + 1) * local]) for j in range(dims.ep)]
            per_src = [sum(sent[q][e0:e0 + local]) for q in group]
            assert list(res["calls"][1][:2]) == [per_dest, per_src], (name, r)  # dispatch forward
            assert list(res["calls"][2][:2]) == [per_src, per_dest], (name, r)  # combine forward
            assert sorted(tuple(map(tuple, c[:2])) for c in res["calls"][3:]) == sorted(
                [(tuple(per_dest), tuple(per_src)), (tuple(per_src), tuple(per_dest))])


TWO = ["ep2_dropless", "ep2_capacity", "tp2_ep2_on_tp_pair"]
FOUR = ["ep2_tp2_etp1_dropless", "ep2_tp2_etp1_capacity", "ep2_tp2_etp2_capacity", "sp_ep2_tp2_etp1_capacity",
        "sp_ep2_tp2_etp2_dropless"]


def test_moe_parity_on_two_ranks():
    _check(2, TWO, run_ranks(_moe_worker, 2, TWO, timeout=120))


def test_moe_parity_ep2_tp2_on_four_ranks():
    _check(4, FOUR, run_ranks(_moe_worker, 4, FOUR, timeout=120))


# --- single-process pieces ----------------------------------------------------------------------------------------

def test_dispatch_plan_keeps_first_slots_per_expert_in_choice_then_token_order():
    indices = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1]])  # 4 tokens, k=2
    order, counts, dropped = dispatch_plan(indices, experts=3, capacity=2)
    # slots s = j*4 + t; expert 0: s=0,1,3 (j=0) then s=6 (j=1) -> keep 0,1; expert 1: s=2, 4, 7 -> keep 2, 4;
    # expert 2: s=5 -> keep
    assert order.tolist() == [0, 1, 2, 4, 5] and counts.tolist() == [2, 2, 1] and dropped == 3
    order, counts, dropped = dispatch_plan(indices, experts=3, capacity=None)
    assert order.tolist() == [0, 1, 3, 6, 2, 4, 7, 5] and counts.tolist() == [4, 3, 1] and dropped == 0


def test_grouped_matmul_loop_and_fast_path_agree_with_per_group_products():
    x = torch.randn(7, 16, generator=_gen(1), dtype=F64)
    w = torch.randn(3, 16, 8, generator=_gen(2), dtype=F64)
    counts = [2, 0, 5]
    want = torch.cat([x[:2] @ w[0], x[2:7] @ w[2]])
    torch.testing.assert_close(grouped_matmul(x, w, counts), want)  # the loop path (float64, CPU)
    # torch's grouped matmul itself, where this torch runs it on the CPU (bf16, rows of 16-byte multiples)
    xb, wb = x.to(torch.bfloat16).requires_grad_(), w.to(torch.bfloat16).requires_grad_()
    try:
        fast = grouped_matmul(xb, wb, counts, fast=True)
    except (RuntimeError, NotImplementedError) as exc:  # no CPU kernel in this torch: the gpu test covers it
        pytest.skip(f"torch's grouped matmul does not run on this CPU: {exc}")
    fast.sum().backward()  # a broadcast gradient: the kernel needs it made contiguous
    want_b = torch.cat([xb[:2].detach() @ wb[0].detach(), xb[2:7].detach() @ wb[2].detach()])
    torch.testing.assert_close(fast.detach(), want_b)  # same bf16 inputs, one product each: bf16 defaults
    torch.testing.assert_close(wb.grad[1], torch.zeros(16, 8, dtype=torch.bfloat16))  # the empty group
    torch.testing.assert_close(xb.grad[:2], wb.detach()[0].sum(1).expand(2, 16))
    with pytest.raises(ContractError, match=r"counts=\[2, 0\] must have one entry per expert \(3\)"):
        grouped_matmul(x, w, [2, 0])


@pytest.mark.gpu
def test_grouped_matmul_fast_path_on_cuda_bf16_matches_the_loop():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counts = [10, 0, 25, 5]
    fast = grouped_matmul(x, w, counts)
    fast.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    slow = grouped_matmul(x, w, counts, fast=False)
    slow.sum().backward()
    # bf16 noise floor: both paths round inputs identically; accumulation order differs
    torch.testing.assert_close(fast, slow, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx, x.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw, w.grad, rtol=2e-2, atol=2e-2)


def test_bad_configs_and_layouts_name_every_number():
    with pytest.raises(ContractError) as info:
        MoEConfig(hidden=8, ffn=0, experts=4, top_k=5, router="sigmoid", capacity_factor=-1.0)
    for fragment in ("ffn=0", "router='sigmoid'", "capacity_factor=-1.0"):
        assert fragment in str(info.value)
    with pytest.raises(ContractError, match=r"top_k=5 is more than experts=4"):
        MoEConfig(hidden=8, ffn=4, experts=4, top_k=5)
    grid = Grid.stand_in(ParallelDims(8, tp=2, ep=4, etp=2), rank=0)
    with pytest.raises(LayoutError, match=r"experts=6 is not divisible by ep=4; ffn=5 is not divisible by etp=2"):
        MoEBlock(MoEConfig(hidden=8, ffn=5, experts=6, top_k=2), grid=grid)


def test_the_profiler_names_the_expert_groups():
    from shardline.job.annotations import comm_name, group_desc
    from shardline.profiling.table.dims import desc_dim

    assert (group_desc("ep"), group_desc("edp")) == ("sl:ep", "sl:edp")
    assert (desc_dim("sl:ep"), desc_dim("sl:edp"), desc_dim("sl:dp")) == ("ep", "edp", "dp")
    assert comm_name("ep", "all_to_all") == "sl:comm:ep:all_to_all"
