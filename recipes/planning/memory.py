"""Memory per GPU before a launch: bytes per rank for every pipeline rank of one layout (issue 18, section 1).

Notation: ``E`` = ``dtype_bytes`` (2: bf16 mixed precision, 4: float32), ``W = 4`` (float32 statistics, softmax,
log-sum-exp, master weights), ``t, cp, p, v, m, b`` = tp, cp, pp, chunks, micro-batches, micro-batch size,
``N = dp * cp`` (the ZeRO group), ``S`` the sequence, ``s = S/cp`` (a CP rank's tokens), ``s_h = s/t`` under
Megatron-SP else ``s`` (the hidden rows a rank holds), ``h, f, a, kv, hd`` width, FFN, heads, KV heads, head dim,
``q = a*hd``. Only pipeline ranks differ (TP shards, padded vocabulary rows and ZeRO partitions are equal across
tp/cp/dp), so one :class:`RankMemory` per pipeline rank, standing for global rank ``r * t * cp * dp``.

**Parameters** (exact; the reference is the rank's model built on the meta device). The ``L + 2`` pipeline layers
``[embedding, blocks, head]`` are cut uniformly into ``p*v`` stages (stage ``k``: ``[k n/(pv), (k+1) n/(pv))``),
stage ``k`` on pipeline rank ``k % p``. TP divides every projection by ``t`` (K/V rows ``kv*hd/t`` even when
``t > kv``) and pads the vocabulary to ``V' = ceil(V/t)*t`` rows; norms, row-parallel biases and GPT's positions
are replicated. A tied head on the last stage is a shadow copy: in params and grads, never partitioned, no
optimizer state (:class:`~shardline.plugins.lightning.deepspeed_compat.TiedAcrossStages`).

**Model states** (Rajbhandari et al. 2020, §3.1, §5, Table 1): mixed-precision Adam holds ``2Ψ + 2Ψ + KΨ``, K = 12
(fp32 master 4, moments 8); P_os divides ``KΨ`` by N, P_os+g also the gradients, P_os+g+p everything: ``16Ψ/N``
(:func:`zero_model_states`). What DeepSpeed 0.19 allocates, which this follows (checked against its partitions):
ZeRO-1/2 flatten the rank's parameters into one buffer padded to a multiple of ``2N`` elements
(``nccl_start_alignment_factor = 2``, times N), partition ``= flat/N``, and clone an fp32 master partition even in
float32 (K = 12 at E = 4 too); ZeRO-3 pads each parameter to a multiple of N (partition ``ceil(n/N)``), keeps
parameters of at most ``stage3_param_persistence_threshold`` elements whole on every rank (besides their
partition) and clones the master too (its no-copy branch for float32 compares ``tensor.device`` with a string,
never equal); ZeRO-0 runs torch's AdamW on the weights in float32 (8 bytes) and ``FP16_UnfusedOptimizer`` in
bf16 (fp32 copies and moments, 12). Gradients: ZeRO-0/1 hold ``Ψ_r E`` during backward (ZeRO-1 reduces at the
boundary), ZeRO-2/3
their partition, the gradients in flight sitting in the buckets (under pp > 1 ZeRO-2 reduces only at the step, so
a rank's gradients wait in its buckets until they overflow into the partition). The fp32 gradient partition the
optimizer step makes (4 bytes per partition element) lives after the activations are gone: not counted.

**Offload**: ``offload_optimizer='cpu'`` (ZeRO >= 1) moves master, moments and the gradient partition to CPU RAM,
``4 + 8 + 4 + E`` bytes per partition element (master, moments, fp32 gradients, and the bf16 staging copy at
ZeRO-1/2 or the gradient partition at ZeRO-3); ``offload_params='cpu'`` (ZeRO-3) leaves the persistent parameters
on the GPU and the partitions in CPU RAM. Both are checked against DeepSpeed's own partitions
(tests/recipes/planning/test_memory.py).

**NVMe offload** (ZeRO-3; checked exactly, part by part, against DeepSpeed 0.19.8's CPU buffers and the bytes of
the files it writes, ``test_nvme_offload_equals_deepspeeds_buffers_and_files``). The settings are
:class:`ZeroSettings` (DeepSpeed's defaults, or a run's config). ``P``: the rank's partition elements, ``1 MB``:
``min_aio_bytes``, the smallest tensor DeepSpeed swaps; swapped sizes are aligned up to 1 KiB. Optimizer
sub-groups are runs of parameters, in the optimizer's order, until their partitions reach ``sub_group_size``.

* ``offload_params='nvme'``: a CPU flat of ``min(P, max_in_cpu)`` elements holds the leading sub-groups that fit
  in it (``cpu.param_flat``). A partition outside it is on the drive when it is >= 1 MB, else it stays in CPU RAM
  (``cpu.param_partitions``). Every partition >= 1 MB is written to the drive at start-up and stays there, even
  one the flat holds (``nvme.params``). Swap buffers: ``buffer_count x buffer_size`` elements
  (``cpu.param_swap_buffers``). When any sub-group is outside the flat there is also a reserve of the largest
  sub-group's parameters at their whole, unpartitioned size (``cpu.param_reserve``). DeepSpeed asserts when a
  swapped partition exceeds ``buffer_size`` (:func:`swap_problems`: a RecipeError here).
* ``offload_optimizer='nvme'``: a sub-group whose fp32 partition is >= 1 MB keeps its master and both moments on
  the drive (``nvme.optimizer``, aligned to 256 elements). Its fp32 gradients go there too, per parameter: the
  aligned part of each one >= 1 MB (``nvme.grads``). A smaller or misaligned gradient stays, whole, where
  DeepSpeed converted it at the end of backward, the accelerator, until the step (``step.unswapped_grads``: after
  the activations are freed, so in neither the GPU peak nor CPU RAM; the CPU test reads it in CPU RAM). A
  sub-group under 1 MB keeps master, moments and fp32 gradient in CPU RAM (16 bytes per element,
  ``cpu.optimizer``). Also in CPU RAM: ``buffer_count`` swap buffers of the largest
  sub-group's fp32 partition (``cpu.optimizer_swap_buffers``) and the gradient partition, ``E P``
  (``cpu.grad_partition``).
* Not modelled: DeepSpeed's last DP rank writes gradients without the partition padding (up to ``N - 1``
  elements fewer per parameter); the start-up peak in CPU RAM (fp32 copies of the sub-groups outside the flat,
  one fp32 buffer of the largest sub-group: about 4 GB per rank for llama3-8b over 8 ranks); persistent
  parameters outside the flat keep their partition on the GPU (counted in CPU RAM; norms, negligible); Adam is
  assumed (3 swapped tensors per sub-group, 4 buffers); one optimizer parameter group (DeepSpeed forms flats and
  sub-groups per group; LanguageModule has one); whether ``buffer_count`` covers the swapped parameters one
  module fetches (and those kept gathered from the second step on) is not checked. The pipelined swapper,
  partial offload (``ratio``), ``fast_init``, ``super_offload`` and GPUDirect Storage are refused by
  :meth:`ZeroSettings.from_deepspeed`. ``cpu`` and ``nvme`` on :class:`RankMemory` are the sums of
  these parts, named in its ``detail`` (with ``io.param_pass``, the bytes read from the drive in each forward or
  backward pass: :func:`swap_traffic`, what the step-time model prices).

**Buffers** (DeepSpeed's defaults, ``runtime/zero/config.py``; allocated at this size whatever the model's size):
``reduce_bucket_size = 5e8`` elements of E: one staging bucket at ZeRO-1, two at ZeRO-2 (``overlap_comm``), one at
ZeRO-3; ZeRO-0 with N > 1 flattens ``min(Ψ_r, allreduce_bucket_size = 5e8)``. ZeRO-3's gathered working set is the
largest hosted layer's non-persistent parameters plus ``stage3_prefetch_bucket_size = 5e7`` (none under pp > 1:
the pipeline runs the coordinator without prefetch), capped by ``stage3_max_live_parameters = 1e9``. The last
stage adds its logits and their fp32 gradient, ``b s V'/t (E + W)``; a pipeline rank its two p2p buffers
``2 b s_h h E``; every GPU :data:`FIXED_OVERHEAD_BYTES` (CUDA context, NCCL communicators, allocator slack).

**Activations**: the bytes autograd saves, per micro-batch (validated against
:class:`~shardline.plugins.pipeline.memory.SavedTensorMeter` within 5%). Korthikanti et al. 2022 (Table 2, 16-bit)
give per layer ``sbh(34 + 5as/h)`` with no parallelism, ``sbh(10 + 24/t + 5as/(ht))`` under TP, ``sbh(34 + 5as/h)/t``
under TP + SP, without the ``5as/h`` term under selective recompute and ``2sbh`` under full recompute
(:func:`korthikanti_layer_bytes`). shardline's layers differ in three ways: attention is fused (flash SDPA, ring
attention keeping the log-sum-exp), so the ``5as^2b`` softmax/dropout terms are never stored and ``selective``
equals ``none``; dropout is 0 (no masks: the paper's ``2sbh``); and Megatron-SP saves the all-gathered input of
each column-parallel projection (``b s h E``, once per projection when ``b > 1``: the gathered tensor is a
non-contiguous view each projection copies) where Megatron keeps the shard. Per block and micro-batch::

    GPT:   E[2 b s_h h + 2 b s h + b s (4q + 2f)/t] + W[4 b s_h + a b s/t]
    Llama: (W + E) 2 b s_h h + 2 W b s_h + E[(c_qkv + c_mlp) b s h + b s (4q + 4f)/t] + W a b s/t
           + E 2 kv hd (h + bias) when t > kv (the gathered K/V weights)

with ``c_qkv, c_mlp = 3, 2`` under SP when ``b > 1``, else 1 (GPT has one projection per gathered input),
plus, under Ulysses, the attention output a second time and two int64 position indexes ``[S]``. The embedding
saves ``8 s`` (GPT's position index; under SP a view of all ``s``) and ``9 b s`` under TP (local ids, mask); the
head its norm, the projection input ``E b s h`` and the loss's fp32 softmax ``W b s V'/t`` with ``10 b s`` of
target index and masks; each rank once the rotary tables ``2 s hd E``. (On a CPU, bf16 LayerNorm keeps its
statistics in bf16, 2 bytes where CUDA keeps 4.) Full recompute saves each block's input ``E b s_h h`` and
recomputes one block at a time (``activations.recompute``, invisible to the meter). In flight per rank: one
micro-batch at ``pp = 1`` (gradient accumulation is sequential); GPipe ``m``; 1F1B ``min(p - r, m)``; interleaved
1F1B the peak, over the rank's schedule, of the bytes of its in-flight (chunk, micro-batch) pairs (Megatron's
warm-up ``min(2(p - r - 1) + (v - 1)p, vm)`` forwards plus one: interleaving's extra over 1F1B).

One file: every term above is one formula per rank in the notation fixed at the top, and they add up to one
:class:`MemoryEstimate` per layout.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from shardline.job import stages as job_stages
from shardline.job.family import Degrees, MicroBatch
from shardline.recipes.planning.layout import PlanLayout
from shardline.recipes.planning.models import ModelSpec
from shardline.recipes.schema import RecipeError

GIB = 2**30
#: DeepSpeed 0.19 defaults this estimate assumes (``runtime/zero/config.py``, ``offload_config.py``), in elements.
REDUCE_BUCKET_SIZE = 500_000_000
ALLREDUCE_BUCKET_SIZE = 500_000_000
PREFETCH_BUCKET_SIZE = 50_000_000
MAX_LIVE_PARAMETERS = 1_000_000_000
PERSISTENCE_THRESHOLD = 100_000
SUB_GROUP_SIZE = 1_000_000_000
NCCL_ALIGNMENT = 2  # nccl_start_alignment_factor: ZeRO-1/2 pad the flat buffer to a multiple of 2N elements
MIB = 2**20
#: DeepSpeed's aio rules (``runtime/swap_tensor/utils.py``): tensors under ``max(MIN_AIO_BYTES, aio.block_size)``
#: are never swapped; swap reads and writes are aligned to ``AIO_ALIGNED_BYTES * aio.intra_op_parallelism``.
MIN_AIO_BYTES, AIO_ALIGNED_BYTES = MIB, 1024
#: Per-GPU cost no layout changes: the CUDA context with cuBLAS/cuDNN workspaces (~0.6 GiB on an H100), NCCL
#: communicators' buffers for the grid's groups (~1 GiB) and the caching allocator's slack. A stated constant (not
#: measured here: no GPU); ``estimate(overhead_bytes=...)`` replaces it.
FIXED_OVERHEAD_BYTES = 2 * GIB
W = 4  # float32: statistics, softmax, log-sum-exp, master weights
CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


@dataclass(frozen=True)
class ZeroSettings:
    """The DeepSpeed settings behind ZeRO-3's sub-groups and NVMe offload, DeepSpeed 0.19's defaults unless a
    config says otherwise (:meth:`from_deepspeed`): ``sub_group_size`` (partition elements per optimizer sub-group,
    ``zero_optimization.sub_group_size``), ``offload_param.buffer_count``/``buffer_size``/``max_in_cpu`` (the
    parameter swap buffers and how many partition elements stay in CPU RAM), ``offload_optimizer.buffer_count``
    (the optimizer's swap buffers) and ``aio.block_size``/``intra_op_parallelism`` (the smallest swapped tensor,
    the alignment)."""

    sub_group_size: int = SUB_GROUP_SIZE
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    optimizer_buffer_count: int = 4
    aio_block_size: int = MIB
    aio_intra_op_parallelism: int = 1

    def __post_init__(self) -> None:
        problems = [f"{f}={getattr(self, f)!r} must be an integer >= {low}" for f, low in (
            ("sub_group_size", 1), ("param_buffer_count", 1), ("param_buffer_size", 1), ("max_in_cpu", 0),
            ("optimizer_buffer_count", 1), ("aio_block_size", 1), ("aio_intra_op_parallelism", 1))
            if isinstance(getattr(self, f), bool) or not isinstance(getattr(self, f), int) or getattr(self, f) < low]
        if problems:
            raise RecipeError("ZeRO settings: " + "; ".join(problems))

    #: (config path, field) pairs :meth:`from_deepspeed` reads.
    KEYS = (("zero_optimization.sub_group_size", "sub_group_size"),
            ("zero_optimization.offload_param.buffer_count", "param_buffer_count"),
            ("zero_optimization.offload_param.buffer_size", "param_buffer_size"),
            ("zero_optimization.offload_param.max_in_cpu", "max_in_cpu"),
            ("zero_optimization.offload_optimizer.buffer_count", "optimizer_buffer_count"),
            ("aio.block_size", "aio_block_size"), ("aio.intra_op_parallelism", "aio_intra_op_parallelism"))

    @classmethod
    def from_deepspeed(cls, config: dict, *, source: str = "deepspeed_config") -> ZeroSettings:
        """The settings a DeepSpeed config dict gives (what ``HybridParallelStrategy(deepspeed_config=...)``
        takes); keys it leaves out keep DeepSpeed's defaults. Numbers may be written as DeepSpeed accepts them
        (``5e8``). RecipeError naming the key and ``source`` for a value that is not a whole number, and for the
        options whose buffers this estimate does not follow (the pipelined optimizer swapper, partial offload,
        ``fast_init``, ``super_offload``, GPUDirect Storage)."""
        if not isinstance(config, dict):
            raise RecipeError(f"{source}: a DeepSpeed config must be a mapping, got {type(config).__name__}")
        values, problems = {}, []
        for path, name in cls.KEYS:
            node = config
            for key in path.split("."):
                node = node.get(key) if isinstance(node, dict) else None
            if node is None:
                continue
            if isinstance(node, bool) or not isinstance(node, (int, float)) or node != int(node):
                problems.append(f"{path}={node!r} must be a whole number")
            else:
                values[name] = int(node)
        zero = config.get("zero_optimization") or {}
        optimizer = zero.get("offload_optimizer") or {} if isinstance(zero, dict) else {}
        for key in ("pipeline_read", "pipeline_write"):
            if isinstance(optimizer, dict) and optimizer.get(key):
                problems.append(f"zero_optimization.offload_optimizer.{key}={optimizer[key]!r}: the pipelined "
                                "optimizer swapper's buffers are not estimated")
        for key in ("fast_init", "super_offload"):
            if isinstance(optimizer, dict) and optimizer.get(key):
                problems.append(f"zero_optimization.offload_optimizer.{key}={optimizer[key]!r}: its start-up and "
                                "buffers are not estimated")
        if isinstance(optimizer, dict) and optimizer.get("ratio", 1.0) != 1.0:
            problems.append(f"zero_optimization.offload_optimizer.ratio={optimizer['ratio']!r}: partial offload "
                            "(some sub-groups' optimizer on the GPU) is not estimated")
        aio = config.get("aio") or {}
        if isinstance(aio, dict) and aio.get("use_gds"):
            problems.append(f"aio.use_gds={aio['use_gds']!r}: GPUDirect Storage keeps the parameter swap buffers "
                            "on the GPU, which is not estimated")
        if problems:
            raise RecipeError(f"{source}: " + "; ".join(problems))
        return cls(**values)

    @property
    def min_aio_bytes(self) -> int:
        """Tensors smaller than this are never swapped."""
        return max(MIN_AIO_BYTES, self.aio_block_size)

    def aligned(self, numel: int, element_bytes: int) -> int:
        """``numel`` rounded up to the swap alignment for ``element_bytes``-byte elements."""
        a = AIO_ALIGNED_BYTES * self.aio_intra_op_parallelism // element_bytes
        return -(-numel // a) * a


DEFAULT_ZERO = ZeroSettings()


@dataclass(frozen=True)
class RankMemory:
    """One pipeline rank's GPU bytes by category, its CPU RAM and NVMe bytes, and named parts (``detail``)."""

    pp_rank: int
    rank: int
    stages: tuple[int, ...]
    param_elements: int  # what the rank's module holds (a tied shadow included): the meta-device count
    optimized_elements: int  # what DeepSpeed optimises (the shadow excluded)
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    cpu: int
    nvme: int
    in_flight: dict = field(default_factory=dict)  # stage -> micro-batches in flight at the activation peak
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def categories(self) -> dict[str, int]:
        """``{"params", "grads", "optimizer", "activations", "buffers", "total"}`` in bytes (the plan's JSON keys)."""
        return {**{k: getattr(self, k) for k in CATEGORIES}, "total": self.total}


