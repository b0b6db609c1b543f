"""Strategy names registered with Lightning: ``Trainer(strategy="shardline_tp2_pp2_zero2")``.

The names and their parser are the layout's (:mod:`shardline.job.layout`: :func:`parse_strategy_name`,
:func:`registered_names`); this module registers them.

``"shardline"`` is data parallel with ZeRO-1. The family ``shardline[_tp{t}][_pp{p}][_zero{z}][_offload]``
covers t, p in {1, 2, 4, 8} and z in {0, 1, 2, 3}; a part of degree 1 may be written or left out, and a missing
zero part means ZeRO-1. ``_offload`` moves optimizer states to CPU memory (stages 1-2) and, at stage 3, the
parameters as well; it does not exist for stage 0. Anything else is the class with arguments.
"""

from __future__ import annotations

from shardline.job.layout import parse_strategy_name, registered_names


def register_strategies(registry=None) -> list[str]:
    """Register every family name with Lightning's StrategyRegistry (idempotent); returns the names."""
    from pytorch_lightning.strategies import StrategyRegistry

    registry = StrategyRegistry if registry is None else registry
    names = registered_names()
    for name in names:
        kwargs = parse_strategy_name(name)
        registry.register(name, make_strategy, description=f"shardline {kwargs}", override=True, **kwargs)
    return names


def make_strategy(**kwargs):
    """The registry's factory. It imports the strategy module only when a name is used: registration runs while
    Lightning itself is being imported, possibly from inside ``shardline.plugins.lightning.strategy``'s own imports."""
    from shardline.plugins.lightning.strategy import HybridParallelStrategy

    return HybridParallelStrategy(**kwargs)


__all__ = ["make_strategy", "parse_strategy_name", "register_strategies", "registered_names"]
