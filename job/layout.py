"""The one layout value of a training job: parallel degrees, the pipeline spec and the ZeRO/offload spec.

``Layout(tp=2, pp=2, zero=ZeroSpec(stage=2))`` exists before any process does (a strategy's arguments, a recipe, a
planner's candidate); it is validated at construction with every offending value named. Every spelling of a layout
converts to and from it here, and nowhere else:

- HybridParallelStrategy's keyword arguments: :meth:`Layout.from_strategy_args` / :meth:`Layout.strategy_args`;
- the registered strategy names ``shardline[_tp{t}][_pp{p}][_zero{z}][_offload]``: :func:`parse_strategy_name`,
  :meth:`Layout.from_name`, :func:`strategy_name` and :func:`registered_names`.

Axes. ``tp, pp, cp`` are the dense degrees (``dp`` follows from the world size: ``world = tp * cp * dp * pp``,
rank order in :mod:`shardline.job.placement`). ``ep`` and ``etp`` are the expert-parallel axes of MoE layers
(Megatron's parallel folding: the same ``tp * cp * dp`` ranks of a stage are re-read as ``etp * ep * edp``, expert
rank order ``etp, ep, edp``); they default to 1 and a dense job never sets them. :meth:`Layout.world_problems`
holds the folding rule (``etp * ep`` divides ``tp * cp * dp``; :func:`expert_fold_problems`, with ``etp`` in
``{1, tp}`` in this version: :func:`expert_degree_problems`). The pipeline schedule is any
:class:`~shardline.job.pipeline.schedule.ScheduleKind` a training run may name (:data:`TRAINING_SCHEDULES`): a
new schedule is a new member there, not a new field here.

Binding to a world size and building process groups is the training side's
(:class:`shardline.plugins.layout.Layout` adds ``bind``/``dims`` on :class:`~shardline.plugins.grid.ParallelDims`).
Pure Python: no torch, no Lightning.
"""

from __future__ import annotations

import enum
import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from shardline.job.errors import ContractError, LayoutError
from shardline.job.pipeline.schedule import ScheduleKind


class SPMode(str, enum.Enum):
    """How the sequence dimension is parallelised."""

    NONE = "none"
    MEGATRON = "megatron"  # sequence sharded over the TP group between the TP regions
    RING = "ring"  # context parallel over cp: ring attention
    ULYSSES = "ulysses"  # context parallel over cp: all-to-all to head sharding


class Offload(str, enum.Enum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


#: The schedules a training layout may name (forward-only is evaluation's, not a choice).
TRAINING_SCHEDULES = (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED)


def parse_offload(value: str | Offload | None, *, name: str) -> Offload:
    if value is None:
        return Offload.NONE
    try:
        return Offload(value)
    except ValueError:
        raise ContractError(f"{name}={value!r} must be None, 'cpu' or 'nvme'") from None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class PipelineSpec:
    """``schedule`` (gpipe, 1f1b, interleaved), ``chunks`` per rank (> 1 only interleaved) and the
    ``micro_batches`` per batch (None: chosen per batch size)."""

    schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B
    chunks: int = 1
    micro_batches: int | None = None

    def __post_init__(self) -> None:
        try:
            kind = ScheduleKind(self.schedule)
        except ValueError:
            kind = None
        if kind not in TRAINING_SCHEDULES:
            raise ContractError(f"schedule={self.schedule!r} must be one of {[k.value for k in TRAINING_SCHEDULES]}")
        object.__setattr__(self, "schedule", kind)
        if not isinstance(self.chunks, int) or self.chunks < 1 or (self.chunks > 1 and kind is not
                                                                    ScheduleKind.INTERLEAVED):
            raise ContractError(f"chunks={self.chunks!r} must be 1, or > 1 with schedule='interleaved' "
                                f"(schedule={kind.value!r})")
        m = self.micro_batches
        if m is not None and not _positive_int(m):
            raise ContractError(f"micro_batches={m!r} must be a positive integer or None")


@dataclass(frozen=True)
class ZeroSpec:
    """ZeRO ``stage`` 0-3 over the data-parallel group and what is offloaded (optimizer states: stage >= 1;
    parameters: stage 3), with the NVMe folder when something goes to NVMe. The stage's range and the offload
    rules are DeepSpeed's, checked where its config is derived (``shardline.plugins.lightning.zero``)."""

    stage: int = 1
    offload_optimizer: Offload | str | None = Offload.NONE
    offload_params: Offload | str | None = Offload.NONE
    nvme_path: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload_optimizer", parse_offload(self.offload_optimizer,
                                                                     name="offload_optimizer"))
        object.__setattr__(self, "offload_params", parse_offload(self.offload_params, name="offload_params"))


