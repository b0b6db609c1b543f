"""Traffic over the links: offload copies against the ranks' host PCIe links, and the collectives' bandwidth
rows (``collective_bandwidth``, kept on the attribution so every output shows the same numbers).

Offload traffic, per rank and direction (host->device, device->host), over the attributed work rows of the whole
trace::

    achieved GB/s = bytes / busy ns        (1 byte/ns = 1 GB/s; copies without a recorded size are left out)
    of_limit      = achieved / link_gbps   (the rank's host PCIe link, x16, per direction)

The host link is the PCIe generation the rank's GPU name implies (``links.LinkTable.host_link``: V100 Gen3
15.75, A100 Gen4 31.5, H100/B200 Gen5 63.0 GB/s); a name no rule knows (or no name) is taken as Gen5.
``exposed_ns`` is the sum of the breakdown's ``memcpy_h2d`` / ``memcpy_d2h`` column (inside step windows) and
``pageable_copies`` counts copies from/to pageable host memory (they stage through a bounce buffer and block).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..attribution.core import attribute, per_rank_work
from ..matching.bandwidth import collective_bandwidth
from ..matching.links import link_table
from ..table.survey import layout_key

#: PCIe Gen5 x16 bandwidth per direction, GB/s (32 GT/s x 16 lanes, 128b/130b), the offload ceiling.
PCIE_GEN5_X16_GBPS = 64.0

#: A rank's host link: (rank, device name, link name, GB/s per direction, whether a device rule knew the name).
HOST_LINK_COLUMNS = ("rank", "device_name", "link", "link_gbps", "known")


def host_links(source, metadata) -> pd.DataFrame:
    """The host PCIe link of each rank of ``source`` (``links.LinkTable.host_link`` of the first GPU name
    its trace's ``deviceProperties`` give; "" and Gen5 where none)."""

    table = link_table()
    rows = []
    for rank in attribute(source, caller="report_sections").ranks:
        props = [p for p in (metadata.get(rank.rank, {}).get("deviceProperties") or []) if isinstance(p, dict)]
        name = str(props[0].get("name", "")) if props else ""
        link, known = table.host_link(name)
        rows.append((int(rank.rank), name, link.name, link.gbps, bool(known and name)))
    return pd.DataFrame(rows, columns=list(HOST_LINK_COLUMNS)).astype({"rank": np.int64, "link_gbps": np.float64,
                                                                        "known": bool})


def offload_traffic(source, bd: pd.DataFrame, *, links: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per (rank, direction): copies, bytes, busy_ns, achieved_gbps, link, link_gbps, of_limit,
    pageable_copies, exposed_ns. ``links``: ``host_links`` (PCIe Gen5 x16 for a rank it lacks)."""
    copies = per_rank_work(source, lambda w: w, columns=("rank", "category", "msg_bytes", "dur_ns", "memory_kind"),
                            categories=("memcpy_h2d", "memcpy_d2h"))
    if copies is None or copies.empty:
        return pd.DataFrame(columns=["rank", "direction", "copies", "bytes", "busy_ns", "achieved_gbps", "link",
                                     "link_gbps", "of_limit", "pageable_copies", "exposed_ns"])
    sized = copies["msg_bytes"].to_numpy() >= 0
    frame = pd.DataFrame({"rank": copies["rank"].to_numpy().astype(np.int64),
                          "direction": copies["category"].astype(str).to_numpy(),
                          "bytes": np.where(sized, copies["msg_bytes"].to_numpy(), 0),
                          "sized_ns": np.where(sized, copies["dur_ns"].to_numpy(), 0),
                          "busy_ns": copies["dur_ns"].to_numpy(),
                          "pageable": (copies["memory_kind"].astype(str) == "Pageable").to_numpy()})
    out = frame.groupby(["rank", "direction"], as_index=False).agg(
        copies=("busy_ns", "size"), bytes=("bytes", "sum"), busy_ns=("busy_ns", "sum"),
        sized_ns=("sized_ns", "sum"), pageable_copies=("pageable", "sum"))
    out["achieved_gbps"] = out["bytes"] / out["sized_ns"].where(out["sized_ns"] > 0)
    by_rank = (links if links is not None else pd.DataFrame(columns=list(HOST_LINK_COLUMNS))).set_index("rank")
    out["link"] = by_rank["link"].reindex(out["rank"]).fillna("pcie-gen5").to_numpy(dtype=object)
    out["link_gbps"] = by_rank["link_gbps"].reindex(out["rank"]).fillna(PCIE_GEN5_X16_GBPS).to_numpy(dtype=float)
    out["of_limit"] = out["achieved_gbps"] / out["link_gbps"]
    exposed = bd.groupby("rank")[["memcpy_h2d", "memcpy_d2h"]].sum() if len(bd) else None
    out["exposed_ns"] = [int(exposed.loc[r, d]) if exposed is not None and r in exposed.index else 0
                         for r, d in zip(out["rank"], out["direction"])]  # one per (rank, direction)
    out["direction"] = out["direction"].map({"memcpy_h2d": "H2D", "memcpy_d2h": "D2H"})
    return out[["rank", "direction", "copies", "bytes", "busy_ns", "achieved_gbps", "link", "link_gbps",
                "of_limit", "pageable_copies", "exposed_ns"]]


@dataclass(frozen=True)
class _TraceSetView:
    """A trace set's files and metadata with another layout's attribution: what ``collective_bandwidth`` reads,
    so it runs on the attribution the report shows (``attribute`` finds it in ``attributions``)."""

    events: pd.DataFrame
    files: dict
    metadata: dict
    layout: object
    attributions: dict


def bandwidth_rows(attribution, *, traceset=None) -> pd.DataFrame:
    """``collective_bandwidth`` of ``attribution`` (default links table), computed once per attribution and
    kept on it; ``traceset``: the ``TraceSet`` it came from (see ``report_sections``)."""

    source = attribution
    if traceset is not None:
        source = traceset
        if attribute(traceset, caller="bandwidth_rows") is not attribution:
            source = _TraceSetView(events=attribution.events, files=traceset.files, metadata=traceset.metadata,
                                   layout=attribution.layout,
                                   attributions={layout_key(attribution.layout): attribution})
    return attribution.derived(_bandwidth, traceset is not None, source=source)


def _bandwidth(attribution, _with_traceset: bool, *, source) -> pd.DataFrame:
    """``collective_bandwidth(source)``, kept once per (attribution, whether a trace set gives the files)."""
    return collective_bandwidth(source)
