"""The one Layout value, and the one statement of rank order and stage placement both halves read."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.job import placement
from shardline.job.pipeline.schedule import ScheduleKind, build_schedule
from shardline.plugins.errors import ContractError, LayoutError
from shardline.plugins.grid import AXES, ParallelDims
from shardline.plugins.layout import Layout, Offload, PipelineSpec, ZeroSpec
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.pipeline.partition import stages_of_rank as partition_stages
from shardline.profiling.table.dims import layout_dim
from shardline.recipes.schema import strategy_layout


def test_a_layout_exists_before_the_world_and_binds_once():
    layout = Layout(tp=2, pp=2, pipeline=PipelineSpec(schedule="interleaved", chunks=2, micro_batches=4),
                    zero=ZeroSpec(stage=3, offload_params="cpu"))
    assert not layout.bound and layout.degrees == {"tp": 2, "cp": 1, "pp": 2}
    bound = layout.bind(8)
    assert bound.dims == ParallelDims(8, tp=2, pp=2) and bound.dims.dp == 2
    assert bound.bind(8) is bound and bound.degrees["dp"] == 2
    assert bound.pipeline.schedule is ScheduleKind.INTERLEAVED and bound.zero.offload_params is Offload.CPU
    with pytest.raises(LayoutError, match="bound to world_size=8; cannot rebind to 16"):
        bound.bind(16)
    with pytest.raises(LayoutError, match="not bound"):
        layout.dims  # noqa: B018
    with pytest.raises(LayoutError, match=r"world_size=6 is not divisible by tp\*cp\*pp = 2\*1\*2"):
        layout.bind(6)
    assert bound.record()["dp"] == 2 and bound.record()["schedule"] == "interleaved"


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tp=0), r"tp=0 must be an integer >= 1"),
    (dict(sp="megatron"), r"sp='megatron' .* needs tp > 1"),
    (dict(pipeline=PipelineSpec), r"must be a PipelineSpec"),
])
def test_bad_layouts_name_the_value(kwargs, message):
    with pytest.raises((LayoutError, ContractError), match=message):
        Layout(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(schedule="zigzag"), r"schedule='zigzag' must be one of \['gpipe', '1f1b', 'interleaved'\]"),
    (dict(schedule="forward_only"), r"schedule='forward_only' must be one of"),
    (dict(chunks=2), r"chunks=2 must be 1, or > 1 with schedule='interleaved' \(schedule='1f1b'\)"),
    (dict(micro_batches=0), r"micro_batches=0 must be a positive integer or None"),
])
def test_bad_pipeline_specs_name_the_value(kwargs, message):
    with pytest.raises(ContractError, match=message):
        PipelineSpec(**kwargs)
    with pytest.raises(ContractError, match=r"offload_optimizer='disk' must be None, 'cpu' or 'nvme'"):
        ZeroSpec(offload_optimizer="disk")


def test_the_strategy_holds_exactly_one_layout_and_the_recipe_checker_builds_the_same():
    strategy = HybridParallelStrategy(tp=2, pp=2, zero_stage=2, micro_batches=8)
    assert isinstance(strategy.layout, Layout) and not strategy.layout.bound
    assert strategy.degrees == {"tp": 2, "pp": 2, "cp": 1} and strategy.zero_stage == 2
    assert strategy.describe() == {k: v for k, v in strategy.layout.record().items() if k != "world_size"}
    recipe = {"class_path": "shardline.plugins.lightning.strategy.HybridParallelStrategy",
              "init_args": {"tp": 2, "pp": 2, "zero_stage": 2, "micro_batches": 8}}
    assert strategy_layout(recipe) == strategy.layout
    assert strategy_layout("shardline_tp2_pp2_zero2") == Layout(tp=2, pp=2, zero=ZeroSpec(stage=2))
    assert strategy_layout("ddp") is None


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]), dp=st.sampled_from([1, 2, 3]),
       pp=st.sampled_from([1, 2, 4]))
def test_rank_order_is_one_rule_for_the_grid_and_the_profiler(tp, cp, dp, pp):
    dims = ParallelDims(tp * cp * dp * pp, tp=tp, cp=cp, pp=pp)
    degrees = dims.degrees
    for rank in range(dims.world_size):
        coords = placement.coords_of(rank, degrees)
        assert coords == dims.coords(rank) and placement.rank_of(coords, degrees) == rank
    # Megatron's order by hand: tp fastest, then cp, dp, pp.
    assert placement.rank_of({"tp": 1 % tp, "cp": 1 % cp, "dp": 1 % dp, "pp": 1 % pp}, degrees) == \
        (1 % tp) + tp * ((1 % cp) + cp * ((1 % dp) + dp * (1 % pp)))
    for axis in AXES:  # the profiler names every group of every axis by the grid's own rule
        if degrees[axis] > 1 and degrees[axis] < dims.world_size:
            for ranks in dims.group_ranks(axis):
                assert layout_dim(str(ranks), size=len(ranks), layout=degrees) == axis


@pytest.mark.parametrize(("p", "v"), [(1, 1), (2, 1), (4, 1), (2, 2), (4, 3)])
def test_stage_placement_is_one_rule_for_schedules_partitions_and_the_grid(p, v):
    schedule = build_schedule("interleaved" if v > 1 else "1f1b", n_ranks=p, n_microbatches=p * 2, n_chunks=v)
    for rank in range(p):
        mine = placement.stages_of_rank(rank, n_stages=p * v, pp=p)
        assert mine == schedule.stages_of_rank(rank) == partition_stages(list(range(p * v)), rank=rank, n_ranks=p)
        assert all(placement.stage_rank(s, pp=p) == rank == schedule.rank_of_stage(s) for s in mine)
        assert mine == [c * p + rank for c in range(v)]  # chunk c of rank r is stage c p + r
