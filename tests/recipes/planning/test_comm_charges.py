"""Context parallelism's traffic is charged (issue 49 §1): the ring's K/V and dK/dV hops on the link each hop
crosses, free only where the attention beside them hides them (and then at the SMs their channels hold); Ulysses'
all-to-alls exposed, replayed by full recompute; and the plan's text has no section header without lines.

Every expected number is the closed form written out here from the catalog's data-sheet and NCCL figures (the
attention core's FLOPs at the GPU's attention rate, a hop's ``bytes / bandwidth + latency``), not read back from the
step model. Tolerances: rel 1e-9 for sums of many terms.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardline.recipes.cli import main
from shardline.recipes.planning import search
from shardline.recipes.planning.catalog import load_catalog
from shardline.recipes.planning.implementation import MEGATRON
from shardline.recipes.planning.layout import PlanLayout
from shardline.recipes.planning.models import packaged
from shardline.recipes.planning.steptime import predict

CATALOG = load_catalog()
H100 = CATALOG.cluster("dgx-h100")
LLAMA3_8B = packaged("llama3-8b")
FLASH_BWD_OVER_FWD = 0.63 / 0.73  # FlashAttention-2's backward vs forward share of the peak


def overlap(transfer: float, compute: float, squeeze: float) -> tuple[float, float, float]:
    """(exposed, hidden, extra compute) of a transfer beside ``compute`` that runs ``squeeze`` times slower while
    the transfer's channels hold their SMs."""
    slow = compute * squeeze
    if transfer >= slow:
        return transfer - slow, slow, slow - compute
    return 0.0, transfer, transfer * (1 - compute / slow)


def ring_charge(*, b: int, seq: int, c: int, heads: int, kv_heads: int, grad_bytes: int, bandwidth: float,
                latency: float, channels: int, recompute: bool = False) -> tuple[float, float, float]:
    """(exposed, hidden, extra compute) of one block's ring attention, one micro-batch, by hand: ``c-1`` forward
    K/V hops each beside ``1/c`` of the forward attention; backward K/V at step 0, K/V + dK/dV at steps 1..c-2,
    dK/dV at step c-1 (each beside ``1/c`` of the backward attention), and the dK/dV hop home alone."""
    gpu, hd, sq = H100.gpu, LLAMA3_8B.dim_per_head, seq // c
    flops = 4 * b * heads * sq * seq * hd / 2  # causal: half the score blocks
    rate = gpu.bf16_tflops * 1e12 * gpu.attention_fraction
    fwd, bwd = flops / rate / c, 2.5 * flops / (rate * FLASH_BWD_OVER_FWD) / c
    kv = 2 * b * sq * kv_heads * hd * 2
    dkv = 2 * b * sq * kv_heads * hd * grad_bytes
    squeeze = gpu.sms / (gpu.sms - channels)

    def hop(nbytes):
        return nbytes / bandwidth + latency
    parts = [(hop(kv), fwd, (2 if recompute else 1) * (c - 1)), (hop(kv), bwd, 1), (hop(kv + dkv), bwd, c - 2),
             (hop(dkv), bwd, 1), (hop(dkv), 0.0, 1)]
    total = [0.0, 0.0, 0.0]
    for transfer, compute, times in parts:
        for k, v in enumerate(overlap(transfer, compute, squeeze)):
            total[k] += times * v
    return tuple(total)


