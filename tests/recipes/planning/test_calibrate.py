"""Calibration from a profile: synthetic Kineto traces written here with known rates (GEMMs at 61% of the H100's
bf16 peak, fp8 at 55%, flash attention at 40%, NVLink and InfiniBand collectives at a known bus bandwidth and
latency) give those rates back, predict() on the calibrated cluster equals predict() on a cluster built from the
true rates, the override YAML rebuilds the cluster through load_catalog, and bad or partial profiles are refused
or warned about. Real traces from the corpus calibrate to physically possible numbers or a PlanError.

Tolerances: the synthetic traces store times in ns (Kineto's µs with 3 decimals), so a rate comes back within
the rounding of its shortest duration (~1e-5 relative); rel=1e-4 covers it with margin.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import warnings

import pytest

from shardline.recipes.planning import catalog as hw
from shardline.recipes.planning.calibrate import (
    Calibration,
    CalibrationWarning,
    Target,
    calibrate,
)
from shardline.recipes.planning.catalog import NCCL_BASE_LATENCY_S, PlanError, load_catalog
from shardline.recipes.planning.layout import PlanLayout
from shardline.recipes.planning.models import packaged
from shardline.recipes.planning.steptime import FLASH_BWD_OVER_FWD, predict

CATALOG = load_catalog()
H100 = CATALOG.cluster("dgx-h100")  # 8 GPUs and 8 NDR NICs per node
REL = 1e-4
# The rates the synthetic run is generated with.
GEMM_F, FP8_F, ATTN_F = 0.61, 0.55, 0.40
INTRA_GBPS, INTRA_ALPHA_US = 310.0, 2.0  # NVLink: bus bandwidth, latency per ring step
INTER_GBPS, INTER_ALPHA_US = 42.0, 9.0  # per NIC
MIB = 1 << 20
WORLD = 16  # two nodes
TP0, TP8, DP = list(range(8)), list(range(8, 16)), [0, 8]


# ------------------------------------------------------------------------------ a synthetic Kineto trace


class KinetoTrace:
    """One rank's trace in the layout torch.profiler writes (record_shapes=True): nested ``cpu_op`` events with
    ``Input Dims``/``Input type``/``Concrete Inputs``, a ``cudaLaunchKernel`` per kernel inside the innermost op,
    the kernel on its stream with the op's External id and the launch's correlation id, ``ac2g`` flows between
    them, and ``record_param_comms`` ops whose NCCL kernels carry (or, old-style, lack) the comm args."""

    def __init__(self, rank: int, *, device: str = "NVIDIA H100 80GB HBM3"):
        self.rank, self.device = rank, device
        self.events: list[dict] = []
        self.cpu_ns = self.gpu_ns = 1_000_000
        self.ext = self.corr = 100

    def _x(self, cat, name, start_ns, dur_ns, args, pid=1234, tid=1234):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": start_ns / 1000,
                            "dur": dur_ns / 1000, "args": args})

    def call(self, ops: list[tuple[str, dict]], kernels: list[tuple[str, int, dict]], *, stream: int = 7,
             launches: bool = True) -> None:
        """Ops outermost first (each ``(name, args)``); the innermost launches ``kernels`` (``(name, dur_ns,
        extra args)``), which run back to back on ``stream``."""
        depth, span = len(ops), 20_000 + 5_000 * len(kernels)
        ids = []
        for level, (name, args) in enumerate(ops):
            self.ext += 1
            ids.append(self.ext)
            self._x("cpu_op", name, self.cpu_ns + 1000 * level, span - 2000 * level,
                    {"External id": self.ext, "Record function id": 0, **args})
        at = self.cpu_ns + 1000 * depth + 1000
        for name, dur_ns, extra in kernels:
            self.corr += 1
            if launches:
                self._x("cuda_runtime", "cudaLaunchKernel", at, 3000,
                        {"External id": ids[-1], "cbid": 211, "correlation": self.corr})
                self.events.append({"ph": "s", "id": self.corr, "pid": 1234, "tid": 1234, "ts": at / 1000,
                                    "cat": "ac2g", "name": "ac2g"})
            start = max(self.gpu_ns, at + 5000)
            self._x("kernel", name, start, dur_ns, {"External id": ids[-1], "queued": 0, "device": 0,
                                                    "context": 1, "stream": stream, "correlation": self.corr,
                                                    "grid": [132, 1, 1], "block": [384, 1, 1], **extra},
                    pid=0, tid=stream)
            if launches:
                self.events.append({"ph": "f", "id": self.corr, "pid": 0, "tid": stream, "ts": start / 1000,
                                    "cat": "ac2g", "name": "ac2g", "bp": "e"})
            self.gpu_ns = start + dur_ns + 2000
            at += 4000
        self.cpu_ns += span + 3000

    def gemm(self, op: str, dims: list, dtype: str, dur_ns: int, *, kernels: int = 1, launches: bool = True):
        """One GEMM op under ``aten::linear``; ``kernels`` > 1 splits its time (a split-K GEMM + reduction)."""
        types = [dtype] * len(dims)
        parts = [dur_ns // kernels] * (kernels - 1)
        names = ["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_execute_kernel__5x_cublas",
                 "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(cublasLt::cublasSplitKParams)"]
        ks = [(names[min(i, 1)], d, {}) for i, d in enumerate([*parts, dur_ns - sum(parts)])]
        self.call([("aten::linear", {"Input Dims": dims[:2], "Input type": types[:2]}),
                   (op, {"Input Dims": dims, "Input type": types, "Concrete Inputs": [""] * len(dims)})],
                  ks, launches=launches)

    def attention(self, b, h, s, d, dur_fwd_ns, dur_bwd_ns, *, causal: bool | None = True):
        """SDPA flash forward (sdpa > _sdpa_flash [B,H,S,D] > _flash_attention_forward [B,S,H,D]) and backward."""
        flag = {True: "True", False: "False", None: ""}[causal]
        bhsd, bshd, t = [b, h, s, d], [b, s, h, d], "c10::BFloat16"
        self.call([("aten::scaled_dot_product_attention", {"Input Dims": [bhsd] * 3, "Input type": [t] * 3}),
                   ("aten::_scaled_dot_product_flash_attention",
                    {"Input Dims": [bhsd] * 3 + [[]] * 3, "Input type": [t] * 3 + ["Scalar", "Scalar", "Scalar"],
                     "Concrete Inputs": ["", "", "", "0.", flag, "False", ""]}),
                   ("aten::_flash_attention_forward",
                    {"Input Dims": [bshd] * 3 + [[]] * 7, "Input type": [t] * 3 + [""] * 7,
                     "Concrete Inputs": ["", "", "", "", "", str(s), str(s), "0.", flag, "False"]})],
                  [("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>"
                    "(pytorch_flash::Flash_fwd_params)", dur_fwd_ns, {})])
        self.call([("aten::_scaled_dot_product_flash_attention_backward",
                    {"Input Dims": [bhsd] * 5 + [[b, h, s]] + [[]] * 9, "Input type": [t] * 5 + ["float"] + [""] * 9,
                     "Concrete Inputs": [""] * 10 + ["0.", flag, "", "", ""]})],
                  [("void pytorch_flash::flash_bwd_dot_do_o_kernel<true>(pytorch_flash::Flash_bwd_params)",
                    dur_bwd_ns // 10, {}),
                   ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<true>"
                    "(pytorch_flash::Flash_bwd_params)", dur_bwd_ns - dur_bwd_ns // 10, {})])

    def collective(self, kind: str, group: list[int], pg_name: str, nbytes: int, dur_ns: int, *,
                   kernel_args: bool = True, ranks_text: bool = True):
        """One NCCL collective of ``nbytes`` (the full buffer) in bf16 on ``group``. ``kernel_args=False``: the
        kernel carries no comm args (older torch; they are on record_param_comms only); ``ranks_text=False``:
        no "Process Group Ranks" (the trace's pg_config says)."""
        name, kernel = {"all_reduce": ("allreduce", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
                        "all_gather": ("_allgather_base", "ncclDevKernel_AllGather_RING_LL"),
                        "reduce_scatter": ("_reduce_scatter_base", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL")
                        }[kind]
        full, n = nbytes // 2, len(group)
        in_n, out_n = {"all_reduce": (full, full), "all_gather": (full // n, full),
                       "reduce_scatter": (full, full // n)}[kind]
        args = {"Collective name": name, "In msg nelems": in_n, "Out msg nelems": out_n, "Group size": n,
                "dtype": "BFloat16", "In split size": "[]", "Out split size": "[]", "Process Group Name": pg_name,
                "Process Group Description": "undefined"}
        if ranks_text:
            args["Process Group Ranks"] = str(group)
        self.call([("record_param_comms", {**args, "Rank": self.rank, "Input Dims": [[in_n]],
                                           "Input type": ["c10::BFloat16"]})],
                  [(f"{kernel}(ncclDevKernelArgsStorage<4096ul>)", dur_ns, args if kernel_args else {})],
                  stream=20)

    def document(self, groups: dict[str, list[int]]) -> dict:
        pg_config = [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": WORLD,
                      "ranks": list(range(WORLD))}]
        pg_config += [{"pg_name": k, "pg_desc": "undefined", "backend_config": "cuda:nccl", "pg_size": len(v),
                       "ranks": v} for k, v in groups.items()]
        step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1234, "tid": 1234,
                "ts": 999.0, "dur": (self.cpu_ns - 999_000) / 1000, "args": {"External id": 1}}
        return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": self.device, "numSms": 132}],
                "distributedInfo": {"backend": "nccl", "rank": self.rank, "world_size": WORLD,
                                    "pg_count": len(pg_config), "pg_config": pg_config, "nccl_version": "2.27.5"},
                "record_shapes": 1, "displayTimeUnit": "ms", "baseTimeNanoseconds": 1_700_000_000_000_000_000,
                "traceName": f"rank{self.rank}.pt.trace.json", "traceEvents": [step, *self.events]}

    def write(self, path, groups: dict[str, list[int]]):
        text = json.dumps(self.document(groups))
        if str(path).endswith(".gz"):
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path.write_text(text)
        return path


# ----------------------------------------------------------------------------------------- known rates


def true_cluster():
    """dgx-h100 with the rates the synthetic run is generated with."""
    gpu = dataclasses.replace(H100.gpu, matmul_fraction_bf16=GEMM_F, matmul_fraction_fp8=FP8_F,
                              attention_fraction=ATTN_F)
    intra = dataclasses.replace(H100.intra_node, collective_gbps=INTRA_GBPS, latency_us=INTRA_ALPHA_US)
    inter = dataclasses.replace(H100.inter_node, collective_gbps=INTER_GBPS, latency_us=INTER_ALPHA_US)
    return dataclasses.replace(H100, gpu=gpu, intra_node=intra, inter_node=inter)


TRUE_CLUSTER = true_cluster()


def gemm_ns(m, n, k, batch=1, *, dtype="bf16") -> int:
    """What the model's gemm_s gives the GEMM at the true fractions (compute-bound shapes only are timed so)."""
    return round(1e9 * hw.gemm_s(TRUE_CLUSTER.gpu, m, n, k, dtype=dtype, batch=batch))


def attention_ns(b, h, s, d, *, causal=True) -> tuple[int, int]:
    """Forward and backward as steptime prices flash attention: F at P a, 2.5 F at P a r."""
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    rate = H100.gpu.peak_flops("bf16") * ATTN_F
    return round(1e9 * flops / rate), round(1e9 * 2.5 * flops / (rate * FLASH_BWD_OVER_FWD))


def collective_ns(kind: str, nbytes: int, group: list[int]) -> int:
    """What the model's ring costs give the call at the true link numbers, on the link group_link places the
    group (consecutive TP ranks: NVLink; the pair {0, 8}: one NIC's share per node)."""
    link = hw.group_link(TRUE_CLUSTER, size=len(group), stride=group[1] - group[0])
    cost = {"all_reduce": hw.ring_all_reduce_s, "all_gather": hw.all_gather_s,
            "reduce_scatter": hw.reduce_scatter_s}[kind]
    return round(1e9 * cost(nbytes, len(group), link))


# Compute-bound GEMMs: the first with q = 1 on 132 SMs (11 x 12 tiles of 256 x 128: its achieved share of the peak
# is the fraction itself), the others with tile and wave quantization.
GEMMS = [("aten::mm", [[2816, 4096], [4096, 1536]], (2816, 1536, 4096, 1)),
         ("aten::addmm", [[1536], [4096, 4096], [4096, 1536]], (4096, 1536, 4096, 1)),
         ("aten::addmm", [[14336], [8192, 4096], [4096, 14336]], (8192, 14336, 4096, 1)),
         ("aten::bmm", [[32, 2048, 1024], [32, 1024, 2048]], (2048, 2048, 1024, 32)),
         ("aten::baddbmm", [[32, 1000, 1000], [32, 1000, 3000], [32, 3000, 1000]], (1000, 1000, 3000, 32))]
ATTENTION = [(2, 32, 4096, 128), (1, 8, 8192, 128)]


def write_run(folder, *, attention=True, collectives=True, fp8=True, decoys=True):
    """Rank 0 (``.json``) and rank 8 (``.json.gz``) of a 2-node run: TP groups of 8 on NVLink, DP pair {0, 8}."""
    folder.mkdir(exist_ok=True)
    r0, r8 = KinetoTrace(0), KinetoTrace(8)
    for op, dims, shape in GEMMS:
        r0.gemm(op, dims, "c10::BFloat16", gemm_ns(*shape))
    r0.gemm("aten::mm", [[8192, 8192], [8192, 8192]], "c10::BFloat16", gemm_ns(8192, 8192, 8192), kernels=2)
    r8.gemm("aten::mm", [[4096, 8192], [8192, 4096]], "c10::Half", gemm_ns(4096, 4096, 8192), launches=False)
    if fp8:
        r0.call([("aten::_scaled_mm", {"Input Dims": [[8192, 8192], [8192, 8192], [], [], [], [], [], []],
                                       "Input type": ["c10::Float8_e4m3fn"] * 2 + ["float"] * 2 + [""] * 4})],
                [("sm90_xmma_gemm_e4m3e4m3_bf16f32_f32_tn_n_tilesize128x128x128_cublas",
                  gemm_ns(8192, 8192, 8192, dtype="fp8"), {})])
    if decoys:  # each would pull the fit away: float32 (no peak), memory-bound (M=8), tiny (under 1 GFLOP)
        r0.gemm("aten::mm", [[4096, 4096], [4096, 4096]], "float", 900_000)
        r0.gemm("aten::addmm", [[4096], [8, 4096], [4096, 4096]], "c10::BFloat16", 400_000)
        r0.gemm("aten::mm", [[256, 256], [256, 256]], "c10::BFloat16", 50_000)
        r0.call([("aten::add", {"Input Dims": [[4096, 4096], [4096, 4096]]})],
                [("void at::native::vectorized_elementwise_kernel<4>", 30_000, {})])
    if attention:
        for shape in ATTENTION:
            r0.attention(*shape, *attention_ns(*shape))
    if collectives:
        for trace, tp, pg in ((r0, TP0, "1"), (r8, TP8, "2")):
            for size in (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB):
                trace.collective("all_reduce", tp, pg, size, collective_ns("all_reduce", size, tp))
            trace.collective("all_reduce", tp, pg, 4 * MIB, collective_ns("all_reduce", 4 * MIB, tp) + 300_000)
            for size in (2 * MIB, 32 * MIB):  # old-style kernels: the sizes come from record_param_comms
                trace.collective("all_gather", tp, pg, size, collective_ns("all_gather", size, tp), kernel_args=False)
            for size in (8 * MIB, 64 * MIB):  # the DP pair crosses the nodes; its ranks only in pg_config
                trace.collective("reduce_scatter", DP, "3", size, collective_ns("reduce_scatter", size, DP),
                                 ranks_text=False)
            trace.collective("all_reduce", DP, "3", 16 * MIB, collective_ns("all_reduce", 16 * MIB, DP) + 2_000_000,
                             ranks_text=False)  # a late peer: slower than the other call of this size
            trace.collective("all_reduce", DP, "3", 16 * MIB, collective_ns("all_reduce", 16 * MIB, DP),
                             ranks_text=False)
    r0.write(folder / "rank0.pt.trace.json", {"1": TP0, "3": DP})
    r8.write(folder / "rank8.pt.trace.json.gz", {"2": TP8, "3": DP})
    return folder


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Calibration:
    folder = write_run(tmp_path_factory.mktemp("run") / "profile")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)  # everything is fitted: no warning
        return calibrate(folder, H100)


# ------------------------------------------------------------------------------------------------ tests

TRUE = {Target.MATMUL_BF16: GEMM_F, Target.MATMUL_FP8: FP8_F, Target.ATTENTION: ATTN_F,
        Target.INTRA_BANDWIDTH: INTRA_GBPS, Target.INTRA_LATENCY: INTRA_ALPHA_US,
        Target.INTER_BANDWIDTH: INTER_GBPS, Target.INTER_LATENCY: INTER_ALPHA_US}


@pytest.mark.parametrize("target", list(Target), ids=lambda t: t.value)
def test_the_known_rates_come_back(full, target):
    fit = full.fit(target)
    assert fit is not None, full.summary()
    assert fit.value == pytest.approx(TRUE[target], rel=REL)
    assert fit.catalog == getattr(getattr(H100, target.part), target.field)
    assert getattr(getattr(full.cluster, target.part), target.field) == fit.value


def test_sample_counts_leave_out_the_decoys(full):
    # 6 bf16 GEMMs on rank 0 + the fp16 one on rank 8 (linked by External id: it has no launch row); the
    # float32, M=8 and 256^3 GEMMs are left out. Attention: 2 forward + 2 backward ops. Collectives: the
    # calls of both ranks, the late duplicates counted as calls but never as the time of their size.
    assert full.fit(Target.MATMUL_BF16).samples == len(GEMMS) + 2
    assert full.fit(Target.MATMUL_FP8).samples == 1
    assert full.fit(Target.ATTENTION).samples == 2 * len(ATTENTION)
    assert full.fit(Target.INTRA_BANDWIDTH).samples == 2 * (4 + 1 + 2)
    assert full.fit(Target.INTER_BANDWIDTH).samples == 2 * (2 + 2)
    assert full.unfitted == ()
    assert full.devices == ("NVIDIA H100 80GB HBM3",)


def test_per_group_numbers_in_nccls_convention(full):
    by_key = {(c.kind, c.ranks): c for c in full.collectives}
    tp_ar = by_key["all_reduce", tuple(TP0)]
    assert not tp_ar.crosses_nodes and tp_ar.sizes == 4 and tp_ar.calls == 5
    assert tp_ar.fit_gbps == pytest.approx(INTRA_GBPS, rel=REL)
    # The free intercept of a ring all-reduce over 8 ranks: alpha0 + 2(N-1) alpha.
    assert tp_ar.fit_latency_us == pytest.approx(NCCL_BASE_LATENCY_S * 1e6 + 14 * INTRA_ALPHA_US, rel=REL)
    best = max(2 * 7 / 8 * s / (collective_ns("all_reduce", s, TP0) * 1e-9) for s in (MIB, 4 * MIB, 16 * MIB,
                                                                                        64 * MIB))
    assert tp_ar.busbw_gbps == pytest.approx(best / 1e9, rel=REL)  # nccl-tests: bus bytes / time
    dp_rs = by_key["reduce_scatter", tuple(DP)]
    assert dp_rs.crosses_nodes and dp_rs.ranks_per_node == 1 and dp_rs.calls == 4
    assert by_key["all_reduce", tuple(DP)].sizes == 1 and by_key["all_reduce", tuple(DP)].fit_gbps is None


def test_predict_on_the_calibrated_cluster_is_predict_on_the_true_rates(full):
    model = packaged("llama3-8b")
    layout = PlanLayout(tp=8, dp=2, zero_stage=1, micro_batches=4, micro_batch_size=1)  # ZeRO pair across nodes
    calibrated = predict(model, layout, full.cluster, seq_len=4096)
    truth = predict(model, layout, TRUE_CLUSTER, seq_len=4096)
    catalog = predict(model, layout, H100, seq_len=4096)
    assert calibrated.step_s == pytest.approx(truth.step_s, rel=REL)
    for label, seconds in truth.time_s.items():
        assert calibrated.time_s[label] == pytest.approx(seconds, rel=REL, abs=1e-12), label
    assert calibrated.time_s["compute"] > catalog.time_s["compute"]  # 0.61 < the catalog's 0.706
    assert calibrated.step_s != pytest.approx(catalog.step_s, rel=1e-3)


def test_the_calibrated_gemm_rate_reproduces_the_measured_gemm_time(full):
    """The fraction's definition: summed over the used GEMMs, catalog.gemm_s at the fitted fraction is their
    measured time."""
    shapes = [s for _, _, s in GEMMS] + [(8192, 8192, 8192, 1)]
    priced = sum(hw.gemm_s(full.cluster.gpu, m, n, k, dtype="bf16", batch=b) for m, n, k, b in shapes)
    measured = sum(gemm_ns(*s) for s in shapes) * 1e-9
    assert priced == pytest.approx(measured, rel=REL)


def test_override_yaml_round_trips_through_load_catalog(full, tmp_path):
    path = tmp_path / "calibrated.yaml"
    path.write_text(full.to_yaml())
    merged = load_catalog(path)
    rebuilt = merged.cluster("dgx-h100")  # the packaged node type, its GPU and links now the calibrated ones
    assert dataclasses.replace(rebuilt, name=full.cluster.name) == full.cluster
    assert set(full.to_dict()) == {"gpus", "links"}
    assert set(full.to_dict()["links"]) == {"nvlink4", "ib-ndr"}
    assert full.to_yaml().startswith("# shardline calibration of cluster 'dgx-h100'")


def test_a_single_trace_file_and_a_loaded_trace_set(tmp_path):
    from shardline.profiling import load

    folder = write_run(tmp_path / "run", collectives=False)
    with pytest.warns(CalibrationWarning):
        one = calibrate(folder / "rank0.pt.trace.json", H100)
    assert one.fit(Target.MATMUL_BF16).value == pytest.approx(GEMM_F, rel=REL)
    with pytest.warns(CalibrationWarning):
        again = calibrate(load(folder), H100)
    assert again.fit(Target.MATMUL_BF16).samples == len(GEMMS) + 2


def test_partial_calibration_warns_and_keeps_the_catalog(tmp_path):
    folder = write_run(tmp_path / "run", attention=False, collectives=False, fp8=False)
    with pytest.warns(CalibrationWarning, match="fitted 1 of 7") as record:
        cal = calibrate(folder, H100)
    message = str(record[0].message)
    for target in ("gpu.attention_fraction", "gpu.matmul_fraction_fp8", "intra_node.collective_gbps",
                   "inter_node.latency_us"):
        assert target in message
    assert "no fused attention" in message and "no collective with a known size" in message
    assert cal.fit(Target.MATMUL_BF16).value == pytest.approx(GEMM_F, rel=REL)
    assert cal.cluster.intra_node == H100.intra_node and cal.cluster.inter_node == H100.inter_node
    assert cal.cluster.gpu.attention_fraction == H100.gpu.attention_fraction
    assert {u.target for u in cal.unfitted} == set(Target) - {Target.MATMUL_BF16}
    assert cal.to_dict() == {"gpus": {"h100-sxm": {"matmul_fraction_bf16": cal.fit(Target.MATMUL_BF16).value}}}


def test_attention_mask_from_the_argument_when_the_trace_does_not_say(tmp_path):
    trace = KinetoTrace(0)
    trace.attention(2, 32, 4096, 128, *attention_ns(2, 32, 4096, 128), causal=None)
    path = trace.write(tmp_path / "rank0.json", {})
    with pytest.raises(PlanError, match="is_causal not recorded"):
        calibrate(path, H100)
    with pytest.warns(CalibrationWarning):
        cal = calibrate(path, H100, causal=True)
    assert cal.fit(Target.ATTENTION).value == pytest.approx(ATTN_F, rel=REL)
    with pytest.warns(CalibrationWarning):
        full_mask = calibrate(path, H100, causal=False)  # twice the FLOPs in the same time
    assert full_mask.fit(Target.ATTENTION).value == pytest.approx(2 * ATTN_F, rel=REL)


def test_one_message_size_fits_the_bandwidth_at_the_catalogs_latency(tmp_path):
    """One size cannot separate latency from bandwidth: the catalog's per-step latency is kept, B fitted alone."""
    at_catalog_latency = dataclasses.replace(TRUE_CLUSTER, intra_node=dataclasses.replace(
        TRUE_CLUSTER.intra_node, latency_us=H100.intra_node.latency_us))
    link = hw.group_link(at_catalog_latency, size=8, stride=1)
    trace = KinetoTrace(0)
    for extra in (0, 150_000, 40_000):  # the fastest of three calls is the transfer
        trace.collective("all_reduce", TP0, "1", 64 * MIB, round(1e9 * hw.ring_all_reduce_s(64 * MIB, 8, link)) + extra)
    path = trace.write(tmp_path / "rank0.json", {"1": TP0})
    with pytest.warns(CalibrationWarning, match="latency not separable"):
        cal = calibrate(path, H100)
    assert cal.fit(Target.INTRA_BANDWIDTH).value == pytest.approx(INTRA_GBPS, rel=REL)
    assert cal.fit(Target.INTRA_BANDWIDTH).samples == 3
    assert cal.fit(Target.INTRA_LATENCY) is None and cal.cluster.intra_node.latency_us == H100.intra_node.latency_us


def test_missing_profile_is_a_plan_error(tmp_path):
    with pytest.raises(PlanError, match="no such file or folder") as info:
        calibrate(tmp_path / "nowhere", H100)
    assert "nowhere" in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlanError, match="empty"):
        calibrate(tmp_path / "empty", H100)


def test_a_trace_without_kernels_is_a_plan_error(tmp_path):
    trace = KinetoTrace(0)
    trace._x("cpu_op", "aten::mm", 1_000_000, 50_000, {"External id": 5, "Input Dims": [[64, 64], [64, 64]],
                                                       "Input type": ["float", "float"]})
    path = trace.write(tmp_path / "cpu_rank0.json", {})
    with pytest.raises(PlanError, match="no GPU kernel") as info:
        calibrate(path, H100)
    assert "cpu_rank0.json" in str(info.value)


def test_a_trace_with_nothing_usable_names_the_file_and_what_is_missing(tmp_path):
    trace = KinetoTrace(0)
    trace.gemm("aten::mm", [[4096, 4096], [4096, 4096]], "float", 900_000)  # float32: no catalog peak
    trace.call([("aten::mm", {})], [("ampere_sgemm_128x64_nn", 10_000, {})])  # no shapes recorded
    path = trace.write(tmp_path / "fp32_rank0.json", {})
    with pytest.raises(PlanError) as info:
        calibrate(path, H100)
    text = str(info.value)
    assert "fp32_rank0.json" in text and "nothing to calibrate" in text
    assert "in fp32 (no catalog peak)" in text and "with no shapes" in text
    assert "no fused attention" in text and "no collective with a known size" in text


def test_bad_arguments_are_plan_errors(tmp_path):
    folder = write_run(tmp_path / "run", attention=False, collectives=False)
    with pytest.raises(PlanError, match="must be a Cluster"):
        calibrate(folder, "dgx-h100")
    with pytest.raises(PlanError, match="min_gemm_flops"):
        calibrate(folder, H100, min_gemm_flops=-1)


def test_a_faster_than_peak_fit_is_refused_not_applied(tmp_path):
    """Traces of an H100 run calibrated against an A100 cluster: the GEMMs beat the A100's peak."""
    folder = write_run(tmp_path / "run", attention=False, fp8=False)
    with pytest.warns(CalibrationWarning, match="the traces ran on NVIDIA H100") as record:
        cal = calibrate(folder, CATALOG.cluster("dgx-a100-80gb"))
    assert re.search(r"gpu.matmul_fraction_bf16 \(the fit gives 1.9\d+, outside \(0, 1\]", str(record[0].message))
    assert cal.fit(Target.MATMUL_BF16) is None and cal.fit(Target.INTRA_BANDWIDTH) is not None
    assert cal.cluster.gpu == CATALOG.cluster("dgx-a100-80gb").gpu
    only_gemms = write_run(tmp_path / "gemms", attention=False, collectives=False, fp8=False)
    with pytest.raises(PlanError, match=r"outside \(0, 1\]"):
        calibrate(only_gemms, CATALOG.cluster("dgx-a100-80gb"))


# ------------------------------------------------------------------------------------------ real traces


def _plausible(cal: Calibration) -> None:
    for fit in cal.fits:
        assert fit.samples > 0 and fit.detail
        if "fraction" in fit.target.field:
            assert 0 < fit.value <= 1, fit
        elif fit.target.field == "collective_gbps":
            link = getattr(cal.base, fit.target.part)
            assert 0 < fit.value <= 2 * link.gbps, fit  # no faster than twice the wire (in-switch reduction)
        else:
            assert fit.value > 0, fit
    assert all(u.reason for u in cal.unfitted)


def test_real_b200_inference_trace(traces_dir):
    with pytest.warns(CalibrationWarning):
        cal = calibrate(traces_dir / "tracelens/b200/eager_trace.json.gz", CATALOG.cluster("dgx-b200"))
    _plausible(cal)
    gemm = cal.fit(Target.MATMUL_BF16)
    assert gemm is not None and gemm.samples > 10  # vLLM's bf16 addmm [888, 2880] x [2880, 640]
    assert cal.devices == ("NVIDIA B200",)
    # Its one all-gather (LL protocol, 402 KB in 22 us) is faster than the catalog's Simple-protocol latency.
    assert cal.fit(Target.INTRA_BANDWIDTH) is None
    assert [c.kind for c in cal.collectives] == ["all_gather"] and cal.collectives[0].sizes == 1


def test_real_a100_all_reduce_trace(traces_dir):
    with pytest.warns(CalibrationWarning, match="no GEMM kernel with known shapes"):
        cal = calibrate(traces_dir / "hta/nccl_parser_config/nccl_data.json.gz", CATALOG.cluster("dgx-a100-40gb"))
    _plausible(cal)
    assert cal.fit(Target.INTRA_BANDWIDTH) is not None  # 15 DDP all-reduces of 5 sizes over ranks [0, 1]
    assert cal.fit(Target.INTER_BANDWIDTH) is None
    # Its 5 sizes fit a per-step latency of ~0.9 ms: waiting for the peer, refused; the catalog's is kept.
    assert any("waiting for peers" in u.reason for u in cal.unfitted if u.target is Target.INTRA_LATENCY)
    predict(packaged("gpt2-125m"), PlanLayout(tp=2), cal.cluster, seq_len=1024)  # the cluster prices


def test_every_real_kineto_trace_calibrates_or_says_why(traces_dir):
    """Across the corpus: a plausible calibration or a PlanError, never another exception."""
    paths = sorted(p for p in traces_dir.rglob("*") if p.name.endswith((".json", ".json.gz"))
                   and "flight_recorder" not in p.parts)
    outcomes = {}
    for path in paths:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cal = calibrate(path, CATALOG.cluster("dgx-a100-80gb"))
        except PlanError as error:
            assert str(path) in str(error) or path.name in str(error)
            outcomes[path.name] = "refused"
            continue
        _plausible(cal)
        outcomes[path.name] = "calibrated"
    assert "calibrated" in outcomes.values() and "refused" in outcomes.values()
