"""shardline.profiling: read Kineto / NCCL_DEBUG / Nsight traces into one events table and attribute every
step's time on every rank. Imports without torch.

Public entry points (loaded on first use, so ``import shardline.profiling`` stays cheap):
``load(path) -> TraceSet`` and ``breakdown(traceset) -> DataFrame``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load": "shardline.profiling.load",
    "TraceSet": "shardline.profiling.load",
    "breakdown": "shardline.profiling.attribution",
    "classify_events": "shardline.profiling.classify",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardline.profiling' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
