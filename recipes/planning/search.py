"""The layout planner: every layout of a model on a cluster that the hard rules allow, priced by the memory
estimator (:mod:`.memory`) and the step-time model (:mod:`.steptime`), ranked fitting-first by predicted step
time (issue 18, section 3).

**What is enumerated.** ``tp`` (a divisor of ``gpus_per_node``: TP stays inside a node), ``cp`` (a divisor of
``seq / 2`` leaving each CP rank's two chunks at least :data:`MIN_CP_CHUNK` tokens; Ring or Ulysses), ``pp`` (at
most one block per virtual stage), ``dp = gpus / (tp cp pp)`` (it must
divide the global batch), the SP mode (``none`` or ``megatron`` when ``tp > 1`` and ``cp = 1``; ``ring`` or
``ulysses`` when ``cp > 1``), the schedule (1F1B, and interleaved 1F1B with ``chunks`` in the powers of two and
the divisors of ``n_layer / pp``, ``micro_batches`` a multiple of ``pp``), the micro-batch size (a divisor of
the replica's batch ``B / dp``; ``micro_batches = B / (dp * micro_batch_size)``), ZeRO stage 0-3, CPU offload
of the optimizer (ZeRO >= 1) and of the parameters (ZeRO-3) and full recompute.

**What is not, and why** (each also stated in :attr:`PlanResult.rejected`, unless the fixed fields leave no
such choice: the GPipe note is left out when ``pp=1`` is fixed or a schedule is): GPipe, whose bubble equals 1F1B's
with ``m`` micro-batches in flight instead of ``min(p - r, m)`` (never faster, never smaller; ``--layout
schedule=gpipe`` still prices it); ``selective`` recompute, which is ``none`` under flash attention (shardline
stores no softmax; priced only with ``attention='materialized'``); NVMe offload (``--layout offload=nvme`` prices
it) since CPU offload is tried first and always cheaper in time.

**Escalation.** Recompute and offload only trade time for memory, so for each structure (tp, cp, sp, pp,
schedule, chunks, micro-batch size) the planner first tries ``(recompute, offload) = (none, none)``; when some
ZeRO stage fits there, nothing heavier is priced (it would only add work or traffic). Otherwise every other
level is priced: ``(full, none), (none, optimizer), (full, optimizer), (none, optimizer + params),
(full, optimizer + params)`` (which of recompute and CPU offload costs less depends on the model and the host
link), each at every ZeRO stage it allows. A micro-batch size at which no level fits ends that structure's
larger micro-batches (memory grows with the micro-batch at every level).

**Fits.** The most loaded rank's estimate (buffers include :data:`~.memory.FIXED_OVERHEAD_BYTES`) must not
exceed the usable HBM: ``hbm_gb`` GiB (HBM capacities are binary: an "80GB" H100 shows CUDA about 79.2 GiB)
times ``1 - headroom``, and the CPU RAM a node's offload needs must not exceed ``cpu_ram_gib`` (given, else the
node type's ``cpu_ram_gib`` in the catalog; with neither, a row that offloads carries a note that its CPU RAM was
not checked). ``headroom`` (default :data:`HEADROOM` = 10%) is the CUDA caching allocator's fragmentation: what
it reserves beyond the tensors alive at the peak. Published reserved-vs-active peaks: torchtitan PR #165 (Llama
7B-class, 8 H100 of 95.04 GiB, FSDP2: 23.92% active vs 32.64% reserved with full AC, 52.13% vs 62.51% with
selective AC: 8.7% and 10.4% of the HBM; FSDP1: 9.0% and 14.3%); llama-recipes PR #165 (LLaMA-7B, FSDP, 8 GPUs:
14.93 GB active, 19.52 GB reserved). A row over the usable HBM but within the HBM itself is **tight**: priced
and listed (``fits`` False, ``tight`` True, after every row that fits), never the best while a row fits.

**Choice.** The step-time model is good to about :data:`ERROR_BAND` (3.44%, its mean error on Korthikanti et
al.'s Table 5; no per-row band is measured yet), so rows within that share of the fastest are ties to it, and
:attr:`PlanResult.pick` is the simplest of them (:func:`simplicity`: no offload, fewer parallel dimensions
crossing nodes, no CP below :func:`cp_floor_tokens`, fewer parallel dimensions, no recompute; then the faster).
:attr:`PlanResult.best` stays the fastest row that fits. :func:`explain` says why the pick beats the next rows,
category by category, and what one change (more nodes, a longer sequence, another GPU) does to it.

A fixed field (``layout={"tp": 8}``, or a complete layout) narrows the enumeration to it; a fixed value the rules
forbid is not dropped: it yields a row that does not fit, or a :class:`~.catalog.PlanError`, naming the numbers.

One file: enumeration, escalation, the fit check and ranking are one search whose rules (above) refer to each
other and fill one :class:`PlanRow` per layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any

from shardline.recipes.planning import catalog as hw
from shardline.recipes.planning import memory as mem
from shardline.recipes.planning import steptime
from shardline.recipes.planning.catalog import Cluster, PlanError
from shardline.recipes.planning.implementation import Implementation
from shardline.recipes.planning.layout import OFFLOAD, RECOMPUTE, SCHEDULES, SP_MODES, PlanLayout
from shardline.recipes.planning.models import ModelSpec
from shardline.recipes.schema import RecipeError

GIB = mem.GIB
#: The share of HBM left to the caching allocator's fragmentation (the module docstring's published figures).
HEADROOM = 0.10
#: Rows whose predicted steps differ by less than this share are ties: the step-time model's mean error on
#: Korthikanti et al.'s Table 5 (tests/recipes/planning/test_steptime.py), no per-row band being measured yet.
ERROR_BAND = 0.0344
#: The smallest CP chunk searched: FlashAttention's 128-row tile (a shorter chunk runs the ring's attention
#: steps on partly empty tiles, and its K/V exchanges are latency-bound).
MIN_CP_CHUNK = 128
#: The ``rejected`` keys that are standing notes on what is never searched, not reasons of this request.
STANDING = ("schedule=gpipe", "recompute=selective", "offload=nvme")
#: ``--layout`` keys: PlanLayout's fields, ``zero`` for ``zero_stage`` and ``offload`` for both offloads
#: (``none``, ``cpu``/``optimizer`` (the optimizer to CPU), ``nvme``, ``cpu+params``/``all`` (optimizer and
#: parameters to CPU), ``nvme+params``).
LAYOUT_KEYS = tuple(f.name for f in dataclasses.fields(PlanLayout)) + ("zero", "offload")
_INT_KEYS = ("tp", "pp", "dp", "cp", "chunks", "zero_stage", "micro_batches", "micro_batch_size")
_OFFLOAD_WORDS = {"none": ("none", "none"), "cpu": ("cpu", "none"), "optimizer": ("cpu", "none"),
                  "nvme": ("nvme", "none"), "cpu+params": ("cpu", "cpu"), "all": ("cpu", "cpu"),
                  "params": ("cpu", "cpu"), "nvme+params": ("nvme", "nvme")}
#: The escalation levels: (recompute, offload_optimizer, offload_params).
LEVELS = (("none", "none", "none"), ("full", "none", "none"), ("none", "cpu", "none"), ("full", "cpu", "none"),
          ("none", "cpu", "cpu"), ("full", "cpu", "cpu"))


def parse_layout(text: str) -> dict[str, Any]:
    """``"tp=8,pp=4,zero=1,offload=cpu,recompute=full"`` as PlanLayout keyword arguments (partial is fine).
    RecipeError naming the bad item."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in re.split(r"[,\s]+", text or ""))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not value:
            raise RecipeError(f"--layout item {item!r} must be key=value (keys: {', '.join(LAYOUT_KEYS)})")
        if key not in LAYOUT_KEYS:
            raise RecipeError(f"--layout key {key!r} is unknown (keys: {', '.join(LAYOUT_KEYS)})")
        if key == "zero":
            key = "zero_stage"
        if key == "offload":
            if value not in _OFFLOAD_WORDS:
                raise RecipeError(f"--layout offload={value!r} must be one of {', '.join(_OFFLOAD_WORDS)}")
            out["offload_optimizer"], out["offload_params"] = _OFFLOAD_WORDS[value]
            continue
        if key in _INT_KEYS:
            try:
                out[key] = int(value)
            except ValueError:
                raise RecipeError(f"--layout {key}={value!r} must be an integer") from None
        else:
            out[key] = value
    return out


