"""shardline.profiling: read Kineto / NCCL_DEBUG / Nsight traces into one events table and attribute every
step's time on every rank. Imports without torch.

Public entry points (loaded on first use, so ``import shardline.profiling`` stays cheap):
``load(path) -> TraceSet`` and ``breakdown(traceset) -> DataFrame``; ``attribute(traceset) -> Attribution``, the
one attributed object of a trace set every analysis and output reads; also ``classify_events``, ``comm_by_dim``,
``pipeline_bubbles``, ``match_p2p`` / ``p2p_messages`` (pipelines from send/recv alone), ``match_collectives``,
``stragglers``, ``clock_offsets``, ``collective_bandwidth``, ``CommRule``, ``Category``.
"""

# No `from __future__ import annotations` here: it would shadow a submodule named annotations.
import importlib

_EXPORTS = {
    "load": "shardline.profiling.load",
    "TraceSet": "shardline.profiling.load",
    "breakdown": "shardline.profiling.attribution",
    "attribute": "shardline.profiling.attribution",
    "Attribution": "shardline.profiling.attribution",
    "classify_events": "shardline.profiling.classify",
    "CommRule": "shardline.profiling.classify",
    "Category": "shardline.profiling.classify",
    "comm_by_dim": "shardline.profiling.attribution",
    "pipeline_bubbles": "shardline.profiling.bubbles",
    "match_p2p": "shardline.profiling.p2p",
    "p2p_messages": "shardline.profiling.p2p",
    "match_collectives": "shardline.profiling.collectives",
    "stragglers": "shardline.profiling.collectives",
    "clock_offsets": "shardline.profiling.collectives",
    "collective_bandwidth": "shardline.profiling.bandwidth",
    "merged_trace": "shardline.profiling.merge",
    "diff_breakdowns": "shardline.profiling.diff",
    "report_sections": "shardline.profiling.report_sections",
    "write_tensorboard": "shardline.profiling.tensorboard",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardline.profiling' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
