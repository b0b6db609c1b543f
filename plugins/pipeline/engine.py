"""The pipeline engine: runs one rank's validated schedule for one batch.

Contract. ``PipelineEngine(stages, schedule=..., pp_rank=..., loss_fn=...)`` owns the stage modules of one rank
(stage ``s`` for every ``s`` in ``schedule.stages_of_rank(pp_rank)``; each maps one tensor to one tensor). A call
``run_batch(inputs, targets)`` splits the batch along dim 0 into ``m = schedule.n_microbatches`` equal
micro-batches and executes exactly ``schedule.actions[pp_rank]``, nothing else:

- ``F`` on stage 0 reads micro-batch ``i`` of ``inputs``; on a later stage it reads the activation received by
  ``RA`` (or handed over locally when the previous stage is on this rank). The last stage applies
  ``loss_fn(output, targets_i)``.
- ``B`` back-propagates: on the last stage from ``loss_i / m`` (``LossReduction.MEAN``: the loss is a mean over
  the micro-batch, so ``sum_i grad(loss_i / m) = grad(mean over the batch)``) or ``loss_i`` (``SUM``), elsewhere
  from the gradient received by ``RG``. The stage's input, output and graph are dropped right after, so the
  activations held are exactly those in flight. Parameter gradients accumulate in ``.grad`` across micro-batches
  (the caller zeroes them between batches), so after the batch they equal the full-batch gradient.
- A run of consecutive send/recv actions is posted as one ``batch_isend_irecv`` (a NCCL group), then its
  receives are waited on; sends are waited on at the end of the batch. :func:`validate` proves this cannot
  deadlock even if sends block until received (see ``simulate``'s module docstring).
- Shapes travel: the first activation a stage sends in a batch is preceded by a small header (ndim, dtype,
  dims) on ``meta_group`` (default: the pp group with tag 1, which gloo keeps apart from the data; NCCL needs a
  gloo ``meta_group``), so the sequence length may change from batch to batch. Later micro-batches of the same
  batch reuse the header (micro-batches of one batch have one shape).
- Data-parallel gradient reduction is not the engine's job: the strategy above does it once per batch, at
  the ``last`` backward of each stage or in ``after_batch`` (see :class:`PipelineHooks`); tied weights are
  synced with :class:`~shardline.plugins.pipeline.partition.TiedWeight`.
- The batch loss (``mean`` or ``sum`` of the micro-batch losses) is broadcast from the rank holding the last
  stage over the pp group and returned on every rank as a float64 scalar.

Every action runs inside ``record_function(pp_action_name(kind, stage=, microbatch=))``, each receive's wait
inside ``pp_action_name("wait", ...)``, the batch inside ``pp_batch_name(...)``. The engine also times each
action itself (:class:`EngineStats`), which gives a measured bubble fraction without a profiler.
"""

from __future__ import annotations

import datetime
import enum
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from shardline.plugins.errors import ContractError, LayoutError, ScheduleError
from shardline.plugins.pipeline.actions import Action, ActionKind, Schedule
from shardline.plugins.pipeline.memory import SavedTensorMeter
from shardline.plugins.pipeline.simulate import split_ops, validate
from shardline.profiling.annotations import pp_action_name, pp_batch_name

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
_MAX_DIMS = 8
_HEADER_TAG, _DATA_TAG = 1, 0
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class LossReduction(str, enum.Enum):
    """How ``loss_fn`` reduces over a micro-batch, hence how micro-batch losses combine into the batch loss."""

    MEAN = "mean"
    SUM = "sum"


class MemoryAccounting(str, enum.Enum):
    """Whether the engine measures the bytes of tensors autograd saves for backward (costs a hook per save)."""

    OFF = "off"
    SAVED_TENSORS = "saved_tensors"


