"""Communication coverage as a contract: every library's real kernel names carry their real category, kernels
launched inside a communication op inherit its collective, and what no rule knows is reported in every format.

Each name below is a real kernel name (or its generator's output), with the public repository and file it comes
from: the classifier must hold on them as written.
"""

from __future__ import annotations

import gzip
import html
import json

import pandas as pd
import pytest

from shardline.profiling.base.schema import conform
from shardline.profiling.present.cli import main
from shardline.profiling.table.names import DEFAULT_RULES, name_categories, name_category

# (name, category, source)
NAMES = [
    # NCCL >= 2.27 symmetric kernels: NVIDIA/nccl src/device/symmetric/generate.py, kernel_cname():
    # "ncclSymkDevKernel_" + coll + algo (+ red + ty), and the "_profile" twin.
    ("ncclSymkDevKernel_AllReduce_RSxLDMC_AGxSTMC_sum_bf16(ncclSymkDevWorkArgs4K)", "all_reduce", "NVIDIA/nccl"),
    ("ncclSymkDevKernel_AllReduce_AGxLL_R_sum_f32_profile", "all_reduce", "NVIDIA/nccl generate.py"),
    ("ncclSymkDevKernel_AllGather_STMC", "all_gather", "NVIDIA/nccl generate.py"),
    ("ncclSymkDevKernel_ReduceScatter_LL_sum_bf16", "reduce_scatter",
     "NVIDIA/nccl gensrc symmetric/reduce_scatter_sum_bf16.cu"),
    # RCCL's port of the same generator (ROCm/rccl src/device/symmetric/generate.py)
    ("ncclSymkDevKernel_ReduceScatter_RailA2A_LsaLD_sum_bf16", "reduce_scatter", "ROCm/rccl"),
    # Lower-case NCCL device kernels, as some profilers print them
    ("nccldevkernel_allreduce_sum_f32_ring_ll", "all_reduce", "NCCL kernel name lower-cased"),
    ("nccldevkernel_sendrecv", "other_comm", "NCCL kernel name lower-cased"),
    # RCCL generic kernel: ROCm/rccl src/device/generate.py emits
    # "template <int UNROLL, bool COLLTRACE> __global__ void rcclGenericKernel(ncclDevKernelArgs4K const args4K)"
    ("void rcclGenericKernel<1, false>(ncclDevKernelArgsStorage<4096ul>)", "other_comm", "ROCm/rccl generate.py"),
    # MSCCL: ROCm/rccl src/device/msccl_kernel_impl.h / microsoft/msccl: MSCCL_KERNEL_ENTRY_NAME(devredop, type,
    # proto[, fullOps]) = mscclKernel_##devredop##_##type##_##proto##_##fullOps
    ("mscclKernel_Sum_bf16_LL128_fullOps(ncclDevComm*, mscclAlgo*, mscclWork*)", "other_comm", "ROCm/rccl msccl"),
    ("mscclKernel_Sum_float_Simple", "other_comm", "microsoft/msccl msccl_kernel.h"),
    # FlashInfer: flashinfer-ai/flashinfer include/flashinfer/comm/trtllm_allreduce_fusion.cuh
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<(flashinfer::"
     "trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, false, false>(flashinfer::"
     "trtllm_allreduce_fusion::AllReduceFusionParams<__nv_bfloat16>)", "all_reduce", "flashinfer-ai/flashinfer"),
    ("allreduce_fusion_kernel_twoshot_sync", "all_reduce", "flashinfer-ai/flashinfer trtllm_allreduce_fusion.cuh"),
    ("allreduce_fusion_kernel_twoshot_direct", "all_reduce", "flashinfer-ai/flashinfer trtllm_allreduce_fusion.cuh"),
    # TensorRT-LLM: NVIDIA/TensorRT-LLM cpp/tensorrt_llm/kernels/communicationKernels/allReduceFusionKernels.cu
    # and moeAllReduceFusionKernels.cu (moefinalize_allreduce_fusion_kernel_oneshot_lamport)
    ("void tensorrt_llm::kernels::ar_fusion::allreduce_fusion_kernel_oneshot_lamport<(tensorrt_llm::kernels::"
     "ar_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, true, false>", "all_reduce", "NVIDIA/TensorRT-LLM"),
    ("moefinalize_allreduce_fusion_kernel_oneshot_lamport", "all_reduce", "NVIDIA/TensorRT-LLM"),
    ("oneshotAllreduceFusionKernel", "all_reduce", "NVIDIA/TensorRT-LLM mnnvlAllreduceKernels.cu"),
    # AMD AITER's fused all-reduce (ROCm/aiter, "allreduce_fusion_kernel_1stage")
    ("allreduce_fusion_kernel_1stage", "all_reduce", "ROCm/aiter"),
    # DeepEP, namespace deep_ep: deepseek-ai/DeepEP csrc/kernels/intranode.cu, internode.cu, internode_ll.cu
    ("void deep_ep::intranode::dispatch<8, 768>(void*)", "all_to_all", "deepseek-ai/DeepEP intranode.cu"),
    ("void deep_ep::intranode::combine<__nv_bfloat16, 8, 768>(...)", "all_to_all", "deepseek-ai/DeepEP"),
    ("void deep_ep::intranode::notify_dispatch<8>(int const*, int*, int, int const*, int*, int, int, int)",
     "all_to_all", "deepseek-ai/DeepEP intranode.cu"),
    ("void deep_ep::intranode::cached_notify_dispatch<8>(void**, int**, int, int, int)", "all_to_all",
     "deepseek-ai/DeepEP intranode.cu"),
    ("void deep_ep::internode::cached_notify<true>(int, int, int, int, int, int, int*, int*)", "all_to_all",
     "deepseek-ai/DeepEP internode.cu"),
    ("void deep_ep::internode_ll::dispatch<true, 8, 3, 7168>(void*)", "all_to_all", "deepseek-ai/DeepEP"),
    # DeepEP under DeepSeek's own namespace: deepseek-ai/profile-data train.json / prefill.json
    ("void dpsk::ep::internode::dispatch<false, 8, true, 8>(...)", "all_to_all", "deepseek-ai/profile-data"),
    ("void dpsk::ep::internode::combine<__nv_bfloat16, 8, true, 8>(...)", "all_to_all", "deepseek-ai/profile-data"),
    ("void dpsk::ep::internode::notify_dispatch<false, 4>(int const*, long*, int, int const*, int*)", "all_to_all",
     "deepseek-ai/profile-data"),
    ("void dpsk::ep::internode::cached_notify<false>(int, int, int, int, int, int, int*)", "all_to_all",
     "deepseek-ai/profile-data"),
    # Local DeepEP work (token layout; a CUB scan in a look-alike namespace) stays compute
    ("void dpsk::ep::cuda::get_dispatch_layout<256, 32, 8>(long const*, int*)", "compute",
     "deepseek-ai/profile-data"),
    ("void deep_ep::layout::get_dispatch_layout<256, 32, 8>(long const*, int*)", "compute",
     "deepseek-ai/DeepEP layout.cu"),
    ("void cdpsk::ep::CUB_200200_900_NS::DeviceScanKernel<int>()", "compute", "deepseek-ai/profile-data"),
    # PyTorch symmetric memory: pytorch/pytorch torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu
    ("void c10d::symmetric_memory::multimem_all_reduce_kernel<c10::BFloat16, 16>(...)", "all_reduce",
     "pytorch/pytorch CUDASymmetricMemoryOps.cu"),
    ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<float, 16>(...)", "all_reduce", "pytorch/pytorch"),
    ("void c10d::symmetric_memory::two_shot_all_reduce_kernel<c10::BFloat16, 16, 8>(...)", "all_reduce",
     "pytorch/pytorch"),
    ("void c10d::symmetric_memory::multimem_all_gather_kernel<16>(...)", "all_gather", "pytorch/pytorch"),
    # Triton-distributed symmetric-memory all-reduce: ByteDance-Seed/Triton-distributed
    # python/triton_dist/kernels/nvidia/allreduce.py
    ("allreduce_two_shot_multimem_st_intra_node_kernel", "all_reduce", "ByteDance-Seed/Triton-distributed"),
    ("allreduce_one_shot_push_intra_node_kernel", "all_reduce", "ByteDance-Seed/Triton-distributed"),
    ("allreduce_double_tree_intra_node_kernel", "all_reduce", "ByteDance-Seed/Triton-distributed"),
    # Ascend HCCL task names in torch_npu / msprof traces ("hcom_allReduce__428_0_1": msprof's COMMUNICATION_OP
    # table; hcom_allGather_, hcom_reduceScatter_, hcom_alltoallv_ kernel CSVs of Ascend tools)
    ("hcom_allReduce__503_0_1", "all_reduce", "Ascend msprof COMMUNICATION_OP"),
    ("hcom_allGather__123_1_1", "all_gather", "Ascend msprof"),
    ("hcom_reduceScatter__9_0_1", "reduce_scatter", "Ascend msprof"),
    ("hcom_alltoallv__77_0_1", "all_to_all", "Ascend msprof"),
    ("hcom_broadcast__1_0_1", "broadcast", "Ascend msprof"),
    ("hcom_send__5_0_1", "p2p_send", "Ascend msprof"),
    ("hcom_receive__6_0_1", "p2p_recv", "Ascend msprof"),
    # NVSHMEM on-stream collectives: NVIDIA/nvshmem src/include/non_abi/device/coll/*.cuh and
    # src/host/coll/*/: alltoall_on_stream_kernel<T>, fcollect_on_stream_kernel<T>,
    # broadcast_on_stream_kernel<T>, rdxn_on_stream_kernel<T, OP>, reducescatter_on_stream_kernel<T, OP>,
    # barrier_on_stream_kernel_threadgroup, sync_all_on_stream_kernel_block
    ("void alltoall_on_stream_kernel<float>(int, float*, float const*, unsigned long)", "all_to_all",
     "NVIDIA/nvshmem alltoall.cuh"),
    ("void fcollect_on_stream_kernel<__nv_bfloat16>(int, __nv_bfloat16*, __nv_bfloat16 const*, unsigned long)",
     "all_gather", "NVIDIA/nvshmem fcollect.cuh"),
    ("void broadcast_on_stream_kernel<int>(int, int*, int const*, unsigned long, int)", "broadcast",
     "NVIDIA/nvshmem broadcast.cuh"),
    ("void rdxn_on_stream_kernel<float, (rdxn_ops)0>(int, float*, float const*, unsigned long)", "all_reduce",
     "NVIDIA/nvshmem reduce.cuh"),
    ("void reducescatter_on_stream_kernel<float, (rdxn_ops)0>(int, float*, float const*, unsigned long)",
     "reduce_scatter", "NVIDIA/nvshmem reducescatter.cuh"),
    ("void barrier_on_stream_kernel_threadgroup<(threadgroup_t)4>(int)", "barrier", "NVIDIA/nvshmem barrier.cuh"),
    ("sync_all_on_stream_kernel_block", "barrier", "NVIDIA/nvshmem barrier.cuh"),
    ("void alltoall32_on_stream_kernel(int, void*, void const*, unsigned long)", "all_to_all",
     "NVIDIA/nvshmem (older ALLTOALL_ON_STREAM_KERNEL(BITS))"),
    # ROCm 7 copies: ROCm/clr rocclr/device/blitcl.cpp (the blit kernels), ROCm/rocprofiler-sdk
    # source/include/rocprofiler-sdk/fwd.h (rocprofiler_memory_copy_operation_t)
    ("__amd_rocclr_copyBuffer", "memcpy_d2d", "ROCm/clr blitcl.cpp"),
    ("__amd_rocclr_copyBufferAligned", "memcpy_d2d", "ROCm/clr blitcl.cpp"),
    ("__amd_rocclr_fillBufferAligned", "memset", "ROCm/clr blitcl.cpp"),
    ("MEMORY_COPY_HOST_TO_DEVICE", "memcpy_h2d", "ROCm/rocprofiler-sdk fwd.h"),
    ("MEMORY_COPY_DEVICE_TO_HOST", "memcpy_d2h", "ROCm/rocprofiler-sdk fwd.h"),
    ("MEMORY_COPY_DEVICE_TO_DEVICE", "memcpy_d2d", "ROCm/rocprofiler-sdk fwd.h"),
]


