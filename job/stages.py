"""The pipeline's uniform cut of a model into stages, and which stages a pipeline rank hosts: one statement read by
the training side (``shardline.plugins.models.decoder.hosted_layers`` through the pipeline's partition), the
planner's memory estimate and its step-time model.

``n`` layers (a decoder's ``[embedding, *blocks, head]``: ``n_layer + 2``) cut into ``S = pp * chunks`` stages:
stage ``k`` takes ``[k n / S, (k+1) n / S)`` (integer division), and lives on the pipeline rank the schedule's
placement ``style`` gives (:func:`shardline.job.placement.stages_of_rank`: ``k % pp`` for ``"loop"``, the V's
zig-zag for ``"v"``). Pure Python.
"""

from __future__ import annotations

from shardline.job import placement


def uniform_bounds(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """``[(first, end), ...]`` of each of ``n_stages`` stages in the uniform cut of ``n_layers`` layers."""
    return [(k * n_layers // n_stages, (k + 1) * n_layers // n_stages) for k in range(n_stages)]


def hosted_stages(n_layers: int, *, pp: int, chunks: int, pp_rank: int, style: str = "loop") -> dict[int, range]:
    """``{stage: its layers}`` of pipeline rank ``pp_rank`` under placement ``style`` (at ``pp = 1`` one stage
    holding every layer)."""
    stages = pp * chunks if pp > 1 else 1
    bounds = uniform_bounds(n_layers, stages)
    return {s: range(*bounds[s]) for s in placement.stages_of_rank(pp_rank, n_stages=stages, pp=pp, style=style)}


__all__ = ["hosted_stages", "uniform_bounds"]
