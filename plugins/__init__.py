"""shardline.plugins: training-side parallelism (process grid, TP/SP layers, pipeline engine, strategy).

Importing this package registers the strategy names (``"shardline"``, ``"shardline_tp2_pp2_zero2"``, ...) with
Lightning, so ``Trainer(strategy="shardline_tp2_zero3")`` works after ``import shardline.plugins``.
"""

from shardline.plugins.registry import register_strategies
from shardline.plugins.strategy import HybridParallelStrategy

register_strategies()

__all__ = ["HybridParallelStrategy", "register_strategies"]
