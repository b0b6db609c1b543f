"""The step-time model: each cost term against its closed form, the prediction's split against the profiler's
categories, and the development set (Korthikanti et al. 2022, Table 5) within a stated error bound.

Tolerances: a closed form recomputed here is compared at rel 1e-12 (the same float operations in another order);
a sum of many terms (the step's partition, ratios of two predictions) at rel 1e-9.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from shardline.profiling.table.partition import LABELS, OVERLAP_COLUMNS
from shardline.recipes.planning import memory
from shardline.recipes.planning.catalog import (
    NCCL_BASE_LATENCY_S,
    TREE_EFFICIENCY,
    PlanError,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    cluster,
    gemm_s,
    group_link,
    load_catalog,
    quantization,
    ring_all_reduce_s,
    tree_all_reduce_s,
)
from shardline.recipes.planning.implementation import MEGATRON, Attention, Precision
from shardline.recipes.planning.layout import PlanLayout
from shardline.recipes.planning.models import ModelSpec, packaged
from shardline.recipes.planning.steptime import (
    _Ledger,
    block_seconds,
    bubble_fraction,
    model_flops,
    pipeline_makespan,
    predict,
    stage_layers,
)

CATALOG = load_catalog()
DGX_A100 = CATALOG.cluster("dgx-a100-80gb")

# ------------------------------------------------------------------------------------------------ dev set
# Korthikanti, Casper, Lym, McAfee, Andersch, Shoeybi, Catanzaro, "Reducing Activation Recomputation in Large
# Transformer Models", arXiv:2205.05198 (MLSys 2023). Table 5: measured end-to-end iteration time (s) on
# Selene (DGX A100 80GB, 8x HDR InfiniBand per node), "full recompute" (TP without SP, every block recomputed)
# vs "present work" (Megatron-SP + selective recompute). Table 3: the configurations (seq 2048, vocab 51200,
# GPT-3-style blocks, d_ff = 4h, fp16). Interleaving (chunks) as recorded by Calculon's validation inputs
# (Isaev et al., "Calculon: a methodology and tool for high-level co-design of systems and large language
# models", SC'23; github.com/calculon-ai/calculon validation/seqsel/tab5/*.json and calculon/llm/validation.py,
# which holds the same iteration times); Calculon's published mean error on these 8 rows is 3.65%.
#        name    h      heads layers tp pp  chunks gpus  batch mbs  full_s  present_s
TABLE5 = [("22B", 6144, 64, 48, 8, 1, 1, 8, 4, 4, 1.42, 1.10),
          ("175B", 12288, 96, 96, 8, 8, 3, 64, 64, 1, 18.13, 13.75),
          ("530B", 20480, 128, 105, 8, 35, 3, 280, 280, 1, 49.05, 37.83),
          ("1T", 25600, 160, 128, 8, 64, 1, 512, 512, 1, 94.42, 71.49)]
# Table 5's model-FLOPs utilization of the present-work rows (Megatron's formula, 312 TFLOP/s per A100).
TABLE5_MFU = {"175B": 0.514, "530B": 0.560, "1T": 0.563}
CALCULON_MEAN_ERROR = 0.0365
# The bound on the mean |relative error| over the 8 rows is Calculon's: this model measures 3.44% (3.71% before
# the local DDP's gradient division was priced, 4.21% before hidden collectives held their NCCL channels' SMs;
# its constants are data-sheet, NCCL-log and published-benchmark values, none fitted to these rows). Every row
# must stay within 12% (the worst, 22B present work, is -6.8%: the model is optimistic for small hidden sizes).
DEV_MEAN_BOUND, DEV_ROW_BOUND = CALCULON_MEAN_ERROR, 0.12


def dev_model(row) -> ModelSpec:
    name, h, heads, layers = row[:4]
    return ModelSpec(name=f"korthikanti-{name}", architecture="gpt2", vocab_size=51200, seq_len=2048,
                     n_layer=layers, n_head=heads, d_model=h, d_ff=4 * h, tie_embeddings=True)


def dev_layout(row, mode: str) -> PlanLayout:
    _, _, _, _, tp, pp, chunks, gpus, batch, mbs = row[:10]
    return PlanLayout(tp=tp, pp=pp, dp=gpus // (tp * pp), chunks=chunks,
                      schedule="interleaved" if chunks > 1 else "1f1b", sp="none" if mode == "full" else "megatron",
                      zero_stage=0, recompute="full" if mode == "full" else "selective",
                      micro_batches=batch // mbs, micro_batch_size=mbs)


#: Megatron-LM as Korthikanti et al. (2022) ran it: fp16, unfused attention, dropout.
MEGATRON_2022 = replace(MEGATRON, dtype=Precision.FP16, attention=Attention.MATERIALIZED, dropout=True)


def dev_predict(row, mode: str, cluster=DGX_A100):
    """The prediction for a Table 5 row (on ``cluster``: bench_plan varies its constants), with Megatron-LM's 2022
    implementation choices: fp16, unfused
    attention, dropout, asynchronous backward TP collectives, scatter-gather pipeline transfers, fp32 main
    gradients accumulated in the weight-gradient GEMM, the local DDP's division of the gradient buffer by the DP
    size (megatron/model/distributed.py, ``allreduce_gradients``: ``buffer_.data /= dp world size``, at dp 1
    too)."""
    return predict(dev_model(row), dev_layout(row, mode), cluster, seq_len=2048, impl=MEGATRON_2022)


def dev_errors() -> list[tuple[str, str, float, float]]:
    """(model, mode, measured s, predicted s) for the 8 rows."""
    out = []
    for row in TABLE5:
        for mode, measured in (("full", row[10]), ("present", row[11])):
            out.append((row[0], mode, measured, dev_predict(row, mode).step_s))
    return out


# Korthikanti et al. Table 4: one transformer layer of the 22B model (Table 3's layout: tp 8, micro-batch 4,
# seq 2048), forward and backward (recompute included) ms, measured on an A100, per (SP mode, recompute).
TABLE4_22B = {("none", "none"): (7.7, 11.9), ("megatron", "none"): (7.2, 11.8), ("none", "full"): (7.7, 19.5),
              ("none", "selective"): (7.7, 13.2), ("megatron", "selective"): (7.2, 13.1)}
# Every configuration's layer is predicted 2.4-5.1% fast (measured: -2.6, -3.8, -2.4, -3.9, -5.1%); 7% bounds it.
LAYER_BOUND = 0.07


def dev_layer_errors() -> list[tuple[str, str, float, float]]:
    """(sp, recompute, measured ms, predicted ms) of Table 4's five layers, with Megatron-LM 2022's choices."""
    out = []
    for (sp, recompute), (fwd, bwd) in TABLE4_22B.items():
        layout = replace(dev_layout(TABLE5[0], "full"), sp=sp, recompute=recompute)
        compute, exposed = block_seconds(dev_model(TABLE5[0]), layout, DGX_A100, seq_len=2048, dtype="fp16",
                                         attention="materialized", dropout=True, tp_overlap=True, fused_wgrad=True,
                                         fused_kernels=True)
        out.append((sp, recompute, fwd + bwd, 1e3 * (compute + exposed)))
    return out


def test_table4_layer_times_are_within_the_bound():
    """The block model against a second public measurement of the same paper, layer by layer: what each of SP,
    full and selective recompute costs a 22B layer. The order is the paper's: SP saves, full recompute costs the
    most, selective recompute far less."""
    rows = {(sp, rc): (measured, predicted) for sp, rc, measured, predicted in dev_layer_errors()}
    for key, (measured, predicted) in rows.items():
        assert abs(predicted / measured - 1) < LAYER_BOUND, (key, measured, predicted)
    t = {key: predicted for key, (_, predicted) in rows.items()}
    assert t[("megatron", "none")] < t[("none", "none")] < t[("none", "selective")] < t[("none", "full")]
    assert t[("megatron", "selective")] < t[("none", "selective")]


def test_table5_mean_error_is_within_the_bound():
    errors = [(name, mode, predicted / measured - 1) for name, mode, measured, predicted in dev_errors()]
    mean = sum(abs(e) for *_, e in errors) / len(errors)
    assert mean < DEV_MEAN_BOUND, f"mean |error| {mean:.2%} (Calculon: {CALCULON_MEAN_ERROR:.2%}); rows {errors}"
    worst = max(errors, key=lambda e: abs(e[2]))
    assert abs(worst[2]) < DEV_ROW_BOUND, f"worst row {worst}"


# ------------------------------------------------------------------------------------------------ closed forms


def test_ring_all_reduce_is_two_n_minus_one_over_n_s_over_b():
    link = group_link(DGX_A100, size=8, stride=1)
    size, n = 1e9, 8
    expected = 2 * (n - 1) / n * size / 235e9 + 2 * (n - 1) * 3.4e-6 + NCCL_BASE_LATENCY_S
    assert ring_all_reduce_s(size, n, link) == pytest.approx(expected, rel=1e-12)
    assert all_gather_s(size, n, link) == pytest.approx((n - 1) / n * size / 235e9 + (n - 1) * 3.4e-6
                                                        + NCCL_BASE_LATENCY_S, rel=1e-12)
    assert ring_all_reduce_s(size, 1, link) == 0.0 and all_gather_s(size, 1, link) == 0.0


def test_all_reduce_takes_the_tree_only_where_latency_dominates():
    link = group_link(DGX_A100, size=1024, stride=8)  # one rank per node: the NIC, 25 GB/s, 14 us per step
    tree_small = 2 * 4096 / (TREE_EFFICIENCY * 25e9) + 2 * math.log2(1024) * 14e-6 + NCCL_BASE_LATENCY_S
    assert tree_all_reduce_s(4096, 1024, link) == pytest.approx(tree_small, rel=1e-12)
    tree = tree_all_reduce_s(4096, 1024, link)
    assert all_reduce_s(4096, 1024, link) == tree < ring_all_reduce_s(4096, 1024, link)
    assert all_reduce_s(1e9, 64, link) == ring_all_reduce_s(1e9, 64, link)  # bandwidth-bound: the ring
    # At 1024 ranks the ring's 2(N-1) steps of 14 us outweigh its bandwidth edge even for 1 GB.
    assert all_reduce_s(1e9, 1024, link) == tree_all_reduce_s(1e9, 1024, link)


def test_a_tp_group_larger_than_a_node_pays_the_nic():
    one_nic = cluster(CATALOG, gpu="a100-80gb", gpus_per_node=8, inter_node="ib-hdr", nics_per_node=1)
    inside = group_link(one_nic, size=8, stride=1)
    across = group_link(one_nic, size=16, stride=1)
    assert (inside.bytes_per_s, inside.crosses_nodes) == (235e9, False)
    # 8 members per node share the node's single 25 GB/s NIC: k/G of it with k = G = 8.
    assert (across.bytes_per_s, across.latency_s, across.crosses_nodes) == (25e9, 14e-6, True)
    # A DP group of one rank per node gets that rank's 1/8 share.
    assert group_link(one_nic, size=4, stride=8).bytes_per_s == 25e9 / 8
    # A group that straddles nodes (3 does not divide 8) is priced as crossing.
    assert group_link(one_nic, size=3, stride=1).crosses_nodes


def test_tp16_all_reduces_are_the_closed_form_over_the_nic():
    """tp=16 on 8-GPU nodes, no SP, no recompute, one stage: per block 2 forward + 2 backward all-reduces of
    ``T h e`` bytes, plus the embedding's and the head's, plus the loss's 3 of ``T`` floats, all on the NIC;
    and with tp=8 the NIC's speed does not matter at all."""
    model = packaged("gpt3-6.7b")
    nets = [cluster(CATALOG, gpu="a100-80gb", gpus_per_node=8, inter_node="ib-hdr", nics_per_node=n)
            for n in (1, 8)]
    lay = PlanLayout(tp=16, micro_batches=2, micro_batch_size=1, zero_stage=0)
    tokens, h = 2048, model.d_model
    for net in nets:
        link = group_link(net, size=16, stride=1)
        per_mb = (4 * model.n_layer + 2) * all_reduce_s(tokens * h * 2, 16, link) \
            + 3 * all_reduce_s(tokens * 4, 16, link)
        got = predict(model, lay, net, seq_len=2048).time_s["all_reduce"]
        assert got == pytest.approx(2 * per_mb, rel=1e-12)
    tp8 = replace(lay, tp=8)
    assert predict(model, tp8, nets[0], seq_len=2048).time_s["all_reduce"] == \
        predict(model, tp8, nets[1], seq_len=2048).time_s["all_reduce"]


