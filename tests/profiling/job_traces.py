"""Realistic synthetic Kineto trace sets of a whole Megatron-style job (a test and benchmark helper, loaded by path).

``write_job(folder, tp=, pp=, dp=, ...)`` simulates one training job on ``tp * pp * dp`` H100s and writes what
``torch.profiler`` (Kineto) would have written on every rank: ``rank{r}.pt.trace.json(.gz)``, one file per rank,
rank = ``dp_idx * pp * tp + pp_idx * tp + tp_idx`` (TP innermost as in Megatron, but DP outermost: Megatron's
default order ``tp-cp-ep-dp-pp`` puts PP outermost, so a layout-derived dim of these groups is not Megatron's). It
returns the ground truth of the timeline it laid out (``write_job``'s docstring lists it), derived from the
simulation, never from the profiler.

The job (per rank, per step):

- host: a ``ProfilerStep#N`` span (``user_annotation``) on the main thread from one ``prof.step()`` to the next;
  forward ops on the main thread, backward ops on the autograd thread (``autograd::engine::evaluate_function:
  ...Backward`` > ``...Backward`` > ``aten::mm``); every kernel launched by a ``cudaLaunchKernel`` row (``cbid``,
  ``correlation``, the innermost op's ``External id``) with its ``ac2g`` flow pair; the host runs ahead of the
  GPU except where it syncs (after each pipeline receive, Megatron's ``batch_p2p_sync``; ``.item()`` of the grad
  norm and of the loss);
- GPU: ``kernel`` rows on ``pid`` = device, ``tid`` = stream with ``device``/``stream``/``correlation``/``External
  id`` args, a kernel starting no earlier than its launch + latency, its stream's previous kernel and, for NCCL
  kernels, the compute stream's pending work (c10d's stream sync); a GPU ``ProfilerStep#N``
  (``gpu_user_annotation``) spanning the work each CPU step launched, and a ``gpu_user_annotation`` named like
  the ``nccl:*`` op over each NCCL kernel (as Kineto writes them);
- per micro-batch, a 1F1B schedule (Megatron's warm-up / steady / cool-down) of transformer layers: forward
  layer norm, QKV GEMM, flash attention, projection GEMM, TP all-reduce, residual add, layer norm, FC1, GeLU,
  FC2, TP all-reduce, add; backward the dgrad/wgrad GEMMs (the column-parallel input-gradient all-reduces
  overlap the wgrad GEMM, as Megatron's async all-reduce does), flash-attention backward, layer-norm and GeLU
  backward. The first stage adds the data (dataloader ``__next__`` span and the pinned H2D copy on TP rank 0,
  the TP broadcast of the batch: ``get_batch_on_this_tp_rank``), the embedding and its TP all-reduce; the last
  stage the data, final layer norm, LM head GEMM and the vocab-parallel cross entropy (three small fp32 TP
  all-reduces);
- TP collectives: ``c10d::allreduce_`` > ``record_param_comms`` > ``nccl:all_reduce`` (``cpu_op``; args
  ``Collective name``, ``Process Group Name``/``Description``/``Ranks``, ``Group size``, ``Seq``, ``In``/``Out
  msg nelems``, ``dtype``), launching ``ncclDevKernel_AllReduce_Sum_bf16_RING_LL(...)`` on the group's stream
  with the same args; every member's kernel ends at the same true time (last arrival + transfer);
- pipeline p2p: ``c10d::send``/``c10d::recv_`` > ``record_param_comms`` > ``nccl:send``/``nccl:recv`` launching
  ``ncclDevKernel_SendRecv(...)`` (args ``Collective name`` send/recv, ``PIPELINE_MODEL_PARALLEL_GROUP`` whose
  ranks are in stage order, ``Dst Rank``/``Src Rank`` the global peer), one stream per direction (receives from
  the previous / next stage on 20 / 22, sends to the next / previous on 21 / 23). A receive starts when posted
  (the stage is free) and ends when the data has landed: ``max(recv start, send start) + bytes / bandwidth``;
  the send kernel spins until then too (``synthetic_traces.spinning_pipeline``'s conventions);
- step end: the gradient reduce-scatter in buckets over ``DATA_PARALLEL_GROUP`` (bf16, parameters / tp / pp),
  the grad-norm all-reduce over ``MODEL_PARALLEL_GROUP`` (``.item()``: a D2H copy and a host sync), the fused
  Adam kernels, the parameter all-gather in buckets over the DP group, the loss ``.item()``.

Clocks: rank r records true time + ``offset[r]`` (a constant, uniform in ``[0, clock_skew_ns]``); kernel
durations carry seeded jitter (``numpy.random.default_rng(seed)``), one rank (the straggler) runs its compute
kernels 15% slower. Files stream out one step at a time (sorted by time per rank, Kineto's metadata rows,
``Trace`` span and instant events at the end, ``baseTimeNanoseconds`` after ``traceEvents`` as current Kineto
writes it), so memory holds one step of events and ``mb_per_rank`` sizes the files by the bytes written.
"""

from __future__ import annotations

import gzip
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

DEVICE_NAME = "NVIDIA H100 80GB HBM3"
GPUS_PER_NODE = 8
#: Model (a ~7B GPT): hidden size, FFN size, sequence length, micro-batch size, padded vocabulary.
HIDDEN, FFN, SEQ, MICRO_BATCH, VOCAB = 4096, 16384, 4096, 1, 50304
#: Effective rates: GEMM flop/ns (650 TFLOP/s), flash attention fwd / bwd flop/ns, HBM bytes/ns.
GEMM_RATE, FLASH_FWD_RATE, FLASH_BWD_RATE, HBM_RATE = 650_000, 450_000, 330_000, 2_800
#: Bus bandwidths (bytes/ns = GB/s): NVLink inside a node, InfiniBand across nodes.
NVLINK_BUS, IB_BUS, NVLINK_P2P, IB_P2P = 360, 42, 450, 45
DP_BUCKET = 40_000_000  # Megatron's gradient bucket (elements)
STRAGGLER_SLOWDOWN = 1.15
FIRST_STEP = 2  # torch.profiler.schedule(wait=1, warmup=1, active=...): the first active step is ProfilerStep#2
BASE_TIME_NS = 1_727_000_000_000_000_000
TRUE_ZERO_NS = 3_000_000_000  # true time 0 is this far after baseTimeNanoseconds

COMPUTE_STREAM, TP_STREAM, DP_STREAM, MP_STREAM = 7, 13, 17, 19
RECV_PREV, SEND_NEXT, RECV_NEXT, SEND_PREV = 20, 21, 22, 23
LAUNCH_LATENCY = 4_000  # ns from a launch call's start to the earliest start of its kernel
CBID_LAUNCH, CBID_MEMCPY, CBID_SYNC = 211, 41, 131

# --- kernel names, as real H100 traces spell them ------------------------------------------------------------

GEMM_TN = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
           "kernel__5x_cublas")
GEMM_NN = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_"
           "kernel__5x_cublas")
GEMM_NT = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_nt_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
           "kernel__5x_cublas")
LN_FWD = ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float, "
          "c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)")
LN_BWD_IN = ("void at::native::(anonymous namespace)::layer_norm_grad_input_kernel_vectorized<c10::BFloat16, float>("
             "c10::BFloat16 const*, c10::BFloat16 const*, float const*, float const*, c10::BFloat16 const*, "
             "c10::BFloat16*, int)")
