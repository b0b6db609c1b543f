"""The one layout value: parallel degrees, the pipeline spec and the ZeRO/offload spec, unbound until the world
size is known and then bound to it once.

``Layout(tp=2, pp=2, zero=ZeroSpec(stage=2))`` can exist before any process does (a strategy's arguments, a
recipe); it is validated at construction with every offending value named. ``layout.bind(world_size)`` returns
the bound layout, whose :attr:`dims` is the :class:`~shardline.plugins.grid.ParallelDims` (``dp`` derived) the
process groups are built from. The strategy holds exactly one; its ``describe()``/``layout_record()``, the recipe
checker, the model (through the grid) and the profiler (:attr:`degrees`) all read it.

Pure Python (no torch, no Lightning): the recipe checker and planning tools import it freely.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from shardline.job.pipeline.schedule import ScheduleKind
from shardline.plugins.errors import ContractError, LayoutError
from shardline.plugins.grid import ParallelDims, SPMode

#: The schedules a training layout may name (forward-only is evaluation's, not a choice).
TRAINING_SCHEDULES = (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED)


class Offload(str, enum.Enum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


def parse_offload(value: str | Offload | None, *, name: str) -> Offload:
    if value is None:
        return Offload.NONE
    try:
        return Offload(value)
    except ValueError:
        raise ContractError(f"{name}={value!r} must be None, 'cpu' or 'nvme'") from None


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
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ContractError(f"micro_batches={m!r} must be a positive integer or None")


@dataclass(frozen=True)
class ZeroSpec:
    """ZeRO ``stage`` 0-3 over the data-parallel group and what is offloaded (optimizer states: stage >= 1;
    parameters: stage 3), with the NVMe folder when something goes to NVMe."""

    stage: int = 1
    offload_optimizer: Offload | str | None = Offload.NONE
    offload_params: Offload | str | None = Offload.NONE
    nvme_path: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload_optimizer", parse_offload(self.offload_optimizer,
                                                                     name="offload_optimizer"))
        object.__setattr__(self, "offload_params", parse_offload(self.offload_params, name="offload_params"))


@dataclass(frozen=True)
class Layout:
    """Degrees ``tp, pp, cp`` (``dp`` follows from the world size), the sequence-parallel mode, the node size,
    the pipeline and ZeRO specs, and once bound the world size."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: SPMode | str = SPMode.NONE
    gpus_per_node: int | None = None
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    zero: ZeroSpec = field(default_factory=ZeroSpec)
    world_size: int | None = None

    def __post_init__(self) -> None:
        # Validate the degrees and mode now, the world still unknown (a world of exactly tp*pp*cp checks them).
        probe = ParallelDims(self.tp * self.pp * self.cp if _positive_ints(self.tp, self.pp, self.cp) else 1,
                             tp=self.tp, pp=self.pp, cp=self.cp, sp=self.sp)
        object.__setattr__(self, "sp", probe.sp)
        if not isinstance(self.pipeline, PipelineSpec) or not isinstance(self.zero, ZeroSpec):
            raise ContractError(f"pipeline={self.pipeline!r} and zero={self.zero!r} must be a PipelineSpec and a "
                                "ZeroSpec")
        if self.world_size is not None:
            object.__setattr__(self, "_dims", self.for_world(self.world_size))

    def for_world(self, world_size: int) -> ParallelDims:
        """The ParallelDims of this layout on ``world_size`` ranks (LayoutError naming every number)."""
        return ParallelDims(world_size, tp=self.tp, pp=self.pp, cp=self.cp, sp=self.sp,
                            gpus_per_node=self.gpus_per_node)

    def bind(self, world_size: int) -> Layout:
        """This layout bound to ``world_size`` (validated); binding a bound layout to another size is refused."""
        if self.world_size is not None and self.world_size != world_size:
            raise LayoutError(f"layout is bound to world_size={self.world_size}; cannot rebind to {world_size}")
        return self if self.world_size == world_size else dataclasses.replace(self, world_size=world_size)

    @property
    def bound(self) -> bool:
        return self.world_size is not None

    @property
    def dims(self) -> ParallelDims:
        if self.world_size is None:
            raise LayoutError("the layout is not bound to a world size yet (Layout.bind(world_size))")
        return self._dims

    @property
    def degrees(self) -> dict[str, int]:
        """``{"tp", "cp", "dp", "pp"}``: what the profiler classifies groups with (``dp`` once bound)."""
        out = {"tp": self.tp, "cp": self.cp, "pp": self.pp}
        if self.bound:
            out["dp"] = self.dims.dp
        return out

    def record(self) -> dict[str, Any]:
        """The layout as plain values (hparams, checkpoints, logs, the profiler)."""
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dims.dp if self.bound else None,
                "sp": self.sp.value, "zero_stage": self.zero.stage,
                "offload_optimizer": self.zero.offload_optimizer.value,
                "offload_params": self.zero.offload_params.value,
                "micro_batches": self.pipeline.micro_batches, "schedule": self.pipeline.schedule.value,
                "chunks": self.pipeline.chunks, "world_size": self.world_size}


def _positive_ints(*values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)
