"""Each report section's compute function (``registry.SECTIONS`` names them): ``(Inputs) -> {ReportSections
field: value}``, its notes and its title written into the inputs. Every one calls the analyses on the one
attribution (see ``report_sections`` for what each section shows)."""

from __future__ import annotations

import pandas as pd

from ..analyses.bubbles import pipeline_bubbles
from ..analyses.coverage import comm_coverage, coverage_note
from ..analyses.critical_path import critical_path, critical_path_summary, describe
from ..analyses.idle import culprits, launch_stats
from ..analyses.kernels import top_kernels
from ..analyses.traffic import bandwidth_rows, host_links, offload_traffic
from ..attribution.core import comm_by_dim
from ..base.errors import AttributionError, ProfilingError
from ..matching.bandwidth import LATENCY_BOUND_BYTES, bandwidth_summary
from ..matching.collectives import match_collectives, stragglers, wait_transfer
from ..matching.pipelines import MEASURED_METHODS
from .scenarios import evaluate_findings
from .sections import Inputs, Section, empty_bandwidth_summary

#: The offload section's title where no GPU name tells the host link.
OFFLOAD_TITLE = "Offload traffic (H2D / D2H) vs the PCIe Gen5 x16 limit"
#: Steps whose critical path a report describes in words (the table holds every step).
DESCRIBED_STEPS = 5


def breakdown_frames(inputs: Inputs) -> dict:
    return {"breakdown": inputs.attribution.breakdown}


def critical_path_frames(inputs: Inputs) -> dict:
    """``critical_path_summary`` of the trace set's chain (per step, rank, label, dim), and in the notes one
    line per step (the first ``DESCRIBED_STEPS``) saying what the step waited on."""
    summary = critical_path_summary(critical_path(inputs.attribution))
    steps = sorted(set(summary["step"].tolist()))
    lines = [describe(summary, step) for step in steps[:DESCRIBED_STEPS]]
    if len(steps) > DESCRIBED_STEPS:
        lines.append(f"... {len(steps) - DESCRIBED_STEPS} more steps in the table")
    inputs.notes[Section.CRITICAL_PATH] = "; ".join(lines) if lines else "no step to walk"
    return {"critical_path": summary}


def idle_frames(inputs: Inputs) -> dict:
    # idle by cause: the breakdown's columns; the host calls behind it: ``idle_culprits`` (an extra frame)
    return {"launch": launch_stats(inputs.attribution), "idle_culprits": culprits(inputs.attribution)}


def comm_by_dim_frames(inputs: Inputs) -> dict:
    cbd = comm_by_dim(inputs.attribution)
    if cbd.empty:
        inputs.notes[Section.COMM_BY_DIM] = "no communication in this trace"
    return {"comm_by_dim": cbd}


def collectives_frames(inputs: Inputs) -> dict:
    try:
        matched = match_collectives(inputs.attribution)
        return {"matched": matched, "wait_transfer": wait_transfer(matched), "stragglers": stragglers(matched)}
    except AttributionError as exc:
        inputs.notes[Section.COLLECTIVES] = str(exc)
        return {"matched": pd.DataFrame(), "wait_transfer": pd.DataFrame(), "stragglers": pd.DataFrame()}


def bandwidth_frames(inputs: Inputs) -> dict:
    return {"bandwidth": bandwidth_section(inputs.attribution, inputs.traceset, inputs.notes)}


def bandwidth_section(attribution, traceset, notes: dict) -> pd.DataFrame:
    """The bandwidth section's frame (``bandwidth_summary`` of ``bandwidth_rows``), its note in ``notes``."""
    try:
        rows = bandwidth_rows(attribution, traceset=traceset)
    except ProfilingError as exc:
        notes[Section.BANDWIDTH] = f"collective bandwidth not computed: {exc}"
        return empty_bandwidth_summary()
    summary = bandwidth_summary(rows)
    if summary.empty:
        notes[Section.BANDWIDTH] = "no collective or point-to-point calls in this trace"
        return summary
    gpn = rows.attrs.get("gpus_per_node")
    text = (f"busbw = algbw x the nccl-tests factor of the collective, medians per bucket; links for "
            f"{gpn} GPUs per node ({rows.attrs.get('gpus_per_node_source')}); buckets whose calls are all under "
            f"{LATENCY_BOUND_BYTES // (1 << 20)} MiB are latency-bound; \"≥\" marks a lower bound (the kernel's whole "
            "duration, waiting included, where the group's calls were not all matched)")
    if (summary["link"] == "").all() and traceset is None:
        text += "; no trace set given, so no GPU names: links unknown"
    notes[Section.BANDWIDTH] = text
    return summary


