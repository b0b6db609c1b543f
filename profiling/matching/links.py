"""The link a collective crosses and its limit, for ``bandwidth.collective_bandwidth``.

The links table: each link's limit in GB/s (1e9 B/s) per direction, per GPU, from its data sheet
(``DEFAULT_LINKS``, read from the one hardware catalog ``shardline.job.hardware`` that the planner's costs read
too), and the device rules (``DEVICE_RULES``: a GPU's name -> the intra-node fabric and the NIC of
its reference system); a links file or mapping adds or replaces either (``link_table``).

The link of a call. The group's ranks (``pg_ranks``, the trace's ``pg_config`` for its name, the world for an
anonymous group; for p2p the rank and its peer) are placed ``rank // gpus_per_node`` on nodes; a group whose
size is known but not its ranks (``unknown``: an anonymous group whose size the call's own tensors tell) is
taken as packed. ``gpus_per_node`` (``node_size``): the argument, else the links file's, else the recorded
layout's, else 8 (an HGX/DGX node) unless the ranks' device indices show more (``device == rank % k`` for
``k = max device + 1 > 8``: the loaded ranks give only a lower bound). One node -> the intra-node fabric the
device name implies (``DEVICE_RULES`` on Kineto's ``deviceProperties`` name). A group of one rank crosses
nothing (link "", NaN limit).

More than one node -> the NIC, and the limit on the call's bus bandwidth over it (``link_limits``): with
``share = nic gbps x nics_per_node / gpus_per_node`` (one GPU's share of its node's NIC ports; one port per GPU
by default), ``n`` ranks in the group and ``k`` the fewest of them on any node it spans::

    p2p send / recv                                   share
    all-reduce, all-gather, reduce-scatter, broadcast share x k, at most the intra-node link (k > 1)
    all-to-all                                        share x (n-1)/(n-k), at most intra x (n-1)/(k-1) (k > 1)

A ring leaves each node once per channel, so the bytes that cross a node's boundary are one rank's bus
traffic, carried by the NIC ports of the node's k members (the planner's ``catalog.group_link``: the node's NICs
x k / gpus_per_node; NCCL's double binary tree sends no more across); in an all-to-all every rank sends the
(n-k)/n of its input that leaves its node through its own share of the NICs, and busbw = algbw x (n-1)/n.

An all-reduce reduced in the switch (a kernel named ``..._NVLS...`` or ``..._COLLNET...``: NVLink SHARP, IB
SHARP) sends its input once and receives the result once, where a ring sends 2(n-1)/n of it: its limit, within
a node or across, is the ring's x 2(n-1)/n.

The functions of the second half read ``collective_bandwidth``'s call rows (columns ``rank``, ``device``,
``category``, ``peer``, ``pg_name``, ``pg_ranks``, ``pg_size``, and ``group_size`` / ``nodes`` / ``device_name`` once
set) with the trace set's metadata (rank -> ``distributedInfo``, ``deviceProperties``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from shardline.job.hardware import hardware

from ..base.errors import ProfilingError
from ..base.schema import P2P_CATEGORIES
from ..table.kinds import Lane

__all__ = ["DEFAULT_GPUS_PER_NODE", "DEFAULT_HOST_PCIE", "DEFAULT_LINKS", "DEFAULT_NIC", "DEVICE_RULES", "HOST_PCIE",
           "IN_SWITCH", "P2P_CATEGORIES", "RING_CATEGORIES", "Link", "LinkTable", "LinkTableError",
           "check_gpus_per_node", "crossed_links", "device_names", "group_sizes", "link_limits", "link_table",
           "node_size", "nodes_spanned", "parse_ranks", "ranks_per_node"]


class LinkTableError(ProfilingError, ValueError):
    """A links file or mapping that cannot be used; the message names the file and the key."""


#: Node size assumed when neither the user, the links file, the layout nor the device indices tell.
DEFAULT_GPUS_PER_NODE = 8
#: Collectives that cross a node boundary as a ring does (once per channel): their bus traffic is what crosses.
RING_CATEGORIES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
#: An NCCL kernel name's algorithm that reduces in the switch (NVLink SHARP, CollNet / IB SHARP).
IN_SWITCH = r"_(?:NVLS|COLLNET)"


@dataclass(frozen=True)
class Link:
    """A link's limit: GB/s (1e9 B/s) per direction, per GPU, and the data sheet it comes from."""

    name: str
    gbps: float
    source: str


