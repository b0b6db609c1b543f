"""The pipeline engine's vocabulary: its options (:class:`LossReduction`, :class:`MemoryAccounting`,
:class:`Annotations`), the callbacks for the layer above (:class:`PipelineHooks`) and what one batch did
(:class:`EngineStats`). :mod:`shardline.plugins.pipeline.engine` re-exports each."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from shardline.plugins.errors import ContractError


class LossReduction(str, enum.Enum):
    """How ``loss_fn`` reduces over a micro-batch, hence how micro-batch losses combine into the batch loss."""

    MEAN = "mean"
    SUM = "sum"


class MemoryAccounting(str, enum.Enum):
    """Whether the engine measures the bytes of tensors autograd saves for backward (costs a hook per save)."""

    OFF = "off"
    SAVED_TENSORS = "saved_tensors"


class Annotations(str, enum.Enum):
    """When the engine enters its ``record_function`` annotations.

    ``record_function`` is not free without a profiler: its enter and exit are dispatcher calls and autograd work
    inside one runs slower, a cost per micro-batch that adds up over a batch (bench_pipeline measures it).
    ``WHEN_PROFILING`` (the default) enters them
    only while torch's profiler flag is up, the one ``torch.profiler.profile``, ``emit_nvtx`` and ``emit_itt``
    raise and torch's compiled code checks before its own annotations; a profiler records nothing from a
    ``record_function`` entered while it is off anyway. ``ALWAYS`` is for observers that do not raise the flag
    (a Kineto on-demand trace started by a daemon, a stand-alone ``ExecutionTraceObserver``).
    """

    WHEN_PROFILING = "when_profiling"
    ALWAYS = "always"


class PipelineHooks:
    """Callbacks for the layer above (the strategy). Override what you need; every default does nothing.

    ``last`` in the backward and weight hooks is True for the final backward (B, or W under a split backward,
    whichever comes later) of that stage in the batch: the gradient accumulation boundary (where ZeRO reduces
    gradients once per batch). The weight hooks bracket a zero-bubble schedule's W actions.
    """

    def before_batch(self, *, n_microbatches: int) -> None: ...

    def after_batch(self, *, loss: torch.Tensor) -> None: ...

    def before_forward(self, *, stage: int, microbatch: int) -> None: ...

    def after_forward(self, *, stage: int, microbatch: int) -> None: ...

    def before_backward(self, *, stage: int, microbatch: int, last: bool) -> None: ...

    def after_backward(self, *, stage: int, microbatch: int, last: bool) -> None: ...

    def before_weight(self, *, stage: int, microbatch: int, last: bool) -> None: ...

    def after_weight(self, *, stage: int, microbatch: int, last: bool) -> None: ...


@dataclass
class EngineStats:
    """What one ``run_batch`` did on this rank, timed with ``perf_counter_ns``.

    ``records`` holds ``(action name, stage, microbatch, start_ns, end_ns)`` for every action and every receive
    wait (name ``"wait"``). ``bubble_fraction = 1 - compute / window``, compute being the F/B/W time and the
    window the whole batch on this rank.
    """

    start_ns: int = 0
    end_ns: int = 0
    records: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    #: Most (stage, micro-batch) pairs held at once: from F until B, or until W for a split backward.
    peak_in_flight: int = 0
    peak_saved_bytes: int | None = None

    @property
    def compute_ns(self) -> int:
        return sum(e - s for name, _, _, s, e in self.records if name in ("F", "B", "W"))

    @property
    def window_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.compute_ns / self.window_ns if self.window_ns else 0.0


def _enum(kind: type[enum.Enum], value, name: str):
    try:
        return kind(value)
    except ValueError:
        raise ContractError(f"{name}={value!r} is not one of {[k.value for k in kind]}") from None
