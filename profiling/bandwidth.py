"""Bandwidth of every collective instance on every rank, against the limit of the link its group crosses.

One row per (collective call, rank): the GPU kernel on ranks attributed on GPUs, else the outermost CPU comm
op (the rows ``collectives.comm_calls`` uses), plus point-to-point sends and receives. nccl-tests' definitions
(``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests), with ``S`` bytes and ``n`` ranks in the group::

    S      all-reduce, broadcast, all-to-all, p2p: the (per-rank) input;  all-gather: the output;
           reduce-scatter: the input (both the full buffer, n x the per-rank shard)
    algbw = S / t                                   (GB/s = 1e9 B/s = bytes per ns)
    busbw = algbw x 2(n-1)/n    all-reduce
          = algbw x (n-1)/n     all-gather, reduce-scatter, all-to-all
          = algbw               broadcast, p2p send / recv
    efficiency = busbw / link_gbps                  (the link's limit per direction)

``t``, ``time_basis``: ``transfer`` is the matched transfer time (``collectives.match_collectives``: the call's
duration less the time it waited for the last member to arrive) when every member of the group was matched;
otherwise ``duration``, the kernel's (or op's) whole duration, which includes any waiting, so the bandwidth
is a lower bound. p2p calls are never matched here: their basis is always ``duration``.

``S`` (``size_source``), first that exists: the row's own ``In/Out msg nelems`` and ``dtype`` args (Kineto,
PyTorch >= 2.1 kernels and ``record_param_comms``), the events table's ``msg_bytes`` (NCCL logs, Nsight, a
kernel given its op's size by ``classify``), then the launching comm op's args: its nelems, else its
``Input Dims`` x ``Input type`` (older PyTorch records only these, on ``nccl:*`` annotations; the input of an
all-gather is one shard, so S = n x input there). The op of a kernel is the one whose External id it shares,
else the innermost one holding size args that contains its launch (same correlation id, same thread); the op
of a CPU row is the first one with size args nested in it. ``imbalance`` (all-to-all-v): the larger of
max/mean of ``In split size`` and ``Out split size`` (1.0 balanced, NaN without splits).

The link. The group's ranks (``pg_ranks``, the trace's ``pg_config`` for its name, the world for an anonymous
group; for p2p the rank and its peer) are placed ``rank // gpus_per_node`` on nodes. ``gpus_per_node``:
the argument, else the links file's, else the recorded layout's, else 8 (an HGX/DGX node) unless the ranks'
device indices show more (``device == rank % k`` for ``k = max device + 1 > 8``: the loaded ranks give only a
lower bound); ``df.attrs`` says which. More than one node -> the GPU's NIC share (``nic gbps x nics_per_node / gpus_per_node``, one port per
GPU by default); one node -> the intra-node fabric the device name implies (``DEVICE_RULES`` on Kineto's
``deviceProperties`` name). A group of one rank crosses nothing (link "", NaN limit).

``latency_bound``: S < ``LATENCY_BOUND_BYTES`` (1 MiB); the efficiency is still computed, but a summary says
"latency-bound" rather than a fraction of the peak there.
"""

from __future__ import annotations

import enum
import json
import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd

from shardline.profiling.attribution import attribute
from shardline.profiling.classify import Lane
from shardline.profiling.collectives import (
    COLLECTIVE_CATEGORIES,
    ClockAlignment,
    _outermost,
    match_collectives,
    step_of,
)
from shardline.profiling.errors import AttributionError, ProfilingError, TraceWarning
from shardline.profiling.readers._kineto_columns import DTYPE_BYTES
from shardline.profiling.schema import COMM_CATEGORIES

__all__ = ["COLUMNS", "DEFAULT_LINKS", "DEVICE_RULES", "HOST_PCIE", "LATENCY_BOUND_BYTES", "Link", "LinkTable",
           "LinkTableError", "TimeBasis", "bandwidth_summary", "busbw_factor", "collective_bandwidth", "link_table"]


class LinkTableError(ProfilingError, ValueError):
    """A links file or mapping that cannot be used; the message names the file and the key."""


class TimeBasis(str, enum.Enum):
    TRANSFER = "transfer"
    DURATION = "duration"


#: Messages below this many bytes are dominated by latency, not bandwidth (NCCL's LL/LL128 range).
LATENCY_BOUND_BYTES = 1 << 20
#: Node size assumed when neither the user, the links file, the layout nor the device indices tell.
DEFAULT_GPUS_PER_NODE = 8

P2P_CATEGORIES = ("p2p_send", "p2p_recv")
CATEGORIES = tuple(c for c in COLLECTIVE_CATEGORIES if c not in ("barrier", "other_comm")) + P2P_CATEGORIES


@dataclass(frozen=True)
class Link:
    """A link's limit: GB/s (1e9 B/s) per direction, per GPU, and the data sheet it comes from."""

    name: str
    gbps: float
    source: str