def test_bubble_fraction_and_makespan():
    assert bubble_fraction(8, 64, 3) == 7 / (3 * 64 + 7)
    for p, m, v in ((4, 8, 1), (8, 64, 3), (35, 280, 3)):
        t = 0.25
        makespan = pipeline_makespan([t] * p, micro_batches=m, chunks=v)
        assert (makespan - m * t) / makespan == pytest.approx(bubble_fraction(p, m, v), rel=1e-12)
    # Unequal stages: the slowest runs all m micro-batches, the others fill and drain once.
    assert pipeline_makespan([1.0, 2.0, 1.0], micro_batches=4) == 4 * 2.0 + 2.0
    assert stage_layers(105, 35, 3) == [3] * 35 and stage_layers(10, 4, 1) == [3, 3, 2, 2]


@pytest.mark.parametrize("n_layer, pp, chunks", [(10, 4, 1), (32, 4, 2), (126, 16, 1), (80, 8, 3), (4, 3, 2)])
def test_shardlines_cut_is_the_estimators(n_layer, pp, chunks):
    # cut="layers": the n_layer + 2 layers cut uniformly, as the pipeline (and memory.hosted_stages) does
    from shardline.recipes.planning.memory import hosted_stages

    model = packaged("llama2-7b").replace(n_layer=n_layer)
    lay = PlanLayout(pp=pp, chunks=chunks, schedule="interleaved" if chunks > 1 else "1f1b", micro_batches=pp)
    expected = [sum(1 for layers in hosted_stages(model, lay, r).values() for i in layers if 0 < i <= n_layer)
                for r in range(pp)]
    assert stage_layers(n_layer, pp, chunks, cut="layers") == expected
    assert sum(expected) == n_layer