@pytest.mark.parametrize("name, category, source", NAMES, ids=[f"{c}:{n[:40]}" for n, c, _ in NAMES])
def test_real_library_kernel_names_carry_their_category(name, category, source):
    assert name_category(name)[0] == category, source
    assert name_categories([name]) == [name_category(name)]  # the batched prefilter agrees


def _kernel(name, *, corr=-1, ext=-1, start=1_000, cat="kernel", **kw):
    return dict(rank=0, lane="gpu", stream=20, name=name, cat=cat, start_ns=start, dur_ns=50,
                correlation=corr, external_id=ext, **kw)


def _cpu(name, start, dur, *, cat="cpu_op", stream=1, corr=-1, ext=-1, **kw):
    return dict(rank=0, lane="cpu", stream=stream, name=name, cat=cat, start_ns=start, dur_ns=dur,
                correlation=corr, external_id=ext, **kw)


def _classify(rows, **kw):
    from shardline.profiling.table.classify import classify_events

    return classify_events(conform(pd.DataFrame(rows)), **kw)


def test_a_kernel_with_a_comm_word_inherits_the_collective_of_the_op_that_launched_it():
    unknown = "void my_lib::fused_allgather_gemm_kernel<bf16>()"  # communication word, no rule
    plain = "void at::native::vectorized_elementwise_kernel<4>()"
    rows = [_cpu("nccl:_all_gather_base", 100, 60, cat="user_annotation", pg_desc="mesh_tp"),
            _cpu("cudaLaunchKernel", 110, 5, cat="cuda_runtime", corr=3), _kernel(unknown, corr=3),
            _cpu("cudaLaunchKernel", 120, 5, cat="cuda_runtime", corr=4), _kernel(plain, corr=4, start=1_100),
            # the same name launched outside any communication op stays compute
            _cpu("cudaLaunchKernel", 300, 5, cat="cuda_runtime", corr=5), _kernel(unknown, corr=5, start=2_000)]
    out = _classify(rows)
    assert out["category"].tolist() == ["all_gather", "compute", "all_gather", "compute", "compute", "compute",
                                        "compute"]
    assert out["pg_desc"].tolist()[2] == "mesh_tp" and out["dim"].tolist()[2] == "tp"  # group args follow


