"""Partitioning layers into stages: uniform, balanced by parameters or cost (against brute force), placement."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardline.plugins.errors import LayoutError
from shardline.plugins.pipeline.partition import (
    balanced_bounds,
    build_stages,
    measure_layer_costs,
    partition_layers,
    stages_of_rank,
)


def brute_force_min_max(costs: list[int], n_stages: int) -> int:
    """Smallest largest-run sum over every way to cut ``costs`` into ``n_stages`` non-empty contiguous runs."""
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        edges = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(edges))
        best = worst if best is None else min(best, worst)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=10), st.integers(1, 10))
def test_balanced_cut_is_contiguous_non_empty_and_optimal(costs, n_stages):
    if n_stages > len(costs):
        with pytest.raises(LayoutError, match=f"cannot cut {len(costs)} layers into n_stages={n_stages}"):
            partition_layers(len(costs), n_stages, method="cost", costs=costs)
        return
    partition = partition_layers(len(costs), n_stages, method="cost", costs=costs)
    bounds = partition.bounds
    assert bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in itertools.pairwise(bounds))
    # Integer costs summed in floats below 2**53: exact.
    assert partition.max_cost == brute_force_min_max(costs, n_stages)
    assert list(partition.stage_costs) == [sum(costs[a:b]) for a, b in bounds]


@pytest.mark.parametrize(("n", "stages", "expected"), [
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    (7, 3, [(0, 2), (2, 4), (4, 7)]),
    (5, 5, [(i, i + 1) for i in range(5)]),
])
def test_uniform_cut_by_layer_count(n, stages, expected):
    assert list(partition_layers(n, stages).bounds) == expected


def _model():
    torch.manual_seed(0)
    embed = nn.Embedding(1000, 16)  # 16000 parameters: heavier than everything after it together
    blocks = [nn.Linear(16, 16) for _ in range(6)]  # 272 each
    head = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 1000))  # 32 + 17000
    return [embed, *blocks, head]


def test_by_parameters_gives_first_stage_the_embedding_and_last_the_head():
    layers = _model()
    partition = partition_layers(layers, 3, method="parameters")
    # The head (17032) cannot share a stage without exceeding itself, so the optimum is the head alone; the
    # embedding (16000) keeps at most three blocks (16816 <= 17032 < 17088). Ties are broken arbitrarily.
    costs = [16000, *[272] * 6, 17032]
    assert partition.max_cost == brute_force_min_max(costs, 3) == 17032
    assert partition.bounds[-1] == (7, 8) and partition.bounds[0][0] == 0 and partition.bounds[0][1] <= 4
    stages = build_stages(layers, partition)
    assert stages[0][0] is layers[0] and stages[-1][-1] is layers[-1]
    x = torch.randint(1000, (2, 3))
    for stage in stages:
        x = stage(x)
    assert x.shape == (2, 3, 1000)


def test_measured_costs_feed_the_balanced_cut():
    layers = _model()[1:7]
    costs = measure_layer_costs(layers, torch.randn(4, 16), repeats=2)
    assert len(costs) == 6 and all(c > 0 for c in costs)
    partition = partition_layers(layers, 2, method="cost", costs=costs)
    assert partition.max_cost == pytest.approx(min(max(sum(costs[:k]), sum(costs[k:])) for k in range(1, 6)))


def test_interleaved_placement_and_errors():
    assert stages_of_rank(list(range(8)), rank=1, n_ranks=4) == [1, 5]  # chunk c of rank r is stage c*p + r
    with pytest.raises(LayoutError, match="cannot place 6 stages on n_ranks=4"):
        stages_of_rank(list(range(6)), rank=0, n_ranks=4)
    with pytest.raises(LayoutError, match=r"needs 3 non-negative per-layer costs, got \[1, -1, 2\]"):
        partition_layers(3, 2, method="cost", costs=[1, -1, 2])
    with pytest.raises(LayoutError, match="needs the layer modules"):
        partition_layers(3, 2, method="parameters")
    with pytest.raises(LayoutError, match=r"method='fastest' is not one of \['uniform', 'parameters', 'cost'\]"):
        partition_layers(3, 2, method="fastest")
    with pytest.raises(LayoutError, match="partition covers 4 layers but 3 were given"):
        build_stages(_model()[:3], partition_layers(4, 2))
    assert balanced_bounds([5.0], 1) == [(0, 1)]