# Per direction, per GPU. Bidirectional data-sheet figures are halved; Gb/s line rates are divided by 8.
DEFAULT_LINKS: dict[str, Link] = {link.name: link for link in (
    Link("pcie-gen3", 15.75, "PCI-SIG PCIe 3.0 base spec: 8 GT/s x 16 lanes, 128b/130b -> 15.75 GB/s per "
                             "direction (Tesla V100 PCIe / T4 data sheets: 32 GB/s bidirectional)"),
    Link("pcie-gen4", 31.5, "PCI-SIG PCIe 4.0 base spec: 16 GT/s x 16 lanes, 128b/130b -> 31.5 GB/s per "
                            "direction (A100 PCIe data sheet: 64 GB/s bidirectional)"),
    Link("pcie-gen5", 64.0, "PCIe 5.0 x16: 64 GB/s per direction (the seed document; H100 PCIe data sheet: "
                            "128 GB/s bidirectional)"),
    Link("nvlink2", 150.0, "Tesla V100 SXM2 data sheet: NVLink 2, 300 GB/s bidirectional per GPU"),
    Link("nvlink3", 300.0, "A100 Tensor Core GPU data sheet: NVLink 3, 600 GB/s bidirectional per GPU (SXM)"),
    Link("nvlink3-a800", 200.0, "A800 SXM4 data sheet: NVLink 400 GB/s bidirectional per GPU"),
    Link("nvlink4", 450.0, "H100 Tensor Core GPU data sheet: NVLink 4, 900 GB/s bidirectional per GPU (SXM; "
                           "H200 SXM, GH200 the same; the seed document)"),
    Link("nvlink4-h800", 200.0, "H800 SXM5 data sheet: NVLink 400 GB/s bidirectional per GPU"),
    Link("nvlink5", 900.0, "DGX B200 / GB200 NVL72 data sheets: NVLink 5, 1.8 TB/s bidirectional per GPU"),
    Link("xgmi", 448.0, "AMD Instinct MI300X data sheet: 7 Infinity Fabric (xGMI) links x 128 GB/s "
                        "bidirectional = 896 GB/s aggregate -> 448 per direction"),
    Link("ib-edr", 12.5, "InfiniBand EDR (ConnectX-5): 100 Gb/s per port -> 12.5 GB/s per direction"),
    Link("ib-hdr", 25.0, "InfiniBand HDR (ConnectX-6 data sheet): 200 Gb/s per port -> 25 GB/s per direction"),
    Link("ib-ndr", 50.0, "InfiniBand NDR (ConnectX-7 data sheet): 400 Gb/s per port -> 50 GB/s per direction "
                         "(the seed document)"),
    Link("ib-xdr", 100.0, "InfiniBand XDR (ConnectX-8 SuperNIC data sheet): 800 Gb/s per port -> 100 GB/s per "
                          "direction"),
    Link("roce-400", 50.0, "RoCE v2 on 400 GbE (ConnectX-7 / Pollara 400): 400 Gb/s -> 50 GB/s per direction"),
)}

#: Device name (regex, case-insensitive, first match wins) -> (intra-node link, NIC): what the GPU's reference
#: system (DGX/HGX, MI300X platform) pairs it with; a links file can prepend rules or force either.
DEVICE_RULES: tuple[tuple[str, str, str], ...] = (
    (r"GB300|B300", "nvlink5", "ib-xdr"),
    (r"GB200|B200|B100", "nvlink5", "ib-ndr"),
    (r"H800", "nvlink4-h800", "ib-ndr"),
    (r"(H100|H200).*(PCIe|NVL)", "pcie-gen5", "ib-ndr"),
    (r"H100|H200|H20\b|GH200", "nvlink4", "ib-ndr"),
    (r"A100.*PCIe|A800.*PCIe", "pcie-gen4", "ib-hdr"),
    (r"A800", "nvlink3-a800", "ib-hdr"),
    (r"A100", "nvlink3", "ib-hdr"),  # SXM4 parts, including Meta's A100-PG509-200 board
    (r"V100.*(SXM|DGXS)", "nvlink2", "ib-edr"),
    (r"V100|T4\b|P100.*PCIe", "pcie-gen3", "ib-edr"),
    (r"MI300|MI325", "xgmi", "roce-400"),
    (r"L40|L4\b|A10\b|A40|A30|RTX 4090|RTX 6000 Ada", "pcie-gen4", "ib-hdr"),
    (r"RTX 5090|RTX PRO 6000", "pcie-gen5", "ib-ndr"),
)
#: The NIC of a device no rule names.
DEFAULT_NIC = "ib-ndr"
#: Intra-node link -> the PCIe generation of the GPU's host interface (x16) in the same reference system (V100:
#: Gen3; A100/A800: Gen4; H100/H200/H800/H20, B200/B300 and MI300X: Gen5); a PCIe part's host link is its own.
HOST_PCIE = {"nvlink2": "pcie-gen3", "nvlink3": "pcie-gen4", "nvlink3-a800": "pcie-gen4", "nvlink4": "pcie-gen5",
             "nvlink4-h800": "pcie-gen5", "nvlink5": "pcie-gen5", "xgmi": "pcie-gen5",
             "pcie-gen3": "pcie-gen3", "pcie-gen4": "pcie-gen4", "pcie-gen5": "pcie-gen5"}
#: The host link assumed for a device no rule names.
DEFAULT_HOST_PCIE = "pcie-gen5"

#: The columns of ``collective_bandwidth``, in order.
COLUMNS = ("rank", "step", "category", "pg", "pg_desc", "dim", "group_size", "dtype", "bytes", "time_ns",
           "time_basis", "algbw_gbps", "busbw_gbps", "link", "link_gbps", "efficiency", "latency_bound",
           "nodes", "imbalance", "size_source", "device_name", "name", "start_ns", "dur_ns", "wait_ns", "peer")


def busbw_factor(category, n) -> np.ndarray:
    """nccl-tests' bus-bandwidth factor of each (category, group size n); NaN where n is unknown (< 1)."""
    category = np.asarray(category, dtype=object)
    n = np.asarray(n, dtype=np.float64)
    safe = np.where(n >= 1, n, np.nan)
    ring = (safe - 1) / safe
    out = np.full(len(category), np.nan)
    out = np.where(category == "all_reduce", 2 * ring, out)
    out = np.where(np.isin(category, ("all_gather", "reduce_scatter", "all_to_all")), ring, out)
    return np.where(np.isin(category, ("broadcast", *P2P_CATEGORIES)), 1.0, out)


# --- the links table ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinkTable:
    """Limits by name, device rules, and the node shape; ``link_table`` builds one from the defaults and a
    file or mapping of overrides."""

    links: Mapping[str, Link]
    rules: tuple[tuple[str, str, str], ...]
    intra: str | None = None
    nic: str | None = None
    gpus_per_node: int | None = None
    nics_per_node: int | None = None

    def device_links(self, name: str) -> tuple[str, str]:
        """(intra-node link, NIC) of a device name ("" for an intra link no rule gives)."""
        intra, nic = "", DEFAULT_NIC
        for pattern, rule_intra, rule_nic in self.rules:
            if re.search(pattern, name, flags=re.IGNORECASE):
                intra, nic = rule_intra, rule_nic
                break
        return self.intra or intra, self.nic or nic

    def host_link(self, name: str) -> tuple[Link, bool]:
        """The PCIe link (x16, per direction) between the host and a GPU of this name, and whether a device
        rule knew it (False: ``DEFAULT_HOST_PCIE`` assumed). Ignores a forced ``intra`` link."""
        for pattern, rule_intra, _nic in self.rules:
            if re.search(pattern, name, flags=re.IGNORECASE) and rule_intra in HOST_PCIE:
                return self.links[HOST_PCIE[rule_intra]], True
        return self.links[DEFAULT_HOST_PCIE], False


