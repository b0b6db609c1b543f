"""``shardline.job``: the description of a training job that both halves of shardline read, below both.

Pure Python (no torch, no pandas, no Lightning, no DeepSpeed), importing nothing from ``shardline.plugins``,
``shardline.profiling`` or ``shardline.recipes``: the training side (plugins), the profiler and the planner
(recipes) each import what they share from here and never from each other. Today it holds the pipeline schedule
IR with its validation and simulation (:mod:`.pipeline`), the rank placement rule (:mod:`.placement`) and the
pipeline's cut into stages (:mod:`.stages`), the one layout value with its strategy-argument and strategy-name
spellings (:mod:`.layout`), one room per model family for its config, layout rules, Hugging Face names and
parameter closed forms (:mod:`.family`, :mod:`.gpt`, :mod:`.llama`, registered in :mod:`.families`), the
trace-annotation naming contract (:mod:`.annotations`), the one hardware catalog the profiler's link limits and the
planner's costs both read (:mod:`.hardware`, ``hardware.yaml``) and the exception types they raise
(:mod:`.errors`).
"""
