"""Every access to DeepSpeed's private state, in one file, behind one version check.

shardline drives DeepSpeed's ordinary engine per pipeline stage and relies on a few things DeepSpeed does not
document as API. Each is a function here, named after what it does for us:

- the gradient-norm flags DeepSpeed reads on parameters (``tensor_model_parallel``, ``partition_dim``,
  ``model_parallel``, ``ds_pipe_replicated``): :func:`set_norm_flags`, derived from the declared roles;
- ZeRO-1's gradient accumulation buffer (``param.grad_accum``): :func:`_zero_accumulator`;
- ZeRO-3's parameter coordinator (``optimizer.parameter_offload``, its forward pre-hook and its trace):
  :class:`Zero3PipelineSteps`;
- the engine's forward/backward with its gradient-accumulation scaling, as the pipeline engine's backend:
  :class:`DeepSpeedStageBackend`.

``TESTED`` is the DeepSpeed range these were checked against (the suite runs them); another version gets one
warning, since a private name may have moved.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from shardline.plugins.layers.roles import RoleKind, role_of
from shardline.plugins.pipeline.backend import StageBackend
from shardline.plugins.pipeline.partition import sync_tied_grads

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


def set_norm_flags(params: list[nn.Parameter], *, tp_rank: int, first_stage: bool, last_stage: bool,
                   tied: set[int] = frozenset()) -> None:
    """Mark ``params`` (one pipeline rank's) so DeepSpeed's global gradient norm counts each dense element once.

    DeepSpeed counts a parameter on every rank when it is "model parallel" and otherwise only on model-parallel
    rank 0 (tp x pp). So: a ``SHARDED`` parameter is model parallel (each TP rank holds a different slice); a
    replicated one on a later pipeline stage is marked model parallel on TP rank 0 only (it lives on no first
    stage, so model-parallel rank 0 would never count it); and the last stage's copy of a weight tied to the
    first stage (``tied``: ids of such parameters) is a pipeline replica, which the norm skips.
    """
    for param in params:
        role = role_of(param)
        if last_stage and id(param) in tied:
            param.ds_pipe_replicated = True
        if role.kind is RoleKind.SHARDED:
            param.tensor_model_parallel = True
            param.partition_dim = role.dim
            continue
        param.tensor_model_parallel = False
        param.partition_dim = -1
        if not first_stage and tp_rank == 0:
            param.model_parallel = True


def _zero_accumulator(param: nn.Parameter):
    """ZeRO-1's buffer of ``param``'s accumulated gradient (it moves each backward's gradient into
    ``grad_accum``); None where the gradient stays in ``param.grad``."""
    return getattr(param, "grad_accum", None)


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
        offload = engine.optimizer.parameter_offload
        offload.fwd_pre_hook.remove()
        self.coordinator = offload.get_param_coordinator()

    def end_batch(self) -> None:
        self.coordinator.reset_step()
        if not self.coordinator.is_invalid_trace():
            self.coordinator._invalidate_trace()


class DeepSpeedStageBackend(StageBackend):
    """The pipeline engine's backend under the strategy: every stage runs through one DeepSpeed engine.

    ``forward``: ``engine(x, stage)`` (the engine wraps a :class:`~shardline.plugins.lightning.stage_host.StageHost`),
    so ZeRO-3 gathers the stage's parameters and DeepSpeed's backward hooks attach to the output. ``backward``:
    ``engine.backward``, on the last stage the micro-batch loss (already ``/ m``) scaled for gradient accumulation,
    elsewhere ``(output * grad).sum()``, whose gradient with respect to the stage's parameters and input is
    exactly ``output.backward(grad)``. ``end_batch``: after a training batch, the gradients of weights tied across
    the first and last stage (``tied``, this rank's copies) are summed over ``embed_group`` in the buffer ZeRO
    accumulates them in; then ZeRO-3's coordinator closes its step (:class:`Zero3PipelineSteps`).
    """

    def __init__(self, engine, *, device, tied: list[nn.Parameter], embed_group, zero_stage: int):
        check_version()
        self.engine, self._device = engine, torch.device(device)
        self.tied, self.embed_group = tied, embed_group
        self._zero3 = Zero3PipelineSteps(engine) if zero_stage == 3 else None

    def forward(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        return self.engine(x, stage)

    def backward(self, stage: int, output: torch.Tensor, grad: torch.Tensor | None) -> None:
        if grad is None:  # the last stage's micro-batch loss, already divided by m
            self.engine.backward(output, scale_wrt_gas=True)
        else:
            self.engine.backward((output * grad).sum(), scale_wrt_gas=False)

    def end_batch(self, *, loss: torch.Tensor, forward_only: bool) -> None:
        if not forward_only:
            sync_tied_grads(self.tied, group=self.embed_group, buffer_of=_zero_accumulator)
        if self._zero3 is not None:
            self._zero3.end_batch()

    def device(self, stage: int) -> torch.device:
        return self._device