@dataclass(frozen=True)
class MemoryEstimate:
    model: ModelSpec
    layout: PlanLayout
    seq_len: int
    dtype_bytes: int
    ranks: tuple[RankMemory, ...]

    @property
    def most_loaded(self) -> RankMemory:
        return max(self.ranks, key=lambda r: (r.total, -r.pp_rank))

    @property
    def max_memory_rank(self) -> int:
        """The global rank of the most loaded position (the first of equals)."""
        return self.most_loaded.rank

    def categories(self) -> dict[str, int]:
        return self.most_loaded.categories()

    def memory_gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.categories().items()}


# --- the layout's rules ------------------------------------------------------------------------------------------

def layout_problems(model: ModelSpec, layout: PlanLayout, *, seq_len: int, dtype_bytes: int) -> list[str]:
    """Every reason ``layout`` cannot run ``model`` (the model classes' ``layout_problems``, DeepSpeed's offload
    rules of :func:`~shardline.plugins.lightning.zero.derive_config`, the schedule's), each naming its numbers."""
    t, cp, p, v = layout.tp, layout.cp, layout.pp, layout.chunks
    stages = p * v if p > 1 else 1
    if not isinstance(seq_len, int) or not 1 <= seq_len <= model.seq_len:
        problems = [f"seq_len={seq_len!r} must be an integer in 1..{model.seq_len} (the model's seq_len)"]
        window = model  # the sequence rules need a valid window: the model's own stands in
    else:
        problems, window = [], model.replace(seq_len=seq_len)
    # the model classes' own rules (the family's), at this layout's degrees; the pipeline's cut is checked below
    problems += model.family.layout_problems(window, Degrees(tp=t, cp=cp, pp=1, sp=layout.layout.sp))
    if model.vocab_size < t and not any(problem.startswith("vocab_size=") for problem in problems):
        problems.append(f"vocab_size={model.vocab_size} is smaller than tp={t}")
    if model.n_layer + 2 < stages:
        problems.append(f"n_layer={model.n_layer} gives {model.n_layer + 2} pipeline layers, fewer than "
                        f"pp*chunks={stages} stages")
    if p > 1 and layout.schedule == "interleaved" and layout.micro_batches % p:
        problems.append(f"interleaved: micro_batches={layout.micro_batches} is not a multiple of pp={p}")
    z, oo, op = layout.zero_stage, layout.offload_optimizer, layout.offload_params
    if oo != "none" and z == 0:
        problems.append(f"offload_optimizer={oo!r} needs zero_stage >= 1 (zero_stage=0)")
    if oo == "nvme" and z != 3:
        problems.append(f"offload_optimizer='nvme' needs zero_stage=3 (zero_stage={z})")
    if op != "none" and z != 3:
        problems.append(f"offload_params={op!r} needs zero_stage=3 (zero_stage={z})")
    if dtype_bytes not in (2, 4):
        problems.append(f"dtype_bytes={dtype_bytes!r} must be 2 (bf16 mixed precision) or 4 (float32)")
    return problems


