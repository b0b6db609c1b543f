"""Strategy names registered with Lightning: ``Trainer(strategy="shardline_tp2_pp2_zero2")``.

``"shardline"`` is data parallel with ZeRO-1. The family ``shardline[_tp{t}][_pp{p}][_zero{z}][_offload]``
covers t, p in {1, 2, 4, 8} and z in {0, 1, 2, 3}; a part of degree 1 may be written or left out, and a missing
zero part means ZeRO-1. ``_offload`` moves optimizer states to CPU memory (stages 1-2) and, at stage 3, the
parameters as well; it does not exist for stage 0. Anything else is the class with arguments.
"""

from __future__ import annotations

import itertools
import re

from shardline.plugins.errors import ContractError

DEGREES = (1, 2, 4, 8)
STAGES = (0, 1, 2, 3)
NAME_PATTERN = re.compile(r"^shardline(?:_tp(?P<tp>\d+))?(?:_pp(?P<pp>\d+))?(?:_zero(?P<zero>\d+))?"
                          r"(?P<offload>_offload)?$")


def parse_strategy_name(name: str) -> dict:
    """The strategy arguments a registered name stands for; ContractError for a name outside the family."""
    match = NAME_PATTERN.match(name)
    if match is None:
        raise ContractError(f"strategy name {name!r} is not of the form shardline[_tp{{t}}][_pp{{p}}]"
                            "[_zero{z}][_offload]")
    tp, pp = int(match["tp"] or 1), int(match["pp"] or 1)
    zero = int(match["zero"]) if match["zero"] is not None else 1
    problems = [f"{k}={v} not in {DEGREES}" for k, v in (("tp", tp), ("pp", pp)) if v not in DEGREES]
    if zero not in STAGES:
        problems.append(f"zero{zero}: the stage must be one of {STAGES}")
    if match["offload"] and zero == 0:
        problems.append("_offload needs ZeRO stage 1, 2 or 3 (zero0 has no optimizer partition to offload)")
    if problems:
        raise ContractError(f"strategy name {name!r}: " + "; ".join(problems))
    kwargs = {"tp": tp, "pp": pp, "zero_stage": zero}
    if match["offload"]:
        kwargs["offload_optimizer"] = "cpu"
        if zero == 3:
            kwargs["offload_params"] = "cpu"
    return kwargs


def registered_names() -> list[str]:
    """Every name in the family, in every spelling (degree-1 parts written or omitted)."""
    names = set()
    for tp, pp, zero, offload in itertools.product(DEGREES, DEGREES, (None, *STAGES), (False, True)):
        if offload and zero == 0:
            continue
        tp_parts = ["", f"_tp{tp}"] if tp == 1 else [f"_tp{tp}"]
        pp_parts = ["", f"_pp{pp}"] if pp == 1 else [f"_pp{pp}"]
        zero_part = "" if zero is None else f"_zero{zero}"
        for tp_part, pp_part in itertools.product(tp_parts, pp_parts):
            names.add(f"shardline{tp_part}{pp_part}{zero_part}{'_offload' if offload else ''}")
    return sorted(names)


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
