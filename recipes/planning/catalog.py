"""The hardware the step-time model prices (GPUs, links, node types, read from the one hardware catalog,
``shardline.job.hardware`` (``job/hardware.yaml``), where each number is cited to its data sheet or published
measurement and whose links the profiler's bandwidth limits read too, optionally with a user's YAML merged over
it), and what one GEMM or one collective costs on it.

A user file has the same sections (``gpus``, ``links``, ``clusters``); an entry whose name exists replaces the
fields it gives (``gpus: {h100-sxm: {hbm_gbps: 3000}}`` changes one number), a new name must give every field.
Every problem is reported at load time with the file, the entry and the field. A :class:`Cluster` is one node
type: the GPU, ``gpus_per_node``, the intra-node link, ``nics_per_node`` NICs of the inter-node link, the host
link offload crosses, and the node's CPU memory and NVMe bandwidths; :func:`cluster` builds one from names,
:meth:`Catalog.cluster` returns a packaged one.

Costs. A GEMM ``M x N x K`` takes ``max(2MNK / (P f q), bytes / (HBM h))``: ``P`` the data-sheet peak, ``f`` the
GPU's sustained GEMM share, ``q`` the tile-and-wave quantization (NVIDIA's "Matrix Multiplication Background"
guide: ``M N / (waves * SMs * tile)``, the best of ``CTA_TILES``), ``h`` the reachable share of HBM. Collectives
are alpha-beta over the link the group crosses, ``B`` its collective bandwidth, ``alpha`` its per-step latency,
``alpha0`` NCCL's base latency (and each link's ``channels``: the SMs a running collective holds, which a GEMM
beside it does without, ``gemm_s(..., sms=)``)::

    ring all-reduce                           2(N-1)/N * S/B + 2(N-1) alpha + alpha0
    tree all-reduce                           2 S/(0.92 B) + 2 log2(N) alpha + alpha0   (the cheaper is taken)
    all-gather / reduce-scatter (S gathered)  (N-1)/N * S/B + (N-1) alpha + alpha0
    all-to-all (S per rank)                   (N-1)/N * S/B + (N-1) alpha + alpha0
    p2p                                       S/B + alpha

A group of ``size`` ranks ``stride`` apart (rank order tp fastest, then cp, dp, pp) stays inside a node when
``size * stride`` divides ``gpus_per_node``; otherwise it crosses the NICs and, with ``k`` members per node, gets
``k / gpus_per_node`` of the node's NIC bandwidth (a TP group larger than a node pays the NIC).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shardline.job.hardware import LINK_KINDS, PACKAGED_HARDWARE, hardware
from shardline.recipes.schema import RecipeError

#: The packaged catalog: the one hardware file both halves read (``catalog.sources[0]``).
PACKAGED_CATALOG = PACKAGED_HARDWARE
NCCL_BASE_LATENCY_S = 8.4e-6  # NCCL src/graph/tuning.cc baseLat[RING][SIMPLE]
TREE_EFFICIENCY = 0.92  # NCCL src/graph/tuning.cc: a tree all-reduce's busBw * .92
CTA_TILES = ((256, 128), (128, 256), (128, 128))  # cuBLAS/CUTLASS tensor-core CTA tiles (Ampere/Hopper)
# A link entry without ``channels`` gets its kind's packaged figure (hardware.yaml: NVLink 24, IB 16, PCIe 2).
DEFAULT_CHANNELS = {"intra": 24, "inter": 16, "host": 2}
#: DeepSpeed's CPU Adam as measured (job/hardware.yaml ``cpu_adam``, cited there: ZeRO-Offload's Table 3), in
#: parameters per second per byte/s of the host's DRAM peak: a node type without its own ``cpu_adam_gparams`` gets
#: this times its ``cpu_mem_gbps``.
CPU_ADAM_PARAMS_PER_DRAM_BYTE = hardware().cpu_adam.params_per_dram_byte

class PlanError(RecipeError):
    """A plan input that cannot be priced (an unknown GPU, link or cluster, a bad catalog entry, a layout the
    model or the cluster cannot hold); names every offending value, and the known names where a name is wrong."""


@dataclass(frozen=True)
class Gpu:
    """One accelerator. Peaks in TFLOP/s (dense), HBM in GB and GB/s; ``matmul_fraction_*`` the measured best
    GEMM throughput over the peak (see job/hardware.yaml)."""

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    hbm_gb: float
    hbm_gbps: float
    sms: int
    matmul_fraction_bf16: float
    matmul_fraction_fp8: float | None
    hbm_fraction: float
    attention_fraction: float
    intra_node: str

    def peak_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s of ``dtype`` (``bf16``/``fp16`` or ``fp8``)."""
        if dtype == "fp8":
            if self.fp8_tflops is None:
                raise PlanError(f"gpu {self.name!r} has no FP8 tensor cores (fp8_tflops is null); use dtype='bf16'")
            return self.fp8_tflops * 1e12
        return self.bf16_tflops * 1e12

    def matmul_fraction(self, dtype: str) -> float:
        if dtype == "fp8" and self.matmul_fraction_fp8 is not None:
            return self.matmul_fraction_fp8
        return self.matmul_fraction_bf16

    @property
    def hbm_bytes_per_s(self) -> float:
        """The bandwidth memory-bound kernels get: ``hbm_gbps * hbm_fraction`` in bytes/s."""
        return self.hbm_gbps * self.hbm_fraction * 1e9


