"""ParallelDims validation and topology (tier 0), Grid on a fake process group for big worlds (tier 1) and on
real gloo ranks (tier 2)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardline.plugins.errors import LayoutError
from shardline.plugins.grid import AXES, Grid, ParallelDims, SPMode
from shardline.plugins.testing import run_ranks


def reference_groups(world: int, tp: int, cp: int, pp: int) -> dict[str, list[list[int]]]:
    """Independent construction: ranks laid out as an array indexed [pp, dp, cp, tp] (tp fastest)."""
    dp = world // (tp * cp * pp)
    grid = np.arange(world).reshape(pp, dp, cp, tp)
    position = {"pp": 0, "dp": 1, "cp": 2, "tp": 3}
    out = {}
    for axis, pos in position.items():
        moved = np.moveaxis(grid, pos, -1).reshape(-1, grid.shape[pos])
        out[axis] = sorted(sorted(row.tolist()) for row in moved)
    out["dp_cp"] = sorted(sorted(grid[p, :, :, t].ravel().tolist()) for p in range(pp) for t in range(tp))
    out["mp"] = sorted(sorted(grid[:, d, c, :].ravel().tolist()) for d in range(dp) for c in range(cp))
    out["embed"] = sorted(sorted({int(grid[0, d, c, t]), int(grid[-1, d, c, t])})
                          for d in range(dp) for c in range(cp) for t in range(tp))
    return out


def layouts(max_world: int = 64):
    for world in (1, 2, 4, 6, 8, 12, 16, 32, 64):
        if world > max_world:
            continue
        for tp, cp, pp in itertools.product((1, 2, 4, 8), (1, 2), (1, 2, 4)):
            if world % (tp * cp * pp) == 0:
                yield world, tp, cp, pp


@pytest.mark.parametrize(("world", "tp", "cp", "pp"), list(layouts()))
def test_group_ranks_match_independent_layout(world, tp, cp, pp):
    dims = ParallelDims(world, tp=tp, cp=cp, pp=pp, sp="ring" if cp > 1 else "none")
    expected = reference_groups(world, tp, cp, pp)
    for axis, groups in expected.items():
        assert dims.group_ranks(axis) == groups, axis
    grid = np.arange(world).reshape(pp, dims.dp, cp, tp)
    for rank in range(world):
        p, d, c, t = (int(i[0]) for i in np.nonzero(grid == rank))
        assert dims.coords(rank) == {"tp": t, "cp": c, "dp": d, "pp": p}
        assert dims.rank_of(**dims.coords(rank)) == rank


def test_documented_example_world8_tp2_pp2():
    dims = ParallelDims(8, tp=2, pp=2)
    assert dims.dp == 2
    assert dims.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(("kwargs", "fragments"), [
    (dict(world_size=8, tp=3), ["world_size=8", "tp*cp*pp = 3*1*1 = 3"]),
    (dict(world_size=8, tp=2, pp=2, dp=3), ["2*1*3*2 = 12", "world_size=8"]),
    (dict(world_size=0, tp=-1), ["world_size=0", "tp=-1"]),
    (dict(world_size=8, tp=2.0), ["tp=2.0"]),
    (dict(world_size=8, sp="megatron"), ["sp='megatron'", "tp > 1", "tp=1"]),
    (dict(world_size=8, sp="ring"), ["sp='ring'", "cp > 1", "cp=1"]),
    (dict(world_size=8, tp=2, sp="ulysses"), ["sp='ulysses'", "cp=1"]),
    (dict(world_size=8, sp="zigzag"), ["sp='zigzag'", "ulysses"]),
    (dict(world_size=16, tp=16, gpus_per_node=8), ["tp=16", "gpus_per_node=8", "NVLink"]),
    (dict(world_size=12, tp=3, gpus_per_node=8), ["tp=3", "gpus_per_node=8"]),
    (dict(world_size=12, tp=2, gpus_per_node=8), ["world_size=12", "whole number of nodes"]),
])
def test_invalid_layouts_name_every_offending_value(kwargs, fragments):
    with pytest.raises(LayoutError) as info:
        ParallelDims(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_all_problems_reported_together():
    with pytest.raises(LayoutError) as info:
        ParallelDims(0, tp=0, pp=-2, sp="bogus")
    message = str(info.value)
    for fragment in ("world_size=0", "tp=0", "pp=-2", "sp='bogus'"):
        assert fragment in message


def test_frozen_and_sp_accepts_strings_and_enum():
    dims = ParallelDims(4, cp=2, sp="ring")
    assert dims.sp is SPMode.RING and ParallelDims(4, cp=2, sp=SPMode.RING) == dims
    with pytest.raises(AttributeError):
        dims.tp = 4
    assert hash(dims) == hash(ParallelDims(4, cp=2, sp="ring"))


def test_coords_out_of_range():
    with pytest.raises(LayoutError, match="rank=8 outside 0..7"):
        ParallelDims(8).coords(8)


def test_describe_lists_groups_and_node_crossings():
    text = ParallelDims(16, tp=4, cp=2, sp="ring", gpus_per_node=8).describe()
    assert "tp     size 4: [0,1,2,3] [4,5,6,7] [8,9,10,11] [12,13,14,15]  (intra-node)" in text
    assert "dp     size 2: [0,8] [1,9] [2,10] [3,11] [4,12] [5,13] [6,14] [7,15]  (8 of 8 cross nodes)" in text
    assert "node 1: ranks 8..15" in text
    assert "5:(1,1,0,0)" in text


# --- tier 1: the Grid's groups for big worlds on torch's fake process group, one rank at a time -------------


@pytest.mark.parametrize(("world", "tp", "cp", "pp"), [(64, 8, 2, 2), (64, 4, 1, 4), (32, 2, 2, 2), (16, 1, 1, 16)])
def test_grid_build_on_fake_backend(world, tp, cp, pp):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = ParallelDims(world, tp=tp, cp=cp, pp=pp, sp="ring" if cp > 1 else "none")
    expected = reference_groups(world, tp, cp, pp)
    for rank in (0, world // 2 + 1, world - 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            grid = Grid.build(dims)
            for axis in (*AXES, "dp_cp", "mp", "embed"):
                mine = next((g for g in expected[axis] if rank in g), None)
                if mine is None:  # a middle pipeline stage holds no tied embedding
                    assert axis == "embed" and grid.group(axis) is None and grid.ranks(axis) == []
                    continue
                assert dist.get_process_group_ranks(grid.group(axis)) == mine, (rank, axis)
                assert grid.ranks(axis) == mine
                assert grid.rank(axis) == mine.index(rank)
            assert grid.coords == dims.coords(rank)
            assert grid.is_first_stage == (dims.coords(rank)["pp"] == 0)
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize(("world", "tp", "cp", "pp"), [(64, 8, 2, 2), (64, 4, 1, 4), (32, 2, 2, 2), (16, 1, 1, 16)])
def test_stand_in_grid_answers_as_the_built_grid(world, tp, cp, pp):
    # Rank r's stand-in (no process group) against an independent derivation of the groups, every axis.
    from shardline.plugins.layers.tp_comm import group_rank, group_size

    dims = ParallelDims(world, tp=tp, cp=cp, pp=pp, sp="ring" if cp > 1 else "none")
    expected = reference_groups(world, tp, cp, pp)
    assert not dist.is_initialized()
    for rank in range(world):
        grid = Grid.stand_in(dims, rank=rank)
        assert grid.is_stand_in and grid.coords == dims.coords(rank)
        for axis in (*AXES, "dp_cp", "mp", "embed"):
            mine = next((g for g in expected[axis] if rank in g), None)
            if mine is None:
                assert axis == "embed" and grid.group(axis) is None and grid.ranks(axis) == []
                continue
            assert grid.ranks(axis) == mine and grid.rank(axis) == mine.index(rank)
            assert group_size(grid.group(axis)) == len(mine) and group_rank(grid.group(axis)) == mine.index(rank)
    with pytest.raises(LayoutError, match="rank=16 is outside the layout's world_size=16"):
        Grid.stand_in(ParallelDims(16, tp=2), rank=16)


def test_grid_build_needs_initialised_world_of_the_right_size():
    with pytest.raises(LayoutError, match="needs torch.distributed initialised"):
        Grid.build(ParallelDims(4))


# --- tier 2: real gloo ranks ----------------------------------------------------------------------------------


def _allreduce_per_axis(rank, world, tp, cp, pp):
    dims = ParallelDims(world, tp=tp, cp=cp, pp=pp, sp="ring" if cp > 1 else "none")
    grid = Grid.build(dims)
    sums = {}
    for axis in (*AXES, "dp_cp", "mp", "embed"):
        if grid.group(axis) is None:
            continue
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=grid.group(axis))
        sums[axis] = value.item()
    return sums


@pytest.mark.parametrize(("world", "tp", "cp", "pp"), [(4, 2, 1, 2), (8, 2, 2, 2), (8, 2, 1, 2)])
def test_grid_groups_allreduce_on_gloo(world, tp, cp, pp):
    expected = reference_groups(world, tp, cp, pp)
    results = run_ranks(_allreduce_per_axis, world, tp, cp, pp, timeout=60)
    for rank, sums in enumerate(results):
        for axis, value in sums.items():
            group = next(g for g in expected[axis] if rank in g)
            assert value == float(sum(group)), (rank, axis)  # exact: small integers in float32


def _gpt_state_on_real_grid(rank, world, tp, pp):
    from shardline.plugins.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=4, d_model=16)
    grid = Grid.build(ParallelDims(world, tp=tp, pp=pp))
    return {k: v.clone() for k, v in GPT(config, grid=grid, seed=3).state_dict().items()}


def test_a_model_built_on_a_stand_in_grid_is_that_ranks_part():
    # Every rank's GPT built on real gloo groups equals, tensor for tensor, the same rank's GPT built in this
    # process on a stand-in grid; running it over the stand-in is refused (our error, naming the group).
    from shardline.plugins.errors import ContractError
    from shardline.plugins.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=4, d_model=16)
    real = run_ranks(_gpt_state_on_real_grid, 4, 2, 2, timeout=120)
    dims = ParallelDims(4, tp=2, pp=2)
    for rank in range(4):
        stand_in = GPT(config, grid=Grid.stand_in(dims, rank=rank), seed=3).state_dict()
        assert stand_in.keys() == real[rank].keys()
        for name, tensor in stand_in.items():
            assert torch.equal(tensor, real[rank][name]), (rank, name)
    assert not torch.equal(real[0]["embedding.wte.weight"], real[1]["embedding.wte.weight"])  # shards differ
    model = GPT(config, grid=Grid.stand_in(dims, rank=1), seed=3)
    with pytest.raises(ContractError, match=r"stand-in tp group \[0, 1\] \(rank 1\)"):
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))


# --- expert axes (MoE parallel folding): written out by hand -----------------------------------------------------


@pytest.mark.parametrize(("kwargs", "expected"), [
    # tp2 x dp4, ep2, etp1: an EP group is two consecutive ranks (here a TP pair); edp strides over the rest
    (dict(world_size=8, tp=2, ep=2), {"etp": [[r] for r in range(8)], "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
                                      "edp": [[0, 2, 4, 6], [1, 3, 5, 7]]}),
    # etp = tp = 2 with pp2: each stage's 8 ranks read as (etp, ep, edp) = (2, 2, 2), etp fastest
    (dict(world_size=16, tp=2, pp=2, ep=2, etp=2),
     {"etp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
      "ep": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
      "edp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]}),
    # cp2 x dp4, ep4: the EP group runs over cp and dp ranks alike
    (dict(world_size=8, cp=2, ep=4, sp="ring"), {"ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
                                                 "edp": [[0, 4], [1, 5], [2, 6], [3, 7]]}),
    # tp2 x dp1, ep2, etp1: ep need not divide dp*cp (the EP group is the TP pair, whose tokens the layer splits)
    (dict(world_size=2, tp=2, ep=2), {"ep": [[0, 1]], "edp": [[0], [1]]}),
])
def test_expert_groups_by_hand(kwargs, expected):
    dims = ParallelDims(**kwargs)
    for axis, groups in expected.items():
        assert dims.group_ranks(axis) == groups, axis
        assert dims.size(axis) == len(groups[0])
    for rank in range(dims.world_size):
        c = dims.expert_coords(rank)
        assert dims.expert_rank_of(**c) == rank
        assert c["pp"] == dims.coords(rank)["pp"]
    text = dims.describe()
    assert "  ep     size" in text and "  edp    size" in text and "rank -> (etp, ep, edp, pp)" in text


@pytest.mark.parametrize(("kwargs", "fragments"), [
    (dict(world_size=8, tp=2, ep=2, etp=4), ["etp=4 must be 1 or tp=2", "ep=2"]),
    (dict(world_size=8, tp=4, ep=2, etp=2), ["etp=2 must be 1 or tp=4"]),
    (dict(world_size=8, ep=3), ["etp*ep = 1*3", "8 ranks of a pipeline stage", "tp*cp*dp = 1*1*8"]),
    (dict(world_size=8, tp=2, pp=2, ep=4, etp=2), ["etp*ep = 2*4", "4 ranks of a pipeline stage",
                                                   "tp*cp*dp = 2*1*2"]),
    (dict(world_size=8, ep=0, etp="2"), ["ep=0 must be an integer >= 1", "etp='2' must be an integer >= 1"]),
    (dict(world_size=8, tp=3, ep=5), ["tp*cp*pp = 3*1*1 = 3"]),
])
def test_impossible_expert_layouts_name_every_number(kwargs, fragments):
    with pytest.raises(LayoutError) as info:
        ParallelDims(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_job_layout_and_parallel_dims_agree_on_the_expert_rules():
    from shardline.job.layout import Layout as JobLayout
    from shardline.plugins.layout import Layout

    with pytest.raises(LayoutError, match=r"etp=4 must be 1 or tp=2"):
        JobLayout(tp=2, ep=2, etp=4)
    assert JobLayout(ep=3).world_problems(8) == [
        "etp*ep = 1*3 does not divide the 8 ranks of a pipeline stage (tp*cp*dp = 1*1*8): expert parallelism "
        "folds the same ranks"]
    dims = Layout(tp=2, ep=2).bind(8).dims
    assert (dims.ep, dims.etp, dims.edp) == (2, 1, 4)


def test_dense_layouts_keep_their_groups_and_grid():
    dims = ParallelDims(8, tp=2, pp=2)
    assert not dims.has_expert_axes and "ep " not in dims.describe() and "ep=" not in dims._summary()
    assert dims.edp == 4 and dims.group_ranks("edp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    grid = Grid.stand_in(dims, rank=5)
    assert grid.group("ep") is None and grid.group("etp") is None
    with pytest.raises(LayoutError, match=r"no 'edp' group was built"):
        grid.group("edp")
    moe_at_ep1 = Grid.stand_in(dims, rank=5, expert_groups=True)  # an MoE model on tp2 x pp2 at ep = 1
    assert moe_at_ep1.group("edp").ranks == (4, 5, 6, 7) and moe_at_ep1.group("ep").ranks == (5,)
    moe = Grid.stand_in(ParallelDims(8, tp=2, ep=2, etp=2), rank=5)
    assert moe.group("ep").ranks == (5, 7) and moe.group("etp") is moe.group("tp")
    assert moe.group("edp").ranks == (1, 5) and moe.rank("edp") == 1 and moe.rank("ep") == 0
