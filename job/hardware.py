"""The one hardware catalog: ``hardware.yaml`` beside this file, read by the profiler's link limits
(``shardline.profiling.links``) and by the planner's catalog (``shardline.recipes.planning.catalog``) alike, so a
measured bandwidth and a predicted one are held against the same number. Every figure is cited in the YAML.

Sections (the YAML's header says each field's meaning and unit):

- ``links``: every link both halves know, one entry each: ``gbps`` (data sheet, GB/s per direction, per GPU or
  port) and its ``source``, with NCCL's ``collective_gbps``, the ring step ``latency_us``, the ``kind`` (intra,
  inter, host) and the ``channels`` a collective holds. ``aliases`` name the same entry again: each alias is a
  link of its own with the entry's numbers (:attr:`Hardware.links` holds every name).
- ``gpus`` and ``clusters``: the planner's accelerators and node types, handed over as plain field mappings (the
  planner merges a user's file over them and validates the result).
- ``cpu_adam``: DeepSpeed's CPU Adam as measured (``params`` updated in ``seconds`` on a host of ``dram_gbps``
  peak DRAM bandwidth) and its ``source``: the planner's rate for a node type that gives none of its own.
- ``devices``: the profiler's rules from a GPU's name to its intra-node link and NIC (first match wins);
  ``host_pcie``: intra-node link -> the PCIe link of the GPU's host interface; ``defaults``: the NIC and host
  link of a device no rule names.

:func:`hardware` loads the packaged file once; :func:`load_hardware` reads any file of the same shape. A malformed
file raises :class:`HardwareError` naming the file, the entry and the field. Pure: PyYAML and the standard library.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from .errors import ShardlineError

PACKAGED_HARDWARE = Path(__file__).with_name("hardware.yaml")
LINK_KINDS = ("intra", "inter", "host")
SECTIONS = ("links", "gpus", "clusters", "cpu_adam", "devices", "host_pcie", "defaults")
_LINK_NUMBERS = ("gbps", "collective_gbps", "latency_us")
_LINK_KEYS = frozenset((*_LINK_NUMBERS, "source", "kind", "channels", "aliases"))


class HardwareError(ShardlineError, ValueError):
    """A hardware catalog file that cannot be used; the message names the file, the entry and the field."""


@dataclass(frozen=True)
class LinkSpec:
    """One link under one of its names: ``gbps`` the data-sheet figure (GB/s per direction, per GPU or port)
    and its ``source``; ``collective_gbps`` NCCL's modelled bandwidth; ``latency_us`` per ring step; ``kind``
    one of :data:`LINK_KINDS`; ``channels`` the SMs a collective on it holds; ``entry`` the catalog entry it
    comes from (its own name, or the entry an alias names)."""

    name: str
    gbps: float
    source: str
    collective_gbps: float
    latency_us: float
    kind: str
    channels: int
    entry: str


@dataclass(frozen=True)
class CpuAdam:
    """A published CPU Adam measurement: ``params`` updated in ``seconds`` on a host whose DRAM peaks at
    ``dram_gbps`` GB/s, cited by ``source``."""

    params: float
    seconds: float
    dram_gbps: float
    source: str

    @property
    def params_per_dram_byte(self) -> float:
        """Parameters per second per byte/s of DRAM peak: the rate another host's DRAM bandwidth scales."""
        return self.params / self.seconds / (self.dram_gbps * 1e9)


@dataclass(frozen=True)
class DeviceRule:
    """A GPU name matching ``match`` (regex, case-insensitive) sits on ``intra`` inside a node ("" for none
    known) and reaches other nodes through ``nic``."""

    match: str
    intra: str
    nic: str


@dataclass(frozen=True)
class Hardware:
    """The catalog, read-only. ``links`` by every name (aliases included), ``gpus``/``clusters`` the planner's
    raw field mappings, ``device_rules`` in order, ``host_pcie`` intra link -> host PCIe link, ``cpu_adam`` the
    planner's CPU Adam measurement (None in a file that leaves it out)."""

    path: Path
    links: Mapping[str, LinkSpec]
    gpus: Mapping[str, Mapping[str, Any]]
    clusters: Mapping[str, Mapping[str, Any]]
    device_rules: tuple[DeviceRule, ...]
    host_pcie: Mapping[str, str]
    default_nic: str
    default_host_pcie: str
    cpu_adam: CpuAdam | None = None  # the planner's; a file for the profiler alone may leave it out

    def link(self, name: str) -> LinkSpec:
        if name not in self.links:
            raise HardwareError(f"{self.path}: unknown link {name!r} (known: {', '.join(sorted(self.links))})")
        return self.links[name]


@functools.cache
def hardware() -> Hardware:
    """The packaged catalog (``hardware.yaml``), read once per process."""
    return load_hardware(PACKAGED_HARDWARE)


