"""Split backward: the input gradient now (B), the weight gradients later (W), for the zero-bubble schedules.

A layer's backward has two halves. ``B`` computes the gradient of the layer's input, which the previous pipeline
stage waits for; ``W`` computes the gradients of the layer's weights, which nothing downstream waits for, so a
schedule can run it later to fill a bubble (Qi et al., 2024). Every layer shardline builds with a weight GEMM or
lookup computes both halves through the functions here:

- :func:`linear` (``y = x A^T + b``: the column/row-parallel linears, the fused projections, the head):
  B is ``dx = dy A``; W is ``dA = dy^T x`` and ``db = sum dy`` over the tokens.
- :func:`add_bias` (``y + b``, the row-parallel bias added after the sum): B passes ``dy`` through; W is
  ``db = sum dy``.
- :func:`embedding` (``E[ids]``, the vocab-parallel embedding): B has nothing to compute (ids have no gradient);
  W is the scatter-add of ``dy`` into ``dE``'s rows.

Split mode. Inside :func:`deferring_weight_grads` (``with deferring_weight_grads(store):``), a forward through one
of these functions records that its weight gradients go to ``store``, a :class:`WeightGradStore`; its backward then
computes the input gradient only and pushes the weight-gradient work, with the two tensors it reads (the layer's
input and its output gradient), into the store. ``store.run()`` (W) computes them and accumulates them into each
parameter's ``.grad`` *through autograd* (``torch.autograd.backward`` with the parameters as roots), so every
gradient hook a parameter carries (a data-parallel engine's reduction, ``register_post_accumulate_grad_hook``)
fires at W, once per parameter and W, and never at B. The mode in force when the *forward* ran decides: the
pipeline engine runs a micro-batch's F (and its B, so that an activation-checkpointed block recomputes the same
graph) inside the mode for every (stage, micro-batch) its schedule has a W for. Outside the mode each function is
the plain torch op (``F.linear``, ``+``, ``F.embedding``): no behaviour change for a run without W actions.

Which parameters split. A parameter is deferred only when it is a leaf that requires grad; a weight computed in
the forward (the replicated-head K/V rows of :class:`~.tp_fused.FusedColumnParallelLinear`, all-gathered from the
parameters' shards each forward) takes its whole gradient in B. Norm weights (LayerNorm, RMSNorm), learned
positions and rotary tables are not split either (their gradients are elementwise products, not GEMMs), nor is any
module of the user's own: their whole backward runs in B and W holds nothing for them. That is correct, just less
of the bubble filled.

Megatron-SP. A column-parallel linear's input is the sequence all-gathered over the TP group. W uses that gathered
input as the forward kept it (autograd already saves the gathered tensor for the unsplit backward, so keeping it
until W costs no extra copy, only a longer life), and does not gather it again: a re-gather would put a TP
collective inside W, the action meant to fill idle time with local compute, and every TP rank would have to reach
its W at the same time for it. The row-parallel linear's input is already local (``[b, s, in/n]``), and its
output gradient arrives all-gathered from the reduce-scatter's backward, which stays in B.

Memory. Between B and W the store holds, per split linear, its input and its output gradient: less than the
whole saved graph (activations of nonlinearities, attention, norms are freed at B) but more than nothing. A store
built with ``hold`` (the engine passes :class:`~shardline.plugins.pipeline.memory.SavedTensorMeter.hold` when it
measures) registers each kept tensor there, so measured activation memory counts what W still holds.

No process group, no Lightning, no DeepSpeed here: torch only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from shardline.plugins.errors import ContractError

__all__ = ["WeightGradStore", "deferring_weight_grads", "active_store", "linear", "add_bias", "embedding"]


class WeightGradStore:
    """The deferred weight-gradient work of one (stage, micro-batch): filled by the backward (B), run by W.

    ``push(params, compute, *tensors)``: ``compute(*tensors)`` returns one gradient per entry of ``params``
    (None entries skipped). ``run()`` computes every pushed item, sums the gradients of a parameter that
    appears more than once, and accumulates them into ``.grad`` through autograd (see the module docstring);
    returns the number of parameter gradients accumulated. A store runs once; ``pending`` counts its items.
    ``hold(tensor) -> handle`` and ``unhold(handle) -> tensor`` wrap the kept tensors (identity by default).
    """

    def __init__(self, *, hold: Callable[[torch.Tensor], object] | None = None,
                 unhold: Callable[[object], torch.Tensor] | None = None):
        self._items: list[tuple[tuple, Callable, tuple]] = []
        self._hold, self._unhold = hold, unhold
        self._ran = False

    @property
    def pending(self) -> int:
        return len(self._items)

    def push(self, params: Sequence[torch.Tensor | None], compute: Callable, *tensors: torch.Tensor) -> None:
        if self._ran:
            raise ContractError("WeightGradStore.push after run(): this store's W has already run")
        kept = tuple(self._hold(t) for t in tensors) if self._hold is not None else tensors
        self._items.append((tuple(params), compute, kept))

    def run(self) -> int:
        if self._ran:
            raise ContractError("WeightGradStore.run called twice: a (stage, micro-batch) has one W")
        self._ran = True
        items, self._items = self._items, []
        totals: dict[int, list] = {}  # id(param) -> [param, summed grad]
        while items:
            params, compute, kept = items.pop(0)
            tensors = tuple(self._unhold(k) for k in kept) if self._unhold is not None else kept
            del kept
            grads = compute(*tensors)
            del tensors
            for param, grad in zip(params, grads):
                if param is None or grad is None:
                    continue
                entry = totals.get(id(param))
                if entry is None:
                    totals[id(param)] = [param, grad]
                else:
                    entry[1] = entry[1] + grad
        if totals:
            params, grads = zip(*totals.values())
            torch.autograd.backward(list(params), grad_tensors=list(grads))
        return len(totals)


_ACTIVE: list[WeightGradStore] = []  # a plain global, not thread-local: CUDA runs backward on autograd's threads


@contextlib.contextmanager
def deferring_weight_grads(store: WeightGradStore | None) -> Iterator[WeightGradStore | None]:
    """Forwards inside defer their weight gradients to ``store`` (None: no split, the plain ops)."""
    if store is not None and not isinstance(store, WeightGradStore):
        raise ContractError(f"deferring_weight_grads needs a WeightGradStore or None, got {type(store).__name__}")
    _ACTIVE.append(store)
    try:
        yield store
    finally:
        _ACTIVE.pop()


def active_store() -> WeightGradStore | None:
    """The store forwards defer to now (None outside :func:`deferring_weight_grads` or while grad is off)."""
    return _ACTIVE[-1] if _ACTIVE and torch.is_grad_enabled() else None


def _deferrable(p: torch.Tensor | None) -> bool:
    return p is None or (p.is_leaf and p.requires_grad)


def _linear_grads(x: torch.Tensor, dy: torch.Tensor, with_weight: bool, with_bias: bool):
    dy2 = dy.reshape(-1, dy.shape[-1])
    dw = dy2.t().mm(x.reshape(-1, x.shape[-1])) if with_weight else None
    db = dy2.sum(0) if with_bias else None
    return dw, db


def _bias_grad(dy: torch.Tensor):
    return (dy.reshape(-1, dy.shape[-1]).sum(0),)


# The split functions take their parameters outside autograd's view (in a tuple, a non-tensor argument): a
# parameter given as a Function input gets an edge to its AccumulateGrad node, which autograd then runs in B with
# no gradient, firing the parameter's hooks (a data-parallel engine's reduction) for nothing. Without that edge,
# W's ``torch.autograd.backward`` is the only time those nodes run. The anchor, a leaf of its own, makes the
# output require grad when no input does (an embedding's ids, a first linear fed data); its gradient is None.
_ANCHOR: list[torch.Tensor] = []


def _anchor() -> torch.Tensor:
    if not _ANCHOR:
        _ANCHOR.append(torch.zeros((), device="cpu", requires_grad=True))
    return _ANCHOR[0]


class _SplitLinear(torch.autograd.Function):
    """``y = x A^T + b``; backward: ``dx`` now, ``dA``/``db`` pushed to the store captured at forward."""

    @staticmethod
    def forward(ctx, x, anchor, store, params):
        weight, bias = params
        ctx.store, ctx.params, ctx.weight = store, params, weight
        ctx.with_bias = bias is not None and bias.requires_grad
        ctx.save_for_backward(x)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dx = dy.matmul(ctx.weight) if ctx.needs_input_grad[0] else None
        with_bias = ctx.with_bias
        ctx.store.push(ctx.params, lambda x_, dy_: _linear_grads(x_, dy_, True, with_bias), x, dy)
        return dx, None, None, None


class _SplitBias(torch.autograd.Function):
    """``y + b`` (``b`` broadcast over the leading dims); backward: ``dy`` now, ``db`` pushed to the store."""

    @staticmethod
    def forward(ctx, y, anchor, store, params):
        ctx.store, ctx.params = store, params
        return y + params[0]

    @staticmethod
    def backward(ctx, dy):
        ctx.store.push(ctx.params, _bias_grad, dy)
        return dy, None, None, None


class _SplitEmbedding(torch.autograd.Function):
    """``E[ids]``; backward: nothing now (ids have no gradient), the scatter-add into ``dE`` pushed to the store."""

    @staticmethod
    def forward(ctx, ids, anchor, store, params):
        (weight,) = params
        ctx.store, ctx.params, ctx.rows = store, params, weight.shape[0]
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        rows = ctx.rows

        def grads(ids_, dy_):
            flat = dy_.reshape(-1, dy_.shape[-1])
            return (flat.new_zeros((rows, flat.shape[1])).index_add_(0, ids_.reshape(-1), flat),)

        ctx.store.push(ctx.params, grads, ids, dy)
        return None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, with its weight gradients deferred to the active store (module docstring)."""
    store = active_store()
    if store is None or not weight.requires_grad or not (_deferrable(weight) and _deferrable(bias)):
        return F.linear(x, weight, bias)
    # the parameters W accumulates into, in _linear_grads' order
    return _SplitLinear.apply(x, _anchor(), store, (weight, bias))


def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y + bias`` (``y`` unchanged for None), with the bias gradient deferred to the active store."""
    if bias is None:
        return y
    store = active_store()
    if store is None or not (bias.requires_grad and _deferrable(bias)):
        return y + bias
    return _SplitBias.apply(y, _anchor(), store, (bias,))


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)``, with the weight gradient deferred to the active store."""
    store = active_store()
    if store is None or not (weight.requires_grad and _deferrable(weight)):
        return F.embedding(ids, weight)
    return _SplitEmbedding.apply(ids, _anchor(), store, (weight,))
