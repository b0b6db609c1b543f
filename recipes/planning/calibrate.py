"""Calibration (``shardline plan --calibrate PROFILE``): the step-time model's hardware numbers measured on the
user's own run, from a shardline profile (a Kineto trace per rank, a file or a folder, gzipped or not), in
place of the catalog's published ones. :func:`calibrate` returns a :class:`Calibration` whose ``.cluster`` is
the given cluster with every fitted number replaced (and `` (calibrated)`` added to its name), for
:func:`~.steptime.predict`; ``.to_yaml()`` writes the same numbers as a catalog override file (the base's GPU
and link names, only the fitted fields) that :func:`~.catalog.load_catalog` merges.

The trace is read by :func:`shardline.profiling.load` with its op args (events, classification, process
groups, and the CPU ops' ``Input Dims``, ``Input type``, ``Concrete Inputs``: the profiler's
``record_shapes=True``; a loaded trace set without them has them read by ``load.read_op_args``). A GPU kernel
belongs to the known op that launched it (``classify.launching_op`` among the known ops: the innermost one
holding the kernel's launch, the CPU row with its correlation id; else the one whose External id it carries,
begun before it). An op's time ``t`` is the sum of its kernels' durations.

GEMMs -> ``gpu.matmul_fraction_bf16`` (bf16 and fp16 operands: one peak) and ``gpu.matmul_fraction_fp8``
(``aten::_scaled_mm``). Ops ``mm [M,K][K,N]``, ``addmm``, ``_addmm_activation``, ``bmm [B,M,K][B,K,N]``,
``baddbmm``, ``_scaled_mm`` (composites such as ``aten::linear`` call one of them). With ``P`` the catalog
GPU's peak for the dtype, ``q`` :func:`~.catalog.quantization` and the roofline bytes of :func:`~.catalog.gemm_s`,
a GEMM is used when it is compute-bound at every efficiency (``c >= m`` at ``f = 1``) and has at least
``min_gemm_flops`` FLOPs (smaller ones are launch and tail, which the model does not price by FLOPs)::

    c_i = 2 M N K B / (P q_i)     m_i = bytes_i / (hbm_gbps hbm_fraction)     f = sum c_i / sum t_i

so ``sum gemm_s`` over the used GEMMs at ``f`` is their measured time. ``achieved`` (in the detail) is the plain
share of peak, ``sum 2MNKB / (P sum t_i)``. The times are the run's, contention with overlapping communication
included: a sustained rate of that run, not of an idle GPU.

Attention -> ``gpu.attention_fraction``. Fused SDPA ops (flash, memory-efficient, cuDNN; forward and backward)
with 4-D bf16/fp16 ``q [B,H,Sq,D]`` (``[B,Sq,H,D]`` for ``_flash_attention_*``) and ``k``. ``F = 4 B H Sq Sk D``,
halved when causal (read from ``Concrete Inputs``, else the ``causal`` argument; causal needs ``Sq == Sk``). The
model runs a forward at ``P a`` and a backward of ``2.5 F`` at ``P a r`` (``r = steptime.FLASH_BWD_OVER_FWD``)::

    a = sum w_i F_i / (P sum t_i)       w = 1 forward, 2.5 / r backward

Collectives -> ``collective_gbps`` and ``latency_us`` of the intra- and inter-node links. GPU kernels of
all-reduce, all-gather, reduce-scatter and all-to-all with a message size ``S`` (``msg_bytes``: the full buffer
of gathers and reduce-scatters, the per-rank buffer of all-to-all) and a known group (``pg_ranks``, the trace's
``pg_config``, or the world). Ranks are placed ``rank // gpus_per_node`` on nodes; a group crosses nodes when
its ranks span several, with ``k`` the most of them on one node. A late peer only adds time, so each (kind,
group, ``S``) keeps its fastest call. NCCL's bus-bandwidth convention gives the bytes each rank moves and the
ring steps, as the model prices them (:mod:`.catalog`)::

    all-reduce   bus = 2(N-1)/N S   steps = 2(N-1)     others   bus = (N-1)/N S   steps = N-1
    t = alpha0 + steps alpha + bus / (s B)             s = 1 inside a node, nics_per_node k / gpus_per_node across

``alpha0`` is NCCL's base latency (``catalog.NCCL_BASE_LATENCY_S``); ``alpha`` (``latency_us``) and ``B``
(``collective_gbps``) are fitted per link over all its kinds and groups by least squares on relative
residuals. With one point (one size of one kind), a fit that gives ``alpha <= 0`` (faster than the ring
Simple-protocol model: NCCL's LL protocol on small messages) or ``alpha`` over ``LATENCY_LIMIT`` times the
catalog's (waiting for peers, not the link), the catalog's ``alpha`` is kept and ``B`` alone fitted. This is
the ring form (NCCL's busBw convention); the model's all-reduce then takes the cheaper of ring and tree as
before, and its ``min(NIC share, intra link)`` for groups with several ranks per node is not
inverted. Per (kind, group) :class:`CollectiveFit` also reports NCCL's own numbers: ``busbw = bus / t``
(nccl-tests) and the free ``t = latency + bus / bandwidth`` fit.

Plausibility: a fraction must land in ``(0, 1]`` and a bandwidth at most twice the link's data-sheet ``gbps``
(in-switch reduction, NVLS or SHARP, can beat the wire, not double it), else the catalog's number is kept with
the reason; a link fit whose rms relative residual exceeds ``POOR_FIT`` is applied but warned about (calls
that include waiting for peers: a one-rank trace cannot tell waiting from transfer).

A number that cannot be fitted keeps the catalog's value, with the reason, and :func:`calibrate` warns
(:class:`CalibrationWarning`); a profile from which nothing can be fitted is a :class:`~.catalog.PlanError`.

One file: the three fits share the op table, the plausibility rules and the :class:`Calibration` they fill,
and much of its length is the formulas above.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from shardline.profiling.base.errors import ProfilingError
from shardline.profiling.base.schema import json_values
from shardline.profiling.table.linking import launching_op
from shardline.profiling.table.load import TraceSet, load, read_op_args
from shardline.recipes.planning import catalog as hw
from shardline.recipes.planning.catalog import Cluster, PlanError
from shardline.recipes.planning.steptime import FLASH_BWD_OVER_FWD

#: GEMM op -> (index of the A operand, of the B operand, batched).
GEMM_OPS = {"aten::mm": (0, 1, False), "aten::addmm": (1, 2, False), "aten::_addmm_activation": (1, 2, False),
            "aten::bmm": (0, 1, True), "aten::baddbmm": (1, 2, True), "aten::_scaled_mm": (0, 1, False)}
#: Attention op -> (index of q, of k, of is_causal, q layout, backward); indices from the ops' schemas.
ATTENTION_OPS = {
    "aten::_flash_attention_forward": (0, 1, 8, "bshd", False),
    "aten::_flash_attention_backward": (1, 2, 11, "bshd", True),
    "aten::_scaled_dot_product_flash_attention": (0, 1, 4, "bhsd", False),
    "aten::_scaled_dot_product_flash_attention_backward": (1, 2, 11, "bhsd", True),
    "aten::_scaled_dot_product_efficient_attention": (0, 1, 6, "bhsd", False),
    "aten::_scaled_dot_product_efficient_attention_backward": (1, 2, 11, "bhsd", True),
    "aten::_scaled_dot_product_cudnn_attention": (0, 1, 6, "bhsd", False),
    "aten::_scaled_dot_product_cudnn_attention_backward": (1, 2, 14, "bhsd", True),
}
#: Collective kind -> (bus bytes per message byte, ring steps), as functions of the group size N.
COLLECTIVES = {"all_reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
               "all_gather": (lambda n: (n - 1) / n, lambda n: n - 1),
               "reduce_scatter": (lambda n: (n - 1) / n, lambda n: n - 1),
               "all_to_all": (lambda n: (n - 1) / n, lambda n: n - 1)}
DTYPES = {"c10::BFloat16": "bf16", "BFloat16": "bf16", "c10::Half": "fp16", "Half": "fp16", "float": "fp32",
          "Float": "fp32", "double": "fp64", "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8",
          "c10::Float8_e4m3fnuz": "fp8", "c10::Float8_e5m2fnuz": "fp8"}
POOR_FIT = 0.25  # rms relative residual above which a collective fit is reported as poor (waiting in the calls)
LATENCY_LIMIT = 10  # a fitted per-step latency over this many times the catalog's is waiting, not the link
_KERNEL_CATS = ("kernel", "Kernel")
_KNOWN_OPS = {**{name: "gemm" for name in GEMM_OPS}, **{name: "attention" for name in ATTENTION_OPS}}


class CalibrationWarning(UserWarning):
    """Part of a calibration kept the catalog's numbers (or fitted poorly); the message says which and why."""