def test_model_flops_is_megatrons_formula():
    for name, h, heads, layers, *_ in TABLE5:
        model = dev_model((name, h, heads, layers))
        b, s, v = 64, 2048, 51200
        megatron = 72 * b * s * layers * h ** 2 * (1 + s / (6 * h) + v / (12 * layers * h))
        assert model_flops(model, seq_len=s, batch=b) == pytest.approx(megatron, rel=1e-12)


def test_model_flops_reproduce_table5s_mfu():
    """MFU = model FLOPs / (iteration time x GPUs x 312 TFLOP/s) gives Table 5's column; its times have 2-4
    significant digits, so the MFU is compared to +-0.0005 (the printed precision)."""
    for name, h, heads, layers, _, _, _, gpus, batch, _, _, present in TABLE5:
        if name in TABLE5_MFU:
            flops = model_flops(dev_model((name, h, heads, layers)), seq_len=2048, batch=batch)
            assert flops / (present * gpus * 312e12) == pytest.approx(TABLE5_MFU[name], abs=5e-4)


def test_quantization_counts_partial_tiles_and_waves():
    assert quantization(256 * 108, 128, 108) == 1.0  # one full wave of 256x128 tiles
    # 109 tiles of 256x128 need a second, nearly empty wave (109/216); 218 of 128x128 fill 218/324: the best
    assert quantization(256 * 109, 128, 108) == pytest.approx(218 / 324, rel=1e-12)
    assert quantization(100, 100, 108) == pytest.approx(100 * 100 / (128 * 128 * 108), rel=1e-12)


