"""The one Layout value of shardline.job: its conversions to and from strategy arguments and names, its room for
expert parallelism, and that the training side, the recipe checker and the planner all build the same value."""

from __future__ import annotations

import pytest

from shardline.job.errors import ContractError, LayoutError
from shardline.job.layout import (
    Layout,
    Offload,
    PipelineSpec,
    SPMode,
    ZeroSpec,
    parse_strategy_name,
    registered_names,
    strategy_name,
)
from shardline.job.pipeline.schedule import ScheduleKind


def test_strategy_args_round_trip():
    layout = Layout(tp=2, pp=4, cp=2, sp="ring", gpus_per_node=8,
                    pipeline=PipelineSpec(schedule="interleaved", chunks=2, micro_batches=8),
                    zero=ZeroSpec(stage=3, offload_optimizer="nvme", offload_params="cpu", nvme_path="/nvme"))
    args = layout.strategy_args()
    assert args == {"tp": 2, "pp": 4, "cp": 2, "sp": "ring", "zero_stage": 3, "offload_optimizer": "nvme",
                    "offload_params": "cpu", "nvme_path": "/nvme", "schedule": "interleaved", "chunks": 2,
                    "micro_batches": 8, "gpus_per_node": 8}
    assert all(type(v) in (int, str) for v in args.values())  # YAML- and JSON-ready
    assert Layout.from_strategy_args(args) == layout
    assert Layout.from_strategy_args({**args, "activation_checkpointing": True, "seed": 3}) == layout
    assert layout.sp is SPMode.RING and layout.pipeline.schedule is ScheduleKind.INTERLEAVED
    assert layout.zero.offload_params is Offload.CPU
    assert Layout().strategy_args() == {"tp": 1, "pp": 1, "cp": 1, "sp": "none", "zero_stage": 1,
                                        "offload_optimizer": "none", "offload_params": "none",
                                        "schedule": "1f1b", "chunks": 1}


def test_every_registered_name_is_a_layout_whose_name_is_its_shortest_spelling():
    names = registered_names()
    assert "shardline" in names and "shardline_tp1_pp1_zero1" in names
    for name in names:
        layout = Layout.from_name(name)
        assert layout == Layout.from_strategy_args(parse_strategy_name(name))
        short = layout.name
        assert short is not None and Layout.from_name(short) == layout and len(short) <= len(name)
    assert Layout.from_name("shardline_tp2_zero3_offload").zero == ZeroSpec(stage=3, offload_optimizer="cpu",
                                                                            offload_params="cpu")
    assert Layout(tp=2, zero=ZeroSpec(stage=2)).name == "shardline_tp2_zero2"
    for unnamed in (Layout(cp=2, sp="ring"), Layout(tp=3), Layout(ep=2),
                    Layout(pp=2, pipeline=PipelineSpec(micro_batches=4)),
                    Layout(zero=ZeroSpec(stage=3, offload_optimizer="cpu"))):
        assert strategy_name(unnamed) is None
    with pytest.raises(ContractError, match=r"strategy name 'shardline_tp3': tp=3 not in"):
        Layout.from_name("shardline_tp3")


def test_expert_axes_default_to_one_and_fold_into_the_stage_ranks():
    assert (Layout().ep, Layout().etp) == (1, 1)
    moe = Layout(tp=2, ep=4, etp=2)
    assert moe.strategy_args()["ep"] == 4 and Layout.from_strategy_args(moe.strategy_args()) == moe
    assert moe.dp_of(16) == 8 and moe.world_problems(16) == []
    assert "etp*ep = 2*4 does not divide the 4 ranks" in moe.world_problems(4)[0]
    with pytest.raises(LayoutError, match=r"ep=0 must be an integer >= 1.*etp='2' must be an integer >= 1"):
        Layout(ep=0, etp="2")


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tp=0), r"tp=0 must be an integer >= 1"),
    (dict(sp="zigzag"), r"sp='zigzag' is not one of \['none', 'megatron', 'ring', 'ulysses'\]"),
    (dict(sp="megatron"), r"sp='megatron' .* needs tp > 1"),
    (dict(sp="ulysses"), r"sp='ulysses' is context parallelism and needs cp > 1"),
])
def test_bad_degrees_name_the_value(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        Layout(**kwargs)


def test_world_problems_name_the_numbers():
    layout = Layout(tp=2, pp=2)
    assert layout.world_problems(6) == ["world_size=6 is not divisible by tp*cp*pp = 2*1*2 = 4"]
    with pytest.raises(LayoutError, match="world_size=6"):
        layout.dp_of(6)
    assert layout.dp_of(8) == 2


def test_the_training_side_recipes_and_the_planner_build_the_same_layout():
    from shardline.plugins import layout as plugins_layout
    from shardline.plugins.grid import SPMode as GridSPMode
    from shardline.recipes.planning.emit import layout_of
    from shardline.recipes.schema import strategy_layout

    assert GridSPMode is SPMode
    recipe = {"trainer": {"devices": 8, "strategy": "shardline_tp2_pp2_zero2"}, "data": {"batch_size": 8}}
    with pytest.raises(Exception, match="micro_batches=None must be set"):
        layout_of(recipe)  # pp > 1 needs the strategy's micro-batch count
    recipe["trainer"]["strategy"] = {"class_path": "shardline.plugins.HybridParallelStrategy",
                                     "init_args": {"tp": 2, "pp": 2, "zero_stage": 2, "micro_batches": 4}}
    plan = layout_of(recipe)
    trained = strategy_layout(recipe["trainer"]["strategy"])
    assert isinstance(trained, plugins_layout.Layout)
    assert Layout.from_strategy_args(trained.strategy_args()) == Layout.from_strategy_args(
        {**plan.layout.strategy_args(), "micro_batches": 4})
    assert (plan.dp, plan.micro_batches, plan.micro_batch_size) == (2, 4, 2)
