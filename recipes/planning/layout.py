"""One candidate layout as the planner sees it: the strategy's degrees plus what only a plan decides
(micro-batch size, recompute).

``dp`` is explicit here (a plan has a GPU count); ``world = tp * cp * dp * pp``. ZeRO shards over ``dp * cp``,
as the strategy does. ``recompute``: ``none``, ``selective`` (attention's softmax/dropout recomputed, Korthikanti
et al. 2022) or ``full`` (each block's input kept, the block recomputed in backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.recipes.schema import RecipeError

SP_MODES = ("none", "megatron", "ring", "ulysses")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "cpu", "nvme")


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
                    ("tp", "pp", "dp", "cp", "chunks", "micro_batches", "micro_batch_size")
                    if not isinstance(getattr(self, k), int) or getattr(self, k) < 1]
        for key, allowed in (("sp", SP_MODES), ("schedule", SCHEDULES), ("recompute", RECOMPUTE),
                             ("offload_optimizer", OFFLOAD), ("offload_params", OFFLOAD)):
            if getattr(self, key) not in allowed:
                problems.append(f"{key}={getattr(self, key)!r} must be one of {allowed}")
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.chunks > 1 and self.schedule != "interleaved":
            problems.append(f"chunks={self.chunks} needs schedule='interleaved' (schedule={self.schedule!r})")
        if self.cp > 1 and self.sp not in ("ring", "ulysses"):
            problems.append(f"cp={self.cp} needs sp='ring' or 'ulysses' (sp={self.sp!r})")
        if problems:
            raise RecipeError("layout: " + "; ".join(problems))

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


__all__ = ["OFFLOAD", "PlanLayout", "RECOMPUTE", "SCHEDULES", "SP_MODES"]