class PipelineHooks:
    """Callbacks for the layer above (the strategy). Override what you need; every default does nothing.

    ``last`` in the backward hooks is True for the final backward of that stage in the batch: the gradient
    accumulation boundary (where ZeRO reduces gradients once per batch).
    """

    def before_batch(self, *, n_microbatches: int) -> None: ...

    def after_batch(self, *, loss: torch.Tensor) -> None: ...

    def before_forward(self, *, stage: int, microbatch: int) -> None: ...

    def after_forward(self, *, stage: int, microbatch: int) -> None: ...

    def before_backward(self, *, stage: int, microbatch: int, last: bool) -> None: ...

    def after_backward(self, *, stage: int, microbatch: int, last: bool) -> None: ...


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


def _as_stage_map(stages, expected: list[int]) -> dict[int, nn.Module]:
    if isinstance(stages, nn.Module):
        stages = [stages]
    if isinstance(stages, Mapping):
        mapping = dict(stages)
    elif isinstance(stages, Sequence):
        if len(stages) != len(expected):
            raise ContractError(f"got {len(stages)} stage modules in chunk order but this rank hosts stages "
                                f"{expected}")
        mapping = dict(zip(expected, stages))
    else:
        raise ContractError(f"stages must be an nn.Module, a sequence or a mapping, got {type(stages).__name__}")
    if sorted(mapping) != expected or not all(isinstance(m, nn.Module) for m in mapping.values()):
        raise ContractError(f"stage modules for stages {sorted(mapping)} do not match the stages this rank "
                            f"hosts {expected} (or are not nn.Modules)")
    return mapping