# ------------------------------------------------------------------------------------------------ the prediction


def test_the_split_uses_the_profilers_labels_and_sums_to_the_step():
    pred = dev_predict(TABLE5[1], "present")
    assert tuple(pred.time_s) == LABELS and tuple(pred.overlapped_s) == OVERLAP_COLUMNS
    assert sum(pred.time_s.values()) == pytest.approx(pred.step_s, rel=1e-9)
    assert all(v >= 0 for v in pred.time_s.values()) and pred.time_s["bubble"] > 0
    summary = pred.categories()
    assert set(summary) == {"compute", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p", "bubble",
                            "offload", "idle", "exposed_comm"}
    assert summary["exposed_comm"] == pytest.approx(sum(pred.time_s[c] for c in (
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier", "other_comm",
        "p2p_send", "p2p_recv")), rel=1e-12)
    assert pred.overlapped_s["overlapped_reduce_scatter"] > 0  # tp_overlap hides SP's backward reduce-scatters
    assert pred.tflops_per_gpu == pytest.approx(pred.mfu * 312, rel=1e-12)
    assert pred.tokens_per_s_per_gpu == pytest.approx(64 * 2048 / pred.step_s / 64, rel=1e-12)


def test_zero3_moves_one_and_a_half_times_zero2s_volume():
    model = packaged("gpt2-760m")
    base = PlanLayout(dp=8, micro_batches=1, micro_batch_size=4)
    comm = {}
    for stage in (2, 3):
        pred = predict(model, replace(base, zero_stage=stage), DGX_A100, seq_len=1024, overlap_dp=False)
        comm[stage] = pred.time_s["all_gather"] + pred.time_s["reduce_scatter"]
    # ZeRO-3 gathers module by module, forward and backward: 24 blocks + embedding + head = 26 gathers of one
    # parameter set each way, so 25 more collective latencies per pass than one whole-model gather
    link = group_link(DGX_A100, size=8, stride=1)
    latency = 7 * link.latency_s + NCCL_BASE_LATENCY_S
    assert (comm[3] - 2 * 25 * latency) / comm[2] == pytest.approx(1.5, rel=1e-9)