class Target(str, enum.Enum):
    """A catalog number calibration can replace, as ``<Cluster attribute>.<field>``."""

    MATMUL_BF16 = "gpu.matmul_fraction_bf16"
    MATMUL_FP8 = "gpu.matmul_fraction_fp8"
    ATTENTION = "gpu.attention_fraction"
    INTRA_BANDWIDTH = "intra_node.collective_gbps"
    INTRA_LATENCY = "intra_node.latency_us"
    INTER_BANDWIDTH = "inter_node.collective_gbps"
    INTER_LATENCY = "inter_node.latency_us"

    @property
    def part(self) -> str:
        return self.value.split(".")[0]

    @property
    def field(self) -> str:
        return self.value.split(".")[1]


@dataclass(frozen=True)
class Fit:
    """One fitted number: ``value`` replaces ``catalog``; ``samples`` kernels or calls went into it."""

    target: Target
    value: float
    catalog: float | None
    samples: int
    detail: str


@dataclass(frozen=True)
class Unfitted:
    target: Target
    reason: str


@dataclass(frozen=True)
class CollectiveFit:
    """One collective kind on one group, NCCL's way: ``busbw_gbps`` the best ``bus / t`` (nccl-tests), and
    with two sizes or more the free fit ``t = latency + bus / bandwidth`` (``fit_*``; None when not physical).
    ``calls`` were recorded, ``sizes`` distinct message sizes kept (the fastest call of each)."""

    kind: str
    ranks: tuple[int, ...]
    crosses_nodes: bool
    ranks_per_node: int
    calls: int
    sizes: int
    busbw_gbps: float
    fit_gbps: float | None
    fit_latency_us: float | None


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured. ``cluster`` is ``base`` with the ``fits`` replacing its numbers (the rest,
    ``unfitted``, are the catalog's); ``devices`` the GPU names the traces recorded."""

    profile: str
    base: Cluster
    cluster: Cluster
    fits: tuple[Fit, ...]
    unfitted: tuple[Unfitted, ...]
    collectives: tuple[CollectiveFit, ...]
    devices: tuple[str, ...]

    def fit(self, target: Target | str) -> Fit | None:
        target = Target(target)
        return next((f for f in self.fits if f.target is target), None)

    def to_dict(self) -> dict:
        """The fitted numbers as a catalog override (``gpus``/``links`` sections, the base's entry names, only
        the fitted fields): merged by ``load_catalog(path)`` it rebuilds ``cluster``'s GPU and links."""
        out: dict[str, dict] = {}
        for fit in self.fits:
            section = "gpus" if fit.target.part == "gpu" else "links"
            name = getattr(self.base, fit.target.part).name
            out.setdefault(section, {}).setdefault(name, {})[fit.target.field] = float(fit.value)
        return out

    def to_yaml(self) -> str:
        """:meth:`to_dict` as YAML, with :meth:`summary` as its comment header."""
        header = "".join(f"# {line}\n" if line else "#\n" for line in self.summary().splitlines())
        return header + yaml.safe_dump(self.to_dict(), sort_keys=False)

    def summary(self) -> str:
        lines = [f"shardline calibration of cluster {self.base.name!r} from {self.profile}",
                 f"trace devices: {', '.join(self.devices) or 'not recorded'}"]
        lines += [f"{f.target.value} = {f.value:.6g} (catalog {f.catalog}) from {f.samples} samples: {f.detail}"
                  for f in self.fits]
        lines += [f"{u.target.value}: catalog value kept ({u.reason})" for u in self.unfitted]
        return "\n".join(lines)


def calibrate(profile: str | Path | TraceSet, cluster: Cluster, *, causal: bool | None = None,
              min_gemm_flops: float = 1e9) -> Calibration:
    """Fit ``cluster``'s GEMM and attention efficiencies and its links' collective bandwidths and latencies to
    the traces of ``profile`` (a path as :func:`shardline.profiling.load` takes it, or a loaded trace set); see
    the module docstring for what is measured and the formulas. ``cluster`` is the cluster the traces were
    recorded on (its GPU's peaks, ``gpus_per_node``, ``nics_per_node``). ``causal``: the attention mask where the
    trace does not record ``is_causal``. Raises :class:`PlanError` for a missing or unreadable profile, or one
    with nothing to fit; warns (:class:`CalibrationWarning`) for each number it could not fit."""
    if not isinstance(cluster, Cluster):
        raise PlanError(f"calibrate: cluster must be a Cluster (catalog.cluster or Catalog.cluster), got "
                        f"{type(cluster).__name__}")
    if not isinstance(min_gemm_flops, (int, float)) or min_gemm_flops < 0:
        raise PlanError(f"calibrate: min_gemm_flops={min_gemm_flops!r} must be a number >= 0")
    traces, where = _load(profile)
    events = traces.events
    kernels = np.flatnonzero(((events["lane"] == "gpu") & events["cat"].isin(_KERNEL_CATS)).to_numpy())
    if not len(kernels):
        raise PlanError(f"{where}: no GPU kernel in the trace (a CPU-only or empty profile): nothing to calibrate")
    ops = _op_table(traces, kernels)
    devices = _devices(traces)
    fits: list[Fit] = []
    unfitted: list[Unfitted] = []
    notes: list[str] = []
    _fit_gemms(ops[ops["kind"] == "gemm"], cluster, min_gemm_flops, fits, unfitted)
    _fit_attention(ops[ops["kind"] == "attention"], cluster, causal, fits, unfitted)
    samples, skipped = _collective_samples(traces, kernels, cluster)
    collectives = _per_group(samples)
    for crosses in (False, True):
        _fit_link(samples, cluster, crosses, skipped, fits, unfitted, notes)
    if not fits:
        raise PlanError(f"{where}: nothing to calibrate from: "
                        + "; ".join(f"{u.target.value}: {u.reason}" for u in unfitted))
    token = cluster.gpu.name.split("-")[0].lower()
    if devices and not any(token in d.lower() for d in devices):
        notes.append(f"the traces ran on {', '.join(devices)} but the cluster's GPU is {cluster.gpu.name!r}: the "
                     f"fitted fractions are shares of {cluster.gpu.name}'s peaks")
    calibration = Calibration(profile=where, base=cluster, cluster=_apply(cluster, fits), fits=tuple(fits),
                              unfitted=tuple(unfitted), collectives=tuple(collectives), devices=devices)
    if unfitted or notes:
        kept = [f"{u.target.value} ({u.reason})" for u in unfitted]
        message = f"calibration from {where}: fitted {len(fits)} of {len(fits) + len(unfitted)} numbers"
        message += ("; kept the catalog's " + "; ".join(kept) if kept else "") + "".join(f"; {n}" for n in notes)
        warnings.warn(message, CalibrationWarning, stacklevel=2)
    return calibration


def _load(profile) -> tuple[TraceSet, str]:
    if isinstance(profile, TraceSet):
        files = sorted(str(f) for f in profile.files)
        return profile, ", ".join(files[:3]) + (f" and {len(files) - 3} more files" if len(files) > 3 else "")
    path = Path(profile)
    if not path.exists():
        raise PlanError(f"calibration profile {path}: no such file or folder")
    try:
        return load(path, op_args=True), str(path)
    except ProfilingError as error:
        raise PlanError(f"calibration profile {path}: {error}") from None


def _apply(cluster: Cluster, fits: list[Fit]) -> Cluster:
    changes: dict[str, dict[str, float]] = {}
    for fit in fits:
        changes.setdefault(fit.target.part, {})[fit.target.field] = fit.value
    parts = {part: dataclasses.replace(getattr(cluster, part), **fields) for part, fields in changes.items()}
    return dataclasses.replace(cluster, name=f"{cluster.name} (calibrated)", **parts)


def _devices(traces: TraceSet) -> tuple[str, ...]:
    names = {str(d.get("name")) for meta in traces.metadata.values()
             for d in (meta.get("deviceProperties") or []) if isinstance(d, dict) and d.get("name")}
    return tuple(sorted(names))


# ---------------------------------------------------------------------------------------- ops and their time


def _op_table(traces: TraceSet, kernels: np.ndarray) -> pd.DataFrame:
    """One row per known op that launched kernels: kind, name, rank, kernels, t_ns (their summed duration) and
    dims/types/concrete, the op's own ``Input Dims`` / ``Input type`` / ``Concrete Inputs`` (None where the
    trace has no shapes for it)."""
    ev = traces.events
    op_rows = np.flatnonzero(((ev["lane"] == "cpu") & ev["name"].isin(list(_KNOWN_OPS))).to_numpy())
    owner = launching_op(ev, ops=op_rows, rows=kernels)
    linked = owner >= 0
    per_op = pd.DataFrame({"op": owner[linked], "t_ns": ev["dur_ns"].to_numpy()[kernels[linked]]})
    per_op = per_op.groupby("op").agg(t_ns=("t_ns", "sum"), kernels=("t_ns", "size")).reset_index()
    rows = per_op["op"].to_numpy()
    args = read_op_args(traces) if len(rows) else None
    shapes = {column: json_values(args[column].iloc[rows]) if len(rows) else [] for column in _SHAPE_ARGS}
    names = ev["name"].iloc[rows].astype(str).to_numpy()
    return pd.DataFrame({"kind": [_KNOWN_OPS[name] for name in names], "name": names,
                         "rank": ev["rank"].to_numpy()[rows], "kernels": per_op["kernels"].to_numpy(),
                         "t_ns": per_op["t_ns"].to_numpy(), "dims": shapes["input_dims"],
                         "types": shapes["input_types"], "concrete": shapes["concrete_inputs"]})


#: The op-args columns of the shapes (``load(..., op_args=True)``; the profiler's ``record_shapes=True``).
_SHAPE_ARGS = ("input_dims", "input_types", "concrete_inputs")


# ------------------------------------------------------------------------------------------ compute rates


def _gemm_shape(name: str, dims, types) -> tuple[int, int, int, int, str] | str:
    """(M, N, K, batch, dtype) of one GEMM op, or why not."""
    if not isinstance(dims, list):
        return "no shapes"
    ia, ib, batched = GEMM_OPS[name]
    a, b = (dims[i] if i < len(dims) else None for i in (ia, ib))
    rank = 3 if batched else 2
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == rank and len(b) == rank):
        return "no shapes"
    if batched and a[0] != b[0] or a[-1] != b[-2]:
        return "inconsistent shapes"
    type_a, type_b = (types[i] if isinstance(types, list) and i < len(types) else "" for i in (ia, ib))
    dtype = DTYPES.get(type_a, str(type_a) or "unknown")
    if DTYPES.get(type_b, str(type_b) or "unknown") != dtype:
        dtype = f"mixed {type_a}/{type_b}"
    return int(a[-2]), int(b[-1]), int(a[-1]), int(a[0]) if batched else 1, dtype


