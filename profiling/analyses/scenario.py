"""The scenarios of ``what_if`` (``Scenario``, parsed from its text) and the one ``Context`` every scenario of
an attribution reads (the breakdown, the critical path, the matched collectives and p2p messages, the pipeline
bubbles), shared by ``what_if`` and its pipeline scenario (``what_if_pipeline``). The analyses of other modules
it reads (the critical path, the bubbles) are given to ``Context.build`` by its caller
(``present.scenarios``): an analysis here calls none of theirs."""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from collections.abc import Callable

import numpy as np
import pandas as pd

from ..base.errors import AttributionError, ProfilingError, TraceWarning
from ..base.schema import COMM_CATEGORIES, P2P_CATEGORIES
from ..matching.collectives import match_collectives
from ..matching.messages import p2p_messages
from ..matching.p2p import match_p2p


class ScenarioError(ProfilingError, ValueError):
    """A scenario that cannot be built or applied; the message names the offending values."""


class ScenarioKind(str, enum.Enum):
    OVERLAP = "overlap"
    COMM_FASTER = "comm_faster"
    NO_STRAGGLER = "no_straggler"
    NO_HOST_BOUND = "no_host_bound"
    NO_IDLE = "no_idle"
    PIPELINE = "pipeline"


class Method(str, enum.Enum):
    BOUND = "exact bound on the attribution"
    REPLAY = "critical-path replay"
    SIMULATION = "simulation"


class Keep(str, enum.Enum):
    """What a new micro-batch count keeps: the micro-batch size, or the global batch."""

    MICROBATCH = "microbatch"
    BATCH = "batch"


_KEYS = {ScenarioKind.OVERLAP: ("category", "dim"), ScenarioKind.COMM_FASTER: ("k", "category", "dim"),
         ScenarioKind.NO_STRAGGLER: ("rank",), ScenarioKind.NO_HOST_BOUND: (), ScenarioKind.NO_IDLE: ("cause",),
         ScenarioKind.PIPELINE: ("m", "v", "schedule", "keep")}
