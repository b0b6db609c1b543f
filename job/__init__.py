"""``shardline.job``: the description of a training job that both halves of shardline read, below both.

Pure Python (no torch, no pandas, no Lightning, no DeepSpeed), importing nothing from ``shardline.plugins``,
``shardline.profiling`` or ``shardline.recipes``: the training side (plugins), the profiler and the planner
(recipes) each import what they share from here and never from each other. Today it holds the pipeline schedule
IR with its validation and simulation (:mod:`.pipeline`), the rank placement rule (:mod:`.placement`), the
trace-annotation naming contract (:mod:`.annotations`), the one hardware catalog the profiler's link limits and the
planner's costs both read (:mod:`.hardware`, ``hardware.yaml``) and the exception types they raise
(:mod:`.errors`).
"""
