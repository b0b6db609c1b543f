"""Step-time model: one optimizer step of a layout on a cluster, split the way the profiler splits a measured
step, from published rates (``job/hardware.yaml``) and closed forms; nothing is fitted to a training run. The costs
of one GEMM and one collective (roofline, alpha-beta, the link a group crosses) live in :mod:`.catalog`. What runs
the layout (precision, attention, overlap and fusion switches, the pipeline cut: ``fused_wgrad``, ``tp_overlap``
... below) is one :class:`~.implementation.Implementation` value.

Notation: ``t, c, p, v, m, b`` = tp, cp, pp, chunks, micro-batches, micro-batch size; ``s`` sequence,
``T = b s / c`` tokens per rank and micro-batch, ``e = 2`` bytes per activation element, ``h`` = d_model.

Compute, per block, micro-batch and TP rank: every GEMM on its own shape (forward ``M,N,K``; backward
input-gradient ``M,K,N`` and weight-gradient ``K,N,M``, the latter accumulated into fp32 under
``fused_wgrad``); memory-bound kernels at bytes / HBM (norms, bias+dropout+residual, GELU/SwiGLU, rotary:
``_layer_elementwise``; backward 2x forward); attention ``flash`` (causal: half of ``4 b s^2 h / t`` FLOPs at
the GPU's ``attention_fraction``, FlashAttention-2/3's published shares; backward 2.5x the forward FLOPs at
63/73 of that rate) or ``materialized`` (Megatron 2022: batched ``QK^T`` and ``PV`` GEMMs per head, softmax
and dropout over the ``s x s`` scores). Recompute ``full`` adds a block forward (with its TP collectives),
``selective`` the core attention (nothing under flash). The optimizer moves ``ADAM_BYTES_*`` per local parameter;
``grad_scale_pass`` adds a read and write of the stage's whole gradient buffer (the DP averaging as its own pass).

Communication: TP 2 all-reduces forward + 2 backward per block, or under Megatron-SP 2 all-gathers + 2
reduce-scatters each way, of ``T h e`` bytes; with ``tp_overlap`` (Megatron's async backward) the
input-gradient collective hides under the weight-gradient GEMM and SP's gathered input is redone under the
input-gradient GEMM, otherwise everything is exposed (shardline's autograd pairs). CP (:func:`_cp_comm`): ring
``c-1`` K/V hops forward; backward ``c-1`` K/V and ``c`` dK/dV hops (K/V and the previous block's dK/dV in one batch
per step, the last dK/dV hop home alone), each on the link it crosses (:func:`ring_hop_link`: NVLink inside a node,
one GPU's NIC share across nodes) and hidden only under the ``1/c`` of the attention core beside it; Ulysses 4
all-to-alls each pass (q, k, v, out), exposed; full recompute replays the forward's. PP: ``2v`` transfers of
``T h e`` (``/t`` under SP or ``pp_scatter_gather``) per micro-batch. ZeRO over ``dp*cp``: stage 0 all-reduce;
1 reduce-scatter + parameter all-gather; 2 the reduce-scatter every micro-batch; 3 all-gather forward and
backward, one per module (each block, the embedding, the head: a collective's latency each), + reduce-scatter
every micro-batch (1.5x stage 2's volume), hidden under the compute it overlaps
(``overlap_dp``; a once-per-step reduction also under the rank's cool-down wait). A collective is not free
when hidden: its NCCL channels hold ``channels`` SMs (job/hardware.yaml, per link), so the compute beside it runs
on ``sms - channels`` SMs for the overlap (a backward GEMM beside a TP collective priced on that many SMs,
waves included; a stage's forward/backward beside ZeRO's traffic ``sms / (sms - channels)`` slower), the
extra time counted as compute; a ring hop beside its attention step pays the same (its link's channels).
Offload copies run on the copy engines (no SMs held) but are charged on the host link (``Cluster.host``):
the optimizer's gradient partition down (fp32: ``OFFLOAD_GRAD_BYTES``) and its bf16 parameters up once per
step, exposed (the CPU step waits for the gradients, the next forward for the parameters); ZeRO-3's parameter
fetches (``offload_params``) each forward and backward pass, hidden under that pass's compute with
``overlap_dp``, exposed without; CPU Adam at the node's DeepSpeed CPU Adam rate over its GPUs
(``Cluster.cpu_adam_params_per_s``: ZeRO-Offload's measured CPU-Adam latency, scaled by the node's DRAM
peak). NVMe offload adds the drive traffic DeepSpeed's swappers make (:func:`~.memory.swap_traffic`, over the
node's drive bandwidth share): the swapped parameter partitions outside the CPU flat read in every forward and
backward pass (beside the host copy) and written back after the step; the swapped sub-groups' master, moments
and fp32 gradients read and written at the step (with DeepSpeed's ``max_in_cpu = 1e9`` most parameters of a rank
stay in CPU RAM).

Pipeline: with per-micro-batch stage times ``t_s``, ``makespan = m max(t_s) + (sum(t_s) - max(t_s)) / v``, i.e.
the bubble fraction ``(p-1)/(v m + p - 1)`` for equal stages (1F1B, GPipe, interleaved); the first stage holds
the embedding, the last the head and loss, so the last is usually the slowest.

Output: the busiest stage's step split by the profiler's exclusive labels (``shardline.profiling.partition``:
``LABELS``, a comm column being its *exposed* time, plus ``OVERLAP_COLUMNS``); pipeline p2p is ``p2p_send``,
offload ``memcpy_h2d``/``memcpy_d2h``, a CPU optimizer ``idle``; the CP ring's hops are ``p2p_send`` (shardline's ring
runs them under ``sl:comm:cp:p2p_send``), Ulysses' ``all_to_all``. MFU uses Megatron's model FLOPs
(:func:`model_flops`).

One file: every term above is priced on one ``_Setup`` and booked on one ``_Ledger`` whose parts must sum to
the step, as the profiler's categories do.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from shardline.job.pipeline import theory
from shardline.job.stages import uniform_bounds
from shardline.profiling.table.partition import LABELS, OVERLAP_COLUMNS
from shardline.recipes.planning import catalog as hw
from shardline.recipes.planning.catalog import Cluster, Gpu, GroupLink, PlanError
from shardline.recipes.planning.implementation import SHARDLINE, Attention, Cut, Implementation, Precision
from shardline.recipes.planning.layout import PlanLayout
from shardline.recipes.planning.memory import ZeroSettings, rank_parameters, swap_traffic
from shardline.recipes.planning.models import ModelSpec

DTYPES = tuple(p.value for p in Precision)
ATTENTION = tuple(a.value for a in Attention)
CUTS = tuple(c.value for c in Cut)
FLASH_BWD_OVER_FWD = 0.63 / 0.73  # FlashAttention-2 (Dao 2023): backward vs forward share of A100 peak
# Optimizer bytes per local parameter on the GPU: gradient norm (read 4), Adam (fp32 p, m, v, g read, p, m, v
# written: 28), master -> bf16 copy (read 4, write 2), gradient-buffer zeroing (4); fp16 adds loss-scale
# unscale + inf check (read 4, write 4). On the CPU: DeepSpeed's CPU Adam at its measured rate
# (``Cluster.cpu_adam_params_per_s``, job/hardware.yaml's cpu_adam_gparams).
ADAM_BYTES_GPU, ADAM_BYTES_FP16_EXTRA = 42, 8
# DeepSpeed's CPU-offloaded optimizer receives its gradient partition in the master dtype (fp32): the GPU converts
# it before the copy (stage_1_and_2.async_inplace_copy_grad_to_fp32_buffer_from_gpu, stage3's
# _offload_grad_partition_at_boundary), so 4 bytes per element cross the host link.
OFFLOAD_GRAD_BYTES = 4
COMM_LABELS = tuple(c[len("overlapped_"):] for c in OVERLAP_COLUMNS)


@dataclass(frozen=True)
class StepPrediction:
    """One step on the reported rank. ``time_s`` holds the profiler's exclusive labels (summing to ``step_s``),
    ``overlapped_s`` its ``overlapped_<comm>`` columns; FLOPs are per step for the whole job."""

    step_s: float
    time_s: dict[str, float]
    overlapped_s: dict[str, float]
    model_flops: float
    hardware_flops: float
    tokens: int
    world: int
    peak_flops: float
    stage: int

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.step_s / self.world

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (Megatron's convention)."""
        return self.model_flops / self.step_s / self.world / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs / (step * world * peak)."""
        return self.model_flops / (self.step_s * self.world * self.peak_flops)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs (recompute included) / (step * world * peak)."""
        return self.hardware_flops / (self.step_s * self.world * self.peak_flops)

    @property
    def exposed_comm_s(self) -> float:
        return sum(self.time_s[c] for c in COMM_LABELS)

    def categories(self) -> dict[str, float]:
        """The plan's summary columns: compute, all_reduce, all_gather, reduce_scatter, all_to_all, p2p, bubble,
        offload, idle, and exposed_comm (the sum of the exposed comm columns, p2p included)."""
        t = self.time_s
        out = {k: t[k] for k in ("compute", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
        out.update(p2p=t["p2p_send"] + t["p2p_recv"], bubble=t["bubble"],
                   offload=t["memcpy_h2d"] + t["memcpy_d2h"], idle=t["idle"], exposed_comm=self.exposed_comm_s)
        return out


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """``(p-1) / (v m + p - 1)``: the idle share of a pipeline of equal stages (1F1B, GPipe, interleaved), as
    :mod:`shardline.job.pipeline.theory` states it."""
    return theory.bubble_fraction("interleaved" if v > 1 else "1f1b", p=p, m=m, v=v)


def pipeline_makespan(stage_s: list[float], *, micro_batches: int, chunks: int = 1) -> float:
    """``m * max(t_s) + (sum(t_s) - max(t_s)) / v``: the slowest stage runs all ``m`` micro-batches back to back,
    and the fill/drain crosses every other stage once (in chunks of ``1/v`` when interleaved)."""
    slowest = max(stage_s)
    return micro_batches * slowest + (sum(stage_s) - slowest) / chunks


def model_flops(model: ModelSpec, *, seq_len: int, batch: int) -> float:
    """Megatron's model FLOPs per step (Narayanan et al. 2021, Korthikanti et al. 2022 App. A): forward + backward
    = 3x the forward's ``2 * tokens * (matmul weights)`` + ``4 B s^2 (heads x head_dim)`` per layer + the logits
    ``2 B s h V``; no recompute, full (non-causal) attention. For GPT shapes (MHA, ``d_ff = 4h``) this is exactly
    ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``."""
    d, hd, f = model.d_model, model.dim_per_head, model.d_ff
    q, kv = model.n_head * hd, model.kv_heads * hd
    mlp = model.family.mlp_matrices * d * f
    weights = d * (q + 2 * kv) + q * d + mlp
    tokens = batch * seq_len
    per_layer = 2 * tokens * weights + 4 * batch * seq_len ** 2 * q
    return 3 * (model.n_layer * per_layer + 2 * tokens * d * model.vocab_size)



@dataclass
class _Ledger:
    """Seconds of one rank: compute, and per comm label the exposed and the overlapped (hidden) parts."""

    compute: float = 0.0
    exposed: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    overlapped: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def comm(self, label: str, seconds: float, *, hidden_under: float = 0.0) -> None:
        hidden = min(seconds, max(hidden_under, 0.0))
        self.overlapped[label] += hidden
        self.exposed[label] += seconds - hidden

    def overlap(self, label: str, seconds: float, *, alone: float, squeezed: float) -> float:
        """A collective of ``seconds`` run beside compute that takes ``alone`` on the whole GPU and ``squeezed``
        on the SMs the collective leaves it: the compute slows while they overlap (its extra time is compute),
        and what outlasts the squeezed compute is exposed. Returns the exposed seconds."""
        alone, squeezed = max(alone, 0.0), max(squeezed, alone, 0.0)
        if seconds >= squeezed:
            self.compute += squeezed - alone
            self.overlapped[label] += squeezed
            self.exposed[label] += seconds - squeezed
            return seconds - squeezed
        self.compute += seconds * (1 - alone / squeezed)  # squeezed > seconds >= 0
        self.overlapped[label] += seconds
        return 0.0

    def add(self, other: _Ledger, times: float = 1.0) -> None:
        self.compute += times * other.compute
        for label, value in other.exposed.items():
            self.exposed[label] += times * value
        for label, value in other.overlapped.items():
            self.overlapped[label] += times * value

    @property
    def busy(self) -> float:
        return self.compute + sum(self.exposed.values())


@dataclass(frozen=True)
class _Setup:
    model: ModelSpec
    layout: PlanLayout
    cluster: Cluster
    seq_len: int
    impl: Implementation

    @property
    def gpu(self) -> Gpu:
        return self.cluster.gpu

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (the CP shard)."""
        return self.layout.micro_batch_size * self.seq_len // self.layout.cp

    def link(self, dim: str) -> GroupLink:
        return self._links[dim]

    @functools.cached_property
    def _links(self) -> dict[str, GroupLink]:
        lay = self.layout
        groups = {"tp": (lay.tp, 1), "cp": (lay.cp, lay.tp), "zero": (lay.zero_group, lay.tp),
                  "pp": (lay.pp, lay.tp * lay.cp * lay.dp)}
        return {dim: hw.group_link(self.cluster, size=max(size, 2), stride=stride)
                for dim, (size, stride) in groups.items()}

    def free_sms(self, link: GroupLink) -> int:
        """The SMs compute keeps while a collective on ``link`` runs (its NCCL channels hold the others)."""
        return max(1, self.gpu.sms - link.channels)

    def squeeze(self, link: GroupLink) -> float:
        """How much longer compute made of many kernels runs beside a collective on ``link``:
        ``sms / (sms - channels)``."""
        return self.gpu.sms / self.free_sms(link)

    def gemm(self, m: int, n: int, k: int, batch: int = 1, sms: int | None = None) -> float:
        return hw.gemm_s(self.gpu, m, n, k, dtype=self.impl.dtype, batch=batch, sms=sms)

    def wgrad(self, m: int, n: int, k: int, sms: int | None = None) -> float:
        """A weight-gradient GEMM: accumulated into an fp32 buffer in its epilogue (``fused_wgrad``, Megatron's
        gradient-accumulation fusion), or written in bf16 and, with several micro-batches, added to ``.grad``
        by autograd (read, read, write)."""
        if self.impl.fused_wgrad:
            return hw.gemm_s(self.gpu, m, n, k, dtype=self.impl.dtype, out_bytes=8, sms=sms)
        extra = 6 * m * n if self.layout.micro_batches > 1 else 0
        return hw.gemm_s(self.gpu, m, n, k, dtype=self.impl.dtype, sms=sms) + self.hbm(extra)

    def hbm(self, nbytes: float) -> float:
        return nbytes / self.gpu.hbm_bytes_per_s



def _block_gemms(st: _Setup) -> dict[str, tuple[int, int, int]]:
    """Forward GEMM shapes of one block on one TP rank: ``name -> (M, N, K)``."""
    mod, t, tok = st.model, st.layout.tp, st.tokens
    q, kv = mod.n_head * mod.dim_per_head // t, mod.kv_heads * mod.dim_per_head // t
    up = (mod.family.mlp_matrices - 1) * mod.d_ff // t  # the MLP's input projections, fused
    return {"qkv": (tok, q + 2 * kv, mod.d_model), "proj": (tok, mod.d_model, q),
            "fc1": (tok, up, mod.d_model), "fc2": (tok, mod.d_model, mod.d_ff // t)}


def _attention_core(st: _Setup) -> tuple[float, float, float]:
    """Seconds of the attention core on one rank and micro-batch: (forward, backward, selective-recompute)."""
    mod, lay = st.model, st.layout
    heads, hd = mod.n_head // lay.tp, mod.dim_per_head
    b, sq, sk = lay.micro_batch_size, st.seq_len // lay.cp, st.seq_len
    if st.impl.attention == "flash":
        flops = 4 * b * heads * sq * sk * hd * 0.5  # causal: half the blocks run
        rate = st.gpu.peak_flops("bf16") * st.gpu.attention_fraction
        return flops / rate, 2.5 * flops / (rate * FLASH_BWD_OVER_FWD), 0.0
    batch, e = b * heads, 2
    scores = batch * sq * sk
    qk, av = st.gemm(sq, sk, hd, batch), st.gemm(sq, hd, sk, batch)
    fwd_bytes = (4 * e + 1 if st.impl.dropout else 2 * e) * scores  # softmax r+w, dropout r+w + 1-byte mask
    bwd_bytes = (5 * e + 1 if st.impl.dropout else 3 * e) * scores  # dropout bwd r+r(mask)+w, softmax bwd 2r+w
    fwd = qk + av + st.hbm(fwd_bytes)
    bwd = (st.gemm(sq, hd, sk, batch) + st.gemm(sk, hd, sq, batch) + st.gemm(sq, sk, hd, batch)
           + st.gemm(sk, hd, sq, batch) + st.hbm(bwd_bytes))
    return fwd, bwd, fwd  # Megatron's selective recompute checkpoints the whole core attention


def _layer_elementwise(st: _Setup) -> float:
    """HBM bytes of one block's memory-bound forward kernels on one rank, per element: norms 4 (read, write;
    shardline's eager RMSNorm: 36, its float32 chain x.float, pow, mean, mul, cast, weight-mul), two residual adds
    6 (+1 per dropout mask), GELU 4, SwiGLU 6 (eager: 10), rotary on q,k 4 (eager: 20): the residual adds here,
    the rest in the family's room (``Family.elementwise_bytes``). Norm and residual regions are ``/t`` under
    Megatron-SP, replicated otherwise."""
    mod, lay, e = st.model, st.layout, 2
    region = st.tokens * mod.d_model / (lay.tp if lay.sp == "megatron" else 1)
    hidden = st.tokens * mod.d_ff // lay.tp
    residual = 2 * (3 * e + (1 if st.impl.dropout else 0)) * region
    return residual + mod.family.elementwise_bytes(mod, tokens=st.tokens, region=region, hidden=hidden, tp=lay.tp,
                                                   e=e, eager=not st.impl.fused_kernels)


def _tp_comm(st: _Setup, led: _Ledger, gemms: dict[str, tuple[int, int, int]],
             gemm_bwd: dict[str, tuple[float, float]], recompute_full: bool) -> None:
    """TP collectives of one block and micro-batch (forward, recomputed forward, backward). An overlapped one
    (``tp_overlap``) runs beside its backward GEMM, which then has the SMs the collective leaves it."""
    t = st.layout.tp
    if t == 1:
        return
    link, size = st.link("tp"), st.tokens * st.model.d_model * 2
    free = st.free_sms(link)

    def beside(label: str, seconds: float, name: str, which: int) -> None:
        m, n, k = gemms[name]
        squeezed = st.gemm(m, k, n, sms=free) if which == 0 else st.wgrad(k, n, m, sms=free)
        led.overlap(label, seconds, alone=gemm_bwd[name][which], squeezed=squeezed)
    if st.layout.sp == "megatron":
        ag, rs = hw.all_gather_s(size, t, link), hw.reduce_scatter_s(size, t, link)
        for _ in range(2 if recompute_full else 1):
            led.comm("all_gather", 2 * ag)
            led.comm("reduce_scatter", 2 * rs)
        led.comm("all_gather", 2 * ag)  # backward of the forward reduce-scatters
        for name in ("qkv", "fc1"):  # backward of the forward all-gathers, + the gathered input redone
            if st.impl.tp_overlap:
                beside("reduce_scatter", rs, name, 1)
                beside("all_gather", ag, name, 0)
            else:
                led.comm("reduce_scatter", rs)
        return
    ar = hw.all_reduce_s(size, t, link)
    led.comm("all_reduce", (4 if recompute_full else 2) * ar)
    for name in ("qkv", "fc1"):
        if st.impl.tp_overlap:
            beside("all_reduce", ar, name, 1)
        else:
            led.comm("all_reduce", ar)


def _cp_heads(st: _Setup) -> tuple[int, int]:
    """(query heads, K/V heads) one rank's CP exchanges carry: K/V repeated to the query heads
    (``cp_repeats_kv``, shardline) or the rank's own KV heads (one gathered head when ``tp > n_kv_head``)."""
    mod, t = st.model, st.layout.tp
    q = mod.n_head // t
    return q, (q if st.impl.cp_repeats_kv else max(1, mod.kv_heads // t))


def ring_hop_link(cluster: Cluster, layout: PlanLayout) -> GroupLink:
    """The link one ring-attention hop crosses (rank ``r`` to ``r+1`` of a CP group, ``tp`` apart): the node's
    scale-up link when the whole group sits inside a node; otherwise the hops that leave a node gate every step
    of the (step-synchronous) ring, and each such hop is one GPU sending to one GPU: one GPU's share of the node's
    NICs (``Cluster.nic_bytes_per_s``) at the NIC's latency, its channels the NIC's."""
    link = hw.group_link(cluster, size=max(layout.cp, 2), stride=layout.tp)
    if not link.crosses_nodes:
        return link
    nic = cluster.inter_node
    return GroupLink(cluster.nic_bytes_per_s, nic.latency_s, True, nic.channels)


def _cp_comm(st: _Setup, led: _Ledger, attn_fwd: float, attn_bwd: float, recompute_full: bool) -> None:
    """Context parallelism per block and micro-batch (forward, recomputed forward, backward).

    Ring (``plugins/layers/sp_ring.py``, balanced layout: each of the ``c`` steps computes half a ``local x
    local`` block, ``1/c`` of the attention core): forward, ``c-1`` hops of K/V (``2 b (s/c) heads d e``
    bytes), hop ``k`` beside step ``k``'s attention; backward, one batch per step to the same peer: step 0 K/V,
    steps ``1..c-2`` K/V and the previous block's dK/dV accumulator (``ring_grad_bytes`` per element), step
    ``c-1`` dK/dV, then the last dK/dV hop home with nothing beside it. A hop beside a step's attention holds its
    link's channels: the attention runs ``sms / (sms - channels)`` slower for the overlap (the extra is compute)
    and what outlasts it is exposed ``p2p_send``. Ulysses: 4 all-to-alls each pass (q, k, v in; the output
    back), synchronous, exposed."""
    lay = st.layout
    c = lay.cp
    if c == 1:
        return
    heads_q, heads_kv = _cp_heads(st)
    hd, e, passes = st.model.dim_per_head, 2, 2 if recompute_full else 1
    if lay.sp == "ring":
        hop = ring_hop_link(st.cluster, lay)
        kv = 2 * lay.micro_batch_size * (st.seq_len // c) * heads_kv * hd * e
        dkv = kv // e * st.impl.ring_grad_bytes
        squeeze, fwd_step, bwd_step = st.squeeze(hop), attn_fwd / c, attn_bwd / c

        def beside(nbytes: float, step: float, times: int) -> None:
            one = _Ledger()
            one.overlap("p2p_send", hw.p2p_s(nbytes, hop), alone=step, squeezed=step * squeeze)
            led.add(one, times)
        beside(kv, fwd_step, passes * (c - 1))
        beside(kv, bwd_step, 1)
        beside(kv + dkv, bwd_step, c - 2)
        beside(dkv, bwd_step, 1)
        led.comm("p2p_send", hw.p2p_s(dkv, hop))  # the last dK/dV hop home: nothing left to hide it
        return
    link, tok = st.link("cp"), st.tokens
    q, kvb = tok * heads_q * hd * e, tok * heads_kv * hd * e
    per_pass = 2 * hw.all_to_all_s(q, c, link) + 2 * hw.all_to_all_s(kvb, c, link)  # q, k, v in; out back
    led.comm("all_to_all", (passes + 1) * per_pass)


def _block(st: _Setup) -> tuple[_Ledger, float, float]:
    """One block, one micro-batch, forward + backward (+ recompute): its ledger, and its forward and backward
    compute seconds."""
    gemms = _block_gemms(st)
    fwd_gemm = {n: st.gemm(m, nn, k) for n, (m, nn, k) in gemms.items()}
    bwd_gemm = {n: (st.gemm(m, k, nn), st.wgrad(k, nn, m)) for n, (m, nn, k) in gemms.items()}
    attn_fwd, attn_bwd, attn_redo = _attention_core(st)
    elementwise = st.hbm(_layer_elementwise(st))
    fwd = sum(fwd_gemm.values()) + attn_fwd + elementwise
    bwd = sum(a + b for a, b in bwd_gemm.values()) + attn_bwd + 2 * elementwise
    recompute = {"none": 0.0, "selective": attn_redo, "full": fwd}[st.layout.recompute]
    led = _Ledger(compute=fwd + bwd + recompute)
    _tp_comm(st, led, gemms, bwd_gemm, st.layout.recompute == "full")
    _cp_comm(st, led, attn_fwd, attn_bwd, st.layout.recompute == "full")
    return led, fwd, bwd + recompute


def _embedding_and_head(st: _Setup, first: bool, last: bool) -> _Ledger:
    """The first stage's embedding (vocab-parallel: an all-reduce, or a reduce-scatter under SP) and the last
    stage's final norm, logits GEMM and vocab-parallel cross-entropy (3 small all-reduces of ``T`` floats);
    cross-entropy moves ``T V/t (2e + 12)`` bytes (logits read, fp32 copy written and read twice, grad written)."""
    mod, lay, e = st.model, st.layout, 2
    led = _Ledger()
    link, size, t = st.link("tp"), st.tokens * mod.d_model * e, lay.tp
    sp = lay.sp == "megatron"
    if first:
        led.compute += st.hbm(4 * size)
        led.comm("reduce_scatter" if sp else "all_reduce",
                 hw.reduce_scatter_s(size, t, link) if sp else hw.all_reduce_s(size, t, link))
    if last:
        m, n, k = st.tokens, -(-mod.vocab_size // t), mod.d_model  # vocab rows per rank, padded
        led.compute += (st.gemm(m, n, k) + st.gemm(m, k, n) + st.wgrad(k, n, m)
                        + st.hbm(st.tokens * n * (2 * e + 12) + 6 * size / (t if sp else 1)))
        if sp:
            led.comm("all_gather", hw.all_gather_s(size, t, link))
            led.comm("reduce_scatter", hw.reduce_scatter_s(size, t, link))
        else:
            led.comm("all_reduce", hw.all_reduce_s(size, t, link))
        led.comm("all_reduce", 3 * hw.all_reduce_s(st.tokens * 4, t, link))
    return led



def stage_layers(n_layer: int, pp: int, chunks: int, *, cut: str = "blocks") -> list[int]:
    """Blocks per pipeline rank; rank ``s`` holds virtual stages ``s, s+pp, ...`` of ``pp * chunks``.

    ``blocks`` (Megatron-LM): the blocks alone are cut, ``n_layer // (pp*chunks)`` per virtual stage and the first
    ``n_layer % (pp*chunks)`` one more. ``layers`` (shardline, :func:`~.memory.hosted_stages`): the
    ``n_layer + 2`` layers (embedding, blocks, head) are cut uniformly, stage ``k`` taking
    ``[k (n+2)/(pp*chunks), (k+1) (n+2)/(pp*chunks))``, so the first and last stages hold fewer blocks."""
    virtual = pp * chunks
    if cut == "layers" and pp > 1:
        blocks = [len(range(max(first, 1), min(end, n_layer + 1)))
                  for first, end in uniform_bounds(n_layer + 2, virtual)]
        return [sum(blocks[s::pp]) for s in range(pp)]
    base, extra = divmod(n_layer, virtual)
    sizes = [base + (1 if j < extra else 0) for j in range(virtual)]
    return [sum(sizes[s::pp]) for s in range(pp)]


def _stage_params(st: _Setup, stage: int, layers: int) -> float:
    """Parameters one rank of ``stage`` holds before ZeRO (TP-sharded; a tied embedding's copy on the last)."""
    mod, lay = st.model, st.layout
    n = layers * mod.block_params()
    if stage == 0:
        n += mod.embedding_params()
    if stage == lay.pp - 1:
        n += mod.head_params() + (mod.vocab_size * mod.d_model if mod.tie_embeddings and lay.pp > 1 else 0)
    return n / lay.tp


def _swap_io(st: _Setup, stage: int, params: float, cut: str, zero: ZeroSettings) -> tuple[float, float]:
    """``(drive bytes per forward or backward pass, drive bytes per optimizer step)`` of one rank of ``stage``:
    DeepSpeed's split (:func:`~.memory.swap_traffic`) under shardline's cut; under ``cut='blocks'`` every
    partition swapped (parameters read each pass, written after the step; master, moments and gradients
    read and written)."""
    lay = st.layout
    if lay.zero_stage != 3 or "nvme" not in (lay.offload_optimizer, lay.offload_params):
        return 0.0, 0.0
    if cut == "layers":
        numels, _ = rank_parameters(st.model, lay, stage)
        return swap_traffic(numels, lay, 2, zero)
    local = params / lay.zero_group
    passes = 2 * local if lay.offload_params == "nvme" else 0.0
    return passes, passes + (2 * 16 * local if lay.offload_optimizer == "nvme" else 0.0)


def _stage(st: _Setup, stage: int, layers: int, block: tuple[_Ledger, float, float], params: float,
           drive_pass: float) -> _Ledger:
    """One pipeline rank, one micro-batch: its blocks, embedding/head, pipeline transfers, and the per-micro-batch
    ZeRO-2/3 collectives and parameter offload hidden (``overlap_dp``) under its forward/backward compute."""
    lay, e = st.layout, 2
    led, fwd, bwd = _Ledger(), layers * block[1], layers * block[2]
    led.add(block[0], layers)
    led.add(_embedding_and_head(st, stage == 0, stage == lay.pp - 1))
    if lay.pp > 1:
        sharded = lay.sp == "megatron" or (st.impl.pp_scatter_gather and lay.tp > 1)
        size = st.tokens * st.model.d_model * e
        led.comm("p2p_send", 2 * lay.chunks * hw.p2p_s(size / (lay.tp if sharded else 1), st.link("pp")))
        if st.impl.pp_scatter_gather and lay.sp != "megatron" and lay.tp > 1:
            led.comm("all_gather", 2 * lay.chunks * hw.all_gather_s(size, lay.tp, st.link("tp")))
    n, link = lay.zero_group, st.link("zero")
    fwd_window, bwd_window = (fwd, bwd) if st.impl.overlap_dp else (0.0, 0.0)
    squeeze = st.squeeze(link)

    def beside(label: str, seconds: float, window: float) -> None:
        led.overlap(label, seconds, alone=window, squeezed=window * squeeze)

    if lay.zero_stage == 2:
        beside("reduce_scatter", hw.reduce_scatter_s(params * st.impl.grad_bytes, n, link), bwd_window)
    if lay.zero_stage == 3:  # gathered module by module (each block, the embedding, the head): a latency each
        modules = max(1, layers + (stage == 0) + (stage == lay.pp - 1))
        gather = modules * hw.all_gather_s(params * e / modules, n, link)
        beside("all_gather", gather, fwd_window)
        beside("all_gather", gather, bwd_window)
        beside("reduce_scatter", hw.reduce_scatter_s(params * st.impl.grad_bytes, n, link),
               max(0.0, bwd_window - gather / squeeze))
    if lay.offload_params != "none":
        local = params / n * e
        seconds = local / st.cluster.host.bytes_per_s
        seconds += drive_pass / (st.cluster.nvme_gbps * 1e9 / st.cluster.gpus_per_node)
        led.comm("memcpy_h2d", seconds, hidden_under=fwd_window)
        led.comm("memcpy_h2d", seconds, hidden_under=bwd_window)
    return led


@dataclass
class _Tail:
    """After the pipeline: the ledger, the part of its exposed comm that sits inside the bubble (the rank's
    cool-down wait), and the seconds the GPU waits for a CPU optimizer."""

    ledger: _Ledger
    in_bubble: float
    cpu_s: float

    @property
    def duration(self) -> float:
        return self.ledger.busy - self.in_bubble + self.cpu_s


def _tail(st: _Setup, stage: int, params: float, bwd_window: float, cooldown: float, drive_step: float) -> _Tail:
    """Once per step on ``stage``: the ZeRO-0/1 gradient reduction (hidden under the last backward, then the
    cool-down wait), the tied-embedding all-reduce between the first and last stage, the optimizer (GPU, or CPU
    with its host traffic) and ZeRO-1/2's parameter all-gather."""
    lay, cl, e = st.layout, st.cluster, 2
    led, n, link = _Ledger(), lay.zero_group, st.link("zero")
    in_bubble = 0.0
    if lay.zero_stage in (0, 1) and n > 1:
        label = "all_reduce" if lay.zero_stage == 0 else "reduce_scatter"
        size = params * st.impl.grad_bytes
        seconds = hw.all_reduce_s(size, n, link) if lay.zero_stage == 0 else hw.reduce_scatter_s(size, n, link)
        window = bwd_window if st.impl.overlap_dp else 0.0
        exposed = led.overlap(label, seconds, alone=window, squeezed=window * st.squeeze(link))
        in_bubble = min(exposed, cooldown) if st.impl.overlap_dp else 0.0
    if lay.pp > 1 and st.model.tie_embeddings and stage in (0, lay.pp - 1):
        pair = hw.group_link(cl, size=2, stride=(lay.pp - 1) * lay.tp * lay.cp * lay.dp)
        led.comm("all_reduce", hw.all_reduce_s(st.model.vocab_size * st.model.d_model / lay.tp * st.impl.grad_bytes, 2,
                                            pair))
    if st.impl.grad_scale_pass:  # the whole gradient buffer divided by the DP size, in place: read, write
        led.compute += st.hbm(2 * st.impl.grad_bytes * params)
    local = params / n if lay.zero_stage >= 1 else params
    cpu_s = 0.0
    if lay.offload_optimizer == "none":
        led.compute += st.hbm((ADAM_BYTES_GPU + (ADAM_BYTES_FP16_EXTRA if st.impl.dtype == "fp16" else 0)) * local)
    else:
        led.comm("memcpy_d2h", local * OFFLOAD_GRAD_BYTES / cl.host.bytes_per_s)
        cpu_s = local / cl.cpu_adam_params_per_s
        led.comm("memcpy_h2d", local * e / cl.host.bytes_per_s)
    # NVMe: master, moments and gradients read and written, the swapped parameters written back
    cpu_s += drive_step / (cl.nvme_gbps * 1e9 / cl.gpus_per_node)
    if lay.zero_stage in (1, 2) and n > 1:
        led.comm("all_gather", hw.all_gather_s(params * e, n, link))
    return _Tail(led, in_bubble, cpu_s)



def _check(model: ModelSpec, layout: PlanLayout, cluster: Cluster, seq_len, impl: Implementation) -> None:
    lay, mod, gpu, cut = layout, model, cluster.gpu, impl.cut
    good_seq = isinstance(seq_len, int) and seq_len >= 1
    rules = [(not good_seq, f"seq_len={seq_len!r} must be an integer >= 1"),
             (impl.dtype == "fp8" and gpu.fp8_tflops is None,
              f"dtype='fp8' but gpu {gpu.name!r} has no FP8 tensor cores"),
             *((value % lay.tp != 0, f"{name}={value} is not divisible by tp={lay.tp}")
               for name, value in (("n_head", mod.n_head), ("d_ff", mod.d_ff))),
             (mod.kv_heads % lay.tp != 0 and (lay.tp % mod.kv_heads != 0
                                              or mod.dim_per_head % (lay.tp // mod.kv_heads) != 0),
              f"kv heads={mod.kv_heads} cannot be spread over tp={lay.tp} (neither divides the other, or head_dim="
              f"{mod.dim_per_head} is not divisible by tp/kv heads)"),
             (cut == "blocks" and mod.n_layer < lay.pp * lay.chunks,
              f"n_layer={mod.n_layer} < pp*chunks={lay.pp * lay.chunks} (a block per virtual stage)"),
             (cut == "layers" and mod.n_layer + 2 < lay.pp * lay.chunks,
              f"n_layer + 2 = {mod.n_layer + 2} layers < pp*chunks={lay.pp * lay.chunks} (a layer per virtual "
              f"stage)"),
             (good_seq and seq_len % lay.cp != 0, f"seq_len={seq_len} is not divisible by cp={lay.cp}"),
             (lay.sp == "ulysses" and mod.n_head % (lay.tp * lay.cp) != 0,
              f"sp='ulysses' needs n_head={mod.n_head} divisible by tp*cp={lay.tp * lay.cp}"),
             (lay.offload_params != "none" and lay.zero_stage != 3,
              f"offload_params={lay.offload_params!r} needs zero_stage=3 (zero_stage={lay.zero_stage})"),
             (lay.offload_optimizer != "none" and lay.zero_stage == 0,
              f"offload_optimizer={lay.offload_optimizer!r} needs zero_stage >= 1")]
    problems = [message for bad, message in rules if bad]
    if problems:
        raise PlanError(f"cannot price {mod.name!r} on {cluster.name!r}: " + "; ".join(problems))


def predict(model: ModelSpec, layout: PlanLayout, cluster: Cluster, *, seq_len: int,
            impl: Implementation = SHARDLINE, **changes: Any) -> StepPrediction:
    """One optimizer step of ``layout`` training ``model`` on ``cluster`` (see the module docstring), run by
    ``impl`` (:class:`~.implementation.Implementation`: :data:`~.implementation.SHARDLINE`, the default, or
    :data:`~.implementation.MEGATRON`, ...). ``changes``: fields of ``impl`` to change for this call
    (``predict(..., overlap_dp=False)`` is ``predict(..., impl=replace(impl, overlap_dp=False))``)."""
    st, stages, tails, makespan, step = _solve(model, layout, cluster, seq_len, impl.with_(**changes))
    m = layout.micro_batches
    busiest = max(range(layout.pp), key=lambda s: (m * stages[s].busy + tails[s].ledger.busy, s))
    return _prediction(st, stages[busiest], tails[busiest], makespan, step, busiest)


def predict_stages(model: ModelSpec, layout: PlanLayout, cluster: Cluster, *, seq_len: int,
                   impl: Implementation = SHARDLINE, **changes: Any) -> list[StepPrediction]:
    """:func:`predict` for every pipeline rank: element ``r`` is pipeline rank ``r``'s step (global ranks
    ``r*tp*cp*dp ...``; TP, CP and DP peers of a pipeline rank are priced alike). :func:`predict` returns the
    busiest of them (the most compute and exposed communication, the last of equals). Same arguments."""
    st, stages, tails, makespan, step = _solve(model, layout, cluster, seq_len, impl.with_(**changes))
    return [_prediction(st, stages[s], tails[s], makespan, step, s) for s in range(layout.pp)]


def block_seconds(model: ModelSpec, layout: PlanLayout, cluster: Cluster, *, seq_len: int,
                  impl: Implementation = SHARDLINE, **changes: Any) -> tuple[float, float]:
    """One transformer block, one micro-batch of ``layout`` on one rank: ``(compute seconds, exposed
    communication seconds)`` of its forward, backward and recompute (what a per-layer measurement such as
    Korthikanti et al.'s Table 4 times). Arguments as :func:`predict`'s (the block's cost reads only its
    precision, attention, dropout, TP overlap, kernel fusion and, under CP, ``cp_repeats_kv`` and
    ``ring_grad_bytes``)."""
    impl = impl.with_(**changes)
    _check(model, layout, cluster, seq_len, impl.with_(cut=Cut.BLOCKS))
    led, _, _ = _block(_Setup(model, layout, cluster, seq_len, impl))
    return led.compute, sum(led.exposed.values())


def _solve(model, layout, cluster, seq_len, impl: Implementation):
    _check(model, layout, cluster, seq_len, impl)
    st = _Setup(model, layout, cluster, seq_len, impl)
    lay, cut, zero = layout, impl.cut, impl.zero
    block = _block(st)
    layers = stage_layers(model.n_layer, lay.pp, lay.chunks, cut=cut)
    params = [_stage_params(st, s, n) for s, n in enumerate(layers)]
    io = [_swap_io(st, s, params[s], cut, zero) for s in range(lay.pp)]
    alike: dict[tuple, _Ledger] = {}  # interior stages of equal size cost the same
    stages = []
    for s, n in enumerate(layers):
        key = (n, s == 0, s == lay.pp - 1)
        if key not in alike:
            alike[key] = _stage(st, s, n, block, params[s], io[s][0])
        stages.append(alike[key])
    times = [led.busy for led in stages]
    makespan = pipeline_makespan(times, micro_batches=lay.micro_batches, chunks=lay.chunks)
    bwd = [n * block[2] for n in layers]
    tails = [_tail(st, s, params[s], bwd[s], sum(bwd[:s]) / lay.chunks, io[s][1]) for s in range(lay.pp)]
    step = makespan + max(t.duration for t in tails)
    return st, stages, tails, makespan, step


def _prediction(st: _Setup, stage: _Ledger, tail: _Tail, makespan: float, step: float, rank: int) -> StepPrediction:
    lay, m = st.layout, st.layout.micro_batches
    total = _Ledger()
    total.add(stage, m)
    total.add(tail.ledger)
    time_s = dict.fromkeys(LABELS, 0.0)
    time_s["compute"] = total.compute
    for label, value in total.exposed.items():
        time_s[label] += value
    time_s["bubble"] = makespan - m * stage.busy - tail.in_bubble
    time_s["idle"] = max(0.0, step - makespan - tail.duration + tail.cpu_s)  # >= 0 up to rounding
    overlapped = {col: total.overlapped.get(col[len("overlapped_"):], 0.0) for col in OVERLAP_COLUMNS}
    parts = sum(time_s.values())
    if not math.isclose(parts, step, rel_tol=1e-9):  # the partition is exact by construction
        raise AssertionError(f"predicted parts {parts} do not sum to the step {step}")
    flops = model_flops(st.model, seq_len=st.seq_len, batch=lay.global_batch)
    layer_share = 1 - 2 * lay.global_batch * st.seq_len * st.model.d_model * st.model.vocab_size * 3 / flops
    extra = {"none": 0.0, "full": flops * layer_share / 3,
             "selective": 4 * lay.global_batch * st.seq_len ** 2 * st.model.n_head * st.model.dim_per_head
             * st.model.n_layer if st.impl.attention == "materialized" else 0.0}[lay.recompute]
    return StepPrediction(step_s=step, time_s=time_s, overlapped_s=overlapped, model_flops=flops,
                          hardware_flops=flops + extra, tokens=lay.global_batch * st.seq_len, world=lay.world,
                          peak_flops=st.gpu.peak_flops(st.impl.dtype), stage=rank)


__all__ = ["ATTENTION", "DTYPES", "StepPrediction", "block_seconds", "bubble_fraction", "model_flops",
           "pipeline_makespan", "predict", "predict_stages", "ring_hop_link", "stage_layers"]
