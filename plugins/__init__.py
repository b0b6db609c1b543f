"""shardline.plugins: training-side parallelism (process grid, TP/SP layers, pipeline engine, strategy)."""
