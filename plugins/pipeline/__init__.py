"""Pipeline parallelism: schedules as data, partitioning into stages, and the engine that runs them.

A typical rank (``grid`` from :class:`~shardline.plugins.grid.Grid`, ``model`` exposing ``pipeline_layers()``)::

    from shardline.plugins.pipeline import PipelineEngine, TiedWeight, build_stages, partition_layers
    from shardline.job.pipeline.schedule import interleaved_one_f_one_b

    p, v = grid.size("pp"), 2
    layers = model.pipeline_layers()
    stages = build_stages(layers, partition_layers(layers, p * v, method="parameters"))
    schedule = interleaved_one_f_one_b(p, 8, v)          # validated again by the engine
    engine = PipelineEngine(stages[grid.rank("pp")::p], schedule=schedule, pp_rank=grid.rank("pp"),
                            loss_fn=model.loss, group=grid.group("pp"))
    loss = engine.run_batch(ids, targets)                # same float on every pp rank
    TiedWeight(tied_param_or_None, grid.group("embed")).sync_grads()
    optimizer.step()

``shardline.job.pipeline.schedule`` is pure Python; the torch-using parts (``PipelineEngine``, partitioning
helpers) are loaded on first attribute access so importing the schedule layer never pulls in torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "PipelineEngine": "engine",
    "PipelineHooks": "engine",
    "LossReduction": "engine",
    "EngineStats": "engine",
    "Annotations": "engine",
    "MemoryAccounting": "engine",
    "SavedTensorMeter": "memory",
    "measure_layer_costs": "partition",
    "stages_of_rank": "partition",
    "balanced_bounds": "partition",
    "partition_layers": "partition",
    "Partition": "partition",
    "PartitionMethod": "partition",
    "build_stages": "partition",
    "TiedWeight": "partition",
    "forward_only": "schedule",  # shardline.job.pipeline.schedule's, through the re-exporting module
    "sync_tied_grads": "partition",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
