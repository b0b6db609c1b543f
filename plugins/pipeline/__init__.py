"""Pipeline parallelism: schedules as data, partitioning into stages, and the engine that runs them.

``shardline.plugins.pipeline.schedule`` is pure Python; the torch-using parts (``PipelineEngine``, partitioning
helpers) are loaded on first attribute access so importing the schedule layer never pulls in torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "PipelineEngine": "engine",
    "PipelineHooks": "engine",
    "LossReduction": "engine",
    "EngineStats": "engine",
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
    "sync_tied_grads": "partition",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