def test_data_parallel_reduction_hides_under_backward():
    """Hidden under the backward, the all-reduce leaves it; the backward beside it runs on 108 - 24 SMs (the
    A100 ring's NCCL channels), so it takes ``AR * 24/108`` longer: compute, in closed form."""
    model = packaged("gpt2-760m")
    lay = PlanLayout(dp=8, zero_stage=0, micro_batches=1, micro_batch_size=4)
    hidden = predict(model, lay, DGX_A100, seq_len=1024)
    exposed = predict(model, lay, DGX_A100, seq_len=1024, overlap_dp=False)
    reduce = exposed.time_s["all_reduce"]
    assert hidden.overlapped_s["overlapped_all_reduce"] == pytest.approx(reduce, rel=1e-9)
    assert hidden.time_s["all_reduce"] == 0.0
    assert DGX_A100.intra_node.channels == 24 and DGX_A100.gpu.sms == 108
    assert hidden.time_s["compute"] - exposed.time_s["compute"] == pytest.approx(reduce * 24 / 108, rel=1e-9)
    assert hidden.step_s == pytest.approx(exposed.step_s - reduce + reduce * 24 / 108, rel=1e-9)


def test_a_gemm_beside_a_collective_runs_on_the_sms_it_leaves():
    """``gemm_s(sms=)``: the peak scales by the SMs kept and the waves are counted over them. 432 tiles of
    256x128 fill 4 waves of 108 SMs exactly; on 84 SMs they need 6 waves (5.14 full), 864 of 128x128 need 11
    (10.3 full, the better), so the GEMM takes 108/84 / 0.935 = 1.375 times as long."""
    gpu = DGX_A100.gpu
    alone = gemm_s(gpu, 6144, 2304, 8192, dtype="bf16")
    beside = gemm_s(gpu, 6144, 2304, 8192, dtype="bf16", sms=84)
    assert quantization(6144, 2304, 108) == 1.0
    assert quantization(6144, 2304, 84) == pytest.approx(max(432 / (6 * 84), 864 / (11 * 84)), rel=1e-12)
    assert beside / alone == pytest.approx(108 / 84 / quantization(6144, 2304, 84), rel=1e-12)