def test_copy_engine_collectives_are_the_nccl_op_and_other_copies_stay_copies():
    # NCCL >= 2.28 runs some collectives on the copy engines: memcpy launched inside the nccl:* op.
    rows = [_cpu("nccl:all_gather", 100, 60, cat="user_annotation"),
            _cpu("cudaMemcpyAsync", 110, 5, cat="cuda_runtime", corr=7),
            _kernel("Memcpy PtoP (Device -> Device)", corr=7, cat="gpu_memcpy"),
            # a copy under a c10d op that is not the NCCL call itself (flattening) stays a copy
            _cpu("c10d::allgather_", 400, 100), _cpu("cudaMemcpyAsync", 410, 5, cat="cuda_runtime", corr=8),
            _kernel("Memcpy DtoD (Device -> Device)", corr=8, cat="gpu_memcpy", start=3_000),
            # and a host-to-device copy is never a collective
            _cpu("nccl:all_reduce", 600, 60, cat="user_annotation"),
            _cpu("cudaMemcpyAsync", 610, 5, cat="cuda_runtime", corr=9),
            _kernel("Memcpy HtoD (Pinned -> Device)", corr=9, cat="gpu_memcpy", start=4_000)]
    got = _classify(rows)["category"].tolist()
    assert [got[2], got[5], got[8]] == ["all_gather", "memcpy_d2d", "memcpy_h2d"]