LN_BWD_W = ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel_32x32<c10::BFloat16, float>(long, "
            "long, c10::BFloat16 const*, c10::BFloat16 const*, float const*, float const*, c10::BFloat16*, "
            "c10::BFloat16*)")
ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
       "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)")
_GELU_LAMBDA = ("at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::"
                "operator()() const::{lambda()#4}::operator()() const::{lambda(c10::BFloat16)#1}")
GELU = (f"void at::native::vectorized_elementwise_kernel<4, {_GELU_LAMBDA}, at::detail::Array<char*, 2> >(int, "
        f"{_GELU_LAMBDA}, at::detail::Array<char*, 2>)")
_GELU_BWD_LAMBDA = ("at::native::GeluBackwardCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::"
                    "{lambda()#2}::operator()() const::{lambda()#4}::operator()() const::"
                    "{lambda(c10::BFloat16, c10::BFloat16)#1}")
GELU_BWD = (f"void at::native::vectorized_elementwise_kernel<4, {_GELU_BWD_LAMBDA}, at::detail::Array<char*, 3> >("
            f"int, {_GELU_BWD_LAMBDA}, at::detail::Array<char*, 3>)")
_FWD_TRAITS = "Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, " \
              "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >"
_BWD_TRAITS = "Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t, " \
              "Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >"
FLASH_FWD = (f"void flash::flash_fwd_kernel<{_FWD_TRAITS}, false, true, false, false, false, true, false, false>("
             "flash::Flash_fwd_params)")
FLASH_BWD_DOT = f"void flash::flash_bwd_dot_do_o_kernel<true, {_BWD_TRAITS} >(flash::Flash_bwd_params)"
FLASH_BWD_MAIN = (f"void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<{_BWD_TRAITS}, false, true, false, "
                  "false, false, false, false>(flash::Flash_bwd_params)")
FLASH_BWD_CONVERT = f"void flash::flash_bwd_convert_dq_kernel<{_BWD_TRAITS} >(flash::Flash_bwd_params, int)"
EMBEDDING = ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, "
             "-2, true>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, at::cuda::detail::TensorInfo<"
             "c10::BFloat16, unsigned int>, at::cuda::detail::TensorInfo<long, unsigned int>, int, int, unsigned int, "
             "unsigned int, long)")
EMBEDDING_BWD = ("void at::native::(anonymous namespace)::embedding_backward_feature_kernel<c10::BFloat16, float, "
                 "long>(long const*, c10::BFloat16 const*, c10::BFloat16*, int, long, int, int)")
_REDUCE = "at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::{}<float> >, unsigned int, " \
          "float, 4>"
REDUCE_MAX = f"void at::native::reduce_kernel<512, 1, {_REDUCE.format('MaxNanFunctor')} >(" \
             f"{_REDUCE.format('MaxNanFunctor')})"
REDUCE_SUM = f"void at::native::reduce_kernel<512, 1, {_REDUCE.format('SumFunctor')} >({_REDUCE.format('SumFunctor')})"
SOFTMAX_ELEMENTWISE = ("void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda("
                       "at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::"
                       "{lambda(float)#1}, at::detail::Array<char*, 2> >(int, at::native::exp_kernel_cuda("
                       "at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::"
                       "{lambda(float)#1}, at::detail::Array<char*, 2>)")
FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>, "
        "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<c10::BFloat16>, at::detail::Array<char*, 1>)")
L2NORM = ("void multi_tensor_apply_kernel<TensorListMetadata<1>, L2NormFunctor<float, 512, 512>, float*, float*, "
          "bool, int>(long, int volatile*, TensorListMetadata<1>, L2NormFunctor<float, 512, 512>, float*, float*, "
          "bool, int)")
ADAM = ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>, float, float, float, float, float, "
        "float, adamMode_t, float>(long, int volatile*, TensorListMetadata<4>, AdamFunctor<float>, float, float, "
        "float, float, float, float, adamMode_t, float)")
NCCL_ARGS = "(ncclDevKernelArgsStorage<4096ul>)"
AR_BF16 = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL" + NCCL_ARGS
AR_F32 = "ncclDevKernel_AllReduce_Sum_f32_RING_LL" + NCCL_ARGS
AR_MAX_F32 = "ncclDevKernel_AllReduce_Max_f32_RING_LL" + NCCL_ARGS
REDUCE_SCATTER = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_SIMPLE" + NCCL_ARGS
ALL_GATHER = "ncclDevKernel_AllGather_RING_SIMPLE" + NCCL_ARGS
BROADCAST = "ncclDevKernel_Broadcast_RING_LL" + NCCL_ARGS
SEND_RECV = "ncclDevKernel_SendRecv" + NCCL_ARGS

_LAUNCH_STATS = {  # kernel -> its launch statistics args (registers, shared memory, grid, block, occupancy)
    "gemm": '"registers per thread": 168, "shared memory": 213248, "blocks per SM": 1, "warps per SM": 12, '
            '"grid": [132, 1, 1], "block": [384, 1, 1], "est. achieved occupancy %": 19',
    "elementwise": '"registers per thread": 28, "shared memory": 0, "blocks per SM": 496.48, "warps per SM": 1985.94, '
                   '"grid": [65536, 1, 1], "block": [128, 1, 1], "est. achieved occupancy %": 100',
    "flash": '"registers per thread": 255, "shared memory": 98304, "blocks per SM": 3.88, "warps per SM": 15.52, '
             '"grid": [32, 16, 1], "block": [128, 1, 1], "est. achieved occupancy %": 6',
    "reduce": '"registers per thread": 32, "shared memory": 16, "blocks per SM": 31.03, "warps per SM": 496.48, '
              '"grid": [4096, 1, 1], "block": [512, 1, 1], "est. achieved occupancy %": 100',
    "nccl": '"registers per thread": 96, "shared memory": 103808, "blocks per SM": 0.12, "warps per SM": 1.94, '
            '"grid": [16, 1, 1], "block": [512, 1, 1], "est. achieved occupancy %": 0',
}


_TORCH_TYPES = {"BFloat16": "c10::BFloat16", "Float": "float", "Long": "long int"}


def _q(text: str) -> str:
    return json.dumps(text)


def _ts(ns: int) -> str:
    """µs text with the ns fraction, exact (Kineto's ``ts``/``dur`` format)."""
    return f"{ns // 1000}.{ns % 1000:03d}"


def rank_of(dp_idx: int, pp_idx: int, tp_idx: int, *, tp: int, pp: int) -> int:
    """TP innermost, then PP, then DP (not Megatron's order, which has DP inside PP)."""
    return dp_idx * pp * tp + pp_idx * tp + tp_idx


# --- model pieces: kernels and their host ops ---------------------------------------------------------------

class _Kernel:
    """One kernel of a program: its op chain (outermost first), name, duration (ns, before jitter), stats."""

    __slots__ = ("chain", "name", "dur", "stats")

    def __init__(self, chain: tuple, name: str, dur: float, stats: str):
        self.chain, self.name, self.dur, self.stats = chain, _q(name), dur, stats


def _op(name: str, args: str = "") -> tuple[str, str, str]:
    """A cpu_op of a chain: (cat, name JSON, extra args text)."""
    return ("cpu_op", _q(name), args)


def _shapes(dims: list, types: list) -> str:
    strides = [[d[-1], 1] if len(d) == 2 else [] for d in dims]
    return (f', "Concrete Inputs": {json.dumps([""] * len(dims))}, "Input type": {json.dumps(types)}, '
            f'"Input Strides": {json.dumps(strides)}, "Input Dims": {json.dumps(dims)}')