def test_cp32_over_four_nodes_is_slower_than_dp32_by_the_charged_ring():
    """The issue's case: llama3-8b, seq 8192, 32 H100 on 4 DGX nodes, global batch 32. Each ring hop that leaves
    a node is one GPU sending to one GPU: one NIC's share (8 x 50 GB/s NDR over 8 GPUs) at 14 us; shardline moves
    K/V repeated to the 32 query heads and dK/dV in fp32. Uncharged, cp=32 (micro-batch 16) would beat plain data
    parallelism; charged, it is slower, and the whole difference it pays is the ring's exposed time plus the
    attention slowed beside the hops."""
    nic = CATALOG.link("ib-ndr")
    bandwidth = H100.nics_per_node * nic.collective_gbps * 1e9 / H100.gpus_per_node
    exposed, hidden, extra = ring_charge(b=16, seq=8192, c=32, heads=32, kv_heads=32, grad_bytes=4,
                                         bandwidth=bandwidth, latency=nic.latency_us * 1e-6, channels=nic.channels)
    cp = PlanLayout(cp=32, sp="ring", zero_stage=1, micro_batches=2, micro_batch_size=16)
    dp = PlanLayout(dp=32, zero_stage=1, recompute="full", micro_batches=1, micro_batch_size=1)
    ring, plain = (predict(LLAMA3_8B, lay, H100, seq_len=8192) for lay in (cp, dp))
    blocks = 2 * LLAMA3_8B.n_layer  # micro-batches x layers
    assert ring.time_s["p2p_send"] == pytest.approx(blocks * exposed, rel=1e-9)
    assert ring.overlapped_s["overlapped_p2p_send"] == pytest.approx(blocks * hidden, rel=1e-9)
    charged = blocks * (exposed + extra)
    assert ring.step_s - charged < plain.step_s < ring.step_s
    # what the CLI's search picks at cp=32 (the better of ring and Ulysses) is slower than its pick at cp=1 too
    picks = [search.plan(LLAMA3_8B, H100, gpus=32, seq_len=8192, global_batch=32,
                         layout={"tp": 1, "pp": 1, "cp": c, "zero_stage": 1}).best for c in (32, 1)]
    assert picks[0].layout.cp == 32 and picks[1].layout.dp == 32
    assert picks[0].step_s > picks[1].step_s


def test_ring_hops_inside_a_node_ride_nvlink_and_hide_at_the_sms_they_hold():
    """cp=4 inside one node, seq 32768, micro-batch 1: every hop is NVLink (370 GB/s, 3.4 us, 24 channels) and
    shorter than the attention beside it, so nothing is exposed but the last dK/dV hop home; the hidden hops
    slow the attention by ``1 - 108/132`` of their own time. Megatron-LM's stack moves the 8 grouped KV heads and
    bf16 dK/dV, shardline 32 repeated heads and fp32 dK/dV."""
    nvlink = CATALOG.link("nvlink4")
    lay = PlanLayout(cp=4, sp="ring", micro_batches=1, micro_batch_size=1)
    got = []
    for impl_changes, kv_heads, grad_bytes in (({}, 32, 4), ({"cp_repeats_kv": False, "ring_grad_bytes": 2}, 8, 2)):
        exposed, hidden, extra = ring_charge(b=1, seq=32768, c=4, heads=32, kv_heads=kv_heads, grad_bytes=grad_bytes,
                                             bandwidth=nvlink.collective_gbps * 1e9, latency=nvlink.latency_us * 1e-6,
                                             channels=nvlink.channels)
        home = 2 * 8192 * kv_heads * 128 * grad_bytes / (nvlink.collective_gbps * 1e9) + nvlink.latency_us * 1e-6
        assert exposed == pytest.approx(home, rel=1e-12)  # the case hides every hop but the last
        pred = predict(LLAMA3_8B, lay, H100, seq_len=32768, **impl_changes)
        assert pred.time_s["p2p_send"] == pytest.approx(LLAMA3_8B.n_layer * exposed, rel=1e-9)
        assert pred.overlapped_s["overlapped_p2p_send"] == pytest.approx(LLAMA3_8B.n_layer * hidden, rel=1e-9)
        got.append(pred)
    assert got[0].step_s > got[1].step_s  # the same hops hidden, more SM time held beside them
    megatron = predict(LLAMA3_8B, lay, H100, seq_len=32768, impl=MEGATRON)  # grouped K/V, bf16 dK/dV
    assert megatron.time_s["p2p_send"] == pytest.approx(got[1].time_s["p2p_send"], rel=1e-12)


def test_full_recompute_replays_the_forward_exchanges():
    """Full recompute runs each block's forward again, its ring hops and Ulysses' all-to-alls with it: Ulysses'
    exposed all-to-all time grows from 2 passes to 3, and the ring's hidden hops by the forward's ``c-1``."""
    lay = PlanLayout(cp=4, sp="ulysses", micro_batches=1, micro_batch_size=1)
    plain, redo = (predict(LLAMA3_8B, replace(lay, recompute=r), H100, seq_len=32768) for r in ("none", "full"))
    assert redo.time_s["all_to_all"] == pytest.approx(1.5 * plain.time_s["all_to_all"], rel=1e-12)
    nvlink = CATALOG.link("nvlink4")
    hidden = [ring_charge(b=1, seq=32768, c=4, heads=32, kv_heads=32, grad_bytes=4,
                          bandwidth=nvlink.collective_gbps * 1e9, latency=nvlink.latency_us * 1e-6,
                          channels=nvlink.channels, recompute=r)[1] for r in (False, True)]
    ring = [predict(LLAMA3_8B, replace(lay, sp="ring", recompute=r), H100, seq_len=32768) for r in ("none", "full")]
    for got, want in zip(ring, hidden):
        assert got.overlapped_s["overlapped_p2p_send"] == pytest.approx(LLAMA3_8B.n_layer * want, rel=1e-9)
    assert hidden[1] > hidden[0]