@dataclass(frozen=True)
class Link:
    """A link's data-sheet bandwidth ``gbps`` and NCCL's modelled ``collective_gbps``, both per direction in
    GB/s; ``latency_us`` per ring step; ``channels`` the SMs a collective on it holds while it runs (one NCCL
    channel, one CTA, per SM)."""

    name: str
    gbps: float
    collective_gbps: float
    latency_us: float
    kind: str
    channels: int

    @property
    def bytes_per_s(self) -> float:
        """The bandwidth the alpha-beta costs use: ``collective_gbps`` in bytes/s."""
        return self.collective_gbps * 1e9

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class Cluster:
    """One node type. ``nic_bytes_per_s`` is one GPU's share of the node's NICs (all of them divided by
    ``gpus_per_node``), ``node_nic_bytes_per_s`` the whole node's."""

    name: str
    gpu: Gpu
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    nics_per_node: int
    host: Link
    cpu_mem_gbps: float
    nvme_gbps: float
    cpu_ram_gib: float | None = None  # one node's CPU RAM (offload must fit in it); None: not known
    #: The node's DeepSpeed CPU Adam throughput, billions of parameters per second (all its cores, shared by its
    #: GPUs' ranks); None: :data:`CPU_ADAM_PARAMS_PER_DRAM_BYTE` times ``cpu_mem_gbps``.
    cpu_adam_gparams: float | None = None

    def __post_init__(self) -> None:
        problems = [f"{k}={getattr(self, k)!r} must be an integer >= 1" for k in ("gpus_per_node", "nics_per_node")
                    if not isinstance(getattr(self, k), int) or getattr(self, k) < 1]
        problems += [f"{k}={getattr(self, k)!r} must be > 0" for k in ("cpu_mem_gbps", "nvme_gbps")
                     if not _positive(getattr(self, k))]
        if self.cpu_ram_gib is not None and not _positive(self.cpu_ram_gib):
            problems.append(f"cpu_ram_gib={self.cpu_ram_gib!r} must be > 0 or None")
        if self.cpu_adam_gparams is not None and not _positive(self.cpu_adam_gparams):
            problems.append(f"cpu_adam_gparams={self.cpu_adam_gparams!r} must be > 0 or None")
        for key, kind in (("intra_node", "intra"), ("inter_node", "inter"), ("host", "host")):
            link = getattr(self, key)
            if link.kind != kind:
                problems.append(f"{key}={link.name!r} is a {link.kind!r} link, not {kind!r}")
        if problems:
            raise PlanError(f"cluster {self.name!r}: " + "; ".join(problems))

    @property
    def cpu_adam_params_per_s(self) -> float:
        """Parameters per second one GPU's rank updates with DeepSpeed's CPU Adam: the node's rate
        (``cpu_adam_gparams``, else the ZeRO-Offload measurement scaled by ``cpu_mem_gbps``) over its GPUs."""
        node = (self.cpu_adam_gparams * 1e9 if self.cpu_adam_gparams is not None
                else CPU_ADAM_PARAMS_PER_DRAM_BYTE * self.cpu_mem_gbps * 1e9)
        return node / self.gpus_per_node

    @property
    def node_nic_bytes_per_s(self) -> float:
        return self.nics_per_node * self.inter_node.bytes_per_s

    @property
    def nic_bytes_per_s(self) -> float:
        return self.node_nic_bytes_per_s / self.gpus_per_node