def pipeline_frames(inputs: Inputs) -> dict:
    # Without a measurable pipeline (annotations of shardline or torch.distributed.pipelining, or receives
    # matched with sends) pipeline_bubbles restates the breakdown's p2p_recv; the section points there instead.
    bubbles = pipeline_bubbles(inputs.attribution)
    if not bubbles["method"].isin(MEASURED_METHODS).any():
        bubbles = pd.DataFrame()
        inputs.notes[Section.PIPELINE] = ("no pipeline found in this trace (no sl:pp:* or torch.distributed."
                                          "pipelining annotations, no receive matched with a send); the time "
                                          "ranks spent in receives is the breakdown's p2p_recv column")
    return {"bubbles": bubbles}


def top_kernels_frames(inputs: Inputs) -> dict:
    return {"top_kernels": top_kernels(inputs.attribution, top=inputs.top)}


def offload_frames(inputs: Inputs) -> dict:
    """The offload traffic against each rank's host link (its note: pageable copies, where the link came
    from; its title: the PCIe generation(s))."""
    links = host_links(inputs.attribution, getattr(inputs.traceset, "metadata", None) or {})
    offload = offload_traffic(inputs.attribution, inputs.frames["breakdown"], links=links)
    note = None
    if offload.empty:
        note = "no host<->device copies in this trace"
    elif offload["pageable_copies"].sum() > 0:
        flagged = offload[offload["pageable_copies"] > 0]
        note = (f"pageable host memory in {int(flagged['pageable_copies'].sum())} copies on ranks "
                f"{sorted(set(flagged['rank'].tolist()))}: they stage through a bounce buffer and block the host; "
                "pin the offload buffers")
    title, link_note = offload_title(links)
    inputs.notes[Section.OFFLOAD] = "; ".join(n for n in (note, link_note) if n)
    inputs.titles[Section.OFFLOAD] = title
    return {"offload": offload}


def _pcie_text(link: str) -> str:
    return link.replace("pcie-gen", "PCIe Gen")


def offload_title(links: pd.DataFrame) -> tuple[str, str]:
    """The offload section's title (the PCIe generation(s) of the ranks' host links) and a note on where the
    generation came from."""
    if links.empty:
        return OFFLOAD_TITLE, f"no GPU name: {_pcie_text('pcie-gen5')} x16 assumed"
    found = links.drop_duplicates(["link"]).sort_values("link_gbps")
    gens = "/".join(_pcie_text(g) for g in found["link"])
    title = f"Offload traffic (H2D / D2H) vs the {gens} x16 limit" + ("s" if len(found) > 1 else "")
    parts = []
    for (name, link, gbps), part in links.groupby(["device_name", "link", "link_gbps"], sort=True):
        ranks = sorted(part["rank"].tolist())
        known = bool(part["known"].all())
        what = f"{_pcie_text(link)} x16 ({gbps:g} GB/s per direction)"
        parts.append(f"{what} from the device name {name!r} on ranks {ranks}" if known else
                     f"{what} assumed on ranks {ranks}: " + (f"no rule knows the device name {name!r}" if name
                                                              else "the trace names no GPU"))
    return title, "host link " + "; ".join(parts)


def comm_coverage_frames(inputs: Inputs) -> dict:
    coverage = comm_coverage(inputs.attribution)
    inputs.notes[Section.COMM_COVERAGE] = coverage_note(coverage)
    return {"comm_coverage": coverage}


def findings_frames(inputs: Inputs) -> dict:
    """The findings rules over the other sections (``inputs.sections``): what-ifs included."""
    found = evaluate_findings(inputs.attribution, inputs.sections)
    if found.empty:
        inputs.notes[Section.FINDINGS] = "no rule found anything to change in this trace"
    return {"findings": found}