def test_a_collective_beside_compute_slows_it_for_the_overlap():
    """_Ledger.overlap: a collective shorter than the squeezed compute adds ``seconds (1 - alone/squeezed)``
    of compute and nothing exposed; a longer one costs the whole squeeze and exposes what outlasts it."""
    short = _Ledger()
    short.overlap("all_reduce", 1.0, alone=3.0, squeezed=4.0)
    assert short.compute == pytest.approx(0.25) and short.exposed["all_reduce"] == 0.0
    assert short.overlapped["all_reduce"] == 1.0
    long = _Ledger()
    long.overlap("all_gather", 5.0, alone=3.0, squeezed=4.0)
    assert long.compute == pytest.approx(1.0) and long.exposed["all_gather"] == pytest.approx(1.0)
    assert long.overlapped["all_gather"] == pytest.approx(4.0)
    assert long.busy == pytest.approx(5.0 - 3.0)  # with the 3 s of compute it ran beside: the collective's 5 s


def test_cpu_optimizer_offload_is_host_traffic_and_gpu_idle():
    model = packaged("gpt2-760m")
    lay = PlanLayout(zero_stage=1, offload_optimizer="cpu", micro_batches=1, micro_batch_size=4)
    pred = predict(model, lay, DGX_A100, seq_len=1024)
    params = model.params()
    assert pred.time_s["memcpy_d2h"] == pytest.approx(params * 4 / 24e9, rel=1e-12)  # fp32 grads, NCCL's Gen4
    assert pred.time_s["memcpy_h2d"] == pytest.approx(params * 2 / 24e9, rel=1e-12)  # bf16 parameters back
    # CPU Adam at ZeRO-Offload's measured 10B parameters in 2.57 s on 255.9 GB/s of DRAM, scaled to the DGX A100's
    # 409.6 GB/s, the node's rate shared by its 8 GPUs
    assert pred.time_s["idle"] == pytest.approx(params / (10e9 / 2.57 * 409.6 / 255.9 / 8), rel=1e-9)
    assert pred.categories()["offload"] == pytest.approx(params * 6 / 24e9, rel=1e-12)


def test_the_gradient_scale_pass_reads_and_writes_every_local_gradient_once():
    """Megatron-LM 2022's local DDP divides the whole gradient buffer by the DP size in place, whatever that
    size: its cost is 2 x grad_bytes per parameter the rank holds (before ZeRO), at HBM speed, and nothing else
    changes (dp 1 and dp 4, fp32 and bf16 gradients)."""
    model = packaged("gpt2-760m")
    for dp, grad_bytes in ((1, 4), (4, 2)):
        lay = PlanLayout(tp=2, dp=dp, zero_stage=1, micro_batches=2, micro_batch_size=2)
        base, scaled = (predict(model, lay, DGX_A100, seq_len=1024, grad_bytes=grad_bytes, grad_scale_pass=on)
                        for on in (False, True))
        local = model.params() / 2  # pp 1, tp 2: the whole model over two ranks (the step model splits norms too)
        hbm = DGX_A100.gpu.hbm_bytes_per_s
        assert scaled.time_s["compute"] - base.time_s["compute"] == pytest.approx(2 * grad_bytes * local / hbm,
                                                                                   rel=1e-9)
        assert {k: v for k, v in scaled.time_s.items() if k != "compute"} == pytest.approx(
            {k: v for k, v in base.time_s.items() if k != "compute"}, rel=1e-12)