_FILE_KEYS = ("links", "devices", "intra", "nic", "gpus_per_node", "nics_per_node")


def link_table(links: str | Path | Mapping | None = None) -> LinkTable:
    """The default table, with ``links`` (a YAML/JSON file path or a mapping) applied on top::

        links:          {NAME: {gbps: GB/s per direction, source: "data sheet"}, ...}   add or replace limits
        devices:        [{match: REGEX, intra: NAME, nic: NAME}, ...]                   rules tried first
        intra: NAME     nic: NAME                                                       force either link
        gpus_per_node: N     nics_per_node: N

    Anything else, a bad value, or a link name no entry defines raises ``LinkTableError`` naming the file
    (or "links mapping") and the key."""
    origin = "links mapping"
    if links is None:
        spec: Mapping = {}
    elif isinstance(links, (str, Path)):
        origin = str(links)
        spec = _read_links_file(Path(links))
    elif isinstance(links, Mapping):
        spec = links
    else:
        raise LinkTableError(f"links={links!r} must be a file path or a mapping")
    if not isinstance(spec, Mapping):
        raise LinkTableError(f"{origin}: the top level must be a mapping with keys {list(_FILE_KEYS)}")
    unknown = [k for k in spec if k not in _FILE_KEYS]
    if unknown:
        raise LinkTableError(f"{origin}: unknown key(s) {unknown}; expected {list(_FILE_KEYS)}")
    table = dict(DEFAULT_LINKS)
    for name, entry in (_mapping(spec.get("links", {}), origin, "links")).items():
        where = f"links.{name}"
        entry = _mapping(entry, origin, where)
        extra = [k for k in entry if k not in ("gbps", "source")]
        if extra:
            raise LinkTableError(f"{origin}: key {where}: unknown field(s) {extra}; expected gbps, source")
        gbps = entry.get("gbps", table[name].gbps if name in table else None)
        table[str(name)] = Link(str(name), _positive(gbps, origin, f"{where}.gbps"),
                                str(entry.get("source", "links file" if origin == "links mapping" else origin)))
    rules = []
    devices = spec.get("devices", [])
    if not isinstance(devices, list):
        raise LinkTableError(f"{origin}: key devices must be a list of {{match, intra, nic}}")
    for i, rule in enumerate(devices):
        where = f"devices[{i}]"
        rule = _mapping(rule, origin, where)
        if not isinstance(rule.get("match"), str):
            raise LinkTableError(f"{origin}: key {where}.match must be a regular expression (text)")
        try:
            re.compile(rule["match"])
        except re.error as exc:
            raise LinkTableError(f"{origin}: key {where}.match {rule['match']!r} is not a regex ({exc})") from None
        rules.append((rule["match"], _link_name(rule.get("intra", ""), table, origin, f"{where}.intra"),
                      _link_name(rule.get("nic", DEFAULT_NIC), table, origin, f"{where}.nic")))
    intra = spec.get("intra")
    nic = spec.get("nic")
    return LinkTable(
        links=table, rules=(*rules, *DEVICE_RULES),
        intra=None if intra is None else _link_name(intra, table, origin, "intra"),
        nic=None if nic is None else _link_name(nic, table, origin, "nic"),
        gpus_per_node=_count(spec.get("gpus_per_node"), origin, "gpus_per_node"),
        nics_per_node=_count(spec.get("nics_per_node"), origin, "nics_per_node"))