def _gemm(m: int, n: int, k: int, name: str, *, forward: bool) -> _Kernel:
    args = _shapes([[m, k], [k, n]], ["c10::BFloat16", "c10::BFloat16"])
    chain = (_op("aten::matmul", args), _op("aten::mm", args)) if forward else (_op("aten::mm", args),)
    return _Kernel(chain, name, 2 * m * n * k / GEMM_RATE, _LAUNCH_STATS["gemm"])


def _elementwise(op: str, name: str, nbytes: float, *, chain: tuple | None = None,
                 stats: str = "elementwise") -> _Kernel:
    """A memory-bound kernel moving ``nbytes`` (launched by ``op``, or by ``chain`` when given)."""
    return _Kernel(chain if chain is not None else (_op(op),), name, 2_500 + nbytes / HBM_RATE,
                   _LAUNCH_STATS[stats])


class _Comm:
    """One collective call kind: c10d op, collective name, nccl op, kernel, dtype, element counts, bytes."""

    __slots__ = ("c10d", "collective", "nccl", "kernel", "dtype", "in_nelems", "out_nelems", "nbytes")

    def __init__(self, c10d: str, collective: str, nccl: str, kernel: str, dtype: str, in_nelems: int,
                 out_nelems: int, *, elem_bytes: int):
        self.c10d, self.collective, self.nccl, self.kernel = _q(c10d), collective, _q(nccl), _q(kernel)
        self.dtype, self.in_nelems, self.out_nelems = dtype, in_nelems, out_nelems
        self.nbytes = max(in_nelems, out_nelems) * elem_bytes


class _Group:
    __slots__ = ("name", "desc", "ranks", "ranks_text", "size", "seq0", "calls")

    def __init__(self, name: str, desc: str, ranks: list[int], seq0: int):
        self.name, self.desc, self.ranks, self.size, self.seq0 = name, desc, list(ranks), len(ranks), seq0
        self.ranks_text = str(list(ranks))
        self.calls: dict[str, int] = {}  # collective name -> calls per member


# --- one rank's recorder -------------------------------------------------------------------------------------

