"""Cutting a sequence of layers into pipeline stages, placing stages on ranks, and keeping tied weights tied.

Layers are the model's ``pipeline_layers()`` in order: the first maps token ids to hidden states (it owns the
embedding), the last maps hidden states to logits (it owns the final norm and head; the loss is applied to its
output by the engine). Every stage gets a non-empty contiguous run of layers, so stage 0 always owns the
embedding and stage ``S - 1`` the head.

Methods (:class:`PartitionMethod`):

- ``uniform``: stage ``k`` gets layers ``[floor(k n / S), floor((k + 1) n / S))`` (sizes differ by at most one).
- ``parameters``: balanced by each layer's parameter count.
- ``cost``: balanced by given per-layer costs (or :func:`measure_layer_costs`).

Balanced means: among all cuts of ``c_0 .. c_{n-1}`` into ``S`` non-empty contiguous runs, one minimising the
largest run sum ``max_k sum_{i in run k} c_i`` (the pipeline's step time is set by its slowest stage). Solved
exactly by dynamic programming over (layers used, stages used) in ``O(n^2 S)``.

Placement: with ``p`` ranks, stage ``s`` is chunk ``s // p`` of its rank; which rank is the schedule's
``placement`` (:mod:`shardline.job.placement`): ``"loop"`` puts it on rank ``s % p`` (a rank's chunks are
``stages[r::p]``: GPipe, 1F1B, interleaved), ``"v"`` on rank ``s % p`` for even chunks and ``p - 1 - s % p`` for
odd ones (ZB-V, DualPipeV: rank 0 hosts the first stage and the last). Pass ``style=schedule.placement``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardline.job import placement
from shardline.job.annotations import comm_name
from shardline.plugins.errors import LayoutError


class PartitionMethod(str, enum.Enum):
    UNIFORM = "uniform"
    PARAMETERS = "parameters"
    COST = "cost"


@dataclass(frozen=True)
class Partition:
    """``bounds[k] = (start, stop)``: stage ``k`` holds layers ``start .. stop - 1``; ``stage_costs[k]`` their cost."""

    bounds: tuple[tuple[int, int], ...]
    stage_costs: tuple[float, ...]

    @property
    def n_stages(self) -> int:
        return len(self.bounds)

    @property
    def max_cost(self) -> float:
        return max(self.stage_costs)

    def stage_of_layer(self, layer: int) -> int:
        for stage, (start, stop) in enumerate(self.bounds):
            if start <= layer < stop:
                return stage
        raise LayoutError(f"layer {layer} is outside the partition's {self.bounds[-1][1]} layers")


def balanced_bounds(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    """Contiguous non-empty cut of ``costs`` into ``n_stages`` runs minimising the largest run sum."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest possible max-run-sum cutting the first i layers into k runs; cut[k][i]: last run start.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(n_stages, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def _check_counts(n_layers: int, n_stages: int) -> None:
    if not isinstance(n_stages, int) or n_stages < 1 or n_layers < n_stages:
        raise LayoutError(f"cannot cut {n_layers} layers into n_stages={n_stages!r} non-empty stages "
                          f"(need 1 <= n_stages <= n_layers)")


def partition_layers(layers: Sequence[nn.Module] | int, n_stages: int, *,
                     method: PartitionMethod | str = PartitionMethod.UNIFORM,
                     costs: Sequence[float] | None = None) -> Partition:
    """Cut ``layers`` (or a layer count, for ``uniform``/``cost``) into ``n_stages`` stages by ``method``."""
    try:
        method = PartitionMethod(method)
    except ValueError:
        raise LayoutError(f"method={method!r} is not one of {[m.value for m in PartitionMethod]}") from None
    n = layers if isinstance(layers, int) else len(layers)
    _check_counts(n, n_stages)
    if method is PartitionMethod.UNIFORM:
        layer_costs = [1.0] * n
        bounds = [(k * n // n_stages, (k + 1) * n // n_stages) for k in range(n_stages)]
    else:
        if method is PartitionMethod.PARAMETERS:
            if isinstance(layers, int):
                raise LayoutError("partition by parameters needs the layer modules, not a count")
            layer_costs = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
        else:
            if costs is None or len(costs) != n or any(not c >= 0 for c in costs):
                raise LayoutError(f"partition by cost needs {n} non-negative per-layer costs, got {costs!r}")
            layer_costs = [float(c) for c in costs]
        bounds = balanced_bounds(layer_costs, n_stages)
    stage_costs = tuple(sum(layer_costs[a:b]) for a, b in bounds)
    return Partition(bounds=tuple(bounds), stage_costs=stage_costs)


def measure_layer_costs(layers: Sequence[nn.Module], example_input: torch.Tensor, *,
                        repeats: int = 3) -> list[float]:
    """Seconds per layer for forward + backward, feeding each layer's output to the next (best of ``repeats``)."""
    costs = []
    x = example_input
    for layer in layers:
        best = float("inf")
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            out.float().sum().backward()
            best = min(best, time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(best)
        x = out.detach()
    return costs


def build_stages(layers: Sequence[nn.Module], partition: Partition) -> list[nn.Sequential]:
    """One ``nn.Sequential`` per stage, holding the partition's run of layers (the modules, not copies)."""
    if partition.bounds[-1][1] != len(layers):
        raise LayoutError(f"partition covers {partition.bounds[-1][1]} layers but {len(layers)} were given")
    return [nn.Sequential(*layers[a:b]) for a, b in partition.bounds]


def stages_of_rank(stages: Sequence, *, rank: int, n_ranks: int, style: str = "loop") -> list:
    """This rank's stages in chunk order under placement ``style`` (``"loop"``: stage ``c * p + r`` is chunk ``c``
    of rank ``r``; ``"v"``: see the module docstring)."""
    if len(stages) % n_ranks or not 0 <= rank < n_ranks:
        raise LayoutError(f"cannot place {len(stages)} stages on n_ranks={n_ranks} (rank={rank}): the number "
                          f"of stages must be a multiple of the ranks")
    # an unknown style: the placement's own ScheduleError, naming it
    return [stages[s] for s in placement.stages_of_rank(rank, n_stages=len(stages), pp=n_ranks, style=style)]


@dataclass
class TiedWeight:
    """A weight used by the first stage and the last (input embedding and output head).

    Each end holds its own copy, initialised equal. The true gradient of a shared weight is the sum of the
    gradients of its uses, so :meth:`sync_grads` all-reduces (sum) the copies' gradients over the embed group
    (first and last stage of this pipeline, ``grid.group("embed")``). With equal gradients and the same
    optimizer, the copies stay identical step after step. Call it once per batch, after the pipeline's last
    backward and before the optimizer step. On a middle stage (group None) it does nothing.
    """

    weight: nn.Parameter | None
    group: dist.ProcessGroup | None

    def sync_grads(self) -> None:
        sync_tied_grads([] if self.weight is None else [self.weight], group=self.group)


def sync_tied_grads(weights: Sequence[nn.Parameter], *, group: dist.ProcessGroup | None) -> None:
    """Sum each weight's ``.grad`` over ``group`` (a missing grad counts as zero). No-op for ``group=None``."""
    if group is None or dist.get_world_size(group) == 1:
        return
    for weight in weights:
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        with torch.profiler.record_function(comm_name("embed", "all_reduce")):
            dist.all_reduce(weight.grad, op=dist.ReduceOp.SUM, group=group)