def _read_links_file(path: Path) -> object:
    try:
        text = path.read_text()
    except OSError as exc:
        raise LinkTableError(f"{path}: cannot read the links file ({exc})") from None
    try:
        if path.suffix.lower() == ".json":
            return json.loads(text)
        import yaml

        return yaml.safe_load(text) or {}
    except (ValueError, ImportError) as exc:  # json.JSONDecodeError is a ValueError
        raise LinkTableError(f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'} ({exc})") from None
    except Exception as exc:  # yaml.YAMLError: imported lazily, so caught by its base here
        raise LinkTableError(f"{path}: not valid YAML ({exc})") from None


def _mapping(value, origin: str, key: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise LinkTableError(f"{origin}: key {key} must be a mapping, got {value!r}")
    return value


def _positive(value, origin: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise LinkTableError(f"{origin}: key {key} must be a positive number of GB/s, got {value!r}")
    return float(value)


def _count(value, origin: str, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LinkTableError(f"{origin}: key {key} must be a positive integer, got {value!r}")
    return value


def _link_name(value, table: Mapping[str, Link], origin: str, key: str) -> str:
    if value == "" and key.endswith(".intra"):
        return ""
    if not isinstance(value, str) or value not in table:
        raise LinkTableError(f"{origin}: key {key}: unknown link {value!r}; known links {sorted(table)}")
    return value


# --- the rows -------------------------------------------------------------------------------------------------

def collective_bandwidth(source, *, links: str | Path | Mapping | None = None, gpus_per_node: int | None = None,
                         clock: ClockAlignment = ClockAlignment.ENDS) -> pd.DataFrame:
    """One row per collective call (and p2p send/recv) per rank, with ``COLUMNS`` (see the module docstring).

    ``source``: a ``TraceSet`` (its Kineto files are read once more for the args the events table does not
    keep: dtype, split sizes, ``Input Dims``), an events table or an ``Attribution`` (sizes from ``msg_bytes``
    only, dtype ""). ``links``: overrides of the links table (``link_table``); ``gpus_per_node`` wins over
    every other source of the node size. ``df.attrs`` holds ``gpus_per_node`` and ``gpus_per_node_source``.
    """
    table = link_table(links)
    if gpus_per_node is not None:
        _count(gpus_per_node, "collective_bandwidth", "gpus_per_node")
    attribution = attribute(source, caller="collective_bandwidth")
    traceset = source if hasattr(source, "files") and hasattr(source, "metadata") else None
    metadata = getattr(traceset, "metadata", None) or {}
    rows = _call_rows(attribution)
    gpn, gpn_source = _gpus_per_node(gpus_per_node, table, traceset, attribution.events)
    if rows.empty:
        out = pd.DataFrame({c: pd.Series(dtype=object) for c in COLUMNS})
        out.attrs.update(gpus_per_node=gpn, gpus_per_node_source=gpn_source)
        return out
    rows = _with_matching(rows, attribution, clock)
    args = attribution.cached("bandwidth.args", lambda: _trace_args(traceset, attribution.events))
    rows["group_size"] = _group_sizes(rows, metadata)
    rows = _with_sizes(rows, args, attribution.events)
    rows["nodes"] = _nodes(rows, metadata, gpn)
    rows["device_name"] = _device_names(rows, metadata)
    return _finish(rows, table, gpn, gpn_source)


_ROW_COLUMNS = ("rank", "lane", "device", "stream", "name", "category", "dim", "start_ns", "dur_ns", "correlation",
                "external_id", "pg_name", "pg_desc", "pg_ranks", "pg_size", "msg_bytes", "peer")


def _call_rows(attribution) -> pd.DataFrame:
    """The calls of every working rank (as ``collectives.comm_calls`` picks them, p2p included), with
    their step and their position in the events table (``row``)."""
    frames = []
    for rank in attribution.working:
        calls = rank.work(list(_ROW_COLUMNS), categories=CATEGORIES)
        if rank.lanes == Lane.CPU.value:
            calls = _outermost(calls)
        if calls.empty:
            continue
        frame = pd.DataFrame({c: (calls[c].astype(str).to_numpy() if isinstance(calls[c].dtype, pd.CategoricalDtype)
                                  else calls[c].to_numpy()) for c in _ROW_COLUMNS})
        frame["row"] = calls.index.to_numpy()
        frame["step"] = step_of(frame["start_ns"].to_numpy(), rank.windows)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _with_matching(rows: pd.DataFrame, attribution, clock) -> pd.DataFrame:
    """``wait_ns``, ``transfer_ns`` and ``members`` of each matched collective call (NaN / 0 elsewhere)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceWarning)  # uneven counts: the unmatched rows fall back below
            matched = match_collectives(attribution, clock=clock)
    except AttributionError:
        matched = pd.DataFrame(columns=["rank", "category", "start_ns", "offset_ns", "dur_ns", "wait_ns",
                                        "transfer_ns", "members"])
    key = pd.DataFrame({"rank": matched["rank"].to_numpy(dtype=np.int64),
                        "category": matched["category"].astype(str).to_numpy(),
                        "start_ns": (matched["start_ns"] + matched["offset_ns"]).to_numpy(dtype=np.int64),
                        "dur_ns": matched["dur_ns"].to_numpy(dtype=np.int64),
                        "wait_ns": matched["wait_ns"].to_numpy(dtype=np.float64),
                        "transfer_ns": matched["transfer_ns"].to_numpy(dtype=np.float64),
                        "members": matched["members"].to_numpy(dtype=np.int64)})
    key = key.drop_duplicates(["rank", "category", "start_ns", "dur_ns"])
    rows = rows.astype({"rank": np.int64, "start_ns": np.int64, "dur_ns": np.int64})
    out = rows.merge(key, on=["rank", "category", "start_ns", "dur_ns"], how="left")
    out["members"] = out["members"].fillna(0).astype(np.int64)
    return out


# --- sizes ----------------------------------------------------------------------------------------------------

_ARG_COLUMNS = ("rank", "gpu", "key", "dtype", "in_nelems", "out_nelems", "input_bytes", "input_dtype",
                "imbalance")
_GPU_CATS = frozenset({"kernel", "Kernel", "gpu_memcpy", "Memcpy"})
#: ``Input type`` texts of the profiler (C++ type names) -> torch ScalarType names (the ``dtype`` arg's).
_INPUT_TYPES = {
    "float": "Float", "double": "Double", "c10::Half": "Half", "c10::BFloat16": "BFloat16", "int": "Int",
    "long": "Long", "long int": "Long", "int64_t": "Long", "short": "Short", "short int": "Short",
    "signed char": "Char", "int8_t": "Char", "unsigned char": "Byte", "uint8_t": "Byte", "bool": "Bool",
    "c10::complex<float>": "ComplexFloat", "c10::complex<double>": "ComplexDouble",
    "c10::complex<c10::Half>": "ComplexHalf", "c10::Float8_e4m3fn": "Float8_e4m3fn",
    "c10::Float8_e5m2": "Float8_e5m2", "c10::Float8_e4m3fnuz": "Float8_e4m3fnuz",
    "c10::Float8_e5m2fnuz": "Float8_e5m2fnuz", "unsigned short": "UInt16", "unsigned int": "UInt32",
}


class _Args(msgspec.Struct, gc=False):
    external_id: int | str | None = msgspec.field(name="External id", default=None)
    correlation: int | str | None = None
    dtype: str | None = None
    in_nelems: int | str | None = msgspec.field(name="In msg nelems", default=None)
    out_nelems: int | str | None = msgspec.field(name="Out msg nelems", default=None)
    in_split: msgspec.Raw = msgspec.field(name="In split size", default=msgspec.Raw(b""))
    out_split: msgspec.Raw = msgspec.field(name="Out split size", default=msgspec.Raw(b""))
    dims: msgspec.Raw = msgspec.field(name="Input Dims", default=msgspec.Raw(b""))
    types: msgspec.Raw = msgspec.field(name="Input type", default=msgspec.Raw(b""))


class _Event(msgspec.Struct, gc=False):
    cat: str | None = None
    args: _Args | None = None


class _Doc(msgspec.Struct, gc=False):
    traceEvents: list[_Event] = []


#: Only the fields the sizes need: msgspec skips every other key natively (no dict per event).
_DECODE_DOC = msgspec.json.Decoder(_Doc)


def _trace_args(traceset, events: pd.DataFrame) -> pd.DataFrame:
    """The comm rows' args the events table does not keep, read again from each rank's Kineto file: one row
    per (rank, gpu, key), key the correlation id of a GPU row, the External id of a CPU op."""
    empty = pd.DataFrame({c: pd.Series(dtype=object) for c in _ARG_COLUMNS})
    if traceset is None:
        return empty
    from shardline.profiling.readers import Format, sniff
    from shardline.profiling.readers._buffers import read_bytes

    comm = events[events["category"].isin(COMM_CATEGORIES)]
    gpu = (comm["lane"] == Lane.GPU.value).to_numpy()
    frames = []
    for path, ranks in traceset.files.items():
        if len(ranks) != 1 or ranks[0] < 0:
            continue
        rank = ranks[0]
        mine = comm["rank"].to_numpy() == rank
        want_corr = set(comm["correlation"].to_numpy()[mine & gpu].tolist()) - {-1}
        want_ext = set(comm["external_id"].to_numpy()[mine & ~gpu].tolist()) - {-1}
        if not (want_corr or want_ext):
            continue
        try:
            if sniff(Path(path)) is not Format.KINETO:
                continue
            doc = _DECODE_DOC.decode(read_bytes(Path(path)))
        except Exception as exc:  # a damaged file the reader salvaged: its sizes come from the table alone
            warnings.warn(f"{path}: collective args not read again ({type(exc).__name__}: {exc}); dtype and "
                          "split sizes unknown for this rank", TraceWarning, stacklevel=3)
            continue
        picked = [(e.cat in _GPU_CATS, e.args) for e in doc.traceEvents if e.args is not None
                  and ((e.args.correlation in want_corr and e.cat in _GPU_CATS)
                       or (e.args.external_id in want_ext and e.cat not in _GPU_CATS))]
        frames.append(_args_frame(rank, picked))
    return pd.concat(frames, ignore_index=True).drop_duplicates(["rank", "gpu", "key"]) if frames else empty


def _args_frame(rank: int, picked: list) -> pd.DataFrame:
    """The decoded args of one rank's comm events (these few only: their texts decoded once per distinct text)."""
    seen: dict[bytes, object] = {}

    def raw(value):
        text = bytes(value)
        if text not in seen:
            try:
                decoded = msgspec.json.decode(text) if text else None
                if isinstance(decoded, str):  # split sizes are written as a text "[1, 2]"
                    decoded = json.loads(decoded) if decoded.strip().startswith("[") else None
            except (ValueError, msgspec.DecodeError):
                decoded = None
            seen[text] = decoded
        return seen[text]

    out = {c: [] for c in _ARG_COLUMNS}
    for is_gpu, a in picked:
        input_bytes, input_dtype = _input_bytes(raw(a.dims), raw(a.types))
        out["rank"].append(rank)
        out["gpu"].append(is_gpu)
        out["key"].append(_as_int(a.correlation if is_gpu else a.external_id))
        out["dtype"].append(a.dtype or "")
        out["in_nelems"].append(_as_int(a.in_nelems))
        out["out_nelems"].append(_as_int(a.out_nelems))
        out["input_bytes"].append(input_bytes)
        out["input_dtype"].append(input_dtype)
        out["imbalance"].append(max(_imbalance(raw(a.in_split)), _imbalance(raw(a.out_split)), key=_nan_low))
    return pd.DataFrame(out)


def _as_int(value) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value), 0)
    except ValueError:
        return -1


def _nan_low(x: float) -> float:
    return -math.inf if math.isnan(x) else x


def _imbalance(splits) -> float:
    """max/mean of the per-peer split sizes (all-to-all-v); NaN without splits."""
    if not isinstance(splits, list) or not splits or not all(isinstance(s, (int, float)) for s in splits):
        return math.nan
    mean = sum(splits) / len(splits)
    return max(splits) / mean if mean > 0 else math.nan


def _input_bytes(dims, types) -> tuple[int, str]:
    """Bytes and dtype of an op's tensor inputs from ``Input Dims`` / ``Input type`` (-1, "" when none)."""
    if not isinstance(dims, list) or not isinstance(types, list):
        return -1, ""
    total, dtype = 0, ""
    for shape, kind in zip(dims, types):
        name = _INPUT_TYPES.get(kind) if isinstance(kind, str) else None
        if name is None or not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            continue
        total += math.prod(shape) * DTYPE_BYTES[name]
        dtype = dtype or name
    return (total, dtype) if dtype else (-1, "")


def _with_sizes(rows: pd.DataFrame, args: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """``bytes``, ``dtype``, ``imbalance`` and ``size_source`` of every row (``group_size`` already set)."""
    args = args.astype({"rank": np.int64, "key": np.int64, "gpu": bool})
    own = rows[["rank"]].assign(gpu=rows["lane"].to_numpy() == Lane.GPU.value,
                                key=np.where(rows["lane"].to_numpy() == Lane.GPU.value, rows["correlation"],
                                             rows["external_id"]).astype(np.int64))
    own = own.merge(args, on=["rank", "gpu", "key"], how="left")
    ops = _op_candidates(events, args)
    op = _linked_ops(rows, ops, events)
    category = rows["category"].to_numpy()
    n = rows["group_size"].to_numpy()
    own_s = _nelems_bytes(category, own["in_nelems"], own["out_nelems"], own["dtype"])
    op_s = _nelems_bytes(category, op["in_nelems"], op["out_nelems"], op["dtype"])
    gather = np.where(category == "all_gather", np.where(n > 0, n, np.nan), 1.0)
    sources = (("args", own_s), ("msg_bytes", _positive_or_nan(rows["msg_bytes"])),
               ("op_args", op_s), ("op_msg_bytes", _positive_or_nan(op["msg_bytes"])),
               ("input", _positive_or_nan(own["input_bytes"]) * gather),
               ("op_input", _positive_or_nan(op["input_bytes"]) * gather))
    size = np.full(len(rows), np.nan)
    source = np.full(len(rows), "", dtype=object)
    for label, values in sources:
        take = np.isnan(size) & ~np.isnan(values)
        size[take], source[take] = values[take], label
    rows["bytes"] = size
    rows["size_source"] = source
    dtype = np.full(len(rows), "", dtype=object)
    for values in (own["dtype"], op["dtype"], own["input_dtype"], op["input_dtype"], _name_dtypes(rows["name"])):
        values = pd.Series(values).fillna("").astype(str).to_numpy()
        dtype = np.where(dtype == "", values, dtype)
    rows["dtype"] = dtype
    imbalance = own["imbalance"].to_numpy(dtype=np.float64)
    rows["imbalance"] = np.where(np.isnan(imbalance), op["imbalance"].to_numpy(dtype=np.float64), imbalance)
    return rows


def _positive_or_nan(values) -> np.ndarray:
    values = pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(dtype=np.float64)
    return np.where(values > 0, values, np.nan)


def _element_bytes(dtype) -> np.ndarray:
    return pd.Series(dtype).map(DTYPE_BYTES).to_numpy(dtype=np.float64)


def _nelems_bytes(category: np.ndarray, in_nelems, out_nelems, dtype) -> np.ndarray:
    """nccl-tests' S from the nelems args: the output of an all-gather, the input of a reduce-scatter and of
    an all-to-all(-v), the larger of the two otherwise (they are equal there); x the dtype's size."""
    i = _positive_or_nan(in_nelems)
    o = _positive_or_nan(out_nelems)
    bigger = np.fmax(i, o)
    nelems = np.where(category == "all_gather", np.where(np.isnan(o), bigger, o),
                      np.where(np.isin(category, ("reduce_scatter", "all_to_all")),
                               np.where(np.isnan(i), bigger, i), bigger))
    return nelems * _element_bytes(dtype)


_KERNEL_DTYPE = re.compile(r"_(?P<t>bf16|f16|f32|f64|half|float|double|fp8_e4m3|fp8_e5m2)(?:[_(]|$)")
_KERNEL_DTYPES = {"bf16": "BFloat16", "f16": "Half", "half": "Half", "f32": "Float", "float": "Float",
                  "f64": "Double", "double": "Double", "fp8_e4m3": "Float8_e4m3fn", "fp8_e5m2": "Float8_e5m2"}


def _name_dtypes(names: pd.Series) -> np.ndarray:
    """The dtype an NCCL reduction kernel's name carries (``..._Sum_bf16_RING_LL``, ``..._Sum_float(``); ""
    for the byte-typed ones (SendRecv, Broadcast, AllGather: ``int8_t`` or none). On unique names."""
    unique = pd.unique(names.to_numpy())
    found = {}
    for name in unique:
        hit = _KERNEL_DTYPE.search(name) if name.startswith("nccl") else None
        found[name] = _KERNEL_DTYPES[hit["t"]] if hit else ""
    return names.map(found).to_numpy(dtype=object)


def _op_candidates(events: pd.DataFrame, args: pd.DataFrame) -> pd.DataFrame:
    """CPU comm ops that tell a size (nelems args, ``Input Dims``, or ``msg_bytes``), with their args."""
    cpu = (events["lane"] == Lane.CPU.value).to_numpy() & events["category"].isin(COMM_CATEGORIES).to_numpy()
    ops = pd.DataFrame({"rank": events["rank"].to_numpy()[cpu].astype(np.int64),
                        "stream": events["stream"].to_numpy()[cpu],
                        "op_start": events["start_ns"].to_numpy()[cpu],
                        "op_end": (events["start_ns"] + events["dur_ns"]).to_numpy()[cpu],
                        "key": events["external_id"].to_numpy()[cpu],
                        "msg_bytes": events["msg_bytes"].to_numpy()[cpu]})
    ops = ops.merge(args[~args["gpu"]].drop(columns="gpu"), on=["rank", "key"], how="left")
    tells = ((ops["msg_bytes"] > 0) | (ops["input_bytes"].fillna(-1) > 0)
             | ((ops[["in_nelems", "out_nelems"]].fillna(-1) > 0).any(axis=1) & (ops["dtype"].fillna("") != "")))
    return ops[tells.to_numpy()].reset_index(drop=True)


_OP_INFO = ("in_nelems", "out_nelems", "dtype", "msg_bytes", "input_bytes", "input_dtype", "imbalance")


def _linked_ops(rows: pd.DataFrame, ops: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """Per row, the ``_OP_INFO`` of its comm op (NaN where none): a kernel's op shares its External id (and
    began before it), else contains its launch; a CPU row's is the first one nested in it."""
    out = pd.DataFrame(index=rows.index, columns=list(_OP_INFO), dtype=object)
    if ops.empty:
        return out
    gpu = rows["lane"].to_numpy() == Lane.GPU.value
    # (a) the External id (recent Kineto gives a kernel its record_param_comms op's)
    by_ext = rows.loc[gpu, ["rank", "external_id", "start_ns"]].reset_index().merge(
        ops.drop_duplicates(["rank", "key"], keep="last"), left_on=["rank", "external_id"],
        right_on=["rank", "key"])
    by_ext = by_ext[by_ext["op_start"] <= by_ext["start_ns"]].set_index("index")
    out.loc[by_ext.index, list(_OP_INFO)] = by_ext[list(_OP_INFO)].to_numpy()
    # (b) the innermost op with a size containing the kernel's launch (same correlation id, same thread)
    rest = rows[gpu & ~rows.index.isin(by_ext.index) & (rows["correlation"].to_numpy() >= 0)]
    cpu_rows = (events["lane"] == Lane.CPU.value).to_numpy() & (events["correlation"].to_numpy() >= 0)
    launches = pd.DataFrame({"rank": events["rank"].to_numpy()[cpu_rows].astype(np.int64),
                             "correlation": events["correlation"].to_numpy()[cpu_rows],
                             "stream": events["stream"].to_numpy()[cpu_rows],
                             "at": events["start_ns"].to_numpy()[cpu_rows]}).drop_duplicates(["rank", "correlation"])
    points = rest[["rank", "correlation"]].reset_index().merge(launches, on=["rank", "correlation"])
    _fill_asof(out, points, ops, direction="backward", within=lambda m: m["op_end"] >= m["at"])
    # CPU rows: the first op with a size nested in the row (the row itself when it has one)
    cpu = rows.loc[~gpu, ["rank", "stream", "start_ns", "dur_ns"]].reset_index()
    cpu = cpu.assign(at=cpu["start_ns"], end=cpu["start_ns"] + cpu["dur_ns"])
    _fill_asof(out, cpu, ops, direction="forward", within=lambda m: m["op_start"] < m["end"])
    return out


def _fill_asof(out: pd.DataFrame, points: pd.DataFrame, ops: pd.DataFrame, *, direction: str, within) -> None:
    if points.empty:
        return
    points = points.astype({"rank": np.int64, "stream": np.int64, "at": np.int64}).sort_values("at")
    ops = ops.astype({"stream": np.int64, "op_start": np.int64}).sort_values("op_start")
    hit = pd.merge_asof(points, ops, left_on="at", right_on="op_start", by=["rank", "stream"],
                        direction=direction)
    hit = hit[hit["op_start"].notna() & within(hit).to_numpy()].set_index("index")
    out.loc[hit.index, list(_OP_INFO)] = hit[list(_OP_INFO)].to_numpy()


# --- groups, nodes, links ------------------------------------------------------------------------------------

def _world(metadata: Mapping) -> int:
    sizes = [m.get("distributedInfo", {}).get("world_size") for m in metadata.values()
             if isinstance(m.get("distributedInfo"), Mapping)]
    sizes = [s for s in sizes if isinstance(s, int) and s > 0]
    return max(sizes) if sizes else -1


def _pg_config(metadata: Mapping) -> dict[str, list[int]]:
    """Process-group name -> global ranks, from the traces' ``distributedInfo.pg_config``."""
    groups: dict[str, list[int]] = {}
    for meta in metadata.values():
        info = meta.get("distributedInfo")
        for group in (info.get("pg_config") or []) if isinstance(info, Mapping) else []:
            if isinstance(group, Mapping) and isinstance(group.get("ranks"), list):
                groups.setdefault(str(group.get("pg_name")), [int(r) for r in group["ranks"]])
    return groups


def _parse_ranks(text: str) -> list[int] | None:
    try:
        ranks = json.loads(text) if text else None
    except ValueError:
        return None
    return [int(r) for r in ranks] if isinstance(ranks, list) and all(isinstance(r, int) for r in ranks) else None


def _group_ranks(rows: pd.DataFrame, metadata: Mapping) -> dict[tuple[str, str], list[int] | None]:
    """(pg_name, pg_ranks) -> the group's global ranks, for each distinct group of the rows."""
    config, world = _pg_config(metadata), _world(metadata)
    out = {}
    for name, text in rows[["pg_name", "pg_ranks"]].drop_duplicates().itertuples(index=False):
        ranks = _parse_ranks(text)
        if ranks is None:
            ranks = config.get(name) if name else (list(range(world)) if world > 0 and not text else None)
        out[(name, text)] = ranks
    return out


def _group_sizes(rows: pd.DataFrame, metadata: Mapping) -> np.ndarray:
    """The group's size: ``pg_size``, else the size of its ranks (``_group_ranks``), else -1."""
    ranks = _group_ranks(rows, metadata)
    known = pd.Series({k: (len(v) if v else -1) for k, v in ranks.items()})
    keyed = pd.MultiIndex.from_frame(rows[["pg_name", "pg_ranks"]])
    from_ranks = known.reindex(keyed).to_numpy(dtype=np.int64) if len(known) else np.full(len(rows), -1)
    return np.where(rows["pg_size"].to_numpy() > 0, rows["pg_size"].to_numpy(), from_ranks).astype(np.int64)


def _nodes(rows: pd.DataFrame, metadata: Mapping, gpn: int) -> np.ndarray:
    """Nodes the call's group spans (ranks placed ``rank // gpn``); a p2p call with a peer spans its rank's
    and its peer's nodes. A group of known size but unknown ranks is taken as packed: ceil(n / gpn)."""
    ranks = _group_ranks(rows, metadata)
    spans = pd.Series({k: (len({r // gpn for r in v}) if v else -1) for k, v in ranks.items()})
    keyed = pd.MultiIndex.from_frame(rows[["pg_name", "pg_ranks"]])
    nodes = spans.reindex(keyed).to_numpy(dtype=np.int64) if len(spans) else np.full(len(rows), -1)
    n = rows["group_size"].to_numpy()
    nodes = np.where((nodes < 0) & (n > 0), -(-n // gpn), nodes)
    peer, rank = rows["peer"].to_numpy(), rows["rank"].to_numpy()
    p2p = np.isin(rows["category"].to_numpy(), P2P_CATEGORIES) & (peer >= 0)
    return np.where(p2p, 1 + (peer // gpn != rank // gpn), nodes).astype(np.int64)


def _device_names(rows: pd.DataFrame, metadata: Mapping) -> np.ndarray:
    """The GPU name of each row (Kineto's ``deviceProperties``): by the row's device index, else the rank's
    only GPU; "" when the trace names none."""
    names: dict[tuple[int, int], str] = {}
    for rank, meta in metadata.items():
        props = [p for p in (meta.get("deviceProperties") or []) if isinstance(p, Mapping)]
        for p in props:
            names[(int(rank), int(p.get("id", -1)))] = str(p.get("name", ""))
        if len(props) == 1:
            names[(int(rank), -1)] = str(props[0].get("name", ""))
    keys = pd.MultiIndex.from_arrays([rows["rank"].to_numpy(), rows["device"].to_numpy().astype(np.int64)])
    fallback = pd.MultiIndex.from_arrays([rows["rank"].to_numpy(), np.full(len(rows), -1)])
    table = pd.Series(names, dtype=object)
    if table.empty:
        return np.full(len(rows), "", dtype=object)
    first = table.reindex(keys).to_numpy()
    second = table.reindex(fallback).to_numpy()
    return np.where(pd.isna(first), np.where(pd.isna(second), "", second), first)


def _gpus_per_node(given, table: LinkTable, traceset, events: pd.DataFrame) -> tuple[int, str]:
    if given is not None:
        return int(given), "argument"
    if table.gpus_per_node is not None:
        return table.gpus_per_node, "links file"
    layout = getattr(traceset, "layout", None)
    if isinstance(layout, Mapping) and isinstance(layout.get("gpus_per_node"), int):
        return int(layout["gpus_per_node"]), "layout"
    gpu = events[(events["lane"] == Lane.GPU.value).to_numpy() & (events["device"].to_numpy() >= 0)]
    if len(gpu):
        device = gpu.groupby("rank", observed=True)["device"].min()
        k = int(device.max()) + 1  # a lower bound: the loaded ranks may not fill their node
        if k > DEFAULT_GPUS_PER_NODE and ((device.index.to_numpy() % k) == device.to_numpy()).all():
            return k, "device indices"
    return DEFAULT_GPUS_PER_NODE, "default"


def _finish(rows: pd.DataFrame, table: LinkTable, gpn: int, gpn_source: str) -> pd.DataFrame:
    n = rows["group_size"].to_numpy()
    category = rows["category"].to_numpy()
    complete = (rows["members"].to_numpy() > 1) & ((n <= 0) | (rows["members"].to_numpy() >= n))
    transfer = rows["transfer_ns"].to_numpy(dtype=np.float64)
    use_transfer = complete & (transfer > 0)
    time = np.where(use_transfer, transfer, rows["dur_ns"].to_numpy(dtype=np.float64))
    rows["time_ns"] = time
    rows["time_basis"] = np.where(use_transfer, TimeBasis.TRANSFER.value, TimeBasis.DURATION.value)
    rows["algbw_gbps"] = rows["bytes"].to_numpy() / np.where(time > 0, time, np.nan)  # bytes per ns = GB/s
    rows["busbw_gbps"] = rows["algbw_gbps"].to_numpy() * busbw_factor(category, n)
    link, gbps = _links(rows, table, gpn)
    alone = (n == 1) & ~np.isin(category, P2P_CATEGORIES)
    rows["link"] = np.where(alone, "", link)
    rows["link_gbps"] = np.where(alone, np.nan, gbps)
    rows["wait_ns"] = np.where(use_transfer, rows["wait_ns"].to_numpy(dtype=np.float64), np.nan)
    rows["efficiency"] = rows["busbw_gbps"].to_numpy() / rows["link_gbps"].to_numpy()
    rows["latency_bound"] = rows["bytes"].to_numpy() < LATENCY_BOUND_BYTES
    rows["pg"] = np.where(rows["pg_name"] != "", rows["pg_name"], rows["pg_ranks"])
    out = rows[list(COLUMNS)].reset_index(drop=True)
    out = out.astype({"step": np.int64, "group_size": np.int64, "nodes": np.int64, "peer": np.int64})
    out.attrs.update(gpus_per_node=gpn, gpus_per_node_source=gpn_source)
    return out


def _links(rows: pd.DataFrame, table: LinkTable, gpn: int) -> tuple[np.ndarray, np.ndarray]:
    """The link each row crosses and its limit (GB/s per direction, per GPU), on distinct (device, nodes>1)."""
    cross = rows["nodes"].to_numpy() > 1
    keys = pd.DataFrame({"device": rows["device_name"].to_numpy(), "cross": cross})
    share = (table.nics_per_node or gpn) / gpn
    found = keys.drop_duplicates().reset_index(drop=True)
    names, limits = [], []
    for device, crosses in found.itertuples(index=False):
        intra, nic = table.device_links(device)
        names.append(nic if crosses else intra)
        limits.append(table.links[names[-1]].gbps * (share if crosses else 1.0) if names[-1] else np.nan)
    found = found.assign(link=names, link_gbps=limits)
    picked = keys.merge(found, on=["device", "cross"], how="left")
    return picked["link"].to_numpy(dtype=object), picked["link_gbps"].to_numpy(dtype=np.float64)


# --- the summary ----------------------------------------------------------------------------------------------

SUMMARY_COLUMNS = ("category", "dtype", "size_bucket", "group", "group_size", "link", "link_gbps", "calls",
                   "ranks", "bytes_median", "time_ns_median", "algbw_gbps_median", "busbw_gbps_median",
                   "busbw_gbps_max", "efficiency_median", "latency_bound", "time_basis", "verdict",
                   "bucket_bytes")


def _bucket_label(lo: float) -> str:
    """``[lo, 4 lo)`` in binary units (1 KiB = 1024 B)."""
    def unit(x: float) -> str:
        for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if x >= size:
                return f"{x / size:g} {name}"
        return f"{x:g} B"
    return f"[{unit(lo)}, {unit(lo * 4)})"


def bandwidth_summary(df: pd.DataFrame) -> pd.DataFrame:
    """``collective_bandwidth`` rows grouped by (category, dtype, size bucket, group, link): medians of size,
    time and bandwidth, the efficiency, and ``verdict``, the text a report shows: "latency-bound" when every
    call of the bucket is under ``LATENCY_BOUND_BYTES``, else "x % of peak" (with "≥" when any time is a
    ``duration``, i.e. the bandwidth a lower bound), "" without a size or a limit. Buckets are powers of 4
    bytes (``bucket_bytes`` is the lower edge, for sorting); ``group`` is the dim when known, else the pg ("(unnamed)"
    for a trace without process-group args)."""
    if df.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in SUMMARY_COLUMNS})
    sized = df["bytes"].to_numpy(dtype=np.float64)
    exponent = np.floor(np.log(np.where(sized > 0, sized, np.nan)) / np.log(4))
    lo = np.where(np.isnan(exponent), np.nan, 4.0 ** exponent)
    dim = df["dim"].astype(str).to_numpy()
    pg = df["pg"].astype(str).replace("", "(unnamed)")
    frame = df.assign(bucket_bytes=lo, group=np.where(np.isin(dim, ("", "unknown")), pg, dim),
                      bucket_key=np.nan_to_num(lo, nan=-1.0),
                      is_transfer=df["time_basis"].to_numpy() == TimeBasis.TRANSFER.value)
    keys = ["category", "dtype", "bucket_key", "group", "link"]
    out = frame.groupby(keys, as_index=False, dropna=False, sort=True).agg(
        bucket_bytes=("bucket_bytes", "first"), group_size=("group_size", "max"), link_gbps=("link_gbps", "first"),
        calls=("rank", "size"), ranks=("rank", "nunique"), bytes_median=("bytes", "median"),
        time_ns_median=("time_ns", "median"), algbw_gbps_median=("algbw_gbps", "median"),
        busbw_gbps_median=("busbw_gbps", "median"), busbw_gbps_max=("busbw_gbps", "max"),
        efficiency_median=("efficiency", "median"), latency_bound=("latency_bound", "all"),
        transfers=("is_transfer", "sum"))
    out["time_basis"] = np.where(out["transfers"] == out["calls"], TimeBasis.TRANSFER.value,
                                 np.where(out["transfers"] == 0, TimeBasis.DURATION.value, "mixed"))
    out["size_bucket"] = [_bucket_label(v) if v == v else "unknown" for v in out["bucket_bytes"]]
    percent = (100 * out["efficiency_median"]).round(1)
    prefix = np.where(out["time_basis"] == TimeBasis.TRANSFER.value, "", "≥ ")
    out["verdict"] = np.where(out["latency_bound"], "latency-bound",
                              np.where(percent.isna(), "", [f"{p}{v:g} % of peak" for p, v in zip(prefix, percent)]))
    return out[list(SUMMARY_COLUMNS)].reset_index(drop=True)