# --- parameters --------------------------------------------------------------------------------------------------

def padded_vocab(model: ModelSpec, *, tp: int) -> int:
    """``V' = ceil(V/tp)*tp`` (:func:`~shardline.plugins.layers.tp_vocab.pad_vocab`)."""
    return -(-model.vocab_size // tp) * tp


def layer_numels(model: ModelSpec, index: int, *, tp: int) -> list[int]:
    """Sizes (elements) of the parameters of pipeline layer ``index`` (0: embedding, ``n_layer + 1``: head) on one
    TP rank, in the module's order (``named_parameters``). The head lists its vocabulary matrix (first) even when
    tied (whether a rank holds it is the caller's)."""
    return list(_layer_numels(model, _kind(model, index), tp))


def _kind(model: ModelSpec, index: int) -> str:
    return "embedding" if index == 0 else "head" if index == model.n_layer + 1 else "block"


@functools.lru_cache(maxsize=1024)
def _layer_numels(model: ModelSpec, kind: str, tp: int) -> tuple[int, ...]:
    """The family's closed forms (:class:`~shardline.job.family.Family`), the vocabulary padded to tp."""
    vocab = padded_vocab(model, tp=tp) // tp
    if kind == "embedding":
        return model.family.embedding_numels(model, vocab=vocab)
    if kind == "head":
        return model.family.head_numels(model, vocab=vocab)
    return model.family.block_numels(model, tp=tp)


def hosted_stages(model: ModelSpec, layout: PlanLayout, pp_rank: int) -> dict[int, range]:
    """``{stage: its layers}`` of pipeline rank ``pp_rank``, the cut of
    :func:`~shardline.plugins.models.decoder.hosted_layers`."""
    return job_stages.hosted_stages(model.n_layer + 2, pp=layout.pp, chunks=layout.chunks, pp_rank=pp_rank)


def rank_parameters(model: ModelSpec, layout: PlanLayout, pp_rank: int) -> tuple[list[int], int]:
    """``(sizes of the parameters DeepSpeed optimises on this rank in the optimizer's order, elements of a tied
    shadow)``."""
    layers = [i for r in hosted_stages(model, layout, pp_rank).values() for i in r]
    numels, shadow = [], 0
    for i in layers:
        sizes = layer_numels(model, i, tp=layout.tp)
        if model.tie_embeddings and i == model.n_layer + 1:
            vocab, sizes = sizes[0], sizes[1:]  # the head's matrix: the embedding's own here, or a shadow of it
            shadow = 0 if 0 in layers else vocab
        numels += sizes
    return numels, shadow


@dataclass(frozen=True)
class _RankStatic:
    """What a pipeline rank hosts, independent of ZeRO, micro-batch and recompute (cached per layout cut)."""

    stages: tuple[tuple[int, range], ...]
    sizes: tuple[tuple[int, int], ...]  # (parameter size, how many) DeepSpeed optimises
    numels: tuple[int, ...]  # the same sizes in the optimizer's order
    shadow: int
    psi: int
    has_blocks: bool
    has_head: bool
    big_max: int  # the largest hosted layer's non-persistent elements (ZeRO-3's gathered working set)
    big_sum: int


@functools.lru_cache(maxsize=65536)
def _rank_static(model: ModelSpec, tp: int, pp: int, chunks: int, pp_rank: int) -> _RankStatic:
    layout = PlanLayout(tp=tp, pp=pp, chunks=chunks, schedule="interleaved" if chunks > 1 else "1f1b")
    stages = hosted_stages(model, layout, pp_rank)
    numels, shadow = rank_parameters(model, layout, pp_rank)
    layers = [i for r in stages.values() for i in r]
    big = [sum(x for x in _layer_numels(model, _kind(model, i), tp) if x > PERSISTENCE_THRESHOLD) for i in layers]
    return _RankStatic(stages=tuple(stages.items()), sizes=tuple(Counter(numels).items()), numels=tuple(numels),
                       shadow=shadow,
                       psi=sum(numels), has_blocks=any(0 < i <= model.n_layer for i in layers),
                       has_head=model.n_layer + 1 in layers, big_max=max(big), big_sum=sum(big))


# --- model states ------------------------------------------------------------------------------------------------

def zero_model_states(psi: float, *, stage: int, n_d: int, k: int = 12) -> float:
    """Bytes of model states per device, mixed precision (Rajbhandari et al. 2020, §5.1, Table 1):
    baseline ``(2 + 2 + K)Ψ``; P_os ``4Ψ + KΨ/N_d``; P_os+g ``2Ψ + (2 + K)Ψ/N_d``; P_os+g+p ``(4 + K)Ψ/N_d``."""
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n_d, 2: 2 * psi + (2 + k) * psi / n_d,
            3: (4 + k) * psi / n_d}[stage]