class PipelineEngine:
    """Executes ``schedule.actions[pp_rank]`` for one batch at a time; see the module docstring."""

    def __init__(self, stages: nn.Module | Sequence[nn.Module] | Mapping[int, nn.Module], *,
                 schedule: Schedule, pp_rank: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 group: dist.ProcessGroup | None = None, meta_group: dist.ProcessGroup | None = None,
                 loss_reduction: LossReduction | str = LossReduction.MEAN,
                 memory: MemoryAccounting | str = MemoryAccounting.OFF, hooks: PipelineHooks | None = None,
                 timeout_s: float = 300.0,
                 backward: Callable[[torch.Tensor, torch.Tensor | None], None] | None = None):
        validate(schedule)
        if not isinstance(pp_rank, int) or not 0 <= pp_rank < schedule.n_ranks:
            raise LayoutError(f"pp_rank={pp_rank!r} outside 0..{schedule.n_ranks - 1} of schedule "
                              f"{schedule.name!r}")
        splits = [(step, a) for step, a in enumerate(schedule.actions[pp_rank]) if a.kind is ActionKind.WEIGHT]
        if splits:
            raise ScheduleError(f"rank {pp_rank}, step {splits[0][0]}: {splits[0][1]} is a split weight "
                                f"backward, which this engine does not execute (F and B only)")
        self.schedule, self.pp_rank, self.loss_fn = schedule, pp_rank, loss_fn
        self.stages = _as_stage_map(stages, schedule.stages_of_rank(pp_rank))
        self.group = group
        size = dist.get_world_size(group)
        if size != schedule.n_ranks:
            raise LayoutError(f"the pp group has {size} ranks but schedule {schedule.name!r} has "
                              f"n_ranks={schedule.n_ranks}")
        backend = dist.get_backend(group)
        if meta_group is None and backend != "gloo":
            raise ContractError(f"backend {backend!r} ignores message tags: pass meta_group, a gloo group over "
                                f"the same ranks, for the shape headers")
        self.meta_group = group if meta_group is None else meta_group
        self._meta_tag = _HEADER_TAG if meta_group is None else 0
        self._meta_device = torch.device("cpu") if dist.get_backend(self.meta_group) == "gloo" else None
        if backend == "nccl":
            # torch requires every rank of a group in its first batch_isend_irecv (the NCCL communicator is
            # created there); a barrier creates it here instead, so construction is collective over the group.
            dist.barrier(group=group)
        self.loss_reduction = _enum(LossReduction, loss_reduction, "loss_reduction")
        self.memory = _enum(MemoryAccounting, memory, "memory")
        self.hooks = hooks or PipelineHooks()
        # How a stage's output is back-propagated: ``backward(output, grad)``, grad None for the last stage's
        # (scaled) loss. The default is plain autograd; a ZeRO strategy passes its engine's backward instead.
        self._backward_fn = backward or _autograd_backward
        if not timeout_s > 0:
            raise ContractError(f"timeout_s={timeout_s!r} must be > 0")
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._ops = split_ops(schedule.actions[pp_rank])
        self._last_stage = schedule.n_stages - 1
        self._last_backward = {s: max(st for st, a in enumerate(schedule.actions[pp_rank])
                                      if a.kind is B and a.stage == s) for s in self.stages}
        self.stats = EngineStats()

    # ---------------------------------------------------------------- the batch
    def run_batch(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Run one batch (inputs needed where stage 0 lives, targets where the last stage lives)."""
        sched = self.schedule
        self._split_batch(inputs, targets)
        self._state: dict[str, dict] = {k: {} for k in ("input", "output", "grad", "recv", "meta_in",
                                                                    "meta_out")}
        self._meta_sent: set[int] = set()
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._losses: list[torch.Tensor] = []
        self.stats = EngineStats(start_ns=time.perf_counter_ns())
        meter = None
        if self.memory is MemoryAccounting.SAVED_TENSORS:
            meter = SavedTensorMeter(self._resident_storages(inputs, targets))
        name = pp_batch_name(sched.name, p=sched.n_ranks, m=sched.n_microbatches, v=sched.n_chunks)
        with record_function(name), ExitStack() as stack:
            if meter is not None:
                stack.enter_context(meter)
            self.hooks.before_batch(n_microbatches=sched.n_microbatches)
            for step, batch in self._ops:
                if batch[0].kind.is_compute:
                    self._compute(step, batch[0])
                else:
                    self._exchange(batch)
            for work, _ in self._pending:
                self._wait(work, "the sends of this batch to complete")
            loss = self._batch_loss()
            self.hooks.after_batch(loss=loss)
        self.stats.end_ns = time.perf_counter_ns()
        self.stats.peak_saved_bytes = None if meter is None else meter.peak_bytes
        self._state = {}
        return loss

    def _split_batch(self, inputs, targets) -> None:
        m = self.schedule.n_microbatches
        self._micro_in = self._split("inputs", inputs, m) if 0 in self.stages else None
        self._micro_tgt = self._split("targets", targets, m) if self._last_stage in self.stages else None

    def _split(self, what: str, tensor, m: int) -> list[torch.Tensor]:
        if not isinstance(tensor, torch.Tensor):
            raise ContractError(f"rank {self.pp_rank} hosts a stage that needs {what}, got {type(tensor).__name__}")
        if tensor.dim() == 0 or tensor.shape[0] % m:
            raise LayoutError(f"{what} batch size {tuple(tensor.shape)[:1]} is not divisible by n_microbatches={m}"
                              f" (micro-batches must be equal for the 1/m loss scaling to give the batch mean)")
        return list(tensor.chunk(m, dim=0))

    def _resident_storages(self, *batch: torch.Tensor | None) -> set[int]:
        """Storages that are resident whatever the schedule: parameters and the caller's batch tensors."""
        tensors = [p for mod in self.stages.values() for p in mod.parameters()]
        tensors += [t for t in batch if isinstance(t, torch.Tensor)]
        return {t.untyped_storage().data_ptr() for t in tensors}

    # ---------------------------------------------------------------- compute
    def _timed(self, name: str, stage: int, mb: int, start: int) -> None:
        self.stats.records.append((name, stage, mb, start, time.perf_counter_ns()))

    def _compute(self, step: int, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        start = time.perf_counter_ns()
        with record_function(pp_action_name(action.kind.value, stage=s, microbatch=mb)):
            if action.kind is F:
                self._forward(s, mb)
            else:
                self._backward(s, mb, last=step == self._last_backward[s])
        self._timed(action.kind.value, s, mb, start)

    def _forward(self, s: int, mb: int) -> None:
        st = self._state
        if s == 0:
            x = self._micro_in[mb]
        elif (s - 1) in self.stages:  # local hand-over (one rank hosting neighbouring stages)
            x = st["output"][(s - 1, mb)].detach().requires_grad_()
        else:
            x = st["recv"].pop((s, mb))
        self.hooks.before_forward(stage=s, microbatch=mb)
        out = self.stages[s](x)
        if s == self._last_stage:
            loss = self.loss_fn(out, self._micro_tgt[mb])
            self._losses.append(loss.detach())
            out = loss / self.schedule.n_microbatches if self.loss_reduction is LossReduction.MEAN else loss
        st["input"][(s, mb)], st["output"][(s, mb)] = x, out
        st["meta_out"].setdefault(s, (out.shape, out.dtype, out.device))
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(st["output"]))
        self.hooks.after_forward(stage=s, microbatch=mb)

    def _backward(self, s: int, mb: int, *, last: bool) -> None:
        st = self._state
        out = st["output"].pop((s, mb))
        x = st["input"].pop((s, mb))
        if s == self._last_stage:
            grad = None
        elif (s + 1) in self.stages:
            grad = st["grad"].pop((s + 1, mb))  # local hand-over from the next stage's backward
        else:
            grad = st["recv"].pop((s, mb))
        self.hooks.before_backward(stage=s, microbatch=mb, last=last)
        self._backward_fn(out, grad)
        del out  # the graph and its saved activations go now, not at the end of the batch
        if s > 0:  # an input the output does not depend on gets a zero gradient, not None
            st["grad"][(s, mb)] = x.grad if x.grad is not None else torch.zeros_like(x)
        self.hooks.after_backward(stage=s, microbatch=mb, last=last)

    # ---------------------------------------------------------------- communication
    def _peer(self, action: Action) -> int:
        return self.schedule.rank_of_stage(action.peer_stage)

    def _exchange(self, batch: list[Action]) -> None:
        """Post every send/recv of the batch together, then wait for the receives."""
        self._exchange_headers(batch)
        with ExitStack() as stack:
            for a in batch:
                stack.enter_context(record_function(pp_action_name(a.kind.value, stage=a.stage,
                                                                   microbatch=a.microbatch)))
            start = time.perf_counter_ns()
            tensors = [self._buffer(a) for a in batch]
            ops = [dist.P2POp(dist.isend if a.kind.is_send else dist.irecv, t, group=self.group,
                              group_peer=self._peer(a), tag=_DATA_TAG) for a, t in zip(batch, tensors)]
            works = dist.batch_isend_irecv(ops)
            for a in batch:
                self._timed(a.kind.value, a.stage, a.microbatch, start)
        for a, tensor, work in zip(batch, tensors, works):
            if a.kind.is_send:
                self._pending.append((work, tensor))  # keeps the buffer alive until the send completes
                continue
            start = time.perf_counter_ns()
            with record_function(pp_action_name(a.kind.value, stage=a.stage, microbatch=a.microbatch)), \
                    record_function(pp_action_name("wait", stage=a.stage, microbatch=a.microbatch)):
                self._wait(work, f"{a} from rank {self._peer(a)}")
            self._timed("wait", a.stage, a.microbatch, start)
            if a.kind is ActionKind.RECV_ACT:
                tensor.requires_grad_(tensor.is_floating_point())
            self._state["recv"][(a.stage, a.microbatch)] = tensor

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait with a deadline: a validated schedule cannot deadlock, so a timeout means the ranks disagree."""
        try:
            work.wait(timeout=self._timeout)
        except RuntimeError as exc:
            raise ScheduleError(f"rank {self.pp_rank} waited more than {self._timeout.total_seconds():g} s for "
                                f"{what} (schedule {self.schedule.name!r}): the ranks are not running the same "
                                f"schedule, or a peer failed ({exc})") from exc

    def _buffer(self, a: Action) -> torch.Tensor:
        """The tensor a send reads or a receive fills."""
        st = self._state
        key = (a.stage, a.microbatch)
        if a.kind is ActionKind.SEND_ACT:
            return st["output"][key].detach().contiguous()
        if a.kind is ActionKind.SEND_GRAD:
            return st["grad"].pop(key).contiguous()
        if a.kind is ActionKind.RECV_ACT:
            shape, dtype, device = st["meta_in"][a.stage]
            return torch.empty(shape, dtype=dtype, device=device)
        # RECV_GRAD: shaped like this stage's output (one shape per stage within a batch).
        meta = st["meta_out"].get(a.stage)
        if meta is None:
            raise ScheduleError(f"rank {self.pp_rank}: {a} is posted before stage {a.stage} ran any forward in "
                                f"this batch, so the gradient's shape is unknown")
        return torch.empty(meta[0], dtype=meta[1], device=meta[2])

    def _exchange_headers(self, batch: list[Action]) -> None:
        """Shape headers for the first activation each stage sends (and receives) in this batch."""
        st = self._state
        for a in batch:
            if a.kind is ActionKind.SEND_ACT and a.stage not in self._meta_sent:
                self._meta_sent.add(a.stage)
                header = _encode_header(st["output"][(a.stage, a.microbatch)], device=self._meta_device)
                work = dist.isend(header, group=self.meta_group, group_dst=self._peer(a), tag=self._meta_tag)
                self._pending.append((work, header))
        for a in batch:
            if a.kind is ActionKind.RECV_ACT and a.stage not in st["meta_in"]:
                header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self._meta_device)
                start = time.perf_counter_ns()
                with record_function(pp_action_name("wait", stage=a.stage, microbatch=a.microbatch)):
                    work = dist.irecv(header, group=self.meta_group, group_src=self._peer(a), tag=self._meta_tag)
                    self._wait(work, f"the shape header of {a} from rank {self._peer(a)}")
                self._timed("wait", a.stage, a.microbatch, start)
                st["meta_in"][a.stage] = (*_decode_header(header), self._device_of(a.stage))

    def _device_of(self, stage: int) -> torch.device:
        # A stage module may declare where its activations live (a parameter-free wrapper, as the strategy's);
        # otherwise its first parameter tells.
        declared = getattr(self.stages[stage], "pipeline_device", None)
        if declared is not None:
            return torch.device(declared)
        param = next(self.stages[stage].parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    # ---------------------------------------------------------------- loss
    def _batch_loss(self) -> torch.Tensor:
        loss = torch.zeros((), dtype=torch.float64, device=self._device_of(next(iter(self.stages))))
        if self._last_stage in self.stages:
            total = torch.stack([x.to(torch.float64) for x in self._losses]).sum()
            loss = total / len(self._losses) if self.loss_reduction is LossReduction.MEAN else total
        if self.schedule.n_ranks > 1:
            dist.broadcast(loss, group=self.group, group_src=self.schedule.rank_of_stage(self._last_stage))
        return loss


def _autograd_backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    torch.autograd.backward(output, grad_tensors=grad)


def _encode_header(tensor: torch.Tensor, *, device) -> torch.Tensor:
    if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
        raise ContractError(f"activation of shape {tuple(tensor.shape)} dtype {tensor.dtype} cannot be sent: at "
                            f"most {_MAX_DIMS} dims and a dtype in {_DTYPES}")
    values = [tensor.dim(), _DTYPES.index(tensor.dtype), *tensor.shape] + [0] * (_MAX_DIMS - tensor.dim())
    return torch.tensor(values, dtype=torch.int64, device=device or tensor.device)


def _decode_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = header.tolist()
    return tuple(values[2:2 + values[0]]), _DTYPES[values[1]]