#: HybridParallelStrategy's arguments that make up a Layout, and the part of the Layout each goes to (with its
#: field name there).
STRATEGY_ARGS = {"tp": (None, "tp"), "pp": (None, "pp"), "cp": (None, "cp"), "ep": (None, "ep"),
                 "etp": (None, "etp"), "sp": (None, "sp"), "gpus_per_node": (None, "gpus_per_node"),
                 "schedule": ("pipeline", "schedule"), "chunks": ("pipeline", "chunks"),
                 "micro_batches": ("pipeline", "micro_batches"), "zero_stage": ("zero", "stage"),
                 "offload_optimizer": ("zero", "offload_optimizer"), "offload_params": ("zero", "offload_params"),
                 "nvme_path": ("zero", "nvme_path")}


def expert_degree_problems(*, tp: int, ep: int, etp: int) -> list[str]:
    """Why the expert axes cannot go with ``tp``, the world still unknown (the one statement of the rule, which
    :class:`~shardline.plugins.grid.ParallelDims` applies too). This version's restriction: an expert is either
    whole on each rank (``etp=1``) or split over the attention's own TP group (``etp=tp``)."""
    if etp in (1, tp):
        return []
    return [f"etp={etp} must be 1 or tp={tp} (ep={ep}): this version splits an expert only over the attention's "
            "TP group (etp=tp) or not at all (etp=1)"]


def expert_fold_problems(*, tp: int, cp: int, dp: int, ep: int, etp: int) -> list[str]:
    """Why the ``tp * cp * dp`` ranks of a pipeline stage cannot be re-read as ``etp * ep * edp`` (Megatron's MoE
    parallel folding): ``etp * ep`` must divide them; ``edp`` is the quotient."""
    stage = tp * cp * dp
    if stage % (etp * ep):
        return [f"etp*ep = {etp}*{ep} does not divide the {stage} ranks of a pipeline stage (tp*cp*dp = "
                f"{tp}*{cp}*{dp}): expert parallelism folds the same ranks"]
    return []