class _Rank:
    """A rank's clocks (host cursor, stream frees: true ns), id counters, open ops and the current step's events."""

    def __init__(self, job: _Job, rank: int, path: Path, offset: int, slow: float):
        self.job, self.rank, self.path, self.offset, self.slow = job, rank, path, offset, slow
        self.device = rank % GPUS_PER_NODE
        self.pid = 2_000_000 + 1_000 * (rank // GPUS_PER_NODE) + 37 * self.device + 11
        self.tid_main, self.tid_bwd = self.pid, self.pid + 233
        self.shift = offset + TRUE_ZERO_NS  # true ns -> ns after baseTimeNanoseconds
        self.host = 0
        self.gpu = 0  # compute stream free
        self.streams: dict[int, int] = {}
        self.pending = 0  # end of an async all-reduce the compute stream waits for at the next "wait"
        self.ext = self.corr = self.ev = 0
        self.stack: list = []
        self.events: list = []
        self.n = 0
        self.gpu_lo = self.gpu_hi = None
        self.seq: dict[str, int] = {}
        self.fh = None
        self.bytes = self.count = self.kernels = self.flows = 0
        self.pending_write = None
        self.first = True
        self.window = [None, None]  # recorded span of the whole trace (true ns)

    # -- host ------------------------------------------------------------------------------------------------
    def open(self, cat: str, name: str, args: str, tid: int) -> int:
        job = self.job
        self.host += job.ns(600, 1_500)
        self.ext += 1
        self.stack.append((self.host, self.n, cat, name, self.ext, args, tid, self.ev))
        self.ev += 1
        self.n += 1
        return self.ext

    def close(self) -> None:
        start, n, cat, name, ext, args, tid, ev = self.stack.pop()
        self.host += self.job.ns(300, 900)
        self.emit(start, n, f'  {{\n    "ph": "X", "cat": "{cat}", "name": {name}, "pid": {self.pid}, "tid": {tid},\n'
                            f'    "ts": {_ts(start + self.shift)}, "dur": {_ts(self.host - start)},\n    "args": {{\n'
                            f'      "External id": {ext}, "Record function id": 0{args}, "Ev Idx": {ev}\n    }}\n  }}')

    def runtime(self, name: str, cbid: int, tid: int, dur=None) -> tuple[int, int, int]:
        """A CUDA runtime call at the host cursor: (its start, correlation id, External id). ``dur``: its
        duration (ns), or a function of its start giving it (a call that blocks), default a few µs."""
        self.host += self.job.ns(500, 1_500)
        start = self.host
        self.host += self.job.ns(2_500, 5_000) if dur is None else dur(start) if callable(dur) else dur
        self.corr += 1
        ext = self.stack[-1][4] if self.stack else 0
        n = self.n
        self.n += 2
        self.emit(start, n, f'  {{\n    "ph": "X", "cat": "cuda_runtime", "name": "{name}", "pid": {self.pid}, '
                            f'"tid": {tid},\n    "ts": {_ts(start + self.shift)}, "dur": {_ts(self.host - start)},\n'
                            f'    "args": {{\n      "External id": {ext}, "cbid": {cbid}, "correlation": {self.corr}'
                            f'\n    }}\n  }}')
        self.flows += 1
        self.emit(start, n + 1, f'  {{\n    "ph": "s", "id": {self.corr}, "pid": {self.pid}, "tid": {tid}, '
                                f'"ts": {_ts(start + self.shift)},\n    "cat": "ac2g", "name": "ac2g"\n  }}')
        return start, self.corr, ext

    def sync_host(self, t: int) -> None:
        """The host waits for the GPU until true time ``t`` (then wakes a few µs later)."""
        if t > self.host:
            self.host = t
        self.host += self.job.ns(4_000, 12_000)

    # -- GPU -------------------------------------------------------------------------------------------------
    def gpu_row(self, cat: str, name: str, stream: int, start: int, dur: int, corr: int, ext: int, args: str) -> None:
        n = self.n
        self.n += 2
        ts = _ts(start + self.shift)
        self.emit(start, n, f'  {{\n    "ph": "X", "cat": "{cat}", "name": {name}, "pid": {self.device}, '
                            f'"tid": {stream},\n    "ts": {ts}, "dur": {_ts(dur)},\n    "args": {{\n'
                            f'      "External id": {ext}, "queued": 0, "device": {self.device}, "context": 1, '
                            f'"stream": {stream}, "correlation": {corr}, {args}\n    }}\n  }}')
        self.emit(start, n + 1, f'  {{\n    "ph": "f", "id": {corr}, "pid": {self.device}, "tid": {stream}, '
                                f'"ts": {ts},\n    "cat": "ac2g", "name": "ac2g", "bp": "e"\n  }}')
        self.kernels += 1
        self.flows += 1
        end = start + dur
        if self.gpu_lo is None or start < self.gpu_lo:
            self.gpu_lo = start
        if self.gpu_hi is None or end > self.gpu_hi:
            self.gpu_hi = end

    def gpu_annotation(self, name: str, stream: int, start: int, dur: int, ext: int) -> None:
        self.emit(start, self.n, f'  {{\n    "ph": "X", "cat": "gpu_user_annotation", "name": {name}, '
                                 f'"pid": {self.device}, "tid": {stream},\n    "ts": {_ts(start + self.shift)}, '
                                 f'"dur": {_ts(dur)},\n    "args": {{\n      "External id": {ext}\n    }}\n  }}')
        self.n += 1

    def emit(self, t: int, n: int, text: str) -> None:
        self.events.append((t, n, text))

    # -- output ----------------------------------------------------------------------------------------------
    def write(self, text: str) -> None:
        """Append to the file (compressed by a writer thread when the job has one: zlib releases the GIL)."""
        data = text.encode()
        self.bytes += len(data)
        if self.pending_write is not None:
            self.pending_write.result()
            self.pending_write = None
        pool = self.job.pool
        if pool is None:
            self.fh.write(data)
        else:
            self.pending_write = pool.submit(self.fh.write, data)

    def flush_step(self) -> None:
        events = self.events
        events.sort()
        if events:
            lo, hi = events[0][0], events[-1][0]
            self.window[0] = lo if self.window[0] is None else min(self.window[0], lo)
            self.window[1] = hi if self.window[1] is None else max(self.window[1], hi)
        body = ",\n".join(e[2] for e in events)
        if body:
            self.write(body if self.first else ",\n" + body)
            self.first = False
        self.count += len(events)
        self.events = []


# --- the job ---------------------------------------------------------------------------------------------------

class _Job:
    def __init__(self, folder: Path, *, tp: int, pp: int, dp: int, micro_batches: int, layers_per_stage: int,
                 seed: int, gzip_files: bool, clock_skew_ns: int):
        if min(tp, pp, dp, micro_batches, layers_per_stage) < 1:
            raise ValueError("tp, pp, dp, micro_batches and layers_per_stage must be >= 1")
        self.folder, self.tp, self.pp, self.dp = Path(folder), tp, pp, dp
        self.m, self.layers, self.gzip = micro_batches, layers_per_stage, gzip_files
        self.world = tp * pp * dp
        self.rng = np.random.default_rng(seed)
        self._uniform: list[float] = []
        self._normal: list[float] = []
        self.offsets = [int(x) for x in self.rng.integers(0, max(clock_skew_ns, 0) + 1, self.world)]
        self.straggler = int(self.rng.integers(0, self.world))
        self._groups()
        self._programs()
        suffix = ".pt.trace.json.gz" if gzip_files else ".pt.trace.json"
        self.ranks = [_Rank(self, r, self.folder / f"rank{r}{suffix}", self.offsets[r],
                            STRAGGLER_SLOWDOWN if r == self.straggler else 1.0) for r in range(self.world)]
        shape = (0, self.world)
        self.recv_wait = np.zeros(shape, np.int64)  # truth per (step, rank): receive time before the send started
        self.p2p_pairs: dict[tuple[int, int], int] = {}
        self.step_numbers: list[int] = []
        self.pool = None  # the writer threads, while the files are open

    # -- randomness (blocks of numbers: a scalar draw per event would dominate) ----------------------------------
    def u(self) -> float:
        if not self._uniform:
            self._uniform = self.rng.random(65_536).tolist()
        return self._uniform.pop()

    def ns(self, lo: int, hi: int) -> int:
        return lo + int((hi - lo) * self.u())

    def jitter(self, sigma: float = 0.02) -> float:
        if not self._normal:
            self._normal = np.clip(self.rng.standard_normal(65_536), -3, 3).tolist()
        return 1.0 + sigma * self._normal.pop()

    # -- parallel groups, created in Megatron's order (names as torch numbers them) -----------------------------
    def _groups(self) -> None:
        tp, pp, dp = self.tp, self.pp, self.dp
        self.groups: list[_Group] = []

        def new(desc: str, ranks: list[int]) -> _Group:
            group = _Group(str(len(self.groups)), desc, ranks, int(self.rng.integers(0, 5_000)))
            self.groups.append(group)
            return group

        new("default_pg", list(range(self.world)))
        self.dp_group = {(s, t): new("DATA_PARALLEL_GROUP", [rank_of(d, s, t, tp=tp, pp=pp) for d in range(dp)])
                         for s in range(pp) for t in range(tp)}
        self.mp_group = {d: new("MODEL_PARALLEL_GROUP", [rank_of(d, s, t, tp=tp, pp=pp) for s in range(pp)
                                                          for t in range(tp)]) for d in range(dp)}
        self.tp_group = {(d, s): new("TENSOR_MODEL_PARALLEL_GROUP", [rank_of(d, s, t, tp=tp, pp=pp) for t in range(tp)])
                         for d in range(dp) for s in range(pp)}
        self.pp_group = {(d, t): new("PIPELINE_MODEL_PARALLEL_GROUP", [rank_of(d, s, t, tp=tp, pp=pp)
                                                                       for s in range(pp)])
                         for d in range(dp) for t in range(tp)}

    def groups_of(self, rank: int) -> list[_Group]:
        return [g for g in self.groups if rank in g.ranks]

    # -- the programs: what one stage runs for a forward / backward of one micro-batch ---------------------------
    def _programs(self) -> None:
        tp, tokens = self.tp, SEQ * MICRO_BATCH
        h, f, v = HIDDEN, FFN // tp, VOCAB // tp
        act = tokens * HIDDEN
        attn = 4 * SEQ * SEQ * (HIDDEN // tp) * MICRO_BATCH / 2  # causal
        ar = _Comm("c10d::allreduce_", "allreduce", "nccl:all_reduce", AR_BF16, "BFloat16", act, act, elem_bytes=2)
        ce_max = _Comm("c10d::allreduce_", "allreduce", "nccl:all_reduce", AR_MAX_F32, "Float", tokens, tokens,
                       elem_bytes=4)
        ce_sum = _Comm("c10d::allreduce_", "allreduce", "nccl:all_reduce", AR_F32, "Float", tokens, tokens,
                       elem_bytes=4)
        self.batch_comm = _Comm("c10d::broadcast_", "broadcast", "nccl:broadcast", BROADCAST, "Long", tokens,
                                tokens, elem_bytes=8)
        ln = _elementwise("", LN_FWD, 2 * act * 2, chain=(_op("aten::layer_norm"), _op("aten::native_layer_norm")))
        add = _elementwise("aten::add", ADD, 3 * act * 2)
        layer_fwd = [
            ("k", ln), ("k", _gemm(tokens, 3 * h // tp, h, GEMM_TN, forward=True)),
            ("k", _Kernel((_op("flash_attn::_flash_attn_forward"),), FLASH_FWD, attn / FLASH_FWD_RATE,
                          _LAUNCH_STATS["flash"])),
            ("k", _gemm(tokens, h, h // tp, GEMM_TN, forward=True)), ("ar", ar), ("k", add),
            ("k", ln), ("k", _gemm(tokens, f, h, GEMM_TN, forward=True)),
            ("k", _elementwise("aten::gelu", GELU, 2 * tokens * f * 2)),
            ("k", _gemm(tokens, h, f, GEMM_TN, forward=True)), ("ar", ar), ("k", add)]

        def backward(fn: str, *items) -> list:
            return [("open", _q(f"autograd::engine::evaluate_function: {fn}")), ("open", _q(fn)), *items,
                    ("close",), ("close",)]

        linear = "LinearWithGradAccumulationAndAsyncCommunicationBackward"

        def row_parallel(n_out: int, k_in: int) -> list:  # y = x W (W: k_in x n_out); no all-reduce backward
            return backward(linear, ("k", _gemm(tokens, k_in, n_out, GEMM_NN, forward=False)),
                            ("k", _gemm(k_in, n_out, tokens, GEMM_NT, forward=False)))

        def column_parallel(n_out: int, k_in: int) -> list:  # input grad all-reduced, overlapping the wgrad GEMM
            return backward(linear, ("k", _gemm(tokens, k_in, n_out, GEMM_NN, forward=False)), ("ar_async", ar),
                            ("k", _gemm(k_in, n_out, tokens, GEMM_NT, forward=False)), ("wait",))

        ln_bwd = backward("NativeLayerNormBackward0",
                          ("k", _elementwise("aten::native_layer_norm_backward", LN_BWD_IN, 3 * act * 2,
                                             chain=(_op("aten::native_layer_norm_backward"),))),
                          ("k", _elementwise("", LN_BWD_W, act * 2, chain=(), stats="reduce")))
        add_bwd = [("k", _elementwise("aten::add", ADD, 3 * act * 2))]
        layer_bwd = [
            *row_parallel(h, f), *backward("GeluBackward0", ("k", _elementwise("aten::gelu_backward", GELU_BWD,
                                                                                3 * tokens * f * 2))),
            *column_parallel(f, h), *ln_bwd, *add_bwd, *row_parallel(h, h // tp),
            *backward("FlashAttnFuncBackward", ("open", _q("flash_attn::_flash_attn_backward")),
                      ("k", _Kernel((), FLASH_BWD_DOT, 2_500 + 3 * act * 2 / tp / HBM_RATE, _LAUNCH_STATS["flash"])),
                      ("k", _Kernel((), FLASH_BWD_MAIN, 2.5 * attn / FLASH_BWD_RATE, _LAUNCH_STATS["flash"])),
                      ("k", _Kernel((), FLASH_BWD_CONVERT, 2_500 + act * 4 / tp / HBM_RATE, _LAUNCH_STATS["flash"])),
                      ("close",)),
            *column_parallel(3 * h // tp, h), *ln_bwd, *add_bwd]
        embed = [("data",), ("bc", self.batch_comm),
                 ("k", _elementwise("", EMBEDDING, act * 2 + tokens * 8,
                                    chain=(_op("aten::embedding"), _op("aten::index_select")))), ("ar", ar)]
        head = [("data",), ("bc", self.batch_comm), ("k", ln), ("k", _gemm(tokens, v, h, GEMM_TN, forward=True)),
                ("k", _elementwise("aten::max", REDUCE_MAX, tokens * v * 4, stats="reduce")), ("ar", ce_max),
                ("k", _elementwise("aten::sub", SOFTMAX_ELEMENTWISE, 2 * tokens * v * 4)), ("ar", ce_sum),
                ("k", _elementwise("aten::sum", REDUCE_SUM, tokens * v * 4, stats="reduce")), ("ar", ce_sum)]
        head_bwd = [*backward("_VocabParallelCrossEntropyBackward",
                              ("k", _elementwise("aten::mul", SOFTMAX_ELEMENTWISE, 3 * tokens * v * 4))),
                    *column_parallel(v, h)]
        embed_bwd = backward("EmbeddingBackward0", ("k", _elementwise("aten::embedding_dense_backward", EMBEDDING_BWD,
                                                                      2 * act * 2)))
        self.forward, self.backward = {}, {}
        for s in range(self.pp):
            first, last = s == 0, s == self.pp - 1
            self.forward[s] = (embed if first else []) + layer_fwd * self.layers + (head if last else [])
            self.backward[s] = (head_bwd if last else []) + layer_bwd * self.layers + (embed_bwd if first else [])
        self.p2p = _Comm("c10d::send", "send", "nccl:send", SEND_RECV, "BFloat16", act, act, elem_bytes=2)
        self.p2p_recv = _Comm("c10d::recv_", "recv", "nccl:recv", SEND_RECV, "BFloat16", act, act, elem_bytes=2)
        # Step end: gradient buckets (bf16) of the rank's parameters.
        params = self.layers * 12 * HIDDEN * HIDDEN // tp
        self.buckets = []
        left = params
        while left > 0:
            n = min(DP_BUCKET, left)
            n -= n % self.dp
            self.buckets.append(max(n, self.dp))
            left -= DP_BUCKET
        self.params = params
        self.rs = [_Comm("c10d::_reduce_scatter_base_", "_reduce_scatter_base", "nccl:_reduce_scatter_base",
                         REDUCE_SCATTER, "BFloat16", n, n // self.dp, elem_bytes=2) for n in self.buckets]
        self.ag = [_Comm("c10d::_allgather_base_", "_allgather_base", "nccl:_all_gather_base", ALL_GATHER,
                         "BFloat16", n // self.dp, n, elem_bytes=2) for n in self.buckets]
        self.norm_ar = _Comm("c10d::allreduce_", "allreduce", "nccl:all_reduce", AR_F32, "Float", 1, 1, elem_bytes=4)
        self.l2norm = _Kernel((_op("aten::_foreach_norm"),), L2NORM, 2_500 + params * 2 / HBM_RATE,
                              _LAUNCH_STATS["reduce"])
        self.adam = _Kernel((), ADAM, 2_500 + params / self.dp * 16 / HBM_RATE, _LAUNCH_STATS["elementwise"])
        self.fill = _Kernel((_op("aten::zero_"), _op("aten::fill_")), FILL, 2_500 + params * 2 / HBM_RATE,
                            _LAUNCH_STATS["elementwise"])

    # -- timing of collectives -------------------------------------------------------------------------------------
    def _same_node(self, ranks: list[int]) -> bool:
        return len({r // GPUS_PER_NODE for r in ranks}) == 1

    def transfer(self, comm: _Comm, group: _Group) -> int:
        n = group.size
        bus = NVLINK_BUS if self._same_node(group.ranks) else IB_BUS
        factor = 2 * (n - 1) / n if comm.collective == "allreduce" else (n - 1) / n
        return int((6_000 + factor * comm.nbytes / bus) * self.jitter(0.05))

    # -- host + GPU of one launch -------------------------------------------------------------------------------
    def launch(self, R: _Rank, kernel: _Kernel, tid: int) -> int:
        for op in kernel.chain:
            R.open(op[0], op[1], op[2], tid)
        start, corr, ext = R.runtime("cudaLaunchKernel", CBID_LAUNCH, tid)
        for _ in kernel.chain:
            R.close()
        begin = max(start + LAUNCH_LATENCY, R.gpu)
        dur = int(kernel.dur * self.jitter() * R.slow)
        R.gpu_row("kernel", kernel.name, COMPUTE_STREAM, begin, dur, corr, ext, kernel.stats)
        R.gpu = begin + dur
        return R.gpu

    @staticmethod
    def _comm_args(comm: _Comm, group: _Group, seq: int | None, peer: tuple[str, int] | None) -> str:
        text = (f'"Collective name": "{comm.collective}", "In msg nelems": {comm.in_nelems}, '
                f'"Out msg nelems": {comm.out_nelems}, "Group size": {group.size}, "dtype": "{comm.dtype}", '
                f'"In split size": "[]", "Out split size": "[]", "Process Group Name": "{group.name}", '
                f'"Process Group Description": "{group.desc}", "Process Group Ranks": "{group.ranks_text}"')
        if peer is not None:
            text += f', "{peer[0]}": {peer[1]}'
        if seq is not None:
            text += f', "Seq": {seq}'
        return text

    def post(self, R: _Rank, comm: _Comm, group: _Group, tid: int, *, peer: tuple[str, int] | None = None) -> tuple:
        """The host side of one NCCL call on R: c10d op > record_param_comms > nccl:* op > cudaLaunchKernel, the
        collective args on the last two (a collective also takes the group's next ``Seq``; a p2p call names its
        ``peer`` instead). Returns (launch start, correlation, External id of the nccl op, args text), what
        ``nccl_kernel`` writes the kernel with."""
        seq = None
        if peer is None:
            seq = R.seq.get(group.name, group.seq0)
            R.seq[group.name] = seq + 1
            if R.rank == group.ranks[0]:
                group.calls[comm.collective] = group.calls.get(comm.collective, 0) + 1
        args = self._comm_args(comm, group, seq, peer)
        shapes = _shapes([[comm.in_nelems]], [_TORCH_TYPES[comm.dtype]])
        R.open("cpu_op", comm.c10d, shapes, tid)
        R.open("cpu_op", '"record_param_comms"', f", {args}, \"Rank\": {R.rank}", tid)
        ext = R.open("cpu_op", comm.nccl, f", {args}", tid)
        start, corr, _ = R.runtime("cudaLaunchKernel", CBID_LAUNCH, tid)
        R.close()
        R.close()
        R.close()
        return start, corr, ext, args

    def nccl_kernel(self, R: _Rank, comm: _Comm, stream: int, begin: int, end: int, posted: tuple) -> None:
        _, corr, ext, args = posted
        R.gpu_row("kernel", comm.kernel, stream, begin, end - begin, corr, ext,
                  _LAUNCH_STATS["nccl"] + ", " + args)
        R.gpu_annotation(comm.nccl, stream, begin - 1, end - begin + 2, ext)
        R.streams[stream] = end

    # -- item(): a D2H copy of one scalar and the host waiting for it --------------------------------------------
    def item(self, R: _Rank, tid: int) -> None:
        """``tensor.item()``: a 4-byte D2H copy on the compute stream; the copy call returns when it is done."""
        R.open("cpu_op", '"aten::item"', "", tid)
        R.open("cpu_op", '"aten::_local_scalar_dense"', "", tid)
        begin = []

        def blocking(start: int) -> int:
            begin.append(max(start + LAUNCH_LATENCY, R.gpu))
            return begin[0] + 1_500 + self.ns(2_000, 5_000) - start

        _, corr, ext = R.runtime("cudaMemcpyAsync", CBID_MEMCPY, tid, dur=blocking)
        R.gpu_row("gpu_memcpy", '"Memcpy DtoH (Device -> Pageable)"', COMPUTE_STREAM, begin[0], 1_500, corr, ext,
                  '"bytes": 4, "memory bandwidth (GB/s)": 0.003')
        R.gpu = begin[0] + 1_500
        R.runtime("cudaStreamSynchronize", CBID_SYNC, tid, dur=self.ns(1_000, 2_000))
        R.close()
        R.close()

    # -- one step -------------------------------------------------------------------------------------------------
    def step(self, index: int) -> None:
        number = FIRST_STEP + index
        self.step_numbers.append(number)
        self.recv_wait = np.vstack([self.recv_wait, np.zeros((1, self.world), np.int64)])
        step_ext = {}
        for R in self.ranks:
            R.gpu_lo = R.gpu_hi = None
            step_ext[R.rank] = R.open("user_annotation", f'"ProfilerStep#{number}"', "", R.tid_main)
            self.launch(R, self.fill, R.tid_main)  # zero the gradient buffer
        for d in range(self.dp):
            self.pipeline(d, index)
        self.step_end()
        for R in self.ranks:
            R.close()  # ProfilerStep#N: prof.step() of the next step
            if R.gpu_lo is not None:
                R.gpu_annotation(f'"ProfilerStep#{number}"', COMPUTE_STREAM, R.gpu_lo, R.gpu_hi - R.gpu_lo,
                                 step_ext[R.rank])
            R.flush_step()

    def stage_ranks(self, d: int, s: int) -> list[_Rank]:
        return [self.ranks[rank_of(d, s, t, tp=self.tp, pp=self.pp)] for t in range(self.tp)]

    def pipeline(self, d: int, index: int) -> None:
        """1F1B over the replica's stages, laid out by an event loop: an action runs when its input has been sent."""
        pp, m = self.pp, self.m
        queue = {}
        for s in range(pp):
            warmup = min(pp - s - 1, m)
            order = [("F", i) for i in range(warmup)]
            for i in range(m - warmup):
                order += [("F", warmup + i), ("B", i)]
            order += [("B", i) for i in range(m - warmup, m)]
            steps = []
            for kind, i in order:
                src = s - 1 if kind == "F" else s + 1
                dst = s + 1 if kind == "F" else s - 1
                if 0 <= src < pp:
                    steps.append(("recv", kind, i))
                steps.append(("compute", kind, i))
                if 0 <= dst < pp:
                    steps.append(("send", kind, i))
            queue[s] = steps
        sent: dict[tuple[str, int, int], list] = {}  # (kind, sender stage, micro-batch) -> per TP rank
        pos = dict.fromkeys(range(pp), 0)
        pending = sum(len(q) for q in queue.values())
        while pending:
            progressed = False
            for s in range(pp):
                members = self.stage_ranks(d, s)
                while pos[s] < len(queue[s]):
                    what, kind, i = queue[s][pos[s]]
                    if what == "recv":
                        src = s - 1 if kind == "F" else s + 1
                        if (kind, src, i) not in sent:
                            break
                        self.receive(d, s, src, kind, sent.pop((kind, src, i)), index)
                    elif what == "compute":
                        program = self.forward[s] if kind == "F" else self.backward[s]
                        self.run(members, program, kind, self.tp_group[(d, s)])
                    else:
                        sent[(kind, s, i)] = self.send(d, s, kind)
                    pos[s] += 1
                    pending -= 1
                    progressed = True
            assert progressed, "pipeline generator deadlocked"  # a bug in the generator itself

    def run(self, members: list[_Rank], program: list, kind: str, group: _Group) -> None:
        """A stage's forward (main thread) or backward (autograd thread) program on its TP ranks (``members``, in
        TP order), the TP collectives over ``group``."""
        tids = {R.rank: (R.tid_main if kind == "F" else R.tid_bwd) for R in members}
        for item in program:
            what = item[0]
            if what == "k":
                for R in members:
                    self.launch(R, item[1], tids[R.rank])
            elif what in ("ar", "ar_async", "bc"):
                if len(members) > 1:  # Megatron skips TP collectives without TP
                    self.collective(members, item[1], group, TP_STREAM, tids, wait=what != "ar_async")
            elif what == "wait":
                for R in members:
                    R.gpu = max(R.gpu, R.pending)
            elif what == "open":
                for R in members:
                    R.open("cpu_op", item[1], "", tids[R.rank])
            elif what == "close":
                for R in members:
                    R.close()
            elif what == "data":
                for j, R in enumerate(members):
                    self.data(R, tids[R.rank], root=j == 0)

    def collective(self, members: list[_Rank], comm: _Comm, group: _Group, stream: int, tids: dict[int, int], *,
                   wait: bool = True) -> int:
        """One call on every member: each arrives at max(launch + latency, its compute stream, its comm stream);
        all end at the last arrival + transfer. ``wait``: the compute stream waits for the end (else it is kept
        in ``pending`` for a later ``wait``)."""
        posted = [self.post(R, comm, group, tids[R.rank]) for R in members]
        arrive = [max(p[0] + LAUNCH_LATENCY, R.gpu, R.streams.get(stream, 0)) for R, p in zip(members, posted)]
        end = max(arrive) + self.transfer(comm, group)
        for R, p, a in zip(members, posted, arrive):
            self.nccl_kernel(R, comm, stream, a, end, p)
            if wait:
                R.gpu = max(R.gpu, end)
            else:
                R.pending = max(R.pending, end)
        return end

    def data(self, R: _Rank, tid: int, *, root: bool) -> None:
        """Megatron's get_batch_on_this_tp_rank: TP rank 0 reads the batch and copies it in; the others allocate
        (the TP broadcast that follows carries it to them)."""
        if not root:
            R.open("cpu_op", '"aten::empty"', "", tid)
            R.close()
            return
        nbytes = SEQ * MICRO_BATCH * 8
        start = R.host + self.ns(1_000, 3_000)
        R.host = start + self.ns(60_000, 400_000)
        R.ext += 1
        R.emit(start, R.n, f'  {{\n    "ph": "X", "cat": "user_annotation", "name": '
                           f'"enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", "pid": {R.pid}, '
                           f'"tid": {tid},\n    "ts": {_ts(start + R.shift)}, "dur": {_ts(R.host - start)},\n'
                           f'    "args": {{\n      "External id": {R.ext}, "Record function id": 0, '
                           f'"Ev Idx": {R.ev}\n    }}\n  }}')
        R.ev += 1
        R.n += 1
        R.open("cpu_op", '"aten::copy_"', "", tid)
        start, corr, ext = R.runtime("cudaMemcpyAsync", CBID_MEMCPY, tid)
        R.close()
        begin = max(start + LAUNCH_LATENCY, R.gpu)
        dur = 2_000 + nbytes // 20
        R.gpu_row("gpu_memcpy", '"Memcpy HtoD (Pinned -> Device)"', COMPUTE_STREAM, begin, dur, corr, ext,
                  f'"bytes": {nbytes}, "memory bandwidth (GB/s)": {nbytes / dur:.3f}')
        R.gpu = begin + dur

    # -- pipeline p2p ---------------------------------------------------------------------------------------------
    def _p2p_bandwidth(self, a: int, b: int) -> int:
        return NVLINK_P2P if a // GPUS_PER_NODE == b // GPUS_PER_NODE else IB_P2P

    def send(self, d: int, s: int, kind: str) -> list:
        """Post the stage's sends of an action's output (activations forward, gradients backward). The send
        kernel's times are set by the receiver (it spins until the data has landed)."""
        dst = s + 1 if kind == "F" else s - 1
        out = []
        for t, R in enumerate(self.stage_ranks(d, s)):
            peer = rank_of(d, dst, t, tp=self.tp, pp=self.pp)
            group = self.pp_group[(d, t)]
            posted = self.post(R, self.p2p, group, R.tid_main, peer=("Dst Rank", peer))
            stream = SEND_NEXT if kind == "F" else SEND_PREV
            ready = max(posted[0] + LAUNCH_LATENCY, R.gpu)  # c10d: the NCCL stream waits for the compute stream
            out.append((R, posted, stream, ready))
            self.p2p_pairs[(R.rank, peer)] = self.p2p_pairs.get((R.rank, peer), 0) + 1
        return out

    def receive(self, d: int, s: int, src: int, kind: str, sends: list, index: int) -> None:
        for t, R in enumerate(self.stage_ranks(d, s)):
            S, send_posted, send_stream, ready = sends[t]
            group = self.pp_group[(d, t)]
            posted = self.post(R, self.p2p_recv, group, R.tid_main, peer=("Src Rank", S.rank))
            stream = RECV_PREV if kind == "F" else RECV_NEXT
            begin = max(posted[0] + LAUNCH_LATENCY, R.gpu, R.streams.get(stream, 0))
            send_begin = max(ready, S.streams.get(send_stream, 0))
            nbytes = self.p2p.nbytes
            landed = max(begin, send_begin) + int((5_000 + nbytes / self._p2p_bandwidth(R.rank, S.rank))
                                                  * self.jitter(0.03))
            self.nccl_kernel(S, self.p2p, send_stream, send_begin, landed, send_posted)
            self.nccl_kernel(R, self.p2p_recv, stream, begin, landed, posted)
            self.recv_wait[index, R.rank] += max(0, send_begin - begin)
            R.gpu = max(R.gpu, landed)
            R.sync_host(landed)  # batch_p2p_sync: the host waits for the receive

    # -- step end: gradient reduce-scatter, grad norm, optimizer, parameter all-gather ------------------------------
    def step_end(self) -> None:
        """Megatron's finalize_model_grads and optimizer step on every rank, the collectives across replicas."""
        tids = {R.rank: R.tid_main for R in self.ranks}
        dp_members = {key: [self.ranks[r] for r in g.ranks] for key, g in self.dp_group.items()}
        if self.dp > 1:  # gradient buckets reduce-scattered over DP; the optimizer waits for them
            for comm in self.rs:
                for key, members in dp_members.items():
                    self.collective(members, comm, self.dp_group[key], DP_STREAM, tids, wait=False)
        for R in self.ranks:
            R.gpu = max(R.gpu, R.pending)
            self.launch(R, self.l2norm, R.tid_main)
        if self.tp * self.pp > 1:  # the grad norm over the model-parallel ranks
            for d in range(self.dp):
                members = [self.ranks[r] for r in self.mp_group[d].ranks]
                self.collective(members, self.norm_ar, self.mp_group[d], MP_STREAM, tids)
        for R in self.ranks:
            self.item(R, R.tid_main)  # clip_grad_norm: total_norm.item()
            R.open("user_annotation", '"Optimizer.step#FusedAdam.step"', "", R.tid_main)
            for _ in range(3):
                self.launch(R, self.adam, R.tid_main)
            R.close()
        if self.dp > 1:  # the updated parameters gathered back
            for comm in self.ag:
                for key, members in dp_members.items():
                    self.collective(members, comm, self.dp_group[key], DP_STREAM, tids)
        for R in self.ranks:
            self.item(R, R.tid_main)  # the loss, for logging
            R.sync_host(max([R.gpu, *R.streams.values()]))

    # -- files ------------------------------------------------------------------------------------------------------
    def open_files(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        device = {"id": 0, "name": DEVICE_NAME, "totalGlobalMem": 85045624832, "computeMajor": 9, "computeMinor": 0,
                  "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048, "regsPerBlock": 65536,
                  "warpSize": 32, "sharedMemPerBlock": 49152, "numSms": 132, "regsPerMultiprocessor": 65536,
                  "sharedMemPerBlockOptin": 232448, "sharedMemPerMultiprocessor": 233472}
        devices = [dict(device, id=i) for i in range(min(GPUS_PER_NODE, self.world))]
        for R in self.ranks:
            info = {"backend": "nccl", "rank": R.rank, "world_size": self.world, "pg_count": len(self.groups),
                    "pg_config": [{"pg_name": g.name, "pg_desc": g.desc, "backend_config": "cuda:nccl",
                                   "pg_size": g.size, "ranks": g.ranks} for g in self.groups_of(R.rank)],
                    "nccl_version": "2.21.5"}
            head = (f'{{\n  "schemaVersion": 1,\n  "deviceProperties": {json.dumps(devices)},\n'
                    f'  "cupti_version": 24,\n  "cuda_runtime_version": 12040,\n  "cuda_driver_version": 12040,\n'
                    f'  "distributedInfo": {json.dumps(info)},\n  "record_shapes": 1,\n  "with_stack": 0,\n'
                    f'  "trace_id": "{R.rank:08X}{self.world:08X}5EED0000CAFE0000",\n  "traceEvents": [\n')
            R.fh = gzip.open(R.path, "wb", compresslevel=1) if self.gzip else open(R.path, "wb")  # noqa: SIM115
            R.trailer_rows = 0
            R.write(head)

    def close_files(self) -> None:
        for R in self.ranks:
            lo, hi = R.window
            lo = (lo if lo is not None else 0) + R.shift
            hi = (hi if hi is not None else 0) + R.shift
            start = _ts(lo - 50_000)
            rows = [f'  {{\n    "name": "process_name", "ph": "M", "ts": {start}, "pid": {R.pid}, "tid": 0,\n'
                    f'    "args": {{\n      "name": "python"\n    }}\n  }}',
                    f'  {{\n    "name": "process_labels", "ph": "M", "ts": {start}, "pid": {R.pid}, "tid": 0,\n'
                    f'    "args": {{\n      "labels": "CPU"\n    }}\n  }}',
                    f'  {{\n    "name": "process_name", "ph": "M", "ts": {start}, "pid": {R.device}, "tid": 0,\n'
                    f'    "args": {{\n      "name": "python"\n    }}\n  }}',
                    f'  {{\n    "name": "process_labels", "ph": "M", "ts": {start}, "pid": {R.device}, "tid": 0,\n'
                    f'    "args": {{\n      "labels": "GPU {R.device}"\n    }}\n  }}']
            for tid, label in ((R.tid_main, f"thread {R.tid_main} (python)"),
                               (R.tid_bwd, f"thread {R.tid_bwd} (pt_autograd_0)")):
                rows.append(f'  {{\n    "name": "thread_name", "ph": "M", "ts": {start}, "pid": {R.pid}, '
                            f'"tid": {tid},\n    "args": {{\n      "name": "{label}"\n    }}\n  }}')
            for stream in sorted({COMPUTE_STREAM, *R.streams}):
                rows.append(f'  {{\n    "name": "thread_name", "ph": "M", "ts": {start}, "pid": {R.device}, '
                            f'"tid": {stream},\n    "args": {{\n      "name": "stream {stream} "\n    }}\n  }}')
            rows.append(f'  {{\n    "ph": "X", "cat": "Trace", "ts": {start}, "dur": {_ts(hi - lo + 100_000)},\n'
                        f'    "pid": "Spans", "tid": "PyTorch Profiler",\n    "name": "PyTorch Profiler (0)",\n'
                        f'    "args": {{\n      "Op count": 0\n    }}\n  }}')
            rows.append(f'  {{\n    "name": "Iteration Start: PyTorch Profiler", "ph": "i", "s": "g",\n'
                        f'    "pid": "Traces", "tid": "Trace PyTorch Profiler", "ts": {start}\n  }}')
            rows.append(f'  {{\n    "name": "Record Window End", "ph": "i", "s": "g",\n    "pid": "", "tid": "", '
                        f'"ts": {_ts(hi + 50_000)}\n  }}')
            R.write((",\n" if not R.first else "") + ",\n".join(rows))
            R.count += len(rows)
            R.trailer_rows = len(rows)
            R.write(f'\n  ],\n  "traceName": "{R.path.name.removesuffix(".gz")}",\n  "displayTimeUnit": "ms",\n'
                    f'  "baseTimeNanoseconds": {BASE_TIME_NS}\n}}\n')
            if R.pending_write is not None:
                R.pending_write.result()
                R.pending_write = None
            R.fh.close()
            R.fh = None


def write_job(folder: Path, *, tp: int = 2, pp: int = 2, dp: int = 2, steps: int = 2, micro_batches: int = 4,
              layers_per_stage: int = 2, mb_per_rank: float | None = None, seed: int = 0,
              gzip_files: bool = True, clock_skew_ns: int = 50_000) -> dict:
    """Write one Kineto trace per rank of a simulated ``tp x pp x dp`` Megatron job under ``folder``.

    ``steps`` profiled steps (``ProfilerStep#2`` on), each of ``micro_batches`` micro-batches through
    ``layers_per_stage`` transformer layers per stage; ``mb_per_rank``: instead of ``steps``, as many steps as
    make each rank's uncompressed JSON about that many MB (1e6 bytes), counted as written (whole steps, at
    least one: the number that brings the farthest rank closest to the size). ``gzip_files``:
    ``.pt.trace.json.gz`` (else ``.pt.trace.json``); ``clock_skew_ns``: the largest per-rank clock offset.

    Returns the ground truth: ``world``, ``layout`` (tp/pp/dp), ``files`` (path per rank), ``steps`` (the
    ``ProfilerStep`` numbers), ``events`` (traceEvents entries per rank), ``rows`` (per rank, the events a reader
    keeps: complete events but the ``Trace`` span, no flows, metadata or instants), ``kernels`` (GPU rows per
    rank: kernels and copies), ``bytes`` (uncompressed size per rank), ``clock_offset_ns`` (rank r's clock
    minus true time), ``straggler`` (the slow rank), ``groups`` (per process-group name: ``desc``, ``ranks``,
    ``collectives``: calls per member by collective name, with ``Seq`` running from ``seq0``), ``pipelines``
    (the PP groups' ranks in stage order), ``p2p_messages`` (per (sender, receiver): messages),
    ``recv_wait_ns`` (an array [step, rank]: the time the rank's receives spun before the matching send
    started, on the true clock: the pipeline bubble).
    """
    job = _Job(folder, tp=tp, pp=pp, dp=dp, micro_batches=micro_batches, layers_per_stage=layers_per_stage,
               seed=seed, gzip_files=gzip_files, clock_skew_ns=clock_skew_ns)
    for R in job.ranks:
        R.host = 1_000_000 + job.ns(0, 20_000)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        job.pool = pool
        try:
            job.open_files()
            head = np.array([R.bytes for R in job.ranks], dtype=np.float64)
            target = None if mb_per_rank is None else mb_per_rank * 1e6
            trailer = 2_500 + 400 * len(job.ranks[0].streams)  # about what close_files adds
            index = 0
            while True:
                job.step(index)
                index += 1
                if target is None:
                    if index >= steps:
                        break
                    continue
                # Steps come whole: stop where the worst rank's distance to the target is smallest (the
                # distance is convex in the number of steps, so the first k not beaten by k + 1).
                sizes = np.array([R.bytes for R in job.ranks], dtype=np.float64) + trailer
                per_step = (sizes - trailer - head) / index
                now = float(np.max(np.abs(sizes - target)))
                if float(np.max(np.abs(sizes + per_step - target))) >= now:
                    break
            job.close_files()
        finally:
            job.pool = None
    groups = {g.name: {"desc": g.desc, "ranks": g.ranks, "collectives": dict(g.calls), "seq0": g.seq0}
              for g in job.groups}
    return {
        "world": job.world, "layout": {"tp": tp, "pp": pp, "dp": dp},
        "files": [R.path for R in job.ranks], "steps": list(job.step_numbers),
        "events": [R.count for R in job.ranks], "rows": [R.count - R.flows - R.trailer_rows for R in job.ranks],
        "kernels": [R.kernels for R in job.ranks],
        "bytes": [R.bytes for R in job.ranks], "clock_offset_ns": list(job.offsets), "straggler": job.straggler,
        "groups": groups, "pipelines": [g.ranks for g in job.pp_group.values()] if pp > 1 else [],
        "p2p_messages": dict(job.p2p_pairs), "recv_wait_ns": job.recv_wait,
    }