def _fit_gemms(ops: pd.DataFrame, cluster: Cluster, min_flops: float, fits: list, unfitted: list) -> None:
    gpu = cluster.gpu
    used: dict[str, list[tuple[float, float, float]]] = {"bf16": [], "fp8": []}
    left_out: Counter = Counter()  # (slot, why) -> GEMM ops; slot "" for those of no slot
    for name, dims, types, t_ns in zip(ops["name"], ops["dims"], ops["types"], ops["t_ns"]):
        shape = _gemm_shape(name, dims, types)
        if isinstance(shape, str):
            left_out["", f"with {shape}"] += 1
            continue
        m, n, k, batch, dtype = shape
        slot = "bf16" if dtype in ("bf16", "fp16") else dtype
        if slot not in used:
            left_out["", f"in {dtype} (no catalog peak)"] += 1
            continue
        if slot == "fp8" and gpu.fp8_tflops is None:
            left_out[slot, f"in fp8 ({gpu.name} has no fp8 peak)"] += 1
            continue
        flops = 2.0 * m * n * k * batch
        peak = gpu.peak_flops(slot)
        c = flops / (peak * hw.quantization(m, n, gpu.sms, batch=batch))
        moved = batch * ((1 if slot == "fp8" else 2) * (m * k + k * n) + 2 * m * n)
        if c < moved / gpu.hbm_bytes_per_s:
            left_out[slot, "memory-bound at the catalog's peak and HBM"] += 1
        elif flops < min_flops:
            left_out[slot, f"under min_gemm_flops={min_flops:g}"] += 1
        elif t_ns > 0:
            used[slot].append((c, flops / peak, t_ns * 1e-9))
    for slot, target in (("bf16", Target.MATMUL_BF16), ("fp8", Target.MATMUL_FP8)):
        rows = used[slot]
        if not rows:
            kind = "bf16/fp16" if slot == "bf16" else slot
            why = ", ".join(f"{v} {w}" for (s, w), v in sorted(left_out.items()) if s in (slot, ""))
            if any(s == slot for s, _ in left_out):
                reason = f"no usable {kind} GEMM ({why})"
            elif all(w == "with no shapes" for _, w in left_out):
                reason = "no GEMM kernel with known shapes" + (f" ({why}: recorded without record_shapes?)" if why
                                                               else " (no GEMM op launched a kernel)")
            else:
                reason = f"no {kind} GEMM in the trace (the others: {why})"
            unfitted.append(Unfitted(target, reason))
            continue
        c, ideal, t = (sum(r[i] for r in rows) for i in range(3))
        detail = (f"{len(rows)} GEMM ops, {ideal * gpu.peak_flops(slot) / 1e12:.4g} TFLOP in {t * 1e3:.4g} ms, "
                  f"achieved {ideal / t:.4g} of the {slot} peak")
        _record(target, c / t, getattr(gpu, target.field), len(rows), detail, fits, unfitted, fraction=True)