# ---------------------------------------------------------------------------- what moving bytes costs


@dataclass(frozen=True)
class GroupLink:
    """The link a process group's collectives cross: bandwidth (bytes/s), per-step latency (s), and the SMs
    (NCCL channels) a collective on it occupies."""

    bytes_per_s: float
    latency_s: float
    crosses_nodes: bool
    channels: int = 0


def group_link(cluster: Cluster, *, size: int, stride: int) -> GroupLink:
    """Where ranks ``r, r+stride, ..., r+(size-1)*stride`` communicate (see the module docstring)."""
    g = cluster.gpus_per_node
    intra = cluster.intra_node
    if size * stride <= g and g % (size * stride) == 0:
        return GroupLink(intra.bytes_per_s, intra.latency_s, False, intra.channels)
    per_node = max(1, min(size, g // stride))
    nic = cluster.node_nic_bytes_per_s * per_node / g
    bandwidth = min(nic, intra.bytes_per_s) if per_node > 1 else nic
    return GroupLink(bandwidth, cluster.inter_node.latency_s, True, cluster.inter_node.channels)


def ring_all_reduce_s(size_bytes: float, n: int, link: GroupLink) -> float:
    """``2(N-1)/N * S/B + 2(N-1) alpha + alpha0``; 0 for one rank."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * size_bytes / link.bytes_per_s + 2 * (n - 1) * link.latency_s + NCCL_BASE_LATENCY_S


def tree_all_reduce_s(size_bytes: float, n: int, link: GroupLink) -> float:
    """Double binary tree: ``2 S / (0.92 B) + 2 log2(N) alpha + alpha0`` (NCCL tuning.cc prices a tree
    all-reduce at 0.92 of the ring's bus bandwidth); 0 for one rank."""
    if n <= 1:
        return 0.0
    return 2 * size_bytes / (TREE_EFFICIENCY * link.bytes_per_s) + 2 * math.log2(n) * link.latency_s \
        + NCCL_BASE_LATENCY_S


def all_reduce_s(size_bytes: float, n: int, link: GroupLink) -> float:
    """The cheaper of ring and tree (NCCL picks per size)."""
    return min(ring_all_reduce_s(size_bytes, n, link), tree_all_reduce_s(size_bytes, n, link))


def all_gather_s(size_bytes: float, n: int, link: GroupLink) -> float:
    """Ring all-gather / reduce-scatter of a full (gathered) buffer of ``S`` bytes, or an all-to-all of a
    per-rank buffer of ``S`` bytes: ``(N-1)/N * S/B + (N-1) alpha + alpha0``; 0 for one rank."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * size_bytes / link.bytes_per_s + (n - 1) * link.latency_s + NCCL_BASE_LATENCY_S


reduce_scatter_s = all_to_all_s = all_gather_s


def p2p_s(size_bytes: float, link: GroupLink) -> float:
    return size_bytes / link.bytes_per_s + link.latency_s


@functools.lru_cache(maxsize=65536)
def quantization(m: int, n: int, sms: int, *, batch: int = 1) -> float:
    """Useful fraction of the tensor cores for an ``M x N`` output in CTA tiles over ``sms`` SMs: ``M N batch /
    (waves * sms * tile)``, the best over ``CTA_TILES`` (tile and wave quantization)."""
    best = 0.0
    for tm, tn in CTA_TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        waves = math.ceil(tiles / sms)
        best = max(best, m * n * batch / (waves * sms * tm * tn))
    return best


def gemm_s(gpu: Gpu, m: int, n: int, k: int, *, dtype: str, batch: int = 1, out_bytes: float = 2,
           sms: int | None = None) -> float:
    """``max(2MNK / (P f q), (A + B + C bytes) / HBM)`` for ``batch`` GEMMs of ``M x N x K`` (the roofline; the
    output ``C`` costs ``out_bytes`` per element: 2, or 8 when accumulated into an fp32 buffer, read and
    written). ``sms``: the GEMM runs on that many of the GPU's SMs (the rest held by a concurrent collective):
    the peak scales by ``sms / gpu.sms`` and the waves are counted over ``sms``."""
    flops = 2 * m * n * k * batch
    in_bytes = 1 if dtype == "fp8" else 2
    moved = batch * (in_bytes * (m * k + k * n) + out_bytes * m * n)
    free = gpu.sms if sms is None else sms
    rate = gpu.peak_flops(dtype) * gpu.matmul_fraction(dtype) * quantization(m, n, free, batch=batch) \
        * free / gpu.sms
    return max(flops / rate, moved / gpu.hbm_bytes_per_s)


_GPU_FIELDS = {f.name for f in dataclasses.fields(Gpu)} - {"name"}
_LINK_FIELDS = {f.name for f in dataclasses.fields(Link)} - {"name"}
_CLUSTER_FIELDS = {"gpu", "gpus_per_node", "intra_node", "inter_node", "nics_per_node", "host", "cpu_mem_gbps",
                   "nvme_gbps", "cpu_ram_gib", "cpu_adam_gparams"}
_NULLABLE = {"fp8_tflops", "matmul_fraction_fp8", "cpu_ram_gib", "cpu_adam_gparams"}
# a user's node type may leave these out (offload's CPU RAM is then not checked; CPU Adam follows cpu_mem_gbps)
_OPTIONAL = {"cpu_ram_gib", "cpu_adam_gparams"}
_SECTIONS = {"gpus": _GPU_FIELDS, "links": _LINK_FIELDS, "clusters": _CLUSTER_FIELDS}


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class Catalog:
    """GPUs, links and node types by name; raw entries as merged from the YAML files."""

    gpus: dict[str, dict[str, Any]]
    links: dict[str, dict[str, Any]]
    clusters: dict[str, dict[str, Any]]
    sources: tuple[str, ...]

    def gpu(self, name: str) -> Gpu:
        return Gpu(name=name, **self._entry("gpus", "gpu", name))

    def link(self, name: str) -> Link:
        return Link(name=name, **self._entry("links", "link", name))

    def cluster(self, name: str) -> Cluster:
        entry = self._entry("clusters", "cluster", name)
        return cluster(self, name=name, **entry)

    def _entry(self, section: str, what: str, name: str) -> dict[str, Any]:
        table = getattr(self, section)
        if name not in table:
            raise PlanError(f"unknown {what} {name!r} (known: {', '.join(sorted(table))})")
        return dict(table[name])


def cluster(catalog: Catalog, *, gpu: str, gpus_per_node: int, inter_node: str, nics_per_node: int,
            intra_node: str | None = None, host: str = "pcie-gen5", cpu_mem_gbps: float = 614.4,
            nvme_gbps: float = 56.0, name: str | None = None, cpu_ram_gib: float | None = None,
            cpu_adam_gparams: float | None = None) -> Cluster:
    """A cluster of ``gpu`` nodes from catalog names. ``intra_node`` defaults to the GPU's own scale-up link;
    the defaults of ``host``, ``cpu_mem_gbps`` and ``nvme_gbps`` are the DGX H100's (job/hardware.yaml);
    ``cpu_ram_gib`` (one node's CPU RAM) has none: unknown, offload's CPU RAM is then not checked;
    ``cpu_adam_gparams`` (the node's CPU Adam rate) none: :data:`CPU_ADAM_PARAMS_PER_DRAM_BYTE` x ``cpu_mem_gbps``."""
    accel = catalog.gpu(gpu)
    return Cluster(name=name or f"{gpus_per_node}x{gpu}", gpu=accel, gpus_per_node=gpus_per_node,
                   intra_node=catalog.link(intra_node or accel.intra_node), inter_node=catalog.link(inter_node),
                   nics_per_node=nics_per_node, host=catalog.link(host), cpu_mem_gbps=cpu_mem_gbps,
                   nvme_gbps=nvme_gbps, cpu_ram_gib=cpu_ram_gib, cpu_adam_gparams=cpu_adam_gparams)


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The packaged catalog, with the user's YAML at ``path`` merged over it (see the module docstring)."""
    merged = _packaged()
    sources = [str(PACKAGED_CATALOG)]
    if path is not None:
        user = _read(Path(path))
        for section, entries in user.items():
            for name, fields in entries.items():
                merged[section][name] = {**merged[section].get(name, {}), **fields}
        sources.append(str(path))
    for fields in merged["links"].values():  # a user's link may leave its channels to its kind's default
        if "channels" not in fields and fields.get("kind") in DEFAULT_CHANNELS:
            fields["channels"] = DEFAULT_CHANNELS[fields["kind"]]
    _validate(merged, " + ".join(sources))
    return Catalog(gpus=merged["gpus"], links=merged["links"], clusters=merged["clusters"], sources=tuple(sources))


def _packaged() -> dict[str, dict[str, dict[str, Any]]]:
    """The planner's three sections of the one hardware catalog, as fresh mutable entries: every link under
    every name (an alias too) with the fields of :class:`Link` (its ``source`` is the profiler's)."""
    hw = hardware()
    keys = [f.name for f in dataclasses.fields(Link) if f.name != "name"]  # the packaged file's field order
    links = {name: {key: getattr(spec, key) for key in keys} for name, spec in hw.links.items()}
    return {"gpus": {name: dict(fields) for name, fields in hw.gpus.items()}, "links": links,
            "clusters": {name: dict(fields) for name, fields in hw.clusters.items()}}


def _read(path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise PlanError(f"catalog {path}: cannot be read ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise PlanError(f"catalog {path}: not valid YAML ({error})") from None
    data = {} if data is None else data
    problems = []
    if not isinstance(data, dict):
        raise PlanError(f"catalog {path}: the top level must be a mapping of {sorted(_SECTIONS)}")
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        problems.append(f"unknown sections {unknown} (known: {sorted(_SECTIONS)})")
    for section in _SECTIONS:
        entries = data.setdefault(section, {}) or {}
        data[section] = entries
        if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
            problems.append(f"{section} must map names to mappings of fields")
    if problems:
        raise PlanError(f"catalog {path}: " + "; ".join(problems))
    return {section: {str(k): dict(v) for k, v in data[section].items()} for section in _SECTIONS}


def _validate(merged: dict[str, dict[str, dict[str, Any]]], source: str) -> None:
    problems = []
    for section, known in _SECTIONS.items():
        for name, fields in merged[section].items():
            unknown = sorted(set(fields) - known)
            missing = sorted(known - set(fields) - _OPTIONAL)
            if unknown:
                problems.append(f"{section}.{name}: unknown fields {unknown} (known: {sorted(known)})")
            if missing:
                problems.append(f"{section}.{name}: missing fields {missing}")
            for key, value in fields.items():
                if key in known and not _valid_value(section, key, value, merged):
                    problems.append(f"{section}.{name}.{key}={value!r} {_expectation(section, key, merged)}")
    if problems:
        raise PlanError(f"catalog {source}: " + "; ".join(problems))


_NAME_REFERENCES = {("gpus", "intra_node"): "links", ("clusters", "gpu"): "gpus",
                    ("clusters", "intra_node"): "links", ("clusters", "inter_node"): "links",
                    ("clusters", "host"): "links"}
_INTEGERS = {"sms", "gpus_per_node", "nics_per_node", "channels"}
_FRACTIONS = {"matmul_fraction_bf16", "matmul_fraction_fp8", "hbm_fraction", "attention_fraction"}


def _valid_value(section: str, key: str, value, merged) -> bool:
    if key in _NULLABLE and value is None:
        return True
    if (section, key) in _NAME_REFERENCES:
        return isinstance(value, str) and value in merged[_NAME_REFERENCES[section, key]]
    if key == "kind":
        return value in LINK_KINDS
    if key in _INTEGERS:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if key in _FRACTIONS:
        return _positive(value) and value <= 1
    return _positive(value)


def _expectation(section: str, key: str, merged) -> str:
    if (section, key) in _NAME_REFERENCES:
        table = _NAME_REFERENCES[section, key]
        return f"must name an entry of {table} (known: {', '.join(sorted(merged[table]))})"
    if key == "kind":
        return f"must be one of {LINK_KINDS}"
    if key in _INTEGERS:
        return "must be an integer >= 1"
    if key in _FRACTIONS:
        return "must be in (0, 1]" + (" or null" if key in _NULLABLE else "")
    return "must be a number > 0" + (" or null" if key in _NULLABLE else "")


__all__ = ["CTA_TILES", "Catalog", "Cluster", "DEFAULT_CHANNELS", "Gpu", "GroupLink", "LINK_KINDS", "Link",
           "NCCL_BASE_LATENCY_S", "PACKAGED_CATALOG", "PlanError", "TREE_EFFICIENCY", "all_gather_s", "all_reduce_s",
           "all_to_all_s",
           "cluster", "gemm_s", "group_link", "load_catalog", "p2p_s", "quantization", "reduce_scatter_s",
           "ring_all_reduce_s", "tree_all_reduce_s"]