def test_the_default_search_on_16_h100_no_longer_ties_every_cp_degree():
    """llama3-8b on 16 H100 (two nodes), seq 8192: before the ring was charged, dp16 and cp 2, 4, 8, 16 with the
    same ZeRO stage and micro-batches were five rows of one step time. Now every cp > 1 row is slower than the
    plain data-parallel row it splits, and the top rows differ."""
    result = search.plan(LLAMA3_8B, H100, gpus=16, seq_len=8192, global_batch=64)
    top = result.fitting[:5]
    assert len({round(r.step_s, 9) for r in top}) == len(top) == 5
    plain = {(r.layout.zero_stage, r.layout.recompute, r.layout.offload_optimizer, r.layout.offload_params,
              r.layout.micro_batches): r.step_s for r in result.fitting
             if r.layout.cp == 1 and r.layout.tp == 1 and r.layout.pp == 1}
    compared = 0
    for row in result.fitting:
        lay = row.layout
        key = (lay.zero_stage, lay.recompute, lay.offload_optimizer, lay.offload_params, lay.micro_batches)
        if lay.cp > 1 and lay.tp == 1 and lay.pp == 1 and key in plain:
            assert row.step_s > plain[key], (search.describe(lay), row.step_s, plain[key])
            compared += 1
    assert compared >= 4


def test_a_fully_fixed_layout_prints_no_empty_rejected_header(capsys):
    """``--layout`` fixing every field: nothing was searched, so no standing note and no ``rejected:`` header;
    a fixed layout that does not fit still says why under the header."""
    fixed = "tp=1,pp=1,cp=32,sp=ring,zero=1,recompute=none,offload=none,micro_batch_size=16"
    assert main(["plan", "--model", "llama3-8b", "--gpus", "32", "--gpu", "h100-sxm", "--seq", "8192",
                 "--global-batch", "32", "--layout", fixed]) == 0
    out = capsys.readouterr().out
    assert "tp=1,pp=1,dp=1,cp=32,sp=ring,zero=1,mbs=16,m=2" in out and "rejected" not in out
    assert main(["plan", "--model", "llama3-70b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch", "64",
                 "--layout", "tp=8,pp=1,cp=1,zero=0,recompute=none,micro_batch_size=1,offload=none,sp=none"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = lines.index("rejected:")
    assert lines[header + 1].startswith("  tp=8,pp=1,cp=1: ") and "does not fit" in lines[header + 1]


def test_offload_copies_cross_the_host_link_exposed_unless_a_pass_hides_them():
    """ZeRO-3 with the optimizer and the parameters on the CPU, 8 ranks of a DGX H100 (PCIe Gen5 host link, NCCL's
    48 GB/s): per step the fp32 gradient partition goes down and the bf16 parameters come up, exposed; each
    forward and backward pass fetches the bf16 partition again, hidden under that pass with ``overlap_dp`` (8
    sequences of 1024 tokens: longer than the copy) and exposed without it: ``(2m + 1)`` parameter copies up."""
    model = packaged("gpt2-760m")
    lay = PlanLayout(dp=8, zero_stage=3, offload_optimizer="cpu", offload_params="cpu", micro_batches=2,
                     micro_batch_size=8)
    host = CATALOG.link(H100.host.name).collective_gbps * 1e9
    local = model.params() / 8
    hidden, exposed = (predict(model, lay, H100, seq_len=1024, overlap_dp=on) for on in (True, False))
    for pred in (hidden, exposed):
        assert pred.time_s["memcpy_d2h"] == pytest.approx(local * 4 / host, rel=1e-12)
    assert hidden.time_s["memcpy_h2d"] == pytest.approx(local * 2 / host, rel=1e-12)
    assert exposed.time_s["memcpy_h2d"] == pytest.approx((2 * 2 + 1) * local * 2 / host, rel=1e-12)
