"""The pipeline engine: runs one rank's validated schedule for one batch.

Contract. ``PipelineEngine(stages, schedule=..., pp_rank=..., loss_fn=...)`` owns the stage modules of one rank
(stage ``s`` for every ``s`` in ``schedule.stages_of_rank(pp_rank)``; each maps one tensor to one tensor). A call
``run_batch(inputs, targets)`` splits the batch along dim 0 into ``m = schedule.n_microbatches`` equal
micro-batches and executes exactly ``schedule.actions[pp_rank]``, nothing else:

- ``F`` on stage 0 reads micro-batch ``i`` of ``inputs``; on a later stage it reads the activation received by
  ``RA`` (or handed over locally when the previous stage is on this rank). The last stage applies
  ``loss_fn(output, targets_i)``. A forward-only schedule (``schedule.forward_only``: evaluation) keeps each
  output only until it is sent or handed over, and no input; run it under ``torch.no_grad()``.
- ``B`` back-propagates: on the last stage from ``loss_i / m`` (``LossReduction.MEAN``: the loss is a mean over
  the micro-batch, so ``sum_i grad(loss_i / m) = grad(mean over the batch)``) or ``loss_i`` (``SUM``), elsewhere
  from the gradient received by ``RG``. The stage's input, output and graph are dropped right after, so the
  activations held are exactly those in flight. Parameter gradients accumulate in ``.grad`` across micro-batches
  (the caller zeroes them between batches), so after the batch they equal the full-batch gradient.
- ``W`` (a zero-bubble schedule's split backward): for every (stage, micro-batch) its program has a W for, the
  engine runs that F and that B inside :func:`~shardline.plugins.layers.split_backward.deferring_weight_grads`
  with a store of its own, so the layers that split (:mod:`~shardline.plugins.layers.split_backward`) compute
  only the input gradient in B and push their weight-gradient work to the store; W runs it
  (``backend.weight``), accumulating into ``.grad`` through autograd. A module that does not split takes its
  whole backward in B and its W is empty. What the store keeps (each split layer's input and output gradient)
  lives until W: the pair counts as in flight from F until W (``EngineStats.peak_in_flight``, as
  :func:`~shardline.job.pipeline.simulate.simulate` counts it), and the memory meter counts those tensors.
  A stage's gradient accumulation boundary (``last`` in the hooks and the backend) is its final B or W,
  whichever comes later in the program.
- A run of consecutive send/recv actions is one op: its sends and receives are posted together (on NCCL as one
  ``batch_isend_irecv``, a NCCL group), then its receives are waited on; sends are waited on at the end of the
  batch. :func:`validate` proves this cannot deadlock even if sends block until received (see ``simulate``'s
  module docstring); the proof needs an op's sends never to wait on its receives, so an op that must first
  read an incoming shape header (below) posts its sends before that wait (on NCCL: its sends as one group,
  then, after the header, its receives as another). On gloo the engine posts to the process group itself and
  posts each receive as early as its shape allows (up to one beyond the current op's), in program order: see
  :mod:`~shardline.plugins.pipeline.p2p`, which also says why that keeps the proof and the message matching.
- Shapes travel: the first activation sent over each edge in a batch goes with a small header (ndim, dtype,
  dims), so the sequence length may change from batch to batch. Later micro-batches of the same batch reuse it
  (micro-batches of one batch have one shape; a stage whose outputs differ within a batch is an error). On
  NCCL the header goes first on ``meta_group`` (a gloo group over the same ranks) and the receiver posts the
  activation's receive once it has read it. On gloo (the pp group, tags keep it apart from the data) the
  receiver also posts, before the batch, a receive shaped like the previous batch's activation, and checks it
  against the header before use: an unchanged shape costs no round trip, a changed one is handled (p2p).
- Data-parallel gradient reduction is not the engine's job: the strategy above does it once per batch, at
  the ``last`` backward (or W) of each stage or in ``after_batch`` (see :class:`PipelineHooks`); tied weights are
  synced with :class:`~shardline.plugins.pipeline.partition.TiedWeight`.
- The batch loss (``mean`` or ``sum`` of the micro-batch losses) goes from the rank holding the last stage to
  every rank of the pp group (gloo: point to point, received into a receive posted before the batch; NCCL: a
  broadcast) and is returned on every rank as a float64 scalar.
- A batch that raised after it began to communicate may leave messages in flight; the engine then refuses to
  run another (``ContractError``) rather than let them meet the next batch's receives.

Every action runs inside ``record_function(pp_action_name(kind, stage=, microbatch=))``, each receive's wait
inside ``pp_action_name("wait", ...)``, the batch inside ``pp_batch_name(...)`` -- while a torch profiler is on,
or always with ``annotations="always"`` (:class:`Annotations` says why not always by default). The engine also
times each action itself (:class:`EngineStats`), which gives a measured bubble fraction without a profiler.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import profiler as autograd_profiler
from torch.profiler import record_function

from shardline.job.annotations import pp_batch_name
from shardline.job.pipeline.actions import ActionKind, Schedule
from shardline.job.pipeline.simulate import validate
from shardline.plugins.errors import ContractError, LayoutError, ScheduleError
from shardline.plugins.layers.split_backward import WeightGradStore, deferring_weight_grads
from shardline.plugins.pipeline.backend import AutogradBackend, StageBackend
from shardline.plugins.pipeline.engine_types import (  # re-exported: the engine's public vocabulary
    Annotations,
    EngineStats,
    LossReduction,
    MemoryAccounting,
    PipelineHooks,
    _enum,
)
from shardline.plugins.pipeline.memory import SavedTensorMeter
from shardline.plugins.pipeline.p2p import (
    DATA_TAG,
    HEADER_TAG,
    RECV_AHEAD,
    GlooLinks,
    Step,
    build_plan,
    decode_header,
    empty_header,
    encode_header,
)

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
_NO_ANNOTATION = nullcontext()


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
                 timeout_s: float = 300.0, backend: StageBackend | None = None,
                 annotations: Annotations | str = Annotations.WHEN_PROFILING):
        validate(schedule)
        if not isinstance(pp_rank, int) or not 0 <= pp_rank < schedule.n_ranks:
            raise LayoutError(f"pp_rank={pp_rank!r} outside 0..{schedule.n_ranks - 1} of schedule "
                              f"{schedule.name!r}")
        #: (stage, micro-batch) pairs whose backward is split (the program has a W for them).
        self._split_pairs = frozenset((a.stage, a.microbatch) for a in schedule.actions[pp_rank] if a.kind is W)
        self.schedule, self.pp_rank, self.loss_fn = schedule, pp_rank, loss_fn
        self._forward_only = schedule.forward_only  # a scan of every action: once, not per action
        self.stages = _as_stage_map(stages, schedule.stages_of_rank(pp_rank))
        self.group = group
        size = dist.get_world_size(group)
        if size != schedule.n_ranks:
            raise LayoutError(f"the pp group has {size} ranks but schedule {schedule.name!r} has "
                              f"n_ranks={schedule.n_ranks}")
        comm = dist.get_backend(group)
        if meta_group is None and comm != "gloo":
            raise ContractError(f"backend {comm!r} ignores message tags: pass meta_group, a gloo group over "
                                f"the same ranks, for the shape headers")
        self.meta_group = group if meta_group is None else meta_group
        self._meta_tag = HEADER_TAG if meta_group is None else 0
        self._meta_device = torch.device("cpu") if dist.get_backend(self.meta_group) == "gloo" else None
        if comm == "nccl":
            # torch requires every rank of a group in its first batch_isend_irecv (the NCCL communicator is
            # created there); a barrier creates it here instead, so construction is collective over the group.
            dist.barrier(group=group)
        self.loss_reduction = _enum(LossReduction, loss_reduction, "loss_reduction")
        self.memory = _enum(MemoryAccounting, memory, "memory")
        self._always_annotate = _enum(Annotations, annotations, "annotations") is Annotations.ALWAYS
        self.hooks = hooks or PipelineHooks()
        # How a stage is computed (forward, backward, end of batch): plain autograd by default; the strategy
        # passes its DeepSpeed backend (see pipeline.backend).
        self.backend = backend if backend is not None else AutogradBackend(self.stages)
        if not isinstance(self.backend, StageBackend):
            raise ContractError(f"backend={backend!r} must be a StageBackend")
        if self._split_pairs and not self.backend.runs_weight_actions:
            step, a = next((i, a) for i, a in enumerate(schedule.actions[pp_rank]) if a.kind is W)
            raise ScheduleError(f"rank {pp_rank}, step {step}: {a} is a split weight backward, but backend "
                                f"{type(self.backend).__name__} overrides backward and not weight, so it does not "
                                f"say how W runs (see StageBackend.weight)")
        if not timeout_s > 0:
            raise ContractError(f"timeout_s={timeout_s!r} must be > 0")
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._last_stage = schedule.n_stages - 1
        self._loss_rank = schedule.rank_of_stage(self._last_stage)
        self._plan = build_plan(schedule, pp_rank)
        self._batch_name = pp_batch_name(schedule.name, p=schedule.n_ranks, m=schedule.n_microbatches,
                                         v=schedule.n_chunks)
        # gloo: the engine's own transport (see p2p); other backends: batch_isend_irecv and a loss broadcast.
        self._links = None if comm != "gloo" else GlooLinks(
            group or dist.group.WORLD, plan=self._plan, loss_rank=self._loss_rank,
            has_last_stage=self._last_stage in self.stages, wait=self._wait)
        self._failed = False
        self._meter: SavedTensorMeter | None = None
        self.stats = EngineStats()
        #: The last batch's per-micro-batch losses (detached), on the rank holding the last stage; else empty.
        self.micro_losses: tuple[torch.Tensor, ...] = ()
        #: With ``keep_outputs = True``: the last batch's per-micro-batch outputs of the last stage (what
        #: ``loss_fn`` received, detached), on the rank holding it; else empty. Off by default: they cost memory.
        self.keep_outputs = False
        self.micro_outputs: tuple[torch.Tensor, ...] = ()

    # ---------------------------------------------------------------- the batch
    def run_batch(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Run one batch (inputs needed where stage 0 lives, targets where the last stage lives)."""
        if self._failed:
            raise ContractError(f"rank {self.pp_rank}: an earlier run_batch failed after posting messages, which "
                                f"may still be in flight and would meet this batch's receives; build a new engine")
        self._split_batch(inputs, targets)
        self._state: dict[str, dict] = {k: {} for k in ("input", "output", "grad", "recv", "meta_in",
                                                        "meta_out", "weight")}
        self._meta_sent: set[int] = set()
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._losses: list[torch.Tensor] = []
        self._outputs: list[torch.Tensor] = []
        self.stats = EngineStats(start_ns=time.perf_counter_ns())
        meter = None
        if self.memory is MemoryAccounting.SAVED_TENSORS:
            meter = SavedTensorMeter(self._resident_storages(inputs, targets))
        self._meter = meter
        with self._annotation(self._batch_name), ExitStack() as stack:
            # A batch that raises drops its activations and graphs at once (the posted sends' buffers stay in
            # _pending, which in-flight messages may still read).
            stack.callback(self._drop_state_if_failed)
            if meter is not None:
                stack.enter_context(meter)
            self.hooks.before_batch(n_microbatches=self.schedule.n_microbatches)
            self._failed = True  # until the batch's messages are all accounted for
            self.backend.begin_batch(forward_only=self._forward_only)
            if self._links is not None:
                self._links.begin(self._device_of)
            for compute, steps, n_recv in self._plan:
                if compute:
                    self._compute(steps[0])
                elif self._links is not None:
                    self._exchange(steps, n_recv)
                else:
                    self._exchange_coalesced(steps)
            loss = self._batch_loss()
            self._failed = False
            self.backend.end_batch(loss=loss, forward_only=self._forward_only)
            self.hooks.after_batch(loss=loss)
        self.stats.end_ns = time.perf_counter_ns()
        self.stats.peak_saved_bytes = None if meter is None else meter.peak_bytes
        self._state, self._meter = {}, None
        self.micro_losses, self.micro_outputs = tuple(self._losses), tuple(self._outputs)
        return loss

    def _drop_state_if_failed(self) -> None:
        if self._failed:
            self._state, self._losses, self._micro_in, self._micro_tgt = {}, [], None, None
            self._meter = None

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

    def _annotating(self) -> bool:
        """Whether to enter the annotations now (see :class:`Annotations`); asked per action, as a profiler may
        start between two."""
        # (A torch without the flag gets annotations always.)
        return self._always_annotate or getattr(autograd_profiler, "_is_profiler_enabled", True)

    def _annotation(self, name: str):
        return record_function(name) if self._annotating() else _NO_ANNOTATION

    def _annotations(self, steps) -> ExitStack:
        """One annotation per step, nested, entered together (an op's actions span its posting)."""
        stack = ExitStack()
        if self._annotating():
            for st in steps:
                stack.enter_context(record_function(st.name))
        return stack

    # ---------------------------------------------------------------- compute
    def _compute(self, step: Step) -> None:
        start = time.perf_counter_ns()
        with self._annotation(step.name):
            if step.kind is F:
                self._forward(step.stage, step.microbatch)
            elif step.kind is B:
                self._backward(step.stage, step.microbatch, last=step.last)
            else:
                self._weight(step.stage, step.microbatch, last=step.last)
        self.stats.records.append((step.kind.value, step.stage, step.microbatch, start, time.perf_counter_ns()))

    def _forward(self, s: int, mb: int) -> None:
        st = self._state
        evaluating = self._forward_only
        if s == 0:
            x = self._micro_in[mb]
        elif (s - 1) in self.stages:  # local hand-over (one rank hosting neighbouring stages)
            x = st["output"].pop((s - 1, mb)) if evaluating else st["output"][(s - 1, mb)].detach().requires_grad_()
        else:
            x = st["recv"].pop((s, mb))
        self.hooks.before_forward(stage=s, microbatch=mb)
        store = None
        if (s, mb) in self._split_pairs:
            meter = self._meter
            store = st["weight"][(s, mb)] = WeightGradStore(
                hold=None if meter is None else meter.hold, unhold=None if meter is None else meter.unhold)
        with deferring_weight_grads(store):
            out = self.backend.forward(s, x)
            if s == self._last_stage:
                loss = self.loss_fn(out, self._micro_tgt[mb])
        if s == self._last_stage:
            self._losses.append(loss.detach())
            if self.keep_outputs:
                self._outputs.append(out.detach())
            out = loss / self.schedule.n_microbatches if self.loss_reduction is LossReduction.MEAN else loss
        if not evaluating:
            st["input"][(s, mb)] = x
        if not (evaluating and s == self._last_stage):  # an evaluation keeps an output only until it is sent
            st["output"][(s, mb)] = out
        meta = st["meta_out"].setdefault(s, (out.shape, out.dtype, out.device))
        if meta[0] != out.shape or meta[1] != out.dtype:
            raise ContractError(f"stage {s} output {tuple(out.shape)} {out.dtype} for micro-batch {mb}, but "
                                f"{tuple(meta[0])} {meta[1]} for an earlier one: the micro-batches of one batch "
                                f"must have one shape (one header per batch describes them)")
        # In flight: forwarded and not yet through its backward (B, or W for a split pair).
        held = len(st["output"]) + sum(key not in st["output"] for key in st["weight"])
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, held)
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
        # A split pair's B runs in the mode too: an activation-checkpointed block recomputes the graph its F built.
        with deferring_weight_grads(st["weight"].get((s, mb))):
            self.backend.backward(s, out, grad, last=last)
        del out  # the graph and its saved activations go now, not at the end of the batch
        if s > 0:  # an input the output does not depend on gets a zero gradient, not None
            st["grad"][(s, mb)] = x.grad if x.grad is not None else torch.zeros_like(x)
        self.hooks.after_backward(stage=s, microbatch=mb, last=last)

    def _weight(self, s: int, mb: int, *, last: bool) -> None:
        """W: the weight gradients its B left in the pair's store (nothing for modules that do not split)."""
        store = self._state["weight"].pop((s, mb))
        self.hooks.before_weight(stage=s, microbatch=mb, last=last)
        self.backend.weight(s, store, last=last)
        del store  # what W held (inputs, output gradients) goes now
        self.hooks.after_weight(stage=s, microbatch=mb, last=last)

    # ---------------------------------------------------------------- communication
    def _exchange(self, steps: tuple[Step, ...], n_recv: int) -> None:
        """gloo: post the op's sends, then its receives (in program order, some posted earlier), waiting for a
        lead header only after the sends (the peer may need them to produce it), post receives ahead where
        shapes allow, then wait for the op's receives."""
        links, records = self._links, self.stats.records
        with self._annotations(st for st in steps if st.is_send):
            start = time.perf_counter_ns()
            for st in steps:
                if st.is_send:
                    links.send(st, self._send_buffer(st), self._pending)
            end = time.perf_counter_ns()
            records += [(st.kind.value, st.stage, st.microbatch, start, end) for st in steps if st.is_send]
        for st in steps:
            if st.is_recv and st.lead:
                start = time.perf_counter_ns()
                with self._annotation(st.wait_name):
                    shape, dtype = links.resolve_lead(st, self._device_of(st.stage))
                records.append(("wait", st.stage, st.microbatch, start, time.perf_counter_ns()))
                self._state["meta_in"][st.stage] = (shape, dtype, self._device_of(st.stage))
        with self._annotations(st for st in steps if st.is_recv):
            start = time.perf_counter_ns()
            links.post_recvs(n_recv, self._recv_buffer)
            links.post_recvs(n_recv + RECV_AHEAD, self._recv_buffer, ahead=True)
            end = time.perf_counter_ns()
            records += [(st.kind.value, st.stage, st.microbatch, start, end) for st in steps if st.is_recv]
        for st in steps:
            if st.is_recv:
                self._wait_recv(st, *links.take(st))

    def _exchange_coalesced(self, steps: tuple[Step, ...]) -> None:
        """Other backends: shape headers, then the op as one batch_isend_irecv, then wait its receives.

        An op that must wait for an incoming shape header and also sends posts its sends (one group) before
        that wait and its receives (another group) after it: the peer may need this op's sends to produce the
        header (validate's proof assumes an op's sends never wait on its receives).
        """
        self._send_headers(steps)
        waits_header = any(st.kind is ActionKind.RECV_ACT and st.stage not in self._state["meta_in"]
                           for st in steps)
        if waits_header and any(st.is_send for st in steps):
            self._post_coalesced(tuple(st for st in steps if st.is_send))
            self._recv_headers(steps)
            self._post_coalesced(tuple(st for st in steps if st.is_recv))
        else:
            self._recv_headers(steps)
            self._post_coalesced(steps)

    def _post_coalesced(self, steps: tuple[Step, ...]) -> None:
        """The steps as one batch_isend_irecv; sends left pending, receives waited."""
        with self._annotations(steps):
            start = time.perf_counter_ns()
            tensors = [self._recv_buffer(st, True) if st.is_recv else self._send_buffer(st) for st in steps]
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend if st.is_send else dist.irecv, t, group=self.group, group_peer=st.peer,
                           tag=DATA_TAG) for st, t in zip(steps, tensors)])
            end = time.perf_counter_ns()
            self.stats.records.extend((st.kind.value, st.stage, st.microbatch, start, end) for st in steps)
        for st, tensor, work in zip(steps, tensors, works):
            if st.is_send:
                self._pending.append((work, tensor))  # keeps the buffer alive until the send completes
            else:
                self._wait_recv(st, work, tensor)

    def _wait_recv(self, st: Step, work: dist.Work, tensor: torch.Tensor) -> None:
        start = time.perf_counter_ns()
        with self._annotation(st.name), self._annotation(st.wait_name):
            self._wait(work, st.what)
        self.stats.records.append(("wait", st.stage, st.microbatch, start, time.perf_counter_ns()))
        if st.kind is ActionKind.RECV_ACT:
            tensor.requires_grad_(tensor.is_floating_point())
        self._state["recv"][(st.stage, st.microbatch)] = tensor

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait with a deadline: a validated schedule cannot deadlock, so a timeout means the ranks disagree."""
        try:
            work.wait(timeout=self._timeout)
        except RuntimeError as exc:
            raise ScheduleError(f"rank {self.pp_rank} waited more than {self._timeout.total_seconds():g} s for "
                                f"{what} (schedule {self.schedule.name!r}): the ranks are not running the same "
                                f"schedule, or a peer failed ({exc})") from exc

    def _send_buffer(self, st: Step) -> torch.Tensor:
        """The tensor a send reads."""
        if st.kind is ActionKind.SEND_ACT:
            outputs = self._state["output"]
            key = (st.stage, st.microbatch)
            # A forward-only schedule has no backward to keep it for: the pending send holds the buffer.
            out = outputs.pop(key) if self._forward_only else outputs[key]
            return out.detach().contiguous()
        return self._state["grad"].pop((st.stage, st.microbatch)).contiguous()

    def _recv_buffer(self, st: Step, required: bool) -> torch.Tensor | None:
        """The tensor a receive fills; None where its shape is not known yet and not ``required``."""
        # RECV_ACT: shaped as the header said; RECV_GRAD: like this stage's output (one shape per stage within
        # a batch).
        meta = self._state["meta_in" if st.kind is ActionKind.RECV_ACT else "meta_out"].get(st.stage)
        if meta is None:
            if not required:
                return None
            raise ScheduleError(f"rank {self.pp_rank}: {st.action} is posted before stage {st.stage} ran any "
                                f"forward in this batch, so the gradient's shape is unknown")
        return torch.empty(meta[0], dtype=meta[1], device=meta[2])

    def _send_headers(self, steps: tuple[Step, ...]) -> None:
        """Shape headers of the first activation each stage sends in this batch."""
        state = self._state
        for st in steps:
            if st.kind is ActionKind.SEND_ACT and st.stage not in self._meta_sent:
                self._meta_sent.add(st.stage)
                header = encode_header(state["output"][(st.stage, st.microbatch)], device=self._meta_device)
                work = dist.isend(header, group=self.meta_group, group_dst=st.peer, tag=self._meta_tag)
                self._pending.append((work, header))

    def _recv_headers(self, steps: tuple[Step, ...]) -> None:
        """Shape headers of the first activation each stage receives in this batch (waited here)."""
        state = self._state
        for st in steps:
            if st.kind is ActionKind.RECV_ACT and st.stage not in state["meta_in"]:
                header = empty_header(self._meta_device)
                start = time.perf_counter_ns()
                with self._annotation(st.wait_name):
                    work = dist.irecv(header, group=self.meta_group, group_src=st.peer, tag=self._meta_tag)
                    self._wait(work, f"the shape header of {st.action} from rank {st.peer}")
                self.stats.records.append(("wait", st.stage, st.microbatch, start, time.perf_counter_ns()))
                state["meta_in"][st.stage] = (*decode_header(header), self._device_of(st.stage))

    def _device_of(self, stage: int) -> torch.device:
        return self.backend.device(stage)

    # ---------------------------------------------------------------- loss
    def _batch_loss(self) -> torch.Tensor:
        """Wait for this batch's sends and return the batch loss (float64, on every rank of the pipeline)."""
        links, n_ranks = self._links, self.schedule.n_ranks
        device = self._device_of(next(iter(self.stages)))
        if self._last_stage in self.stages:
            total = torch.stack([x.to(torch.float64) for x in self._losses]).sum()
            loss = total / len(self._losses) if self.loss_reduction is LossReduction.MEAN else total
            if links is not None:
                links.send_loss(loss, n_ranks, self.pp_rank, self._pending)
        elif links is not None:
            loss = None
        else:
            loss = torch.zeros((), dtype=torch.float64, device=device)
        for work, _ in self._pending:
            self._wait(work, "the sends of this batch to complete")
        if loss is None:
            loss = links.receive_loss().to(device)
        elif links is None and n_ranks > 1:
            dist.broadcast(loss, group=self.group, group_src=self._loss_rank)
        return loss
