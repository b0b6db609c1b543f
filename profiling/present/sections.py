"""The values a report is made of: its sections (:class:`Section`, in report order), the frames they show
(:class:`ReportSections`) and what a section's compute function reads and writes (:class:`Inputs`). The
registry of sections (``registry.SECTIONS``: name, title, compute, display) is built on these."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import pandas as pd

from ..analyses.coverage import comm_coverage_frame
from ..matching.bandwidth import bandwidth_summary


class Section(str, enum.Enum):
    """Report sections, in order; the value is the HTML id and the markdown anchor."""

    WORKLOAD = "workload"
    FINDINGS = "findings"
    BREAKDOWN = "breakdown"
    CRITICAL_PATH = "critical-path"
    IDLE = "idle"
    COMM_BY_DIM = "comm-by-dim"
    COLLECTIVES = "collectives"
    BANDWIDTH = "bandwidth"
    PIPELINE = "pipeline"
    TOP_KERNELS = "top-kernels"
    OFFLOAD = "offload"
    COMM_COVERAGE = "comm-coverage"


def empty_bandwidth_summary() -> pd.DataFrame:
    return bandwidth_summary(pd.DataFrame())


@dataclass(frozen=True)
class ReportSections:
    """The frames a report shows; ``notes[section]`` says why a section is empty or how to read it.
    ``matched``: the matched collectives ``wait_transfer`` and ``stragglers`` summarise (empty when none);
    ``attribution``: the ``Attribution`` every frame was computed from; ``workload``: the detected workload
    (``table.workload.Workload``; None where the sections were built without it)."""

    breakdown: pd.DataFrame
    comm_by_dim: pd.DataFrame
    wait_transfer: pd.DataFrame
    stragglers: pd.DataFrame
    bubbles: pd.DataFrame
    top_kernels: pd.DataFrame
    offload: pd.DataFrame
    notes: dict[Section, str] = field(default_factory=dict)
    matched: pd.DataFrame = field(default_factory=pd.DataFrame)
    attribution: object = None
    comm_coverage: pd.DataFrame = field(default_factory=lambda: comm_coverage_frame([]))
    bandwidth: pd.DataFrame = field(default_factory=empty_bandwidth_summary)
    titles: dict[Section, str] = field(default_factory=dict)
    critical_path: pd.DataFrame = field(default_factory=pd.DataFrame)  # critical_path_summary (rank, label, dim)
    launch: pd.DataFrame = field(default_factory=pd.DataFrame)  # idle.launch_stats
    findings: pd.DataFrame = field(default_factory=pd.DataFrame)  # findings.findings, ranked
    timings: dict = field(default_factory=dict)  # seconds per analysis (breakdown includes idle_causes)
    warnings: tuple[str, ...] = ()  # the analyses' warnings, each once (md/html: the breakdown's note)
    workload: object = None  # table.workload.Workload: what the trace records and its all-to-all's use
    #: Frames of sections that declare no field above (a new section's compute returns whatever names it
    #: likes): read as attributes, ``sections.<name>``, like the declared ones.
    extra: dict[str, object] = field(default_factory=dict)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "extra":
            raise AttributeError(name)
        try:
            return self.extra[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no frame {name!r}") from None

    @classmethod
    def of(cls, frames: dict[str, object], **fields) -> ReportSections:
        """The sections of ``frames`` (what the compute functions returned; names that are not declared
        fields go to :attr:`extra`) and ``fields``."""
        declared = set(cls.__dataclass_fields__)
        extra = {k: v for k, v in frames.items() if k not in declared}
        return cls(**{k: v for k, v in frames.items() if k in declared}, **fields, extra=extra)

    def with_frames(self, frames: dict[str, object], **fields) -> ReportSections:
        """A copy with ``frames`` (declared or :attr:`extra`) and ``fields`` replaced."""
        declared = set(type(self).__dataclass_fields__)
        extra = {**self.extra, **{k: v for k, v in frames.items() if k not in declared}}
        return dataclasses.replace(self, **{k: v for k, v in frames.items() if k in declared}, **fields,
                                   extra=extra)


@dataclass
class Inputs:
    """What a section's compute function reads (the attribution, the trace set it came from or None, the
    number of top kernels; ``frames``: the ``ReportSections`` fields the sections before it computed;
    ``sections``: the other sections, for a section computed after them) and where it writes its notes and
    its title when it is not the registry's."""

    attribution: object
    traceset: object
    top: int
    notes: dict[Section, str] = field(default_factory=dict)
    titles: dict[Section, str] = field(default_factory=dict)
    frames: dict[str, object] = field(default_factory=dict)
    sections: ReportSections | None = None


def is_traceset(source) -> bool:
    return hasattr(source, "files") and hasattr(source, "metadata") and hasattr(source, "events")
