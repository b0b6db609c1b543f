"""Every access to DeepSpeed's private state, in one file, behind one version check.

shardline drives DeepSpeed's ordinary engine per pipeline stage and relies on a few things DeepSpeed does not
document as API. Each is a function here, named after what it does for us:

- the gradient-norm flags DeepSpeed reads on parameters (``tensor_model_parallel``, ``partition_dim``,
  ``model_parallel``): :func:`set_norm_flags`, derived from the declared roles;
- a ZeRO-3 partitioned weight's whole shape (``ds_shape``, ``ds_id``) and gathering it, for weights tied across
  the first and last stage: :class:`TiedAcrossStages`;
- ZeRO-3's parameter coordinator (``optimizer.parameter_offload``, its forward pre-hook and its trace):
  :class:`Zero3PipelineSteps`;
- the engine's forward/backward with its gradient-accumulation scaling, as the pipeline engine's backend:
  :class:`DeepSpeedStageBackend`;
- the torch backend's shared-memory inference all-reduce op, not built on CPU: :func:`without_shm_comm_op`.

``TESTED`` is the DeepSpeed range these were checked against (the suite runs them); another version gets one
warning, since a private name may have moved.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings

import torch
import torch.distributed as dist
from torch import nn

from shardline.job.annotations import comm_name
from shardline.plugins.errors import ContractError
from shardline.plugins.layers.roles import RoleKind, role_of
from shardline.plugins.pipeline.backend import StageBackend
from shardline.plugins.torch_compat import is_view, parameter_table

#: DeepSpeed versions whose private state this file was checked against (the package admits the same range).
TESTED = ((0, 19, 8), (0, 20, 0))
_warned = False


def check_version() -> None:
    """Warn once when the installed DeepSpeed is outside ``TESTED``."""
    global _warned
    import deepspeed

    parts = tuple(int(p) for p in deepspeed.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    if not _warned and not TESTED[0] <= parts < TESTED[1]:
        _warned = True
        warnings.warn(f"DeepSpeed {deepspeed.__version__} is outside the versions shardline's pipeline and gradient-"
                      f"norm integration was tested with ({'.'.join(map(str, TESTED[0]))} up to "
                      f"{'.'.join(map(str, TESTED[1]))}); see shardline.plugins.lightning.deepspeed_compat",
                      stacklevel=2)


@contextlib.contextmanager
def without_shm_comm_op():
    """While DeepSpeed's torch backend is created, build no shared-memory all-reduce op.

    ``deepspeed.comm.torch.TorchBackend`` builds ``deepspeed_shm_comm`` (a C++ op compiled on first use, and a line
    printed on every rank) for ``inference_all_reduce`` alone, which neither shardline nor ZeRO's training path
    calls: their collectives go to ``torch.distributed``. The backend treats a missing op as "use the process
    group", which is what happens anyway. Private: ``deepspeed.comm.torch.build_shm_op`` (a module function);
    where it is absent, nothing changes."""
    try:  # by name: the attribute deepspeed.comm.torch is the torch package itself
        ds_torch = importlib.import_module("deepspeed.comm.torch")
    except ImportError:
        yield
        return
    original = getattr(ds_torch, "build_shm_op", None)
    if original is None:
        yield
        return
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = original


def set_norm_flags(params: list[nn.Parameter], *, tp_rank: int, first_stage: bool) -> None:
    """Mark ``params`` (one pipeline rank's) so DeepSpeed's global gradient norm counts each dense element once.

    DeepSpeed counts a parameter on every rank when it is "model parallel" and otherwise only on model-parallel
    rank 0 (tp x pp). So: a ``SHARDED`` parameter is model parallel (each TP rank holds a different slice); a
    replicated one on a later pipeline stage is marked model parallel on TP rank 0 only (it lives on no first
    stage, so model-parallel rank 0 would never count it). A weight tied across the first and last stage is a
    parameter of the first stage only (:class:`TiedAcrossStages`), so it is counted there, once.
    """
    for param in params:
        role = role_of(param)
        if role.kind is RoleKind.SHARDED:
            param.tensor_model_parallel = True
            param.partition_dim = role.dim
            continue
        param.tensor_model_parallel = False
        param.partition_dim = -1
        if not first_stage and tp_rank == 0:
            param.model_parallel = True


class Zero3PipelineSteps:
    """ZeRO-3 under a pipeline: one step of the parameter coordinator per batch, closed on every rank.

    The coordinator assumes one forward of the whole model per step, the same on every rank: a pre-hook on the
    top module closes the step and checks, by a world-wide broadcast, that every rank recorded the same module
    order. Under a pipeline each micro-batch runs one stage's forward, at different times on different ranks,
    with different modules, and that check deadlocks. So the hook is dropped, the coordinator stays in its
    no-trace mode (it fetches each module's parameters on demand, without prefetch), and :meth:`end_batch`
    closes its step once per batch, at the same point on every rank.
    """

    def __init__(self, engine) -> None:
        check_version()
        # Training: the ZeRO-3 optimizer holds the coordinator's owner; inference (``validate``/``test`` with
        # no optimizer): DeepSpeed's "optimizer" is that owner itself.
        offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
        offload.fwd_pre_hook.remove()
        self.coordinator = offload.get_param_coordinator()

    def end_batch(self) -> None:
        self.coordinator.reset_step()
        if not self.coordinator.is_invalid_trace():
            self.coordinator._invalidate_trace()


class TiedAcrossStages:
    """Weights tied across the first and the last pipeline stage (input embedding and output head) under any
    ZeRO stage, with or without offload.

    ZeRO-2 and ZeRO-3 reduce each micro-batch's gradient during its backward, into a partition of the stage's
    own flattened parameters, so the two stages' copies cannot be summed after the batch (ZeRO-1 could) and the
    partitions of the two stages do not line up. So the weight is a parameter of the first stage only: DeepSpeed
    optimises and partitions it there, and the gradient norm counts it there, once. On the last stage its place
    in the hosted layers is taken by a *shadow*, a plain leaf tensor that DeepSpeed never sees (set up by
    :meth:`shadow` before ``deepspeed.initialize``):

    - before a batch after an optimizer step (and before the first), the first stage sends the weight (gathered
      when ZeRO-3 partitions it) to the shadow over the ``embed`` group (:meth:`begin_batch`);
    - the shadow accumulates its gradient by plain autograd over the batch's micro-batches; after the last
      stage's final backward it goes to the first stage (:meth:`after_last_backward`);
    - the first stage adds it to the weight's gradient in its final micro-batch backward, through a tensor
      hook that runs before ZeRO's gradient hooks (:meth:`final_backward`), so ZeRO reduces the sum of both
      uses. Summation is linear, so that equals summing per micro-batch.

    Both gradients are in the same scale: fp16 loss scaling (a per-engine scale) is refused under pp > 1 by
    the strategy, and bf16/fp32 scale nothing.

    ``first``: on the first stage's rank, its tied parameters; ``shadows``: on the last stage's rank, one
    shadow per tied parameter, in the same order (the order of the model's parameters on both ranks).
    """

    def __init__(self, *, group, peer: int, first: list[nn.Parameter] | None = None,
                 shadows: list[torch.Tensor] | None = None, holders=None):
        if (first is None) == (shadows is None):
            raise ContractError("TiedAcrossStages is built with the first stage's weights or the last's shadows")
        self.group, self.peer = group, peer
        self.first, self.shadows = first, shadows
        self._holders = holders or []  # (module, attribute name, index into shadows) for re-allocating
        self._stale = True  # the shadow has never been filled
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []  # a send and the buffer it reads

    @classmethod
    def shadow(cls, layers: list[nn.Module], tied: list[nn.Parameter], *, group, peer: int) -> TiedAcrossStages:
        """On the last stage's rank: take every tied parameter out of the hosted ``layers`` and put a shadow of
        its shape in its place (an attribute of the same name, so the layer's ``forward`` reads it as before)."""
        shadows, holders = [], []
        index = {id(p): i for i, p in enumerate(tied)}
        for param in tied:
            shape = tuple(getattr(param, "ds_shape", param.shape))  # ZeRO-3 has partitioned it already
            shadows.append(torch.zeros(shape, dtype=param.dtype, device=param.device, requires_grad=True))
        for layer in layers:
            for module in layer.modules():
                table = parameter_table(module)
                for name, param in list(table.items()):
                    if param is not None and id(param) in index:
                        del table[name]
                        setattr(module, name, shadows[index[id(param)]])
                        holders.append((module, name, index[id(param)]))
        return cls(group=group, peer=peer, shadows=shadows, holders=holders)

    def place(self, engine, device: torch.device) -> None:
        """After ``deepspeed.initialize``: give the shadows the dtype and device the parameters have now (the
        precision plugin and DeepSpeed cast them after the shadows were made)."""
        if self.shadows is None:
            return
        now = next((p.dtype for p in engine.module.parameters() if p.is_floating_point()), None)
        for i, old in enumerate(self.shadows):
            dtype = now or old.dtype
            if old.dtype != dtype or old.device != device:
                self.shadows[i] = torch.zeros(old.shape, dtype=dtype, device=device, requires_grad=True)
        for module, name, i in self._holders:
            setattr(module, name, self.shadows[i])

    def _gathered(self):
        """The first stage's weights whole for the duration (ZeRO-3 partitions them)."""
        if any(hasattr(p, "ds_id") for p in self.first):
            import deepspeed

            return deepspeed.zero.GatheredParameters(self.first, modifier_rank=None)
        return contextlib.nullcontext()

    def begin_batch(self) -> None:
        """Fill the shadows from the first stage's weights when an optimizer step may have changed them."""
        if not self._stale:
            return
        self._stale = False
        with torch.profiler.record_function(comm_name("embed", "broadcast")):
            if self.first is not None:
                me = dist.get_rank()
                with self._gathered(), torch.no_grad():
                    for weight in self.first:
                        dist.broadcast(weight.data, src=me, group=self.group)
            else:
                with torch.no_grad():
                    for shadow in self.shadows:
                        dist.broadcast(shadow.data, src=self.peer, group=self.group)

    def after_last_backward(self) -> None:
        """Last stage: send the shadows' accumulated gradients to the first stage."""
        for shadow in self.shadows:
            grad = (shadow.grad if shadow.grad is not None else torch.zeros_like(shadow)).contiguous()
            self._pending.append((dist.broadcast(grad, src=dist.get_rank(), group=self.group, async_op=True), grad))

    @contextlib.contextmanager
    def final_backward(self):
        """First stage: receive the last stage's gradients and add them to the weights' gradients of the
        backward run inside this context (the stage's final one of the batch)."""
        received = []
        with torch.profiler.record_function(comm_name("embed", "broadcast")):
            for weight in self.first:
                shape = tuple(getattr(weight, "ds_shape", weight.shape))
                buf = torch.empty(shape, dtype=weight.dtype, device=weight.device)
                dist.broadcast(buf, src=self.peer, group=self.group)
                received.append(buf)
        handles = [weight.register_hook(lambda grad, extra=extra: grad + extra.to(grad.dtype))
                   for weight, extra in zip(self.first, received, strict=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def end_batch(self) -> None:
        """After a training batch: the sends are done, the shadows' gradients cleared, the shadows stale (the
        optimizer step comes next)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []
        if self.shadows is not None:
            for shadow in self.shadows:
                shadow.grad = None
        self._stale = True


class DeepSpeedStageBackend(StageBackend):
    """The pipeline engine's backend under the strategy: every stage runs through one DeepSpeed engine.

    ``forward``: ``engine(x, stage)`` (the engine wraps a :class:`~shardline.plugins.lightning.stage_host.StageHost`),
    so ZeRO-3 gathers the stage's parameters and DeepSpeed's backward hooks attach to the output. ``backward``:
    ``engine.backward``, on the last stage the micro-batch loss (already ``/ m``) scaled for gradient accumulation,
    elsewhere ``(output * grad).sum()``, whose gradient with respect to the stage's parameters and input is
    exactly ``output.backward(grad)``. Weights tied across the first and last stage (``tied``) are exchanged
    around the batch by :class:`TiedAcrossStages`: the weights before it, the last stage's gradient into the first
    stage's final backward. ``end_batch``: ZeRO-3's coordinator closes its step (:class:`Zero3PipelineSteps`).
    """

    def __init__(self, engine, *, device, tied: TiedAcrossStages | None, first_stage: int, last_stage: int,
                 zero_stage: int):
        check_version()
        self.engine, self._device = engine, torch.device(device)
        self.tied, self._first, self._last = tied, first_stage, last_stage
        if tied is not None:
            tied.place(engine, self._device)
        self._zero3 = Zero3PipelineSteps(engine) if zero_stage == 3 else None

    def begin_batch(self, *, forward_only: bool) -> None:
        if self.tied is not None:
            self.tied.begin_batch()

    def forward(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        return self.engine(x, stage)

    def backward(self, stage: int, output: torch.Tensor, grad: torch.Tensor | None, *, last: bool) -> None:
        exchange = self.tied is not None and last
        context = (self.tied.final_backward() if exchange and stage == self._first and self.tied.first
                   else contextlib.nullcontext())
        with context:
            if grad is None:  # the last stage's micro-batch loss, already divided by m
                self.engine.backward(output, scale_wrt_gas=True)
            else:
                self.engine.backward((output * grad).sum(), scale_wrt_gas=False)
        if exchange and stage == self._last and self.tied.shadows:
            self.tied.after_last_backward()

    def end_batch(self, *, loss: torch.Tensor, forward_only: bool) -> None:
        if self.tied is not None and not forward_only:
            self.tied.end_batch()
        if self._zero3 is not None:
            self._zero3.end_batch()

    def device(self, stage: int) -> torch.device:
        return self._device


# --- checkpoints: the optimizer's own counters ------------------------------------------------------------------
# Weights and optimizer moments go through DeepSpeed's public per-parameter accessors
# (``deepspeed.utils.safe_get_full_fp32_param`` and friends); only the base optimizer's step count and its state
# keys live on the wrapped torch optimizer, which DeepSpeed's ZeRO optimizers hold as ``.optimizer``.

def base_optimizer(ds_optimizer) -> torch.optim.Optimizer | None:
    """The torch optimizer doing the update: the one DeepSpeed's ZeRO/bf16 optimizer wraps, or the client's own
    optimizer itself (ZeRO-0 in float32)."""
    if ds_optimizer is None:
        return None
    inner = getattr(ds_optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    return ds_optimizer if isinstance(ds_optimizer, torch.optim.Optimizer) else None


def optimizer_state_keys(ds_optimizer) -> list[str]:
    """The per-element state tensors the optimizer keeps (Adam: ``exp_avg``, ``exp_avg_sq``); empty before the
    first step of an optimizer that creates its state lazily."""
    base = base_optimizer(ds_optimizer)
    keys: set[str] = set()
    for state in (base.state.values() if base is not None else ()):
        keys |= {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() >= 1}
    return sorted(keys)


def optimizer_step_count(ds_optimizer) -> int | None:
    """The optimizer's ``step`` (the same for every parameter it has updated); None before any step."""
    base = base_optimizer(ds_optimizer)
    steps = [state["step"] for state in (base.state.values() if base is not None else ()) if "step" in state]
    return int(max(float(s) for s in steps)) if steps else None


def set_optimizer_step_count(ds_optimizer, step: int) -> None:
    base = base_optimizer(ds_optimizer)
    for state in (base.state.values() if base is not None else ()):
        if "step" in state:
            old = state["step"]
            state["step"] = torch.full_like(old, step) if isinstance(old, torch.Tensor) else step


def ensure_optimizer_state(ds_optimizer, keys: list[str]) -> None:
    """Make the optimizer hold its state before any step, so a checkpoint's ``keys`` (Adam: ``exp_avg``,
    ``exp_avg_sq``) can be set into it. DeepSpeed 0.19's ZeRO optimizers, like torch's Adam, create it at the
    first step, keyed by their flat float32 partitions (ZeRO-1/2: ``single_partition_of_fp32_groups``, ZeRO-3:
    ``fp32_partitioned_groups_flat``, bf16: ``fp32_groups_flat_partition``), and ZeRO-1/2 only then link each
    parameter's fragment of it (``_lazy_init_hp_params_optimizer_state``). Zeros and step 0 are what the first
    step starts from; the checkpoint then overwrites every value, the step count included."""
    base = base_optimizer(ds_optimizer)
    if base is None:
        return
    flats = None
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        flats = getattr(ds_optimizer, name, None)
        if flats is not None:
            break
    if flats is None:
        return  # ZeRO-0 in float32: the torch optimizer's own parameters, given state one by one on load
    for flat in flats:
        if flat is not None and flat not in base.state:
            base.state[flat] = {"step": torch.tensor(0.0), **{k: torch.zeros_like(flat) for k in keys}}
    link = getattr(ds_optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if callable(link):
        link()


# --- checkpoints: this rank's own fragment of a parameter, without a collective --------------------------------
# ZeRO-3 has public per-parameter local accessors (``safe_get_local_fp32_param`` and friends). ZeRO-1/2 and the
# bf16 optimizer have only the full ones, which all-reduce the whole parameter over the data-parallel group; their
# per-parameter fragment is ``param._hp_mapping`` (the same object those accessors read): its
# ``lp_fragment_address`` says where the fragment sits in the flattened parameter.

def whole_shape(param) -> tuple[int, ...]:
    """The rank's whole shape of ``param``: ZeRO-3 keeps a partition and records the shape as ``ds_shape``."""
    return tuple(getattr(param, "ds_shape", param.shape))


def zero3_partitioned(param) -> bool:
    return hasattr(param, "ds_id")


def has_optimizer_view(param) -> bool:
    """Whether DeepSpeed's per-parameter accessors see ``param`` (a ZeRO-1/2/bf16 fragment mapping or a ZeRO-3
    optimizer)."""
    return hasattr(param, "_hp_mapping") or hasattr(param, "_z3_optimizer")


def on_nvme(param) -> bool:
    """A ZeRO-3 parameter whose partition lives on NVMe (swapped: set it through a gather, not in place)."""
    return str(getattr(getattr(param, "ds_tensor", None), "final_location", "")).endswith("nvme")


def local_fragment(param, key: str | None = None) -> tuple[int, torch.Tensor] | None:
    """``(start, values)``: the elements ``[start, start + len(values))`` of the flattened parameter (its
    tensor-parallel part) that this rank's ZeRO partition holds, of the float32 master (``key`` None) or of
    optimizer state ``key``; ``values`` is empty where this rank holds none of it. None when the parameter is not
    partitioned (ZeRO-0 in float32, a frozen parameter, ZeRO-3's inference engine): use its whole value."""
    if not getattr(param, "requires_grad", False):
        return None
    if hasattr(param, "ds_id"):
        if not hasattr(param, "_z3_optimizer"):
            return None
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        values = safe_get_local_fp32_param(param) if key is None else safe_get_local_optimizer_state(param, key)
        start, stop = zero3_partition_range(param)
        return start, values.reshape(-1)[:stop - start]
    if not hasattr(param, "_hp_mapping"):
        return None
    mapping = param._hp_mapping
    if mapping is None:
        return 0, torch.empty(0)
    return mapping.lp_fragment_address.start, mapping.get_hp_fragment(key).reshape(-1)


def set_local_fragment(param, values: torch.Tensor, key: str | None = None) -> None:
    """Set what :func:`local_fragment` returned (same start and length) from ``values``."""
    if hasattr(param, "ds_id"):
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        live = _zero3_local_view(param, key)
        if live is not None:  # one copy, into DeepSpeed's own partition; its padding past the end zeroed
            flat = live.data.reshape(-1)
            with torch.no_grad():
                flat[:values.numel()].copy_(values.reshape(-1))
                flat[values.numel():].zero_()
            return
        full = torch.zeros(param.ds_tensor.numel(), dtype=torch.float32)
        full[:values.numel()] = values.to(torch.float32)
        full = full.to(param.ds_tensor.device)
        if key is None:
            safe_set_local_fp32_param(param, full)
        else:
            safe_set_local_optimizer_state(param, full, key)
        return
    mapping = param._hp_mapping
    if mapping is not None:
        fragment = mapping.get_hp_fragment(key)
        fragment.data.copy_(values.to(fragment.dtype).reshape(fragment.shape))


def _zero3_local_view(param, key: str | None) -> torch.Tensor | None:
    """The tensor ZeRO-3's local accessor returns for ``param`` (its float32 master partition, or optimizer state
    ``key``) where it is a view of the optimizer's own flat partition, so writing it sets the value; None where
    it is not: optimizer state swapped to NVMe (the accessor's buffer is released after the call) or a copy on
    another device (the accessor moves the value to the accelerator)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    if getattr(param._z3_optimizer, "swap_optimizer", False):
        return None
    value = safe_get_local_fp32_param(param) if key is None else safe_get_local_optimizer_state(param, key)
    if value is None or not is_view(value) or value.numel() != param.ds_tensor.numel():
        return None
    return value


def zero3_partition_range(param) -> tuple[int, int]:
    """The elements ``[start, stop)`` of a ZeRO-3 parameter's flattened value this rank's partition holds (the
    last rank's partition is padded past the end)."""
    size = param.ds_tensor.numel()
    start = dist.get_rank(group=param.ds_process_group) * size
    return min(start, param.ds_numel), min(start + size, param.ds_numel)


def set_zero3_weight_partition(param, values: torch.Tensor) -> None:
    """The module's own (low-precision) ZeRO-3 partition of ``param`` from ``values`` (the elements of
    :func:`zero3_partition_range`); the padding past the end stays as it is."""
    with torch.no_grad():
        param.ds_tensor.data.reshape(-1)[:values.numel()].copy_(values.to(param.ds_tensor.dtype).reshape(-1))