def test_generic_library_kernels_take_the_collective_of_their_op():
    rows = [_cpu("record_param_comms", 100, 80, ext=42, collective="all_to_allv"),
            _kernel("void rcclGenericKernel<1, false>(ncclDevKernelArgsStorage<4096ul>)", ext=42, corr=99),
            _cpu("nccl:reduce_scatter", 300, 60, cat="user_annotation"),
            _cpu("hipLaunchKernel", 310, 5, cat="cuda_runtime", corr=5),
            _kernel("mscclKernel_Sum_bf16_LL128_fullOps", corr=5, start=2_000)]
    got = _classify(rows)["category"].tolist()
    assert (got[1], got[4]) == ("all_to_all", "reduce_scatter")


def test_comm_words_are_found_in_any_case_and_at_the_right_name():
    from shardline.profiling.table.names import comm_word_table

    names = ["İstanbul_gemm", "My_AllGather_x", "gemm", "NCCL_thing", "", "x_Recv"]
    assert comm_word_table(names).tolist() == [False, True, False, True, False, True]


def test_default_rules_are_data():
    from shardline.profiling.table.names import CommRule

    assert all(isinstance(r, CommRule) for r in DEFAULT_RULES)
    assert len({r.pattern for r in DEFAULT_RULES}) == len(DEFAULT_RULES)


# --- the diagnostic, in every report format ---------------------------------------------------------------------

MYSTERY = "void mystery::fused_ar_kernel<bf16>()"  # no NCCL name, no rule, no communication word


def _event(name, cat, ts_us, dur_us, *, gpu=False, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0 if gpu else 1000, "tid": 7 if gpu else 1,
            "ts": ts_us, "dur": dur_us, "args": ({"device": 0, "stream": 7} if gpu else {}) | args}


