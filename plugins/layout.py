"""The training side's :class:`Layout`: :class:`shardline.job.layout.Layout` (the one layout value: degrees, the
pipeline spec and the ZeRO/offload spec, with its conversions to and from strategy arguments and names) bound to a
world size once it is known.

``layout.bind(world_size)`` returns the bound layout, whose :attr:`dims` is the
:class:`~shardline.plugins.grid.ParallelDims` (``dp`` derived) the process groups are built from. The strategy
holds exactly one; its ``describe()``/``layout_record()``, the recipe checker, the model (through the grid) and the
profiler (:attr:`degrees`) all read it.

Pure Python (no torch, no Lightning): the recipe checker and planning tools import it freely.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shardline.job import layout as job_layout
from shardline.job.layout import TRAINING_SCHEDULES, Offload, PipelineSpec, ZeroSpec, parse_offload
from shardline.plugins.errors import LayoutError
from shardline.plugins.grid import ParallelDims


@dataclass(frozen=True)
class Layout(job_layout.Layout):
    """:class:`shardline.job.layout.Layout` plus its binding to a world size (:meth:`bind`, :attr:`dims`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.world_size is not None:
            object.__setattr__(self, "_dims", self.for_world(self.world_size))

    def for_world(self, world_size: int) -> ParallelDims:
        """The ParallelDims of this layout on ``world_size`` ranks (LayoutError naming every number)."""
        dims = ParallelDims(world_size, tp=self.tp, pp=self.pp, cp=self.cp, sp=self.sp,
                            gpus_per_node=self.gpus_per_node, ep=self.ep, etp=self.etp)
        problems = self.world_problems(world_size)
        if problems:
            raise LayoutError("invalid parallel layout: " + "; ".join(problems))
        return dims

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


__all__ = ["Layout", "Offload", "PipelineSpec", "TRAINING_SCHEDULES", "ZeroSpec", "parse_offload"]
