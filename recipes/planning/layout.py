"""One candidate layout as the planner sees it: a :class:`~shardline.job.layout.Layout` (the strategy's degrees,
pipeline and ZeRO specs: the one layout value shardline has) plus what only a plan decides around it: the
data-parallel degree, the micro-batch size and count, and recompute.

``dp`` is explicit here (a plan has a GPU count); ``world = tp * cp * dp * pp``. ZeRO shards over ``dp * cp``,
as the strategy does. ``recompute``: ``none``, ``selective`` (attention's softmax/dropout recomputed, Korthikanti
et al. 2022) or ``full`` (each block's input kept, the block recomputed in backward).

The fields are the flat view the search, the tables and the JSON records use (the enum-valued parts of the
Layout as their values); :attr:`PlanLayout.layout` is the Layout itself, built and validated at construction,
and :meth:`PlanLayout.around` builds a plan's layout around a given one. The planner does not price experts: its
Layout has ``ep = etp = 1``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shardline.job.errors import ShardlineError
from shardline.job.layout import TRAINING_SCHEDULES as _SCHEDULE_KINDS
from shardline.job.layout import Layout, Offload, SPMode
from shardline.recipes.schema import RecipeError


class Recompute(str, enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


#: The values each string field takes (the enums' values, in their order).
SP_MODES = tuple(m.value for m in SPMode)
SCHEDULES = tuple(k.value for k in _SCHEDULE_KINDS)
RECOMPUTE = tuple(r.value for r in Recompute)
OFFLOAD = tuple(o.value for o in Offload)


@dataclass(frozen=True)
class PlanLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    chunks: int = 1
    sp: str = "none"
    schedule: str = "1f1b"
    zero_stage: int = 1
    offload_optimizer: str = "none"
    offload_params: str = "none"
    recompute: str = "none"
    micro_batches: int = 1
    micro_batch_size: int = 1

    def __post_init__(self) -> None:
        problems = [f"{k}={getattr(self, k)!r} must be an integer >= 1" for k in
                    ("dp", "micro_batches", "micro_batch_size")
                    if not isinstance(getattr(self, k), int) or getattr(self, k) < 1]
        if self.recompute not in RECOMPUTE:
            problems.append(f"recompute={self.recompute!r} must be one of {RECOMPUTE}")
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if isinstance(self.cp, int) and self.cp > 1 and self.sp not in ("ring", "ulysses"):
            problems.append(f"cp={self.cp} needs sp='ring' or 'ulysses' (sp={self.sp!r})")
        try:
            layout = Layout.from_strategy_args({
                "tp": self.tp, "pp": self.pp, "cp": self.cp, "sp": self.sp, "schedule": self.schedule,
                "chunks": self.chunks, "zero_stage": self.zero_stage, "offload_optimizer": self.offload_optimizer,
                "offload_params": self.offload_params})
        except ShardlineError as error:
            problems.append(str(error))
        if problems:
            raise RecipeError("layout: " + "; ".join(problems))
        object.__setattr__(self, "_layout", layout)
        for key, value in (("sp", layout.sp), ("schedule", layout.pipeline.schedule),
                           ("offload_optimizer", layout.zero.offload_optimizer),
                           ("offload_params", layout.zero.offload_params), ("recompute", Recompute(self.recompute))):
            object.__setattr__(self, key, value.value)

    @classmethod
    def around(cls, layout: Layout, *, dp: int = 1, recompute: str = "none", micro_batches: int = 1,
               micro_batch_size: int = 1) -> PlanLayout:
        """The plan of ``layout`` with the planner's own choices (``layout``'s micro-batch count, when set, is the
        pipeline's and must equal ``micro_batches``)."""
        if layout.pipeline.micro_batches not in (None, micro_batches):
            raise RecipeError(f"layout: micro_batches={micro_batches} != the layout's pipeline micro_batches="
                              f"{layout.pipeline.micro_batches}")
        if (layout.ep, layout.etp) != (1, 1):
            raise RecipeError(f"layout: ep={layout.ep}, etp={layout.etp}: the planner does not price expert "
                              "parallelism yet")
        return cls(tp=layout.tp, pp=layout.pp, dp=dp, cp=layout.cp, chunks=layout.pipeline.chunks,
                   sp=layout.sp.value, schedule=layout.pipeline.schedule.value, zero_stage=layout.zero.stage,
                   offload_optimizer=layout.zero.offload_optimizer.value,
                   offload_params=layout.zero.offload_params.value, recompute=recompute,
                   micro_batches=micro_batches, micro_batch_size=micro_batch_size)

    @property
    def layout(self) -> Layout:
        """The :class:`~shardline.job.layout.Layout` this plan runs (no micro-batch count, no node size)."""
        return self._layout

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def zero_group(self) -> int:
        """The ranks ZeRO shards over: ``dp * cp``."""
        return self.dp * self.cp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro-batch size x micro-batches x dp."""
        return self.micro_batch_size * self.micro_batches * self.dp


__all__ = ["OFFLOAD", "PlanLayout", "RECOMPUTE", "Recompute", "SCHEDULES", "SP_MODES"]