def write_trace(path, *, rank: int | None = 0):
    """A Kineto trace: an all-reduce op that launches only MYSTERY, and an NCCL kernel launched by no op."""
    events = [
        _event("ProfilerStep#1", "user_annotation", 0, 200),
        _event("nccl:all_reduce", "user_annotation", 10, 30),
        _event("cudaLaunchKernel", "cuda_runtime", 12, 2, correlation=1, **{"External id": 1}),
        _event(MYSTERY, "kernel", 40, 10, gpu=True, correlation=1, **{"External id": 1}),
        _event("aten::mm", "cpu_op", 50, 20, **{"External id": 2}),
        _event("cudaLaunchKernel", "cuda_runtime", 52, 2, correlation=2, **{"External id": 2}),
        _event("void gemm_kernel<float>()", "kernel", 60, 40, gpu=True, correlation=2, **{"External id": 2}),
        _event("cudaLaunchKernel", "cuda_runtime", 80, 2, correlation=3, **{"External id": 3}),
        _event("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 110, 30, gpu=True,
               correlation=3, **{"External id": 3}),
    ]
    doc = {"schemaVersion": 1, "traceEvents": events}
    if rank is not None:
        doc["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": 2}
    with gzip.open(path, "wt") as fh:
        json.dump(doc, fh)
    return path


@pytest.fixture
def trace(tmp_path):
    return write_trace(tmp_path / "job.pt.trace.json.gz")


def test_comm_coverage_names_both_findings(trace):
    from shardline.profiling.analyses.coverage import Finding, comm_coverage
    from shardline.profiling.table.load import load

    cov = comm_coverage(load(trace))
    assert cov[["finding", "name", "category", "ranks", "count"]].values.tolist() == [
        [Finding.OP_WITHOUT_KERNEL.value, "nccl:all_reduce", "all_reduce", "0", 1],
        [Finding.KERNEL_WITHOUT_OP.value, "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
         "all_gather", "0", 1]]
    assert cov["launched"].tolist() == [f"{MYSTERY} ×1", ""]  # the name a new rule should match


def test_comm_coverage_is_empty_when_everything_is_covered():
    from shardline.profiling.analyses.coverage import comm_coverage

    rows = [_cpu("nccl:all_reduce", 100, 60, cat="user_annotation"),
            _cpu("cudaLaunchKernel", 110, 5, cat="cuda_runtime", corr=3),
            _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", corr=3),
            _cpu("record_param_comms", 200, 10),  # work.wait(): no GPU work at all, not a finding
            _cpu("cudaStreamWaitEvent", 202, 2, cat="cuda_runtime", corr=4)]
    assert comm_coverage(_classify(rows)).empty


def test_the_diagnostic_is_in_every_report_format(trace, tmp_path, capsys):
    assert main(["profile", "report", str(trace)]) == 0
    text = capsys.readouterr().out
    assert "communication op with no communication kernel: nccl:all_reduce" in text
    assert MYSTERY in text and "communication kernel with no communication op" in text

    for fmt in ("md", "html"):
        out = tmp_path / f"r.{fmt}"
        assert main(["profile", "report", str(trace), "-o", str(out)]) == 0
        doc = out.read_text()
        assert "Communication coverage" in doc and (html.escape(MYSTERY) if fmt == "html" else MYSTERY) in doc
        assert "communication op with no communication kernel" in doc
    assert 'id="comm-coverage-table"' in (tmp_path / "r.html").read_text()

    for fmt in ("csv", "json"):
        assert main(["profile", "report", str(trace), "--format", fmt]) == 0
        err = capsys.readouterr().err
        assert "communication op with no communication kernel" in err and len(err.splitlines()) == 1

    pytest.importorskip("tensorboard")
    logdir = tmp_path / "tb"
    assert main(["profile", "report", str(trace), "--format", "tensorboard", "-o", str(logdir)]) == 0
    blob = b"".join(p.read_bytes() for p in logdir.glob("events.out.tfevents.*"))
    assert b"diagnostics/comm_coverage" in blob and MYSTERY.encode() in blob


def test_a_covered_trace_reports_no_finding(tmp_path, capsys):
    rules = tmp_path / "rules.yaml"
    rules.write_text("- {pattern: 'mystery::fused_ar', category: all_reduce, note: 'our fused AR'}\n")
    trace = write_trace(tmp_path / "t.pt.trace.json.gz")
    assert main(["profile", "report", str(trace), "--rules", str(rules)]) == 0
    text = capsys.readouterr().out
    assert "communication op with no communication kernel" not in text
    assert "communication kernel with no communication op" in text  # the NCCL kernel still has no op