def _attention_flops(name: str, dims, types, concrete, causal: bool | None) -> tuple[float, bool] | str:
    """(forward FLOPs, backward?) of one fused attention op, or why not."""
    iq, ik, ic, layout, backward = ATTENTION_OPS[name]
    q, k = (dims[i] if isinstance(dims, list) and i < len(dims) else None for i in (iq, ik))
    if not (isinstance(q, list) and isinstance(k, list) and len(q) == 4 and len(k) == 4):
        return "no 4-D q/k shapes (varlen or not recorded)"
    dtype = DTYPES.get(types[iq] if isinstance(types, list) and iq < len(types) else "", "other")
    if dtype not in ("bf16", "fp16"):
        return "not bf16/fp16"
    b, h, sq, d = (q[0], q[2], q[1], q[3]) if layout == "bshd" else tuple(q)
    sk = k[1] if layout == "bshd" else k[2]
    flag = concrete[ic] if isinstance(concrete, list) and ic < len(concrete) else ""
    is_causal = {"true": True, "1": True, "false": False, "0": False}.get(str(flag).strip().lower(), causal)
    if is_causal is None:
        return "is_causal not recorded (pass causal=)"
    if is_causal and sq != sk:
        return "causal with Sq != Sk"
    return 4.0 * b * h * sq * sk * d * (0.5 if is_causal else 1.0), backward