SCHEDULES = ("gpipe", "1f1b", "interleaved")
#: The idle a ``no_idle`` scenario removes: an idle cause's set, or ``pageable`` (the GPU idle under the host's
#: blocking copies from or to pageable memory, ``attribution.idle.pageable_idle``).
IDLE_KINDS = ("sync", "dataloader", "host_bound", "pageable")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One what-if (module docstring). ``categories``/``dims``: the communication it applies to (empty: all;
    ``p2p`` stands for both p2p categories); ``k``: the speed-up (default 2); ``rank``: the straggler (None:
    each step's);
    ``m``/``v``/``schedule``/``keep``: the pipeline to predict (None: as measured)."""

    kind: ScenarioKind
    k: float = 2.0
    categories: tuple[str, ...] = ()
    dims: tuple[str, ...] = ()
    rank: int | None = None
    m: int | None = None
    v: int | None = None
    schedule: str | None = None
    keep: Keep = Keep.MICROBATCH
    cause: str = "pageable"

    def __post_init__(self) -> None:
        bad = []
        try:
            object.__setattr__(self, "kind", ScenarioKind(self.kind))
        except ValueError:
            raise ScenarioError(f"unknown scenario kind {self.kind!r}; expected one of "
                                f"{[k.value for k in ScenarioKind]}") from None
        try:
            object.__setattr__(self, "keep", Keep(self.keep))
        except ValueError:
            bad.append(f"keep={self.keep!r} (expected one of {[k.value for k in Keep]})")
        object.__setattr__(self, "categories", tuple(self.categories))
        object.__setattr__(self, "dims", tuple(self.dims))
        if not (isinstance(self.k, int | float) and math.isfinite(self.k) and self.k > 0):
            bad.append(f"k={self.k!r} (a finite speed-up > 0)")
        unknown = [c for c in self.categories if c not in (*COMM_CATEGORIES, "p2p")]
        if unknown:
            bad.append(f"category={unknown} (expected among {[*COMM_CATEGORIES, 'p2p']})")
        if any(not isinstance(d, str) or not d for d in self.dims):
            bad.append(f"dim={list(self.dims)} (non-empty names)")
        for name in ("m", "v"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                bad.append(f"{name}={value!r} (an integer >= 1)")
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank < 0):
            bad.append(f"rank={self.rank!r} (a rank >= 0)")
        if self.cause not in IDLE_KINDS:
            bad.append(f"cause={self.cause!r} (expected one of {list(IDLE_KINDS)})")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            bad.append(f"schedule={self.schedule!r} (expected one of {list(SCHEDULES)})")
        if bad:
            raise ScenarioError(f"scenario {self.kind.value}: bad " + "; ".join(bad))

    @classmethod
    def parse(cls, text: str) -> Scenario:
        """``kind[:key=value,...]``, e.g. ``comm_faster:k=2,dim=tp+dp``, ``no_straggler:rank=7``,
        ``pipeline:m=16,schedule=gpipe``; several values of one key are joined by ``+``."""
        kind_text, _, params = str(text).strip().partition(":")
        try:
            kind = ScenarioKind(kind_text)
        except ValueError:
            raise ScenarioError(f"unknown scenario {kind_text!r} in {text!r}; expected one of "
                                f"{[k.value for k in ScenarioKind]}") from None
        pairs = [item.partition("=") for item in params.split(",") if item.strip()]
        malformed = [key for key, eq, value in pairs if not eq or not value]
        unknown = [key for key, _, _ in pairs if key not in _KEYS[kind]]
        repeated = sorted({key for key, _, _ in pairs if [k for k, _, _ in pairs].count(key) > 1})
        if malformed or unknown or repeated:
            raise ScenarioError(f"scenario {text!r}: " + "; ".join(filter(None, [
                malformed and f"not key=value: {malformed}", unknown and f"unknown keys {unknown} (allowed for "
                f"{kind.value}: {list(_KEYS[kind])})", repeated and f"repeated keys {repeated}"])))
        values = {key.strip(): value.strip() for key, _, value in pairs}
        fields: dict = {}
        for key, value in values.items():
            if key in ("category", "dim"):
                fields["categories" if key == "category" else "dims"] = tuple(value.split("+"))
            elif key in ("schedule", "keep", "cause"):
                fields[key] = value
            else:
                try:
                    fields[key] = float(value) if key == "k" else int(value)
                except ValueError:
                    raise ScenarioError(f"scenario {text!r}: {key}={value!r} is not a number") from None
        return cls(kind, **fields)

    def __str__(self) -> str:
        parts = []
        if self.kind is ScenarioKind.COMM_FASTER:
            parts.append(f"k={self.k:g}")
        for key, value in (("category", self.categories), ("dim", self.dims)):
            if value and key in _KEYS[self.kind]:
                parts.append(f"{key}={'+'.join(value)}")
        for key in ("rank", "m", "v", "schedule"):
            if getattr(self, key) is not None and key in _KEYS[self.kind]:
                parts.append(f"{key}={getattr(self, key)}")
        if self.kind is ScenarioKind.NO_IDLE:
            parts.append(f"cause={self.cause}")
        if self.kind is ScenarioKind.PIPELINE and self.keep is not Keep.MICROBATCH:
            parts.append(f"keep={self.keep.value}")
        return self.kind.value + (":" + ",".join(parts) if parts else "")

    def selected(self) -> tuple[str, ...]:
        """The communication categories it applies to."""
        if not self.categories:
            return COMM_CATEGORIES
        return tuple(c for c in COMM_CATEGORIES
                     if c in self.categories or (c in P2P_CATEGORIES and "p2p" in self.categories))


@dataclasses.dataclass
class Context:
    """What every scenario of one attribution reads: the breakdown, the chain (``critical_path.critical_path``)
    and its length per step, the matched collectives (with each instance's last arriver), p2p messages
    (``match_p2p``) and their receives, each rank's clock offset, and ``bubbles()``: the pipeline bubbles
    (``bubbles.pipeline_bubbles``, its warnings not issued), computed when a scenario asks."""

    attribution: object
    breakdown: pd.DataFrame
    chain: pd.DataFrame
    path: pd.Series
    calls: pd.DataFrame
    receives: pd.DataFrame
    messages: pd.DataFrame
    offsets: dict
    bubbles: Callable[[], pd.DataFrame]

    @classmethod
    def build(cls, attribution, *, chain: pd.DataFrame, bubbles: Callable[[], pd.DataFrame]) -> Context:
        """The context of ``attribution`` given its critical path ``chain`` and its ``bubbles``."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceWarning)  # the analyses give them to their own callers
            try:
                calls = match_collectives(attribution)
            except AttributionError:  # no collectives: nothing waits for a collective's last arriver
                calls = pd.DataFrame({c: np.empty(0, np.int64) for c in ("rank", "start_ns", "end_ns", "wait_ns",
                                                                           "offset_ns", "instance")})
                calls["category"], calls["group"], calls["is_last"] = "", "", False
            receives = match_p2p(attribution) if not p2p_messages(attribution).empty else None
        key = ["group", "category", "instance"]
        last = calls[calls["is_last"]].set_index(key)["rank"]
        calls = calls.assign(last_rank=last.reindex(pd.MultiIndex.from_frame(calls[key])).to_numpy()
                             if len(calls) else np.empty(0, np.int64))
        if receives is None:
            receives = pd.DataFrame({c: np.empty(0, np.int64) for c in ("rank", "peer", "start_ns", "end_ns",
                                                                         "wait_ns")}).assign(kind="", method="")
        offsets = {int(r): int(o) for r, o in calls.groupby("rank")["offset_ns"].first().items()}
        path = chain.groupby("step")["dur_ns"].sum()
        return cls(attribution, attribution.breakdown, chain, path, calls, receives[receives["kind"] == "recv"],
                   receives, offsets, bubbles)