# The one hardware catalog (``shardline.job.hardware``, ``job/hardware.yaml``) holds every number and rule below,
# cited there; the planner's costs read the same entries. Per direction, per GPU (a NIC: per port).
_HARDWARE = hardware()
DEFAULT_LINKS: dict[str, Link] = {name: Link(name, float(spec.gbps), spec.source)
                                  for name, spec in _HARDWARE.links.items()}

#: Device name (regex, case-insensitive, first match wins) -> (intra-node link, NIC): what the GPU's reference
#: system (DGX/HGX, MI300X platform) pairs it with; a links file can prepend rules or force either.
DEVICE_RULES: tuple[tuple[str, str, str], ...] = tuple((rule.match, rule.intra, rule.nic)
                                                       for rule in _HARDWARE.device_rules)
#: The NIC of a device no rule names.
DEFAULT_NIC = _HARDWARE.default_nic
#: Intra-node link -> the PCIe generation of the GPU's host interface (x16) in the same reference system (V100:
#: Gen3; A100/A800: Gen4; H100/H200/H800/H20, B200/B300 and MI300X: Gen5); a PCIe part's host link is its own.
HOST_PCIE: dict[str, str] = dict(_HARDWARE.host_pcie)
#: The host link assumed for a device no rule names.
DEFAULT_HOST_PCIE = _HARDWARE.default_host_pcie

# --- the table ------------------------------------------------------------------------------------------------

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


def check_gpus_per_node(value, origin: str) -> int:
    """``value`` as a node size (an int >= 1); ``LinkTableError`` naming ``origin`` otherwise."""
    return _count(value, origin, "gpus_per_node")


# --- where a call's group sits -------------------------------------------------------------------------------

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


def parse_ranks(text: str) -> list[int] | None:
    """A ``Process Group Ranks`` text (``"[0, 1, 2]"``) as its ranks; None for anything else."""
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
        ranks = parse_ranks(text)
        if ranks is None:
            ranks = config.get(name) if name else (list(range(world)) if world > 0 and not text else None)
        out[(name, text)] = ranks
    return out


def group_sizes(rows: pd.DataFrame, metadata: Mapping) -> np.ndarray:
    """The group's size: ``pg_size``, else the size of its ranks (``_group_ranks``), else -1."""
    ranks = _group_ranks(rows, metadata)
    known = pd.Series({k: (len(v) if v else -1) for k, v in ranks.items()})
    keyed = pd.MultiIndex.from_frame(rows[["pg_name", "pg_ranks"]])
    from_ranks = known.reindex(keyed).to_numpy(dtype=np.int64) if len(known) else np.full(len(rows), -1)
    return np.where(rows["pg_size"].to_numpy() > 0, rows["pg_size"].to_numpy(), from_ranks).astype(np.int64)


def _by_group(rows: pd.DataFrame, metadata: Mapping, value) -> np.ndarray:
    """``value(ranks)`` of each row's group (``_group_ranks``; -1 where its ranks are unknown)."""
    ranks = _group_ranks(rows, metadata)
    found = pd.Series({k: (value(v) if v else -1) for k, v in ranks.items()})
    keyed = pd.MultiIndex.from_frame(rows[["pg_name", "pg_ranks"]])
    return found.reindex(keyed).to_numpy(dtype=np.int64) if len(found) else np.full(len(rows), -1, dtype=np.int64)


def _unknown_mask(rows: pd.DataFrame, unknown) -> np.ndarray:
    return np.zeros(len(rows), dtype=bool) if unknown is None else np.asarray(unknown, dtype=bool)