def test_nvme_offload_prices_the_drive_traffic_deepspeed_makes():
    """llama3-8b over 8 ranks: 1.004e9 partition elements per rank, one sub-group (sub_group_size 1e9 closes only
    at the last parameters) that does not fit DeepSpeed's max_in_cpu = 1e9 flat, so every swapped partition is
    read in each forward and backward pass and written back after the step; with max_in_cpu = 2e9 all stay in CPU
    RAM and the drive is never read. Nothing hidden (overlap_dp off): the step grows by exactly (2m + 1) passes
    over the node's drive share; the optimizer's own traffic (nvme) adds 2 x (master, moments, gradients)."""
    model, h100 = packaged("llama3-8b"), CATALOG.cluster("dgx-h100")
    roomy = memory.ZeroSettings(max_in_cpu=2_000_000_000)
    share = h100.nvme_gbps * 1e9 / h100.gpus_per_node
    for oo in ("cpu", "nvme"):
        lay = PlanLayout(dp=8, zero_stage=3, offload_optimizer=oo, offload_params="nvme", recompute="full",
                         micro_batches=2)
        numels, _ = memory.rank_parameters(model, lay, 0)
        passes, step = memory.swap_traffic(numels, lay, 2)
        parts = memory.estimate(model, lay, seq_len=4096).ranks[0].detail
        assert passes == parts["io.param_pass"] > 0.99 * parts["nvme.params"]  # (nearly) all swapped ones
        assert step == passes + (0 if oo == "cpu" else 2 * (parts["nvme.optimizer"] + parts["nvme.grads"]))
        assert memory.swap_traffic(numels, lay, 2, roomy)[0] == 0
        slow, fast = (predict(model, lay, h100, seq_len=4096, overlap_dp=False, zero=z)
                      for z in (memory.DEFAULT_ZERO, roomy))
        fast_step = memory.swap_traffic(numels, lay, 2, roomy)[1]
        assert slow.step_s - fast.step_s == pytest.approx(((2 * 2 + 1) * passes + step - passes - fast_step) / share,
                                                          rel=1e-9)
    assert memory.swap_traffic(numels, PlanLayout(dp=8, zero_stage=3, offload_optimizer="cpu"), 2) == (0, 0)


def test_ulysses_all_to_alls_are_the_closed_form_and_ring_hops_hide_under_attention():
    """Ulysses: per block and micro-batch 2 x (q and out of ``T a d`` bytes + k and v) all-to-alls each way,
    exposed; k and v carry ``T a d`` bytes under shardline (its decoder repeats grouped K/V to the query heads
    first) and ``T g d`` where K/V travel grouped (``cp_repeats_kv=False``); ring: the K/V hops overlap the
    attention they feed (their closed form: tests/recipes/planning/test_comm_charges.py)."""
    model, h100 = packaged("llama3-8b"), CATALOG.cluster("dgx-h100")
    lay = PlanLayout(cp=4, sp="ulysses", micro_batches=1, micro_batch_size=1)
    tokens, hd = 32768 // 4, model.dim_per_head
    link = group_link(h100, size=4, stride=1)
    for repeated, kv_heads in ((True, model.n_head), (False, model.kv_heads)):
        per_pass = 2 * all_to_all_s(tokens * model.n_head * hd * 2, 4, link) \
            + 2 * all_to_all_s(tokens * kv_heads * hd * 2, 4, link)
        got = predict(model, lay, h100, seq_len=32768, cp_repeats_kv=repeated).time_s["all_to_all"]
        assert got == pytest.approx(model.n_layer * 2 * per_pass, rel=1e-12)
    ring = predict(model, replace(lay, sp="ring"), h100, seq_len=32768)
    assert ring.overlapped_s["overlapped_p2p_send"] > 0 and ring.time_s["all_to_all"] == 0