def _fit_attention(ops: pd.DataFrame, cluster: Cluster, causal, fits: list, unfitted: list) -> None:
    weighted = seconds = 0.0
    used, left_out = Counter(), Counter()
    for name, dims, types, concrete, t_ns in zip(ops["name"], ops["dims"], ops["types"], ops["concrete"],
                                                 ops["t_ns"]):
        got = _attention_flops(name, dims, types, concrete, causal)
        if isinstance(got, str):
            left_out[got] += 1
            continue
        flops, backward = got
        weighted += flops * (2.5 / FLASH_BWD_OVER_FWD if backward else 1.0)
        seconds += t_ns * 1e-9
        used["backward" if backward else "forward"] += 1
    if not used or seconds <= 0:
        why = ", ".join(f"{v} {k}" for k, v in sorted(left_out.items()))
        unfitted.append(Unfitted(Target.ATTENTION, f"no fused attention kernel with known shapes ({why})" if why
                                 else "no fused attention (flash / efficient / cuDNN SDPA) kernel in the trace"))
        return
    detail = f"{used['forward']} forward and {used['backward']} backward attention ops in {seconds * 1e3:.4g} ms"
    _record(Target.ATTENTION, weighted / (cluster.gpu.peak_flops("bf16") * seconds), cluster.gpu.attention_fraction,
            sum(used.values()), detail, fits, unfitted, fraction=True)