def model_states(numels: list[int], shadow: int, layout: PlanLayout, dtype_bytes: int,
                 zero: ZeroSettings = DEFAULT_ZERO) -> dict[str, int]:
    """GPU bytes of params/grads/optimizer (and CPU RAM, NVMe) for one rank, as DeepSpeed allocates them (see the
    module docstring); ``numels`` in the order the optimizer holds the parameters (ZeRO-3's sub-groups follow it)."""
    return _states(tuple(Counter(numels).items()), tuple(numels), shadow, layout, dtype_bytes, zero)


def _states(sizes: tuple[tuple[int, int], ...], numels: tuple[int, ...], shadow: int, layout: PlanLayout,
            dtype_bytes: int, zero: ZeroSettings) -> dict:
    """:func:`model_states` over ``(parameter size, how many)`` pairs (and the ordered sizes, for NVMe offload);
    ``detail`` names the CPU RAM and NVMe parts of an NVMe offload."""
    e, n, z = dtype_bytes, layout.zero_group, layout.zero_stage
    oo, op = layout.offload_optimizer, layout.offload_params
    psi = sum(x * c for x, c in sizes)
    out = dict(cpu=0, nvme=0, partition=psi, detail={})
    if z == 0:
        out.update(params=psi * e, grads=psi * e, optimizer=(12 if e == 2 else 8) * psi)
    elif z in (1, 2):
        flat = -(-psi // (NCCL_ALIGNMENT * n)) * NCCL_ALIGNMENT * n
        part = out["partition"] = flat // n
        grads = psi * e if z == 1 else (0 if oo != "none" else part * e)
        out.update(params=flat * e, grads=grads, optimizer=0 if oo != "none" else 12 * part)
        if oo != "none":
            out["cpu"] = (4 + 8 + 4 + e) * part
    else:
        part = out["partition"] = sum(-(-x // n) * c for x, c in sizes)
        persistent = sum(x * c for x, c in sizes if x <= PERSISTENCE_THRESHOLD)
        out.update(params=(persistent if op != "none" else part + persistent) * e,
                   grads=0 if oo != "none" else part * e,
                   optimizer=0 if oo != "none" else 12 * part)
        if oo == "cpu":
            out["cpu"] += (12 + e + 4) * part
        if op == "cpu":
            out["cpu"] += part * e
        if "nvme" in (oo, op):
            swap = out["detail"] = dict(_swap_parts(numels, n, e, oo, op, zero))  # the cache's own stays intact
            out["cpu"] += sum(v for k, v in swap.items() if k.startswith("cpu."))
            out["nvme"] += sum(v for k, v in swap.items() if k.startswith("nvme."))
    out["params"] += shadow * e
    out["grads"] += shadow * e
    return out


def _sub_groups(parts: list[int], size: int) -> list[tuple[int, int]]:
    """ZeRO-3's optimizer sub-groups as ``[start, stop)`` parameter ranges: parameters in order until their
    partitions reach ``size`` elements (the last group takes the rest); one group when all fit."""
    if size >= sum(parts):
        return [(0, len(parts))]
    groups, start, acc = [], 0, 0
    for i, p in enumerate(parts):
        acc += p
        if acc >= size or i == len(parts) - 1:
            groups.append((start, i + 1))
            start, acc = i + 1, 0
    return groups


@functools.lru_cache(maxsize=4096)
def _swap_parts(numels: tuple[int, ...], n: int, e: int, oo: str, op: str, zero: ZeroSettings) -> dict[str, int]:
    """CPU RAM (``cpu.*``) and drive (``nvme.*``) bytes of ZeRO-3's NVMe offload on one rank, as DeepSpeed 0.19
    allocates them (see the module docstring, **NVMe offload**)."""
    parts = [-(-x // n) for x in numels]
    groups = _sub_groups(parts, zero.sub_group_size)
    sums = [sum(parts[a:b]) for a, b in groups]
    low = zero.min_aio_bytes
    out: dict[str, int] = {}
    if op == "nvme":
        total = sum(parts)
        flat = max(1, total if total <= zero.max_in_cpu else zero.max_in_cpu)  # an empty flat is 1 element
        offset, outside = 0, []
        for (a, b), size in zip(groups, sums):
            if offset + size > flat:
                outside.extend(range(a, b))
            offset += size
        swapped = [p * e >= low for p in parts]
        out["cpu.param_flat"] = flat * e
        out["cpu.param_partitions"] = e * sum(parts[i] for i in outside if not swapped[i])
        out["cpu.param_swap_buffers"] = zero.param_buffer_count * zero.aligned(zero.param_buffer_size, e) * e
        if outside:  # the fp16 flat's stand-in for swapping out after the step: the largest sub-group, unpartitioned
            a, b = groups[sums.index(max(sums))]
            out["cpu.param_reserve"] = e * sum(zero.aligned(x, e) for x in numels[a:b])
        out["nvme.params"] = e * sum(zero.aligned(p, e) for p, s in zip(parts, swapped) if s)
        # drive traffic, not bytes held: read in every forward and every backward pass, written after the step
        out["io.param_pass"] = e * sum(zero.aligned(parts[i], e) for i in outside if swapped[i])
    if oo == "nvme":
        unit = zero.aligned(1, W)
        on_drive = [size * W >= low for size in sums]
        out["cpu.optimizer_swap_buffers"] = zero.optimizer_buffer_count * zero.aligned(max(sums), W) * W
        out["cpu.grad_partition"] = sum(parts) * e
        # a sub-group too small to swap keeps its fp32 master, Adam moments and fp32 gradient in CPU RAM
        out["cpu.optimizer"] = (4 + 8 + 4) * sum(size for size, d in zip(sums, on_drive) if not d)
        kept = written = 0
        for (a, b), d in zip(groups, on_drive):
            for p in parts[a:b] if d else ():
                body = p // unit * unit if p * W >= low else 0
                if body * W >= low:
                    written += body * W
                if body * W < low or body != p:  # an unswapped piece (or the remainder's view) keeps it all
                    kept += p * W
        # on the accelerator (converted there at the end of backward) until the step, after the activations are
        # freed: not in the GPU peak, nor in CPU RAM (on a CPU accelerator, CPU RAM)
        out["step.unswapped_grads"] = kept
        out["nvme.optimizer"] = 3 * W * sum(zero.aligned(size, W) for size, d in zip(sums, on_drive) if d)
        out["nvme.grads"] = written
    return out


def swap_traffic(numels: list[int], layout: PlanLayout, dtype_bytes: int,
                 zero: ZeroSettings = DEFAULT_ZERO) -> tuple[int, int]:
    """``(bytes read from the drive in each forward or backward pass, bytes read and written at each optimizer
    step)`` of one rank's NVMe offload: the swapped parameter partitions outside the CPU flat (read each pass,
    written back after the step), the swapped sub-groups' master and moments (read and written) and fp32
    gradients (written at the end of backward, read at the step). ``(0, 0)`` without NVMe offload."""
    oo, op = layout.offload_optimizer, layout.offload_params
    if layout.zero_stage != 3 or "nvme" not in (oo, op):
        return 0, 0
    parts = _swap_parts(tuple(numels), layout.zero_group, dtype_bytes, oo, op, zero)
    passes = parts.get("io.param_pass", 0)
    return passes, passes + 2 * parts.get("nvme.optimizer", 0) + 2 * parts.get("nvme.grads", 0)


def swap_problems(numels: list[int], layout: PlanLayout, dtype_bytes: int, zero: ZeroSettings) -> list[str]:
    """What DeepSpeed 0.19 refuses (an assertion at start-up or at the first step) in this rank's NVMe offload:
    a swapped parameter partition larger than one parameter swap buffer, fewer optimizer swap buffers than Adam
    swaps in at once (master, two moments and the gradient)."""
    problems, n, e = [], layout.zero_group, dtype_bytes
    if layout.zero_stage != 3:
        return problems
    if layout.offload_params == "nvme":
        biggest = max((-(-x // n) for x in numels if -(-x // n) * e >= zero.min_aio_bytes), default=0)
        if biggest > zero.param_buffer_size:
            problems.append(f"offload_params='nvme': a parameter partition of {biggest} elements exceeds "
                            f"offload_param.buffer_size={zero.param_buffer_size} (raise buffer_size to >= {biggest})")
    if layout.offload_optimizer == "nvme" and zero.optimizer_buffer_count < 4:
        problems.append(f"offload_optimizer='nvme': offload_optimizer.buffer_count={zero.optimizer_buffer_count} "
                        "is fewer than the 4 buffers Adam's step swaps in (master, 2 moments, gradient)")
    return problems


# --- activations -------------------------------------------------------------------------------------------------

def _shape(layout: PlanLayout, *, seq_len: int, dtype_bytes: int) -> MicroBatch:
    """One micro-batch of ``layout`` on one rank."""
    s = seq_len // layout.cp
    megatron = layout.sp == "megatron"
    return MicroBatch(b=layout.micro_batch_size, S=seq_len, s=s, sh=s // layout.tp if megatron else s, t=layout.tp,
                      e=dtype_bytes, megatron=megatron, ulysses=layout.sp == "ulysses" and layout.cp > 1)


@functools.lru_cache(maxsize=4096)
def block_bytes(model: ModelSpec, g: MicroBatch) -> int:
    """Bytes one block saves for backward for one micro-batch (the module docstring's formula, written in the
    family's room: :meth:`~shardline.job.family.Family.block_activation_bytes`)."""
    return model.family.block_activation_bytes(model, g)


def embedding_bytes(model: ModelSpec, g: MicroBatch) -> int:
    return model.family.embedding_activation_bytes(model, g)


def head_bytes(model: ModelSpec, g: MicroBatch, *, cp: int) -> int:
    """Final norm, projection input, and the vocab-parallel loss (fp32 softmax, target index, two masks)."""
    d, b, s, e = model.d_model, g.b, g.s, g.e
    norm = model.family.final_norm_activation_bytes(model, g)
    vocab = padded_vocab(model, tp=g.t) // g.t
    return norm + e * b * s * d + W * b * s * vocab + 10 * b * s + W * (1 if cp == 1 else 2)


def stage_bytes(model: ModelSpec, layers: range, g: MicroBatch, layout: PlanLayout) -> int:
    """Bytes one micro-batch leaves saved on a stage of ``layers``."""
    blocks = len(range(max(layers.start, 1), min(layers.stop, model.n_layer + 1)))
    per_block = g.e * g.b * g.sh * model.d_model if layout.recompute == "full" else block_bytes(model, g)
    total = blocks * per_block
    if 0 in layers:
        total += embedding_bytes(model, g)
    if model.n_layer + 1 in layers:
        total += head_bytes(model, g, cp=layout.cp)
    return total


@functools.lru_cache(maxsize=4096)
def _interleaved_order(p: int, m: int, v: int, r: int) -> tuple[int, np.ndarray, np.ndarray]:
    """``(warmup, forward chunks, backward chunks)`` of pipeline rank ``r`` under Megatron's interleaved 1F1B
    (:func:`~shardline.job.pipeline.schedule.interleaved_one_f_one_b`): its ``m v`` forwards run chunk
    ``(k // p) % v``, its backwards chunk ``v - 1 - (k // p) % v``; ``warmup`` forwards, then pairs (forward
    ``warmup + k``, backward ``k``), then the remaining backwards."""
    total = m * v
    k = np.arange(total)
    chunk = (k // p) % v
    return min(2 * (p - r - 1) + (v - 1) * p, total), chunk, v - 1 - chunk


def in_flight_peak(layout: PlanLayout, pp_rank: int, per_stage: dict[int, int]) -> tuple[int, dict[int, int]]:
    """``(peak bytes, {stage: micro-batches in flight then})`` on ``pp_rank`` given each hosted stage's bytes per
    micro-batch: 1 at pp = 1, ``m`` for GPipe, ``min(p - r, m)`` for 1F1B; interleaved, the peak over the rank's
    program of ``F_cum[warmup + k] - B_cum[k]`` (the bytes of the forwards run so far minus the backwards, just
    after the ``k``-th steady-state forward; the warm-up only climbs to it and the cool-down only descends)."""
    p, m = layout.pp, layout.micro_batches
    if p == 1 or layout.schedule != "interleaved":
        (stage, nbytes), = per_stage.items()
        count = 1 if p == 1 else m if layout.schedule == "gpipe" else min(p - pp_rank, m)
        return count * nbytes, {stage: count}
    v = layout.chunks
    warmup, fwd, bwd = _interleaved_order(p, m, v, pp_rank)
    chunk_bytes = np.array([per_stage[c * p + pp_rank] for c in range(v)], dtype=np.int64)
    f_cum = np.cumsum(chunk_bytes[fwd])
    total = len(fwd)
    if warmup == total:  # every forward before any backward
        at, done = total - 1, 0
    else:
        b_before = np.concatenate(([0], np.cumsum(chunk_bytes[bwd])[:total - warmup - 1]))
        live = f_cum[warmup:] - b_before
        k = int(np.argmax(live))
        at, done = warmup + k, k
    counts = np.bincount(fwd[:at + 1], minlength=v) - np.bincount(bwd[:done], minlength=v)
    peak = int(f_cum[at] - (chunk_bytes[bwd[:done]].sum() if done else 0))
    return peak, {c * p + pp_rank: int(n) for c, n in enumerate(counts) if n}


# --- the estimate ------------------------------------------------------------------------------------------------

def _buffers(model, layout, g, static: _RankStatic, dtype_bytes) -> dict[str, int]:
    e, z, n = dtype_bytes, layout.zero_stage, layout.zero_group
    buckets = {0: min(static.psi, ALLREDUCE_BUCKET_SIZE) if n > 1 else 0, 1: REDUCE_BUCKET_SIZE,
               2: 2 * REDUCE_BUCKET_SIZE, 3: REDUCE_BUCKET_SIZE}[z] * e
    gather = 0
    if z == 3:
        prefetch = min(PREFETCH_BUCKET_SIZE, static.big_sum - static.big_max) if layout.pp == 1 else 0
        gather = min(MAX_LIVE_PARAMETERS, static.big_max + prefetch) * e
    logits = g.b * g.s * padded_vocab(model, tp=g.t) // g.t * (e + W) if static.has_head else 0
    p2p = 2 * g.b * g.sh * model.d_model * e if layout.pp > 1 else 0
    return {"buffers.buckets": buckets, "buffers.zero3_gather": gather, "buffers.logits": logits,
            "buffers.p2p": p2p}


def representative_ranks(model: ModelSpec, layout: PlanLayout) -> list[int]:
    """The pipeline ranks that can be the most loaded: the first of each distinct cut (the per-chunk block counts
    and whether the embedding/head are there). A later rank with the same cut holds the same parameters and no
    more activations (1F1B keeps ``min(p - r, m)`` micro-batches, interleaving's warm-up shrinks with ``r``, GPipe
    keeps ``m`` everywhere)."""
    chunks = layout.chunks if layout.pp > 1 else 1
    seen, out = set(), []
    for r in range(layout.pp):
        cut = tuple((len(layers), 0 in layers, model.n_layer + 1 in layers)
                    for _, layers in _rank_static(model, layout.tp, layout.pp, chunks, r).stages)
        if cut not in seen:
            seen.add(cut)
            out.append(r)
    return out


def estimate(model: ModelSpec, layout: PlanLayout, *, seq_len: int, dtype_bytes: int = 2,
             overhead_bytes: int = FIXED_OVERHEAD_BYTES, pp_ranks: list[int] | None = None,
             zero: ZeroSettings = DEFAULT_ZERO) -> MemoryEstimate:
    """Bytes per GPU for every pipeline rank of ``layout`` training ``model`` on ``seq_len``-token sequences with
    ``dtype_bytes`` activations/weights (2: bf16 mixed precision, 4: float32); see the module docstring.
    ``pp_ranks`` limits it to those pipeline ranks (the planner passes :func:`representative_ranks`: the most
    loaded rank is among them). ``zero``: the DeepSpeed settings of ZeRO-3's sub-groups and NVMe offload
    (:meth:`ZeroSettings.from_deepspeed` reads them from a DeepSpeed config).

    RecipeError naming every bad value when the layout cannot run the model (or DeepSpeed would refuse its NVMe
    offload's settings)."""
    problems = layout_problems(model, layout, seq_len=seq_len, dtype_bytes=dtype_bytes)
    if problems:
        raise RecipeError(f"model {model.name!r} cannot be estimated on {layout}: " + "; ".join(problems))
    g = _shape(layout, seq_len=seq_len, dtype_bytes=dtype_bytes)
    ranks = []
    for r in range(layout.pp) if pp_ranks is None else pp_ranks:
        static = _rank_static(model, layout.tp, layout.pp, layout.chunks if layout.pp > 1 else 1, r)
        swap = swap_problems(list(static.numels), layout, dtype_bytes, zero)
        if swap:
            raise RecipeError(f"model {model.name!r} cannot be estimated on {layout} (pipeline rank {r}): "
                              + "; ".join(swap))
        states = _states(static.sizes, static.numels, static.shadow, layout, dtype_bytes, zero)
        saved, in_flight = _saved_activations(model, static, g, layout.recompute, layout.cp, layout.pp,
                                              layout.micro_batches, layout.schedule, layout.chunks, r)
        in_flight = dict(in_flight)
        if static.has_blocks and layout.recompute != "full":
            saved += model.family.shared_activation_bytes(model, g)
        recompute = block_bytes(model, g) if static.has_blocks and layout.recompute == "full" else 0
        parts = _buffers(model, layout, g, static, dtype_bytes) | {"buffers.overhead": overhead_bytes}
        detail = {"activations.saved": saved, "activations.recompute": recompute, **parts,
                  "params.shadow": static.shadow * dtype_bytes, "partition_elements": states["partition"],
                  **states["detail"]}
        ranks.append(RankMemory(
            pp_rank=r, rank=r * layout.tp * layout.cp * layout.dp, stages=tuple(s for s, _ in static.stages),
            param_elements=static.psi + static.shadow, optimized_elements=static.psi, params=states["params"],
            grads=states["grads"], optimizer=states["optimizer"], activations=saved + recompute,
            buffers=sum(parts.values()), cpu=states["cpu"], nvme=states["nvme"], in_flight=in_flight,
            detail=detail))
    return MemoryEstimate(model=model, layout=layout, seq_len=seq_len, dtype_bytes=dtype_bytes, ranks=tuple(ranks))


class _ActivationFields(NamedTuple):
    recompute: str
    cp: int
    pp: int
    micro_batches: int
    schedule: str
    chunks: int


@functools.lru_cache(maxsize=65536)
def _saved_activations(model: ModelSpec, static: _RankStatic, g: MicroBatch, recompute: str, cp: int, pp: int,
                       micro_batches: int, schedule: str, chunks: int, pp_rank: int) -> tuple[int, tuple]:
    """``in_flight_peak`` of a rank's stages: the same for every ZeRO stage, offload and dp of a structure, so
    computed once per (cut, micro-batch shape, recompute, schedule) and kept; ``(peak bytes, ((stage, in
    flight), ...))``."""
    # What stage_bytes and in_flight_peak read of a layout (a PlanLayout would check fields they ignore).
    layout = _ActivationFields(recompute=recompute, cp=cp, pp=pp, micro_batches=micro_batches, schedule=schedule,
                               chunks=chunks)
    per_stage = {s: stage_bytes(model, layers, g, layout) for s, layers in static.stages}
    saved, in_flight = in_flight_peak(layout, pp_rank, per_stage)
    return saved, tuple(in_flight.items())


def korthikanti_layer_bytes(*, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one transformer layer, Korthikanti et al. 2022, Table 2 (16-bit activations, 1-byte
    dropout masks): ``sbh(10 + 24/t + 5as/(ht))`` (TP), ``sbh(34 + 5as/h)/t`` (TP + SP; t = 1: no parallelism),
    the ``5as/h`` term dropped under selective recompute, ``2sbh`` under full recompute."""
    if recompute == "full":
        return 2 * s * b * h
    attention = 5 * a * s / h if recompute == "none" else 0.0
    return s * b * h * ((34 + attention) / t if sp else 10 + (24 + attention) / t)


def clear_caches() -> None:
    """Forget the per-layer, per-rank, per-block and pipeline-order tables memoised across :func:`estimate` calls
    (see :func:`shardline.recipes.planning.search.clear_caches`)."""
    for cached in (_layer_numels, _rank_static, block_bytes, _interleaved_order, _saved_activations, _swap_parts):
        cached.cache_clear()


__all__ = ["CATEGORIES", "DEFAULT_ZERO", "FIXED_OVERHEAD_BYTES", "GIB", "MemoryEstimate", "RankMemory", "ZeroSettings",
           "block_bytes", "clear_caches", "estimate", "hosted_stages", "in_flight_peak", "korthikanti_layer_bytes",
           "layer_numels", "layout_problems", "model_states", "padded_vocab", "rank_parameters",
           "representative_ranks", "swap_problems", "swap_traffic", "zero_model_states"]