def test_shardlines_eager_kernels_cost_more_than_fused_ones():
    model, h100 = packaged("llama3-8b"), CATALOG.cluster("dgx-h100")
    lay = PlanLayout(dp=8, micro_batches=2, micro_batch_size=1)
    eager = predict(model, lay, h100, seq_len=8192)
    fused = predict(model, lay, h100, seq_len=8192, fused_kernels=True)
    assert fused.step_s < eager.step_s and fused.mfu > eager.mfu


def test_full_recompute_costs_more_than_selective_which_costs_more_than_none():
    row = TABLE5[0]
    steps = {mode: predict(dev_model(row), replace(dev_layout(row, "present"), recompute=mode), DGX_A100,
                           seq_len=2048, attention="materialized").step_s for mode in ("none", "selective", "full")}
    assert steps["none"] < steps["selective"] < steps["full"]


def test_bad_inputs_name_every_value():
    model = packaged("llama3-8b")
    with pytest.raises(PlanError) as error:
        predict(model, PlanLayout(tp=3, pp=64, offload_params="cpu", zero_stage=2), DGX_A100, seq_len=8192,
                dtype="fp8")
    message = str(error.value)
    for part in ("n_head=32 is not divisible by tp=3", "kv heads=8", "n_layer + 2 = 34 layers < pp*chunks=64",
                 "offload_params='cpu' needs zero_stage=3", "dtype='fp8'", "a100-80gb"):
        assert part in message
    with pytest.raises(PlanError, match=re.escape("n_layer + 2 = 34 layers < pp*chunks=35")):
        predict(model, PlanLayout(pp=35, micro_batches=35), DGX_A100, seq_len=8192)
    with pytest.raises(PlanError, match=re.escape("n_layer=32 < pp*chunks=33")):
        predict(model, PlanLayout(pp=33, micro_batches=33), DGX_A100, seq_len=8192, cut="blocks")
    with pytest.raises(PlanError, match="cut='stages' must be one of"):
        predict(model, PlanLayout(), DGX_A100, seq_len=8192, cut="stages")
    with pytest.raises(PlanError, match="attention='sdpa'"):
        predict(model, PlanLayout(), DGX_A100, seq_len=8192, attention="sdpa")


def test_the_implementation_is_one_value_and_the_keywords_change_it():
    model, lay = packaged("llama3-8b"), PlanLayout(tp=2, pp=2, dp=2, micro_batches=4)
    by_value = predict(model, lay, DGX_A100, seq_len=2048, impl=replace(MEGATRON, overlap_dp=False))
    by_keywords = predict(model, lay, DGX_A100, seq_len=2048, tp_overlap=True, pp_scatter_gather=True, grad_bytes=4,
                          fused_wgrad=True, fused_kernels=True, cut="blocks", grad_scale_pass=True, overlap_dp=False)
    assert by_value == by_keywords
    assert MEGATRON_2022.attention is Attention.MATERIALIZED and MEGATRON_2022.cut == "blocks"
    with pytest.raises(PlanError, match=r"dtype='fp32' must be one of .*tp_overlap='yes' must be true or false"):
        predict(model, lay, DGX_A100, seq_len=2048, dtype="fp32", tp_overlap="yes")
    with pytest.raises(PlanError, match=r"unknown field\(s\) \['overlap'\]"):
        predict(model, lay, DGX_A100, seq_len=2048, overlap=True)
