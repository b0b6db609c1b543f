"""shardline.profiling: read Kineto / NCCL_DEBUG / Nsight traces into one events table and attribute every
step's time on every rank. Imports without torch.

Public entry points (loaded on first use, so ``import shardline.profiling`` stays cheap):
``load(path) -> TraceSet`` and ``breakdown(traceset) -> DataFrame``; ``attribute(traceset) -> Attribution``, the
one attributed object of a trace set every analysis and output reads; also ``classify_events``, ``comm_by_dim``,
``pipeline_bubbles``, ``match_p2p`` / ``p2p_messages`` (pipelines from send/recv alone), ``match_collectives``,
``stragglers``, ``clock_offsets``, ``collective_bandwidth``, ``what_if``, ``CommRule``, ``Category``.

The sub-packages are floors, each importing only those below it (tests/test_dependency_direction.py):

- ``base``: errors, the events schema, interval sets;
- ``readers``: one reader per trace format (Kineto, NCCL_DEBUG logs, NCCL profiler, Nsight, flight recorder);
- ``table``: ``load`` (the events table of a trace set), classification (``kinds``, ``names``, ``dims``,
  ``linking``, ``classify``), the partition's labels, and the per-rank survey (``survey``: one per trace set);
- ``matching``: across ranks -- collectives and clock offsets, p2p messages and their matching, bandwidth and
  links, the pipelines each rank's bubble is measured from; one typed ``Matching`` value per survey (``matched``);
- ``attribution``: ``Attribution`` = survey + matching + partition + idle causes, the breakdown, and ``scale``
  (an executor over the same survey, matching and partition, rank by rank);
- ``analyses``: critical path, what-if, diff, findings, coverage, kernels, traffic, bubbles, rank summaries,
  each reading the attribution, none calling another's entry point (a star: ``present.scenarios`` gives the
  what-if and the findings the analyses they read);
- ``present``: the report's sections (one registry row each: name, title, compute, display), their display,
  HTML / Markdown, TensorBoard, the merged trace, the CLI.
"""

# No `from __future__ import annotations` here: it would shadow a submodule named annotations.
import importlib

# The lazy entry points: name -> the module (relative to this package) that defines it, imported on first use so
# that `import shardline.profiling` loads no pandas (tests/test_dependency_direction.py reads these as imports).

_EXPORTS = {
    "load": ".table.load",
    "TraceSet": ".table.load",
    "breakdown": ".attribution.core",
    "attribute": ".attribution.core",
    "Attribution": ".attribution.core",
    "classify_events": ".table.classify",
    "CommRule": ".table.classify",
    "Category": ".table.classify",
    "comm_by_dim": ".attribution.core",
    "pipeline_bubbles": ".analyses.bubbles",
    "match_p2p": ".matching.p2p",
    "p2p_messages": ".matching.messages",
    "match_collectives": ".matching.collectives",
    "stragglers": ".matching.collectives",
    "clock_offsets": ".matching.collectives",
    "collective_bandwidth": ".matching.bandwidth",
    "what_if": ".present.scenarios",
    "merged_trace": ".present.merge",
    "diff_breakdowns": ".analyses.diff",
    "report_sections": ".present.report_sections",
    "write_tensorboard": ".present.tensorboard",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardline.profiling' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