# --- results ----------------------------------------------------------------------------------------------------

@dataclass
class PlanRow:
    """One priced layout. ``fits`` is False with ``problems`` naming the numbers when it cannot run or does not
    fit; ``memory`` is None only when the layout could not be estimated at all (a rule it breaks)."""

    layout: PlanLayout
    fits: bool
    memory: mem.MemoryEstimate | None
    prediction: steptime.StepPrediction | None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Over the usable HBM (the allocator's headroom) but within the HBM: priced, never the best while a row fits.
    tight: bool = False

    @property
    def step_s(self) -> float:
        return self.prediction.step_s if self.prediction is not None else math.inf

    def to_json(self) -> dict[str, Any]:
        lay, pred = self.layout, self.prediction
        row: dict[str, Any] = {k: getattr(lay, k) for k in (
            "tp", "pp", "dp", "cp", "chunks", "sp", "zero_stage", "offload_optimizer", "offload_params",
            "recompute", "micro_batches", "micro_batch_size")}
        row["schedule"] = lay.schedule
        row["fits"] = self.fits
        row["tight"] = self.tight
        row["memory_gib"] = self.memory.memory_gib() if self.memory is not None else None
        row["cpu_gib_per_gpu"] = self.memory.most_loaded.cpu / GIB if self.memory is not None else None
        row["nvme_gib_per_gpu"] = self.memory.most_loaded.nvme / GIB if self.memory is not None else None
        row["max_memory_rank"] = self.memory.max_memory_rank if self.memory is not None else None
        row["step_s"] = pred.step_s if pred else None
        row["tokens_per_s_per_gpu"] = pred.tokens_per_s_per_gpu if pred else None
        row["tflops_per_gpu"] = pred.tflops_per_gpu if pred else None
        row["mfu"] = pred.mfu if pred else None
        row["time_s"] = pred.categories() if pred else None
        row["problems"] = list(self.problems)
        if self.notes:
            row["notes"] = list(self.notes)
        return row


@dataclass
class PlanResult:
    model: ModelSpec
    cluster: Cluster
    gpus: int
    seq_len: int
    global_batch: int
    dtype: str
    usable_bytes: float
    rows: list[PlanRow]
    rejected: dict[str, str]
    evaluated: int
    headroom: float = HEADROOM
    #: ``plan``'s other arguments (dtype, attention, layout, ...), so :func:`explain` can search again with one change.
    request: dict[str, Any] = field(default_factory=dict)
    band: float = ERROR_BAND

    @property
    def fitting(self) -> list[PlanRow]:
        return [r for r in self.rows if r.fits]

    @property
    def tight(self) -> list[PlanRow]:
        return [r for r in self.rows if r.tight]

    @property
    def best(self) -> PlanRow:
        """The fastest row that fits; when none does, the fastest tight row (over the allocator's headroom)."""
        if not self.rows or not (self.rows[0].fits or self.rows[0].tight):
            why = self.rows[0].problems if self.rows else list(self.rejected.values())[:3]
            raise PlanError(f"no layout of {self.model.name!r} fits {self.gpus} x {self.cluster.gpu.name} "
                            f"({self.usable_bytes / GIB:.1f} GiB usable per GPU): " + "; ".join(why))
        return self.rows[0]

    @functools.cached_property
    def ties(self) -> list[PlanRow]:
        """The rows that fit within :attr:`band` of the fastest (the model cannot tell them apart), fastest first;
        empty when nothing fits."""
        fitting = self.fitting
        if not fitting:
            return []
        limit = fitting[0].step_s * (1 + self.band)
        return [r for r in fitting if r.step_s <= limit]

    @functools.cached_property
    def pick(self) -> PlanRow:
        """The layout to run: the simplest of :attr:`ties` (:func:`simplicity`), else :attr:`best`."""
        if not self.ties:
            return self.best
        return min(self.ties, key=lambda r: simplicity(r, self))

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        m, cl = self.model, self.cluster
        rows = self.rows if not top else self.rows[:top]
        out = {
            "model": {**dataclasses.asdict(m), "params": m.params()},
            "cluster": {"name": cl.name, "gpu": cl.gpu.name, "gpus": self.gpus, "gpus_per_node": cl.gpus_per_node,
                        "nodes": max(1, self.gpus // cl.gpus_per_node), "intra_node": cl.intra_node.name,
                        "inter_node": cl.inter_node.name, "nics_per_node": cl.nics_per_node,
                        "hbm_gib": cl.gpu.hbm_gb, "usable_gib": self.usable_bytes / GIB},
            "seq_len": self.seq_len, "global_batch": self.global_batch, "dtype": self.dtype,
            "headroom": self.headroom, "error_band": self.band,
            "evaluated": self.evaluated, "fitting": len(self.fitting), "tight": len(self.tight),
            "layouts": [r.to_json() for r in rows],
            "rejected": dict(self.rejected),
        }
        if self.ties:
            out["pick"] = {**self.pick.to_json(), "layout": describe(self.pick.layout),
                           "why": choice_reason(self)}
            out["equivalent"] = [{"layout": describe(r.layout), "step_s": r.step_s} for r in self.ties
                                 if r is not self.pick]
        return out


# --- enumeration ------------------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_request(model: ModelSpec, cluster: Cluster, gpus, seq_len, global_batch) -> None:
    g = cluster.gpus_per_node
    problems = [f"{k}={v!r} must be an integer >= 1" for k, v in
                (("gpus", gpus), ("seq_len", seq_len), ("global_batch", global_batch))
                if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if not problems:
        if gpus > g and gpus % g:
            problems.append(f"gpus={gpus} is not a whole number of {g}-GPU nodes")
        if gpus < g and g % gpus:
            problems.append(f"gpus={gpus} (one partial node) must divide gpus_per_node={g}")
        if seq_len > model.seq_len:
            problems.append(f"seq_len={seq_len} exceeds the model's seq_len={model.seq_len}")
    if problems:
        raise PlanError(f"plan for {model.name!r} on {cluster.name!r}: " + "; ".join(problems))


def _fixed(fixed: dict[str, Any], key: str, default: list) -> list:
    return [fixed[key]] if key in fixed else default


def _structures(model: ModelSpec, cluster: Cluster, gpus: int, seq_len: int, global_batch: int,
                fixed: dict[str, Any], attention: str, rejected: dict[str, str]):
    """(tp, cp, sp, pp, dp, schedule, chunks, micro_batch_size, micro_batches) the rules allow; what they
    forbid lands in ``rejected`` (one line per family)."""
    node = min(cluster.gpus_per_node, gpus)
    tps = _fixed(fixed, "tp", [t for t in _divisors(node)])
    for tp in tps:
        fam = f"tp={tp}"
        why = [f"n_head={model.n_head}" if model.n_head % tp else "", f"d_ff={model.d_ff}" if model.d_ff % tp else "",
               f"n_kv_head={model.kv_heads}" if model.kv_heads % tp and tp % model.kv_heads else ""]
        why = [w for w in why if w]
        if why:
            rejected[fam] = f"{', '.join(why)} not divisible by tp={tp}"
            continue
        if gpus % tp:
            rejected[fam] = f"tp={tp} does not divide gpus={gpus}"
            continue
        if tp > cluster.gpus_per_node and "tp" not in fixed:
            continue
        for cp in _fixed(fixed, "cp", _divisors(gpus // tp)):
            if cp > 1 and seq_len % (2 * cp):
                rejected.setdefault(f"cp={cp}", f"seq_len={seq_len} is not divisible by 2*cp={2 * cp} "
                                                f"(causal load balancing gives each CP rank two chunks)")
                continue
            if cp > 1 and seq_len // (2 * cp) < MIN_CP_CHUNK and "cp" not in fixed:
                rejected.setdefault(f"cp>={cp}", f"not searched: a CP rank's two chunks of seq_len/(2*cp)="
                                                 f"{seq_len // (2 * cp)} tokens would be under one {MIN_CP_CHUNK}-"
                                                 f"token attention tile")
                break
            if gpus % (tp * cp):
                continue
            sps = (["none", "megatron"] if tp > 1 else ["none"]) if cp == 1 else ["ring", "ulysses"]
            for sp in [fixed["sp"]] if fixed.get("sp") in sps else [] if "sp" in fixed else sps:
                if sp == "ulysses" and (model.n_head // tp) % cp:
                    rejected.setdefault(f"tp={tp},cp={cp},sp=ulysses",
                                        f"ulysses: n_head/tp={model.n_head // tp} is not divisible by cp={cp}")
                    continue
                if sp == "megatron" and (seq_len // cp) % tp:
                    rejected.setdefault(f"tp={tp},sp=megatron",
                                        f"megatron-SP: seq_len={seq_len} is not divisible by tp={tp}")
                    continue
                yield from _pipelines(model, gpus, global_batch, fixed, rejected, tp, cp, sp)


def _pipelines(model, gpus, global_batch, fixed, rejected, tp, cp, sp):
    rest = gpus // (tp * cp)
    for pp in _fixed(fixed, "pp", _divisors(rest)):
        if rest % pp:
            continue
        if pp > model.n_layer:
            rejected.setdefault(f"pp={pp}", f"pp={pp} > n_layer={model.n_layer} (a block per stage)")
            continue
        dp = rest // pp
        if "dp" in fixed and fixed["dp"] != dp:
            continue
        if global_batch % dp:
            rejected.setdefault(f"tp={tp},cp={cp},pp={pp}",
                                f"dp={dp} does not divide global_batch={global_batch}")
            continue
        replica = global_batch // dp
        if pp == 1:
            schedules = [("1f1b", 1)]
        else:
            per = model.n_layer // pp
            chunks = sorted({v for v in range(2, per + 1) if per % v == 0 or v & (v - 1) == 0})
            schedules = [("1f1b", 1)] + [("interleaved", v) for v in chunks]
        if pp == 1 and (fixed.get("chunks", 1) > 1 or fixed.get("schedule") not in (None, "1f1b")):
            continue  # a schedule needs a pipeline (the fixed fields were checked against a fixed pp already)
        if "schedule" in fixed or "chunks" in fixed:
            sched = fixed.get("schedule", "interleaved" if fixed.get("chunks", 1) > 1 else "1f1b")
            v = fixed.get("chunks", 1 if sched != "interleaved" else None)
            schedules = [(sched, c) for c in ([v] if v else [c for s, c in schedules if s == "interleaved"])]
        sizes = []
        for mbs in _fixed(fixed, "micro_batch_size", _divisors(replica)):
            if replica % mbs:
                rejected.setdefault(f"micro_batch_size={mbs}",
                                    f"micro_batch_size={mbs} does not divide global_batch/dp={replica}")
            elif "micro_batches" not in fixed or fixed["micro_batches"] == replica // mbs:
                sizes.append((mbs, replica // mbs))
        if "micro_batches" in fixed and not sizes:
            m = fixed["micro_batches"]
            rejected.setdefault(f"tp={tp},cp={cp},pp={pp},micro_batches={m}", (
                f"micro_batches={m} does not divide global_batch/dp = {global_batch}/{dp} = {replica}"
                if replica % m else f"micro_batches={m} needs micro_batch_size = {replica}/{m} = {replica // m}, "
                                    f"not {fixed.get('micro_batch_size')} (dp={dp})"))
        for schedule, v in schedules:
            fitting = [(mbs, m) for mbs, m in sizes if schedule != "interleaved" or m % pp == 0]
            if fitting:
                yield tp, cp, sp, pp, dp, schedule, v, fitting
            elif schedule == "interleaved" and sizes:  # dropped once per pp, unless another dp allows it (plan)
                rejected.setdefault(f"pp={pp},interleaved", (
                    f"interleaved needs micro_batches a multiple of pp={pp}: global_batch/dp = {global_batch}/{dp} "
                    f"gives micro_batches {sorted({m for _, m in sizes})}"))


def _levels(fixed: dict[str, Any], attention: str):
    levels = list(LEVELS)
    if attention == "materialized":
        levels.insert(1, ("selective", "none", "none"))
    if any(k in fixed for k in ("recompute", "offload_optimizer", "offload_params")):
        keep = []
        # selective only where it differs from none (materialized attention), or where it is asked for
        recomputes = [r for r in RECOMPUTE if r != "selective" or attention == "materialized"
                      or fixed.get("recompute") == "selective"]
        for r, oo, op in levels + [(r, o, p) for r in recomputes for o in OFFLOAD for p in OFFLOAD]:
            if (fixed.get("recompute", r), fixed.get("offload_optimizer", oo), fixed.get("offload_params", op)) \
                    == (r, oo, op) and (r, oo, op) not in keep:
                keep.append((r, oo, op))
        levels = keep
    return levels


def _zero_stages(fixed: dict[str, Any], oo: str, op: str) -> list[int]:
    if "zero_stage" in fixed:
        return [fixed["zero_stage"]]
    if op != "none" or oo == "nvme":
        return [3]
    return [1, 2, 3] if oo != "none" else [0, 1, 2, 3]


def check_fixed(model: ModelSpec, fixed: dict[str, Any], gpus: int) -> None:
    """A fixed field no layout can have is an error naming it (never an empty result)."""
    problems = [f"{k}={fixed[k]!r} must be an integer >= 1" for k in
                ("tp", "pp", "dp", "cp", "chunks", "micro_batches", "micro_batch_size")
                if k in fixed and (not isinstance(fixed[k], int) or isinstance(fixed[k], bool) or fixed[k] < 1)]
    if "zero_stage" in fixed and fixed["zero_stage"] not in (0, 1, 2, 3):
        problems.append(f"zero_stage={fixed['zero_stage']!r} must be 0, 1, 2 or 3")
    if problems:
        raise PlanError("layout: " + "; ".join(problems))
    dims = [k for k in ("tp", "pp", "cp", "dp") if k in fixed]
    product = math.prod(fixed[k] for k in dims)
    if dims and (gpus % product or (len(dims) == 4 and product != gpus)):
        shown = f"{dims[0]}={product}" if len(dims) == 1 else \
            f"{'*'.join(dims)} = {'*'.join(str(fixed[k]) for k in dims)} = {product}"
        raise PlanError(f"layout: {shown} {'!=' if len(dims) == 4 else 'does not divide'} gpus={gpus}")
    pp, cp, tp = fixed.get("pp"), fixed.get("cp"), fixed.get("tp")
    sp, schedule, chunks = fixed.get("sp"), fixed.get("schedule"), fixed.get("chunks", 1)
    rules = [
        (pp is not None and pp > model.n_layer, f"pp={pp} > n_layer={model.n_layer} (a block per stage)"),
        (pp == 1 and (chunks > 1 or schedule not in (None, "1f1b")),
         f"pp=1 has no pipeline schedule (chunks={chunks}, schedule={schedule!r})"),
        (chunks > 1 and schedule not in (None, "interleaved"), f"chunks={chunks} needs schedule='interleaved' "
                                                              f"(schedule={schedule!r})"),
        (pp is not None and pp * chunks > model.n_layer,
         f"pp*chunks = {pp}*{chunks} > n_layer={model.n_layer} (a block per virtual stage)"),
        (sp in ("ring", "ulysses") and cp == 1, f"sp={sp!r} needs cp > 1 (cp=1)"),
        (sp in ("none", "megatron") and cp is not None and cp > 1, f"cp={cp} needs sp='ring' or 'ulysses' "
                                                                   f"(sp={sp!r})"),
        (sp == "megatron" and tp == 1, "sp='megatron' needs tp > 1 (tp=1)"),
    ]
    problems = [message for bad, message in rules if bad]
    if problems:
        raise PlanError("layout: " + "; ".join(problems))


def _node_cpu_bytes(estimate: mem.MemoryEstimate, cluster: Cluster) -> float:
    """The CPU RAM one node's offload needs: the most offloading rank's CPU bytes on every GPU of the node."""
    return max(r.cpu for r in estimate.ranks) * cluster.gpus_per_node


def _fit_problem(estimate: mem.MemoryEstimate, usable: float, cpu_ram: float | None, cluster: Cluster,
                 headroom: float = HEADROOM) -> tuple[list[str], bool]:
    """``(problems, tight)``: what keeps the estimate from running, and whether it is only the allocator's
    headroom (over the usable HBM, within the HBM)."""
    top = estimate.most_loaded
    problems = []
    hbm = cluster.gpu.hbm_gb * GIB
    tight = usable < top.total <= hbm
    if top.total > usable:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in top.categories().items() if k != "total")
        word = "tight" if tight else "does not fit"
        problems.append(f"{word}: {top.total / GIB:.1f} GiB on rank {top.rank} ({parts}) > "
                        f"{usable / GIB:.1f} GiB usable ({hbm / GIB:.0f} GiB HBM less the {100 * headroom:g}% "
                        f"allocator headroom" + (", --headroom lowers it)" if tight else ")"))
    if cpu_ram is not None:
        node_cpu = _node_cpu_bytes(estimate, cluster)
        if node_cpu > cpu_ram:
            problems.append(f"does not fit: offload needs {node_cpu / GIB:.0f} GiB of CPU RAM per node > "
                            f"cpu_ram_gib={cpu_ram / GIB:.0f}")
            tight = False
    return problems, tight


def _check_options(headroom, cpu_ram_gib, predict_kwargs: dict[str, Any]) -> None:
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise PlanError(f"headroom={headroom!r} must be a share of HBM in [0, 1)")
    if cpu_ram_gib is not None and not (isinstance(cpu_ram_gib, (int, float)) and cpu_ram_gib > 0):
        raise PlanError(f"cpu_ram_gib={cpu_ram_gib!r} must be > 0")
    Implementation().with_(**predict_kwargs)  # an unknown or bad field is one error now, not a problem per row


def plan(model: ModelSpec, cluster: Cluster, *, gpus: int, seq_len: int, global_batch: int,
         layout: dict[str, Any] | None = None, top: int | None = None, dtype: str = "bf16",
         attention: str = "flash", headroom: float = HEADROOM, cpu_ram_gib: float | None = None,
         overhead_bytes: int = mem.FIXED_OVERHEAD_BYTES, zero: mem.ZeroSettings = mem.DEFAULT_ZERO,
         **predict_kwargs) -> PlanResult:
    """Every layout of ``model`` on ``gpus`` GPUs of ``cluster`` training ``global_batch`` sequences of
    ``seq_len`` tokens per step (see the module docstring), fitting rows first by predicted step time, then the
    tight ones (over ``headroom``, the allocator's share of HBM, within the HBM) by step time, then the rest by
    memory. ``layout`` fixes fields (PlanLayout's names, or :func:`parse_layout`'s output); ``top``
    keeps that many rows. ``zero``: the DeepSpeed settings the memory estimate follows (ZeRO-3's sub-groups, the
    NVMe offload's buffers; :meth:`~.memory.ZeroSettings.from_deepspeed`). ``predict_kwargs``: fields of the
    :class:`~.implementation.Implementation` priced (``tp_overlap`` ...), passed to :func:`~.steptime.predict`."""
    _check_request(model, cluster, gpus, seq_len, global_batch)
    fixed = dict(layout or {})
    unknown = set(fixed) - {f.name for f in dataclasses.fields(PlanLayout)}
    if unknown:
        raise PlanError(f"layout: unknown field(s) {sorted(unknown)} (fields: {', '.join(LAYOUT_KEYS[:-2])})")
    for key, allowed in (("sp", SP_MODES), ("schedule", SCHEDULES), ("recompute", RECOMPUTE),
                         ("offload_optimizer", OFFLOAD), ("offload_params", OFFLOAD)):
        if key in fixed and fixed[key] not in allowed:
            raise PlanError(f"layout: {key}={fixed[key]!r} must be one of {allowed}")
    check_fixed(model, fixed, gpus)
    _check_options(headroom, cpu_ram_gib, predict_kwargs)
    if all(k in fixed for k in ("tp", "pp", "cp")) and "dp" not in fixed and \
            gpus % (fixed["tp"] * fixed["pp"] * fixed["cp"]) == 0:
        fixed_dp = gpus // (fixed["tp"] * fixed["pp"] * fixed["cp"])
    else:
        fixed_dp = fixed.get("dp")
    if fixed_dp is not None and "micro_batches" in fixed and "micro_batch_size" in fixed:
        product = fixed["micro_batches"] * fixed["micro_batch_size"] * fixed_dp
        if product != global_batch:
            raise PlanError(f"layout: micro_batches*micro_batch_size*dp = {fixed['micro_batches']}*"
                            f"{fixed['micro_batch_size']}*{fixed_dp} = {product} != global_batch={global_batch}")
    usable = cluster.gpu.hbm_gb * GIB * (1 - headroom)
    node_ram_gib = cluster.cpu_ram_gib if cpu_ram_gib is None else cpu_ram_gib  # else the node type's own
    cpu_ram = node_ram_gib * GIB if node_ram_gib is not None else None
    dtype_bytes = 4 if dtype == "fp32" else 2
    rejected: dict[str, str] = {}
    if "schedule" not in fixed and fixed.get("pp") != 1:  # STANDING notes, each only where the search could choose
        rejected["schedule=gpipe"] = ("not searched: the same bubble as 1f1b with m micro-batches in flight instead "
                                      "of min(pp - rank, m) (never faster, never smaller)")
    if attention == "flash" and "recompute" not in fixed:
        rejected["recompute=selective"] = "not searched: equals recompute=none under flash attention"
    if "offload_optimizer" not in fixed and "offload_params" not in fixed:
        rejected["offload=nvme"] = ("not searched: CPU offload is tried first and is never slower "
                                    "(--layout offload=nvme prices it)")
    rows: list[PlanRow] = []
    closest: dict[str, PlanRow] = {}
    evaluated = 0
    explicit = _fully_fixed(fixed)
    interleaved: set[int] = set()  # the pipeline degrees some structure interleaves
    for tp, cp, sp, pp, dp, schedule, v, sizes in _structures(model, cluster, gpus, seq_len, global_batch,
                                                              fixed, attention, rejected):
        family = f"tp={tp},pp={pp},cp={cp}"
        if schedule == "interleaved":
            interleaved.add(pp)
        for mbs, m in sizes:  # ascending: memory grows with the micro-batch at every level
            found = False
            for recompute, oo, op in _levels(fixed, attention):
                level_rows = []
                for z in _zero_stages(fixed, oo, op):
                    try:
                        lay = PlanLayout(tp=tp, pp=pp, dp=dp, cp=cp, chunks=v, sp=sp, schedule=schedule,
                                         zero_stage=z, offload_optimizer=oo, offload_params=op,
                                         recompute=recompute, micro_batches=m, micro_batch_size=mbs)
                    except RecipeError as error:
                        if explicit:
                            raise PlanError(str(error)) from None
                        continue
                    evaluated += 1
                    row = _price(model, lay, cluster, seq_len, dtype, dtype_bytes, attention, usable, cpu_ram,
                                 overhead_bytes, predict_kwargs, explicit, zero, headroom)
                    if tp > cluster.gpus_per_node:
                        row.notes.append(f"tp={tp} > gpus_per_node={cluster.gpus_per_node}: TP crosses the NICs")
                    if cpu_ram is None and row.memory is not None and (oo, op) != ("none", "none"):
                        node = _node_cpu_bytes(row.memory, cluster) / GIB
                        row.notes.append(f"offload needs {node:.0f} GiB of CPU RAM per node (not checked: the "
                                         f"node type's CPU RAM is not known; give cpu_ram_gib / --cpu-ram-gib)")
                    if row.memory is not None and "nvme" in (oo, op):
                        drive = max(r.nvme for r in row.memory.ranks)
                        row.notes.append(f"NVMe offload keeps {drive / GIB:.1f} GiB per GPU on the drive "
                                         f"({drive * cluster.gpus_per_node / GIB:.0f} GiB per node)")
                    level_rows.append(row)
                good = [r for r in level_rows if r.fits]
                found = _keep_tight(rows, level_rows) or found
                if good:
                    rows.extend(good)
                    found = True
                    if (recompute, oo, op) == LEVELS[0]:
                        break  # the base level fits: nothing heavier can be faster
                for row in level_rows:
                    best = closest.get(family)
                    if best is None or (row.memory is not None and (
                            best.memory is None or row.memory.most_loaded.total < best.memory.most_loaded.total)):
                        closest[family] = row
            if not found:
                break  # a larger micro-batch needs more memory at every level
    for pp in interleaved:  # another dp interleaved at this pp: not a rejection of the family
        rejected.pop(f"pp={pp},interleaved", None)
    fitting_families = {f"tp={r.layout.tp},pp={r.layout.pp},cp={r.layout.cp}" for r in rows if r.fits or r.tight}
    for family, row in closest.items():
        if family in fitting_families:
            continue
        rejected[family] = f"{describe(row.layout)}: " + "; ".join(row.problems)
        if not any(r is row for r in rows):
            rows.append(row)
    rows.sort(key=lambda r: (0 if r.fits else 1 if r.tight else 2, r.step_s if r.fits or r.tight else
                             (r.memory.most_loaded.total if r.memory else math.inf)))
    if not rows and all(k in STANDING for k in rejected):
        raise PlanError(f"plan for {model.name!r} on {gpus} GPUs, global batch {global_batch}: no layout has the "
                        f"fixed fields {fixed}")
    request = dict(layout=dict(layout or {}), dtype=dtype, attention=attention, headroom=headroom,
                   cpu_ram_gib=cpu_ram_gib, overhead_bytes=overhead_bytes, zero=zero, **predict_kwargs)
    return PlanResult(model=model, cluster=cluster, gpus=gpus, seq_len=seq_len, global_batch=global_batch,
                      dtype=dtype, usable_bytes=usable, rows=rows[:top] if top else rows, rejected=rejected,
                      evaluated=evaluated, headroom=headroom, request=request)


def _keep_tight(rows: list[PlanRow], level_rows: list[PlanRow]) -> bool:
    """Lists the tight rows of a level (after every row that fits; a heavier level may still fit): any?"""
    tight = [r for r in level_rows if r.tight]
    rows.extend(tight)
    return bool(tight)


def _fully_fixed(fixed: dict[str, Any]) -> bool:
    return all(k in fixed for k in ("tp", "pp", "cp", "zero_stage", "recompute", "offload_optimizer",
                                    "micro_batch_size"))


def _price(model, lay, cluster, seq_len, dtype, dtype_bytes, attention, usable, cpu_ram, overhead,
           predict_kwargs, explicit_price: bool = False, zero: mem.ZeroSettings = mem.DEFAULT_ZERO,
           headroom: float = HEADROOM) -> PlanRow:
    """The row of one layout: its memory, and its step time when it fits, is tight, or ``explicit_price``."""
    try:
        ranks = None if explicit_price else _representatives(model, lay.tp, lay.pp, lay.chunks)
        estimate = mem.estimate(model, lay, seq_len=seq_len, dtype_bytes=dtype_bytes, overhead_bytes=overhead,
                                pp_ranks=ranks, zero=zero)
    except RecipeError as error:
        return PlanRow(lay, False, None, None, [str(error)])
    problems, tight = _fit_problem(estimate, usable, cpu_ram, cluster, headroom)
    prediction = None
    if problems and not explicit_price and not tight:
        return PlanRow(lay, False, estimate, None, problems)
    try:
        impl = Implementation(dtype="bf16" if dtype == "fp32" else dtype, attention=attention, zero=zero)
        prediction = steptime.predict(model, lay, cluster, seq_len=seq_len, impl=impl, **predict_kwargs)
    except PlanError as error:
        problems.append(str(error))
        tight = False
    return PlanRow(lay, not problems, estimate, prediction, problems, tight=tight and prediction is not None)


@functools.lru_cache(maxsize=4096)
def _representatives(model: ModelSpec, tp: int, pp: int, chunks: int) -> list[int]:
    return mem.representative_ranks(model, PlanLayout(tp=tp, pp=pp, chunks=chunks,
                                                      schedule="interleaved" if chunks > 1 else "1f1b"))


def clear_caches() -> None:
    """Forget what the planner memoises across calls (the representative pipeline ranks here, the estimator's
    per-layer and per-rank tables in :mod:`.memory`, the GEMM tile quantization in :mod:`.catalog`): the next
    :func:`plan` runs as in a fresh process. For timing the search; results never depend on it."""
    _representatives.cache_clear()
    mem.clear_caches()
    hw.quantization.cache_clear()


def describe(lay: PlanLayout) -> str:
    """``lay`` on one line, as the table, the rejected families and ``shardline plan --emit`` show it: ``tp``,
    ``pp``, ``dp``, ``cp``, ``zero``, ``mbs`` (micro-batch size) and ``m`` (micro-batches) always; ``sp``,
    ``SCHEDULExCHUNKS``, ``recompute`` and ``offload=OPTIMIZER/PARAMS`` only where they are not the default,
    e.g. ``tp=8,pp=4,dp=2,cp=1,sp=megatron,interleavedx2,zero=1,mbs=1,m=64,recompute=full``."""
    parts = [f"tp={lay.tp}", f"pp={lay.pp}", f"dp={lay.dp}", f"cp={lay.cp}"]
    if lay.sp != "none":
        parts.append(f"sp={lay.sp}")
    if lay.schedule != "1f1b" or lay.chunks > 1:
        parts.append(f"{lay.schedule}x{lay.chunks}")
    parts += [f"zero={lay.zero_stage}", f"mbs={lay.micro_batch_size}", f"m={lay.micro_batches}"]
    if lay.recompute != "none":
        parts.append(f"recompute={lay.recompute}")
    if lay.offload_optimizer != "none" or lay.offload_params != "none":
        parts.append(f"offload={lay.offload_optimizer}/{lay.offload_params}")
    return ",".join(parts)


# --- choice -----------------------------------------------------------------------------------------------------

def crossing_dims(lay: PlanLayout, cluster: Cluster) -> list[str]:
    """The parallel dimensions (of tp, cp, dp, pp larger than 1) whose groups cross a node boundary, in the
    rank order the step-time model uses (tp fastest, then cp, dp, pp)."""
    groups = (("tp", lay.tp, 1), ("cp", lay.cp, lay.tp), ("dp", lay.dp, lay.tp * lay.cp),
              ("pp", lay.pp, lay.tp * lay.cp * lay.dp))
    return [name for name, size, stride in groups
            if size > 1 and hw.group_link(cluster, size=size, stride=stride).crosses_nodes]


def cp_floor_tokens(model: ModelSpec, lay: PlanLayout, cluster: Cluster, impl: Implementation) -> float:
    """Tokens per CP rank (of each sequence) below which a ring hop outlasts the attention step beside it, from
    the charge in :func:`~.steptime._cp_comm`: a forward step computes ``2 b H T^2 d`` FLOPs (``T`` tokens per
    rank, ``H`` query heads per TP rank) at the flash rate ``R`` while its hop sends ``2 b T H_kv d e`` bytes at
    ``B`` (:func:`~.steptime.ring_hop_link`), so it hides once ``T >= (H_kv / H) e R / B``; the backward sends
    ``e + g`` bytes per element (``g`` = ``ring_grad_bytes``) beside 2.5x the FLOPs at the backward's
    ``FLASH_BWD_OVER_FWD`` of the rate. The larger of the two; the hop's latency and the SMs it holds are left
    out, so below it the ring is exposed for sure."""
    heads_q = model.n_head // lay.tp
    heads_kv = heads_q if impl.cp_repeats_kv else max(1, model.kv_heads // lay.tp)
    share = heads_kv / heads_q
    rate = cluster.gpu.peak_flops("bf16") * cluster.gpu.attention_fraction
    link = steptime.ring_hop_link(cluster, lay).bytes_per_s
    forward = share * 2 * rate / link
    backward = share * (2 + impl.ring_grad_bytes) * rate * steptime.FLASH_BWD_OVER_FWD / (2.5 * link)
    return max(forward, backward)


def _below_floor(row: PlanRow, result: PlanResult) -> float | None:
    """The CP floor (tokens per rank) ``row`` is under, or None."""
    lay = row.layout
    if lay.cp == 1:
        return None
    impl = _impl(result)
    floor = cp_floor_tokens(result.model, lay, result.cluster, impl)
    return floor if result.seq_len / lay.cp < floor else None


def _impl(result: PlanResult) -> Implementation:
    req = result.request
    dtype = req.get("dtype", result.dtype)
    kwargs = {k: v for k, v in req.items() if k not in _PLAN_ARGS}
    return Implementation(dtype="bf16" if dtype == "fp32" else dtype, attention=req.get("attention", "flash"),
                          zero=req.get("zero", mem.DEFAULT_ZERO)).with_(**kwargs)


_PLAN_ARGS = ("layout", "dtype", "attention", "headroom", "cpu_ram_gib", "overhead_bytes", "zero")


def simplicity(row: PlanRow, result: PlanResult) -> tuple:
    """How complex ``row``'s layout is, as a sort key (smaller is simpler): offload (any; its CPU Adam rate is
    the least certain number priced, scaled from another host, and its CPU RAM and host-link contention are not in
    the step), parallel dimensions crossing nodes (:func:`crossing_dims`), CP below :func:`cp_floor_tokens`,
    parallel dimensions (tp, cp, pp) used, recompute; then the predicted step."""
    lay = row.layout
    offload = lay.offload_optimizer != "none" or lay.offload_params != "none"
    dims = sum(1 for d in (lay.tp, lay.cp, lay.pp) if d > 1)
    return (offload, len(crossing_dims(lay, result.cluster)), _below_floor(row, result) is not None, dims,
            lay.recompute != "none", row.step_s)


def choice_reason(result: PlanResult) -> str:
    """One sentence: why :attr:`PlanResult.pick` is the pick."""
    pick, ties = result.pick, result.ties
    fastest = ties[0]
    band = f"{result.band:.2%}".rstrip("0").rstrip(".")
    if len(ties) == 1:
        return f"the fastest row that fits; the next is more than {band} (the model's error band) slower"
    head = f"{len(ties)} rows lie within {band} of the fastest (the model's error band: ties)"
    if pick is fastest:
        return head + "; none of them is simpler than the fastest"
    mine, theirs = simplicity(pick, result), simplicity(fastest, result)
    slower = pick.step_s / fastest.step_s - 1
    if mine[0] != theirs[0]:
        said = "no offload (the fastest offloads)"
    elif mine[1] != theirs[1]:
        said = f"fewer dimensions crossing nodes ({mine[1]} vs {theirs[1]})"
    elif mine[2] != theirs[2]:
        said = (f"no CP under its tokens-per-rank floor (the fastest runs {result.seq_len // fastest.layout.cp} "
                f"tokens per CP rank, its floor is {_below_floor(fastest, result):,.0f})")
    elif mine[3] != theirs[3]:
        said = f"fewer parallel dimensions ({mine[3]} vs {theirs[3]})"
    else:
        said = "no recompute (the fastest recomputes)"
    return (f"{head}; picked as the simplest: {said}, {slower:.1%} slower than the fastest, "
            f"{describe(fastest.layout)}")


#: The profiler's labels as :func:`explain` names them.
_CATEGORY_WORDS = {"compute": "compute", "all_reduce": "exposed all-reduce", "all_gather": "exposed all-gather",
                   "reduce_scatter": "exposed reduce-scatter", "all_to_all": "exposed all-to-all",
                   "p2p_send": "exposed p2p (pipeline, CP ring)", "p2p_recv": "exposed p2p receive",
                   "bubble": "pipeline bubble", "memcpy_h2d": "offload copy to GPU",
                   "memcpy_d2h": "offload copy to CPU", "idle": "wait for the CPU optimizer"}


def _significant(x: float, digits: int = 2) -> str:
    """``x`` to ``digits`` significant figures, without an exponent (8093 -> '8090' at 3)."""
    if x == 0 or not math.isfinite(x):
        return format(x, "g")
    places = digits - 1 - math.floor(math.log10(abs(x)))
    return f"{round(x, places):.{max(0, places)}f}"


def explain(result: PlanResult, *, versus: int = 3, changes: bool = True, catalog: hw.Catalog | None = None
            ) -> dict[str, Any]:
    """Why :attr:`PlanResult.pick` beats the next ``versus`` rows, category by category (each other row's
    seconds minus the pick's, in the profiler's labels: they sum to the step-time difference), and, with
    ``changes``, what one change does to the pick: twice the GPUs, twice the sequence (within the model's
    context), the next GPU type of ``catalog`` (each a new search with that change alone)."""
    pick = result.pick
    others = [r for r in result.rows if (r.fits or r.tight) and r is not pick][:versus]
    rows = []
    for row in others:
        delta = {k: row.prediction.time_s[k] - pick.prediction.time_s[k] for k in pick.prediction.time_s}
        rows.append({"layout": describe(row.layout), "tight": row.tight, "step_s": row.step_s,
                     "delta_s": row.step_s - pick.step_s, "categories": delta})
    out: dict[str, Any] = {"pick": describe(pick.layout), "step_s": pick.step_s, "why": choice_reason(result),
                           "versus": rows}
    if changes:
        out["changes"] = _what_changes(result, catalog)
    return out


def _shape(lay: PlanLayout) -> tuple:
    return (lay.tp, lay.pp, lay.cp, lay.sp, lay.schedule, lay.chunks, lay.zero_stage, lay.offload_optimizer,
            lay.offload_params, lay.recompute)


def _what_changes(result: PlanResult, catalog: hw.Catalog | None) -> list[dict[str, Any]]:
    req = dict(result.request)
    req["layout"] = {k: v for k, v in req.get("layout", {}).items() if k not in ("dp", "micro_batches")}
    cl, model = result.cluster, result.model
    asks: list[tuple[str, dict[str, Any]]] = []
    more = result.gpus * 2 if result.gpus >= cl.gpus_per_node else cl.gpus_per_node
    asks.append((f"{more} GPUs ({max(1, more // cl.gpus_per_node)} nodes)", {"gpus": more}))
    if result.seq_len * 2 <= model.seq_len:
        asks.append((f"sequence {result.seq_len * 2}", {"seq_len": result.seq_len * 2}))
    other = _another_gpu(cl, catalog)
    if other is not None:
        asks.append((f"{other.gpu.name} ({other.name})", {"cluster": other}))
    out = []
    for what, change in asks:
        args = {"gpus": result.gpus, "seq_len": result.seq_len, "global_batch": result.global_batch,
                "cluster": cl, **change}
        where = args.pop("cluster")
        entry: dict[str, Any] = {"change": what}
        try:
            again = plan(model, where, **args, **req)
            new = again.pick
        except PlanError as error:
            entry.update(pick=None, changed=True, note=str(error))
            out.append(entry)
            continue
        entry.update(pick=describe(new.layout), step_s=new.step_s, tight=new.tight,
                     tokens_per_s_per_gpu=new.prediction.tokens_per_s_per_gpu,
                     changed=_shape(new.layout) != _shape(result.pick.layout))
        out.append(entry)
    if not result.seq_len * 2 <= model.seq_len:
        out.append({"change": f"sequence {result.seq_len * 2}", "pick": None, "changed": None,
                    "note": f"beyond {model.name}'s context of {model.seq_len} tokens: not searched"})
    return out


def _another_gpu(cl: Cluster, catalog: hw.Catalog | None) -> Cluster | None:
    """The next packaged node type (catalog order, wrapping) whose GPU differs from ``cl``'s."""
    if catalog is None:
        catalog = hw.load_catalog()
    names = list(catalog.clusters)
    own = next((i for i, n in enumerate(names) if catalog.clusters[n]["gpu"] == cl.gpu.name), -1)
    for name in names[own + 1:] + names[:own + 1]:
        if catalog.clusters[name]["gpu"] != cl.gpu.name:
            return catalog.cluster(name)
    return None


def format_explain(result: PlanResult, explained: dict[str, Any]) -> str:
    """:func:`explain`'s dict as text: the pick, one line per compared row (its categories, largest first, that
    move the step by at least a millisecond), one line per change."""
    lines = [f"why {explained['pick']} ({_significant(explained['step_s'], 3)} s): {explained['why']}"]
    for row in explained["versus"]:
        parts = sorted(((v, k) for k, v in row["categories"].items() if abs(v) >= 5e-4), key=lambda x: -abs(x[0]))
        said = ", ".join(f"{v:+.{_decimals(v)}f} s {_CATEGORY_WORDS.get(k, k)}" for v, k in parts) or "the same"
        tight = " (tight)" if row["tight"] else ""
        lines.append(f"  vs {row['layout']}{tight}: {row['delta_s']:+.{_decimals(row['delta_s'])}f} s "
                     f"({_significant(row['step_s'], 3)} s): {said}")
    for entry in explained.get("changes", []):
        if entry.get("pick") is None:
            lines.append(f"  with {entry['change']}: {entry['note']}")
            continue
        verdict = "the pick changes to" if entry["changed"] else "the same shape:"
        lines.append(f"  with {entry['change']}: {verdict} {entry['pick']} ({_significant(entry['step_s'], 3)} s, "
                     f"{_significant(entry['tokens_per_s_per_gpu'], 3)} tokens/s/GPU)")
    return "\n".join(lines)


def _decimals(x: float) -> int:
    """Decimals for a time difference: two significant figures, at least a millisecond's."""
    if x == 0:
        return 3
    return min(3, max(0, 1 - math.floor(math.log10(abs(x))))) if abs(x) >= 1e-3 else 3


def format_table(result: PlanResult, top: int = 10) -> str:
    """The ``--top`` rows as a text table (memory and time breakdowns; rows equal to the one above at the
    table's precision folded into an ``equivalent:`` line under it), the pick and its ties, then one line per
    rejected family. Step times and throughput to three significant figures (the model's error band is
    3.44%), parts of a step to the millisecond."""
    head = (f"{result.model.name} ({result.model.params() / 1e9:.2f}B params) on {result.gpus} x "
            f"{result.cluster.gpu.name} ({result.cluster.gpus_per_node}/node, {result.cluster.intra_node.name}, "
            f"{result.cluster.nics_per_node} x {result.cluster.inter_node.name}), seq {result.seq_len}, global "
            f"batch {result.global_batch} ({result.global_batch * result.seq_len / 1e6:.2f}M tokens); "
            f"{result.evaluated} layouts priced, {len(result.fitting)} fit in "
            f"{result.usable_bytes / GIB:.1f} GiB usable ({100 * result.headroom:g}% of HBM kept for the allocator)"
            + (f", {len(result.tight)} tight" if result.tight else ""))
    cols = ("#", "layout", "fits", "GiB", "par", "grad", "opt", "act", "buf", "step s", "tok/s/GPU", "TFLOP/s",
            "MFU", "compute", "exp.comm", "bubble", "offload")
    lines, folded, shown = [], {}, []
    for row in result.rows[:top] if top else result.rows:
        line = _table_line(row)
        if shown and row.prediction is not None and line[2:] == lines[-1][3:]:
            folded.setdefault(id(shown[-1]), []).append(row)  # equal at the table's precision
            continue
        lines.append((str(len(lines) + 1), *line))
        shown.append(row)
    widths = [max(len(cols[j]), *(len(r[j]) for r in lines)) if lines else len(cols[j]) for j in range(len(cols))]
    out = [head, "", "  ".join(c.rjust(w) if j not in (1,) else c.ljust(w) for j, (c, w) in
                              enumerate(zip(cols, widths)))]
    out += ["  ".join(v.rjust(w) if j != 1 else v.ljust(w) for j, (v, w) in enumerate(zip(r, widths)))
            for r in lines]
    for i, row in enumerate(shown, 1):  # why a row does not fit, and what a fitting one leaves unchecked
        said = [*row.problems, *row.notes]
        if said:
            out.append(f"  #{i} {describe(row.layout)}: {'; '.join(said)}")
        if id(row) in folded:
            out.append(f"  #{i} equivalent: " + "; ".join(describe(r.layout) for r in folded[id(row)]))
    out += _choice_lines(result, shown)
    rejected = [f"  {k}: {v}" for k, v in result.rejected.items() if v]
    if rejected:  # no header without a line under it
        out += ["", "rejected:", *rejected]
    out.append("")
    out.append("GiB: the most loaded rank (params, grads, optimizer, activations, buffers incl. "
               f"{mem.FIXED_OVERHEAD_BYTES / GIB:.0f} GiB fixed CUDA/NCCL overhead); times per step on the busiest "
               "pipeline rank; MFU: Megatron's model FLOPs over the bf16 peak.")
    return "\n".join(out)


def _table_line(row: PlanRow) -> tuple[str, ...]:
    g = row.memory.memory_gib() if row.memory else {}
    p = row.prediction
    c = p.categories() if p else {}

    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)
    return (describe(row.layout), "yes" if row.fits else "tight" if row.tight else "NO", f(g.get("total")),
            f(g.get("params")), f(g.get("grads")), f(g.get("optimizer")), f(g.get("activations")),
            f(g.get("buffers")), "-" if p is None else _significant(p.step_s, 3),
            "-" if p is None else _significant(p.tokens_per_s_per_gpu, 3), f(p and p.tflops_per_gpu, ".0f"),
            f(p and 100 * p.mfu, ".1f"), f(c.get("compute"), ".3f"), f(c.get("exposed_comm"), ".3f"),
            f(c.get("bubble"), ".3f"), f(c.get("offload"), ".3f"))


def _choice_lines(result: PlanResult, shown: list[PlanRow]) -> list[str]:
    """``pick:`` and ``equivalent:`` (the other rows within the error band), only when rows fit."""
    if not result.ties:
        if result.tight:
            return ["", f"no row fits in {result.usable_bytes / GIB:.1f} GiB; the fastest tight row is "
                        f"{describe(result.tight[0].layout)} (--headroom lowers the allocator's share)"]
        return []
    number = {id(r): i for i, r in enumerate(shown, 1)}

    def name(row: PlanRow) -> str:
        return (f"#{number[id(row)]} " if id(row) in number else "") + describe(row.layout)
    pick = result.pick
    out = ["", f"pick: {name(pick)} ({_significant(pick.step_s, 3)} s): {choice_reason(result)}"]
    others = [r for r in result.ties if r is not pick]
    if others:
        more = f"; and {len(others) - 5} more" if len(others) > 5 else ""
        out.append("equivalent: " + "; ".join(f"{name(r)} ({_significant(r.step_s, 3)} s)" for r in others[:5])
                   + more)
    faster_tight = [r for r in result.tight if r.step_s < pick.step_s]
    if faster_tight:
        r = faster_tight[0]
        out.append(f"tight (within the {100 * result.headroom:g}% allocator headroom, not picked): "
                   f"{describe(r.layout)} ({_significant(r.step_s, 3)} s, {r.memory.most_loaded.total / GIB:.1f} GiB)")
    return out


__all__ = ["ERROR_BAND", "HEADROOM", "LAYOUT_KEYS", "PlanResult", "PlanRow", "check_fixed", "choice_reason",
           "clear_caches", "cp_floor_tokens", "crossing_dims", "describe", "explain", "format_explain",
           "format_table", "parse_layout", "plan", "simplicity"]