def _record(target: Target, value: float, catalog, samples: int, detail: str, fits: list, unfitted: list, *,
            fraction: bool) -> None:
    if not np.isfinite(value) or value <= 0 or fraction and value > 1:
        unfitted.append(Unfitted(target, f"the fit gives {value:.4g}, outside (0, 1]: the kernels ran faster than "
                                 "the catalog's peak (is the cluster's GPU the one the trace ran on?)"
                                 if fraction else f"the fit gives {value:.4g}"))
        return
    fits.append(Fit(target, float(value), catalog, samples, detail))


# ------------------------------------------------------------------------------------------- collectives


def _collective_samples(traces: TraceSet, kernels: np.ndarray, cluster: Cluster) -> tuple[pd.DataFrame, list]:
    """The fastest call per (kind, group, message size) with its bus bytes, steps and NIC share; and what was
    left out, in words."""
    ev = traces.events.iloc[kernels]
    ev = ev[ev["category"].isin(list(COLLECTIVES)).to_numpy()]
    no_size = int((ev["msg_bytes"] <= 0).sum())
    skipped = [f"{no_size} collective kernels without a message size"] if no_size else []
    ev = ev[(ev["msg_bytes"] > 0).to_numpy()]
    keys = pd.DataFrame({c: ev[c].astype(str).to_numpy() for c in ("pg_name", "pg_ranks", "pg_desc")})
    keys["rank"], keys["pg_size"] = ev["rank"].to_numpy(), ev["pg_size"].to_numpy()
    unique = keys.drop_duplicates()
    groups = {tuple(row): _group_ranks(traces, *row) for row in unique.itertuples(index=False)}
    ranks = [groups[tuple(row)] for row in keys.itertuples(index=False)]
    unknown = sum(r is None for r in ranks)
    if unknown:
        skipped.append(f"{unknown} collective kernels of a group whose ranks are unknown")
    known = np.array([r is not None and len(r) > 1 for r in ranks], dtype=bool)  # a group of one moves nothing
    frame = pd.DataFrame({"kind": ev["category"].astype(str).to_numpy()[known],
                          "ranks": [r for r, k in zip(ranks, known) if k],
                          "bytes": ev["msg_bytes"].to_numpy()[known], "t": ev["dur_ns"].to_numpy()[known] * 1e-9})
    frame = frame[frame["t"] > 0]
    if frame.empty:
        return frame.assign(n=[], bus=[], steps=[], share=[], crosses=[], per_node=[], calls=[]), skipped
    best = frame.groupby(["kind", "ranks", "bytes"], sort=True).agg(t=("t", "min"), calls=("t", "size"))
    best = best.reset_index()
    g = cluster.gpus_per_node
    per_node = [max(Counter(r // g for r in ranks).values()) for ranks in best["ranks"]]
    best["crosses"] = [len({r // g for r in ranks}) > 1 for ranks in best["ranks"]]
    best["per_node"] = per_node
    best["n"] = [len(r) for r in best["ranks"]]
    best["bus"] = [COLLECTIVES[k][0](n) * s for k, n, s in zip(best["kind"], best["n"], best["bytes"])]
    best["steps"] = [COLLECTIVES[k][1](n) for k, n in zip(best["kind"], best["n"])]
    best["share"] = np.where(best["crosses"], cluster.nics_per_node * best["per_node"] / g, 1.0)
    return best, skipped


def _group_ranks(traces: TraceSet, pg_name: str, pg_ranks: str, pg_desc: str, rank: int,
                 pg_size: int) -> tuple[int, ...] | None:
    """The global ranks of a collective's group: its ``pg_ranks`` text, else the trace's ``pg_config`` entry of
    its ``pg_name``, else the world for the default group; None when none says."""
    parsed = tuple(int(x) for x in re.findall(r"-?\d+", pg_ranks))
    if parsed and (pg_size <= 0 or len(parsed) == pg_size):
        return parsed
    info = traces.metadata.get(int(rank), {}).get("distributedInfo")
    info = info if isinstance(info, dict) else {}
    for group in info.get("pg_config") or []:
        if isinstance(group, dict) and pg_name and str(group.get("pg_name")) == pg_name:
            members = group.get("ranks")
            if isinstance(members, list) and all(isinstance(m, int) for m in members):
                return tuple(members)
    world = info.get("world_size")
    if isinstance(world, int) and (pg_desc == "default_pg" or pg_size == world):
        return tuple(range(world))
    return None


def _per_group(samples: pd.DataFrame) -> list[CollectiveFit]:
    out = []
    for (kind, ranks), rows in samples.groupby(["kind", "ranks"], sort=True):
        bus, t = rows["bus"].to_numpy(float), rows["t"].to_numpy(float)
        fit_gbps = fit_latency = None
        if len(rows) >= 2:
            (latency, beta), _ = _weighted_lstsq(np.column_stack([np.ones(len(t)), bus]), t, t)
            if beta > 0 and latency >= 0:
                fit_gbps, fit_latency = float(1e-9 / beta), float(latency * 1e6)
        out.append(CollectiveFit(kind=kind, ranks=ranks, crosses_nodes=bool(rows["crosses"].iloc[0]),
                                 ranks_per_node=int(rows["per_node"].iloc[0]), calls=int(rows["calls"].sum()),
                                 sizes=len(rows), busbw_gbps=float((bus / t).max() / 1e9), fit_gbps=fit_gbps,
                                 fit_latency_us=fit_latency))
    return out


def _weighted_lstsq(design: np.ndarray, y: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, int]:
    """Least squares on residuals relative to the measured times ``t``: (coefficients, rank of the design)."""
    coef, _, rank, _ = np.linalg.lstsq(design / t[:, None], y / t, rcond=None)
    return coef, int(rank)


def _fit_link(samples: pd.DataFrame, cluster: Cluster, crosses: bool, skipped: list, fits: list,
              unfitted: list, notes: list) -> None:
    """The link's ``latency_us`` and ``collective_gbps`` over every kind and group that crosses it (docstring)."""
    bandwidth, latency = ((Target.INTER_BANDWIDTH, Target.INTER_LATENCY) if crosses
                          else (Target.INTRA_BANDWIDTH, Target.INTRA_LATENCY))
    link = cluster.inter_node if crosses else cluster.intra_node
    rows = samples[samples["crosses"] == crosses] if len(samples) else samples
    if rows.empty:
        where = "crosses nodes" if crosses else f"stays inside one {cluster.gpus_per_node}-GPU node"
        reason = f"no collective with a known size and group {where}"
        reason += f" ({'; '.join(skipped)})" if skipped else ""
        unfitted += [Unfitted(bandwidth, reason), Unfitted(latency, reason)]
        return
    t = rows["t"].to_numpy(float)
    steps, x = rows["steps"].to_numpy(float), (rows["bus"] / rows["share"]).to_numpy(float)
    y = t - hw.NCCL_BASE_LATENCY_S
    (alpha, beta), rank = _weighted_lstsq(np.column_stack([steps, x]), y, t)
    kept = None
    if rank < 2:
        kept = f"one message size per step count ({len(rows)} point{'s' * (len(rows) > 1)}): latency not separable"
    elif alpha <= 0:
        kept = (f"the fit gives a per-step latency of {alpha * 1e6:.3g} us: the calls are faster than the ring "
                "Simple-protocol latency model (NCCL's LL protocol)")
    elif alpha > LATENCY_LIMIT * link.latency_s:
        kept = (f"the fit gives {alpha * 1e6:.4g} us per ring step, over {LATENCY_LIMIT}x the catalog's "
                f"{link.latency_us} us: the calls include waiting for peers (the fastest call of each size is kept; "
                "the traces of every rank of a group tell waiting from transfer better)")
    if kept:
        alpha = link.latency_s
        beta = float(np.sum(x * (y - steps * alpha) / t**2) / np.sum(x**2 / t**2))
    calls = int(rows["calls"].sum())
    kinds = ", ".join(f"{k} x{n}" for k, n in rows.groupby("kind")["calls"].sum().items())
    if beta <= 0 or 1e-9 / beta > 2 * link.gbps:
        reason = (f"the fit gives {1e-9 / beta:.4g} GB/s, over twice {link.name}'s data-sheet {link.gbps} GB/s (is "
                  "the cluster's link the one the run used?)" if beta > 0 else
                  f"{calls} call{'s' * (calls > 1)} ({kinds}) took no longer than the catalog's latency "
                  f"({link.latency_us} us per ring step + NCCL's base) predicts, which leaves no time for the bytes")
        unfitted += [Unfitted(bandwidth, reason + (f"; {kept}" if kept else "")), Unfitted(latency, kept or reason)]
        return
    model = hw.NCCL_BASE_LATENCY_S + steps * alpha + x * beta
    rms = float(np.sqrt(np.mean(((model - t) / t) ** 2)))
    detail = f"{len(rows)} sizes of {calls} calls ({kinds}); rms relative residual {rms:.2%}"
    fits.append(Fit(bandwidth, 1e-9 / beta, link.collective_gbps, calls, detail))
    if kept:
        unfitted.append(Unfitted(latency, kept))
    else:
        fits.append(Fit(latency, alpha * 1e6, link.latency_us, calls, detail))
    if rms > POOR_FIT:
        notes.append(f"{link.name} fits poorly (rms relative residual {rms:.0%}): its calls' durations include "
                     "waiting for peers or vary with more than size")


__all__ = ["ATTENTION_OPS", "COLLECTIVES", "Calibration", "CalibrationWarning", "CollectiveFit", "Fit", "GEMM_OPS",
           "Target", "Unfitted", "calibrate"]