def nodes_spanned(rows: pd.DataFrame, metadata: Mapping, gpn: int, *, unknown=None) -> np.ndarray:
    """Nodes the call's group spans (ranks placed ``rank // gpn``); a p2p call with a peer spans its rank's
    and its peer's nodes. A group of known size but unknown ranks (no ranks to be found, or ``unknown``, a
    boolean per row) is taken as packed: ceil(n / gpn)."""
    nodes = _by_group(rows, metadata, lambda v: len({r // gpn for r in v}))
    n = rows["group_size"].to_numpy()
    nodes = np.where(((nodes < 0) | _unknown_mask(rows, unknown)) & (n > 0), -(-n // gpn), nodes)
    peer, rank = rows["peer"].to_numpy(), rows["rank"].to_numpy()
    p2p = np.isin(rows["category"].to_numpy(), P2P_CATEGORIES) & (peer >= 0)
    return np.where(p2p, 1 + (peer // gpn != rank // gpn), nodes).astype(np.int64)


def ranks_per_node(rows: pd.DataFrame, metadata: Mapping, gpn: int, *, unknown=None) -> np.ndarray:
    """The fewest of the call's group's ranks on any node it spans (``k`` of the module docstring); packed
    (as ``nodes_spanned``) where the ranks are unknown: ``n`` on one node, else ``n mod gpn`` or ``gpn``; 1 for
    p2p, -1 where the group's size is unknown too."""
    fewest = _by_group(rows, metadata, lambda v: min(np.unique(np.asarray(v) // gpn, return_counts=True)[1]))
    n = rows["group_size"].to_numpy()
    packed = np.where(n <= gpn, n, np.where(n % gpn == 0, gpn, n % gpn))
    fewest = np.where(((fewest < 0) | _unknown_mask(rows, unknown)) & (n > 0), packed, fewest)
    return np.where(np.isin(rows["category"].to_numpy(), P2P_CATEGORIES), 1, fewest).astype(np.int64)


def device_names(rows: pd.DataFrame, metadata: Mapping) -> np.ndarray:
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


def node_size(given, table: LinkTable, traceset, events: pd.DataFrame) -> tuple[int, str]:
    """(GPUs per node, where it came from: "argument", "links file", "layout", "device indices", "default"),
    by the rule of the module docstring; ``given``: the caller's argument or None."""
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


def crossed_links(rows: pd.DataFrame, table: LinkTable, gpn: int) -> tuple[np.ndarray, np.ndarray]:
    """The link each row crosses (its intra-node fabric on one node, its NIC across nodes) and the limit on its
    bus bandwidth there (GB/s per direction, per GPU; ``link_limits``). Reads ``device_name``, ``nodes``,
    ``category``, ``group_size`` and ``ranks_per_node`` (``ranks_per_node``; without it, one rank per node)."""
    cross = rows["nodes"].to_numpy() > 1
    k = rows["ranks_per_node"].to_numpy() if "ranks_per_node" in rows else np.ones(len(rows), dtype=np.int64)
    names = rows["name"].astype(str) if "name" in rows else pd.Series([""] * len(rows))
    switch = names.str.contains(IN_SWITCH).to_numpy(dtype=bool) & (rows["category"].to_numpy() == "all_reduce")
    keys = pd.DataFrame({"device": rows["device_name"].to_numpy(), "cross": cross,
                         "category": rows["category"].to_numpy(), "n": rows["group_size"].to_numpy(),
                         "k": np.where(cross, k, 0), "switch": switch})
    found = keys.drop_duplicates().reset_index(drop=True)
    links, limits = [], []
    for device, crosses, category, n, fewest, reduced in found.itertuples(index=False):
        intra, nic = table.device_links(device)
        links.append(nic if crosses else intra)
        if not links[-1]:
            limit = np.nan
        elif not crosses:
            limit = table.links[intra].gbps
        else:
            limit = link_limits(category, n, fewest, nic=table.links[nic].gbps,
                                share=(table.nics_per_node or gpn) / gpn,
                                intra=table.links[intra].gbps if intra else np.nan)
        limits.append(limit * 2 * (n - 1) / n if reduced and n > 1 else limit)
    found = found.assign(link=links, link_gbps=limits)
    picked = keys.merge(found, on=["device", "cross", "category", "n", "k", "switch"], how="left")
    return picked["link"].to_numpy(dtype=object), picked["link_gbps"].to_numpy(dtype=np.float64)


def link_limits(category: str, n: int, k: int, *, nic: float, share: float, intra: float) -> float:
    """The limit (GB/s) on the bus bandwidth of a ``category`` call whose ``n``-rank group spans nodes with at
    least ``k`` of its ranks on each, over NIC ports of ``nic`` GB/s of which a GPU has ``share``; ``intra``: the
    intra-node link's GB/s (NaN: unknown, no cap). The rules of the module docstring."""
    per_gpu = nic * share
    k = max(int(k), 1)
    if category in RING_CATEGORIES:
        limit = per_gpu * k
        return min(limit, intra) if k > 1 and not math.isnan(intra) else limit
    if category == "all_to_all" and n > k:
        limit = per_gpu * (n - 1) / (n - k)
        return min(limit, intra * (n - 1) / (k - 1)) if k > 1 and not math.isnan(intra) else limit
    return per_gpu
