"""shardline.profiling: trace analysis. Imports without torch."""