def load_hardware(path: str | Path) -> Hardware:
    """Read and check a catalog file of ``hardware.yaml``'s shape."""
    path = Path(path)
    data = _read(path)
    links = _links(data.get("links"), path)
    known = sorted(links)

    def name(value, where: str, *, empty: bool = False) -> str:
        if (empty and value == "") or (isinstance(value, str) and value in links):
            return value
        raise HardwareError(f"{path}: {where}: unknown link {value!r} (known: {', '.join(known)})")

    rules = []
    devices = data.get("devices") or []
    if not isinstance(devices, list):
        raise HardwareError(f"{path}: devices must be a list of {{match, intra, nic}}")
    for i, rule in enumerate(devices):
        where = f"devices[{i}]"
        rule = _mapping(rule, path, where)
        extra = sorted(set(rule) - {"match", "intra", "nic"})
        if extra or not isinstance(rule.get("match"), str):
            raise HardwareError(f"{path}: {where}: needs match (a regex) and intra, nic link names; got {rule!r}")
        try:
            re.compile(rule["match"])
        except re.error as error:
            raise HardwareError(f"{path}: {where}.match {rule['match']!r} is not a regex ({error})") from None
        rules.append(DeviceRule(rule["match"], name(rule.get("intra", ""), f"{where}.intra", empty=True),
                                name(rule.get("nic"), f"{where}.nic")))
    host_pcie = {name(k, f"host_pcie key {k!r}"): name(v, f"host_pcie.{k}")
                 for k, v in _mapping(data.get("host_pcie") or {}, path, "host_pcie").items()}
    defaults = _mapping(data.get("defaults") or {}, path, "defaults")
    return Hardware(
        path=path, links=MappingProxyType(links),
        gpus=_entries(data.get("gpus"), path, "gpus"), clusters=_entries(data.get("clusters"), path, "clusters"),
        device_rules=tuple(rules), host_pcie=MappingProxyType(host_pcie),
        default_nic=name(defaults.get("nic"), "defaults.nic"),
        default_host_pcie=name(defaults.get("host_pcie"), "defaults.host_pcie"),
        cpu_adam=_cpu_adam(data.get("cpu_adam"), path))


def _cpu_adam(section, path: Path) -> CpuAdam | None:
    if section is None:
        return None
    fields = _mapping(section, path, "cpu_adam")
    keys = ("params", "seconds", "dram_gbps", "source")
    problems = [f"unknown fields {sorted(set(fields) - set(keys))}"] if set(fields) - set(keys) else []
    problems += [f"missing fields {sorted(set(keys) - set(fields))}"] if set(keys) - set(fields) else []
    problems += [f"{k}={fields[k]!r} must be a number > 0" for k in keys[:3] if k in fields
                 and not _positive(fields[k])]
    if "source" in fields and not (isinstance(fields["source"], str) and fields["source"].strip()):
        problems.append(f"source={fields['source']!r} must be a citation (text)")
    if problems:
        raise HardwareError(f"{path}: cpu_adam: " + "; ".join(problems))
    return CpuAdam(**{k: fields[k] for k in keys})


def _read(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as error:
        raise HardwareError(f"{path}: cannot be read ({error.strerror})") from None
    try:
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as error:
        raise HardwareError(f"{path}: not valid YAML ({error})") from None
    if not isinstance(data, dict):
        raise HardwareError(f"{path}: the top level must be a mapping of {list(SECTIONS)}")
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise HardwareError(f"{path}: unknown sections {unknown} (known: {list(SECTIONS)})")
    return data


def _mapping(value, path: Path, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise HardwareError(f"{path}: {where} must be a mapping, got {value!r}")
    return value


def _entries(section, path: Path, where: str) -> Mapping[str, Mapping[str, Any]]:
    section = _mapping(section or {}, path, where)
    return MappingProxyType({str(k): MappingProxyType(dict(_mapping(v, path, f"{where}.{k}")))
                             for k, v in section.items()})


def _links(section, path: Path) -> dict[str, LinkSpec]:
    out: dict[str, LinkSpec] = {}
    for entry, fields in _mapping(section or {}, path, "links").items():
        where = f"links.{entry}"
        fields = _mapping(fields, path, where)
        problems = [f"unknown fields {sorted(set(fields) - _LINK_KEYS)}"] if set(fields) - _LINK_KEYS else []
        problems += [f"missing fields {sorted(_LINK_KEYS - {'aliases'} - set(fields))}"] \
            if _LINK_KEYS - {"aliases"} - set(fields) else []
        problems += [f"{k}={fields[k]!r} must be a number > 0" for k in _LINK_NUMBERS
                     if k in fields and not _positive(fields[k])]
        if "kind" in fields and fields["kind"] not in LINK_KINDS:
            problems.append(f"kind={fields['kind']!r} must be one of {LINK_KINDS}")
        channels = fields.get("channels", 1)
        if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
            problems.append(f"channels={channels!r} must be an integer >= 1")
        if "source" in fields and not (isinstance(fields["source"], str) and fields["source"].strip()):
            problems.append(f"source={fields['source']!r} must be a citation (text)")
        aliases = fields.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            problems.append(f"aliases={aliases!r} must be a list of names")
            aliases = []
        if problems:
            raise HardwareError(f"{path}: {where}: " + "; ".join(problems))
        for name in (str(entry), *aliases):
            if name in out:
                raise HardwareError(f"{path}: {where}: the name {name!r} is given twice")
            out[name] = LinkSpec(name=name, entry=str(entry),
                                 **{k: v for k, v in fields.items() if k != "aliases"})
    return out


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


__all__ = ["CpuAdam", "DeviceRule", "Hardware", "HardwareError", "LINK_KINDS", "LinkSpec", "PACKAGED_HARDWARE",
           "SECTIONS", "hardware", "load_hardware"]