@dataclass(frozen=True)
class Layout:
    """Degrees ``tp, pp, cp`` (``dp`` follows from the world size), the expert axes ``ep, etp``, the
    sequence-parallel mode, the node size, the pipeline and ZeRO specs, and once bound the world size."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: SPMode | str = SPMode.NONE
    gpus_per_node: int | None = None
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    zero: ZeroSpec = field(default_factory=ZeroSpec)
    world_size: int | None = None
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        problems = self.degree_problems()
        if problems:
            raise LayoutError("invalid parallel layout: " + "; ".join(problems))
        if not isinstance(self.pipeline, PipelineSpec) or not isinstance(self.zero, ZeroSpec):
            raise ContractError(f"pipeline={self.pipeline!r} and zero={self.zero!r} must be a PipelineSpec and a "
                                "ZeroSpec")

    def degree_problems(self) -> list[str]:
        """Every reason the degrees and the SP mode cannot go together, the world still unknown (the rules of
        :class:`~shardline.plugins.grid.ParallelDims` that need no world size, in its words; the node size is
        checked with the world). Normalises ``sp``."""
        named = {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "etp": self.etp}
        problems = [f"{name}={value!r} must be an integer >= 1" for name, value in named.items()
                    if not _positive_int(value)]
        try:
            object.__setattr__(self, "sp", SPMode(self.sp))
        except ValueError:
            problems.append(f"sp={self.sp!r} is not one of {[m.value for m in SPMode]}")
        if problems:
            return problems
        if self.sp is SPMode.MEGATRON and self.tp == 1:
            problems.append("sp='megatron' shards the sequence over the TP group and needs tp > 1 (tp=1)")
        if self.sp in (SPMode.RING, SPMode.ULYSSES) and self.cp == 1:
            problems.append(f"sp={self.sp.value!r} is context parallelism and needs cp > 1 (cp=1)")
        return problems + expert_degree_problems(tp=self.tp, ep=self.ep, etp=self.etp)

    def dp_of(self, world_size: int) -> int:
        """The data-parallel degree on ``world_size`` ranks (LayoutError naming the numbers if it is none)."""
        problems = self.world_problems(world_size)
        if problems:
            raise LayoutError(f"invalid parallel layout on world_size={world_size!r}: " + "; ".join(problems))
        return world_size // (self.tp * self.cp * self.pp)

    def world_problems(self, world_size: int) -> list[str]:
        """Why this layout cannot run on ``world_size`` ranks: the dense degrees must divide it, and the expert
        axes fold into each stage's ``tp * cp * dp`` ranks (``etp * ep`` divides it)."""
        if not _positive_int(world_size):
            return [f"world_size={world_size!r} must be an integer >= 1"]
        model = self.tp * self.cp * self.pp
        if world_size % model:
            return [f"world_size={world_size} is not divisible by tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = "
                    f"{model}"]
        return expert_fold_problems(tp=self.tp, cp=self.cp, dp=world_size // model, ep=self.ep, etp=self.etp)

    @property
    def micro_batches(self) -> int | None:
        return self.pipeline.micro_batches

    # --- conversions ------------------------------------------------------------------------------------------

    @classmethod
    def from_strategy_args(cls, args: dict[str, Any]) -> Layout:
        """The layout of HybridParallelStrategy's keyword arguments (other arguments are ignored; absent ones
        take the strategy's defaults). Bad values raise ContractError/LayoutError naming them."""
        parts: dict[str | None, dict[str, Any]] = {None: {}, "pipeline": {}, "zero": {}}
        for key, (part, name) in STRATEGY_ARGS.items():
            if key in args:
                parts[part][name] = args[key]
        return cls(**parts[None], pipeline=PipelineSpec(**parts["pipeline"]), zero=ZeroSpec(**parts["zero"]))

    def strategy_args(self) -> dict[str, Any]:
        """HybridParallelStrategy's keyword arguments for this layout, as plain values (YAML- and JSON-ready):
        always ``tp, pp, cp, sp, zero_stage, offload_*, schedule, chunks``; ``nvme_path``, ``micro_batches``,
        ``ep``/``etp`` and ``gpus_per_node`` only when set. ``from_strategy_args`` of it is this layout."""
        z, p = self.zero, self.pipeline
        args: dict[str, Any] = {"tp": self.tp, "pp": self.pp, "cp": self.cp, "sp": self.sp.value,
                                "zero_stage": z.stage, "offload_optimizer": z.offload_optimizer.value,
                                "offload_params": z.offload_params.value}
        if z.nvme_path is not None:
            args["nvme_path"] = z.nvme_path
        args["schedule"] = p.schedule.value
        args["chunks"] = p.chunks
        if p.micro_batches is not None:
            args["micro_batches"] = p.micro_batches
        if (self.ep, self.etp) != (1, 1):
            args.update(ep=self.ep, etp=self.etp)
        if self.gpus_per_node is not None:
            args["gpus_per_node"] = self.gpus_per_node
        return args

    @classmethod
    def from_name(cls, name: str) -> Layout:
        """The layout a registered strategy name stands for (ContractError for a name outside the family)."""
        return cls.from_strategy_args(parse_strategy_name(name))

    @property
    def name(self) -> str | None:
        """The registered strategy name of this layout (degree-1 parts and ZeRO-1 left out), or None when the
        family cannot spell it."""
        return strategy_name(self)


# --- registered strategy names ------------------------------------------------------------------------------------

#: The degrees and ZeRO stages the registered names cover.
NAME_DEGREES = (1, 2, 4, 8)
NAME_STAGES = (0, 1, 2, 3)
NAME_PATTERN = re.compile(r"^shardline(?:_tp(?P<tp>\d+))?(?:_pp(?P<pp>\d+))?(?:_zero(?P<zero>\d+))?"
                          r"(?P<offload>_offload)?$")


def parse_strategy_name(name: str) -> dict[str, Any]:
    """The strategy arguments a registered name stands for; ContractError for a name outside the family.

    ``"shardline"`` is data parallel with ZeRO-1. The family ``shardline[_tp{t}][_pp{p}][_zero{z}][_offload]``
    covers t, p in {1, 2, 4, 8} and z in {0, 1, 2, 3}; a part of degree 1 may be written or left out, and a
    missing zero part means ZeRO-1. ``_offload`` moves optimizer states to CPU memory (stages 1-2) and, at stage
    3, the parameters as well; it does not exist for stage 0."""
    match = NAME_PATTERN.match(name)
    if match is None:
        raise ContractError(f"strategy name {name!r} is not of the form shardline[_tp{{t}}][_pp{{p}}]"
                            "[_zero{z}][_offload]")
    tp, pp = int(match["tp"] or 1), int(match["pp"] or 1)
    zero = int(match["zero"]) if match["zero"] is not None else 1
    problems = [f"{k}={v} not in {NAME_DEGREES}" for k, v in (("tp", tp), ("pp", pp)) if v not in NAME_DEGREES]
    if zero not in NAME_STAGES:
        problems.append(f"zero{zero}: the stage must be one of {NAME_STAGES}")
    if match["offload"] and zero == 0:
        problems.append("_offload needs ZeRO stage 1, 2 or 3 (zero0 has no optimizer partition to offload)")
    if problems:
        raise ContractError(f"strategy name {name!r}: " + "; ".join(problems))
    kwargs: dict[str, Any] = {"tp": tp, "pp": pp, "zero_stage": zero}
    if match["offload"]:
        kwargs["offload_optimizer"] = "cpu"
        if zero == 3:
            kwargs["offload_params"] = "cpu"
    return kwargs


def strategy_name(layout: Layout) -> str | None:
    """The shortest registered name of ``layout``, or None when the family cannot spell it (cp, SP, ep/etp, a
    schedule or micro-batch count, NVMe or an offload other than the name's, a node size)."""
    z = layout.zero
    offload = z.offload_optimizer is Offload.CPU and z.offload_params is (Offload.CPU if z.stage == 3 else
                                                                           Offload.NONE)
    plain = z.offload_optimizer is Offload.NONE and z.offload_params is Offload.NONE
    if not (offload or plain) or layout.tp not in NAME_DEGREES or layout.pp not in NAME_DEGREES \
            or z.stage not in NAME_STAGES or z.nvme_path is not None:
        return None
    name = ("shardline" + (f"_tp{layout.tp}" if layout.tp > 1 else "") + (f"_pp{layout.pp}" if layout.pp > 1 else "")
            + (f"_zero{z.stage}" if z.stage != 1 else "") + ("_offload" if offload else ""))
    return name if layout.from_name(name) == layout else None


def registered_names() -> list[str]:
    """Every name in the family, in every spelling (degree-1 parts written or omitted)."""
    names = set()
    for tp, pp, zero, offload in itertools.product(NAME_DEGREES, NAME_DEGREES, (None, *NAME_STAGES), (False, True)):
        if offload and zero == 0:
            continue
        tp_parts = ["", f"_tp{tp}"] if tp == 1 else [f"_tp{tp}"]
        pp_parts = ["", f"_pp{pp}"] if pp == 1 else [f"_pp{pp}"]
        zero_part = "" if zero is None else f"_zero{zero}"
        for tp_part, pp_part in itertools.product(tp_parts, pp_parts):
            names.add(f"shardline{tp_part}{pp_part}{zero_part}{'_offload' if offload else ''}")
    return sorted(names)


__all__ = ["Layout", "NAME_DEGREES", "NAME_PATTERN", "NAME_STAGES", "Offload", "PipelineSpec", "SPMode",
           "STRATEGY_ARGS", "TRAINING_SCHEDULES", "ZeroSpec", "expert_degree_problems", "expert_fold_problems",
           "parse_offload", "parse_strategy_name",
           "registered_names", "strategy_name"]
