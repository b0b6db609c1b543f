"""grid.mpu with real DeepSpeed ZeRO 1/2/3 on 4 gloo ranks at tp=2: the partitions are over the dp group only."""

from __future__ import annotations

import math

import deepspeed  # a hard dependency: a broken install must fail here, not skip
import torch
import torch.distributed as dist

from shardline.plugins.grid import Grid, ParallelDims
from shardline.plugins.testing import run_ranks

N_PARAMS = 10 * 30 + 30 + 30 * 7 + 7  # the model below: 547 parameters


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 30), torch.nn.Linear(30, 7))


def _zero_partitions(rank, world, stages, use_mpu):
    grid = Grid.build(ParallelDims(world, tp=2))
    deepspeed.init_distributed(dist_backend="gloo")
    out = {"coords": grid.coords, "mpu": {}}
    mpu = grid.mpu
    out["mpu"] = {name: getattr(mpu, name)() for name in (
        "get_data_parallel_world_size", "get_data_parallel_rank", "get_data_parallel_group_ranks",
        "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank", "get_model_parallel_world_size",
        "get_sequence_data_parallel_world_size", "get_pipeline_model_parallel_world_size",
        "get_tensor_model_parallel_src_rank")}
    for stage in stages:
        model = _model()
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": stage}}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=config, mpu=mpu if use_mpu else None)
        initial = [t.detach().clone() for t in optimizer.single_partition_of_fp32_groups] if stage != 3 else []
        x = torch.randn(2, 10, generator=torch.Generator().manual_seed(grid.rank("dp")))  # one replica, one batch
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        if stage == 3:
            shards = [p.ds_tensor.detach().clone() for p in engine.module.parameters()]
        else:
            shards = [t.detach().clone() for t in optimizer.single_partition_of_fp32_groups]
        out[stage] = {"dp_world": engine.dp_world_size, "zero_group": dist.get_process_group_ranks(
            engine.seq_data_parallel_group), "shards": shards, "initial": initial,
            "full": torch.cat([p.detach().reshape(-1) for p in _model().parameters()])}
    return out


def _expected_flat_partition(dp: int) -> int:
    # ZeRO-1/2 pad the flat fp32 buffer to dp * 2 elements (DeepSpeed's start-alignment factor for 4-byte types).
    return math.ceil(N_PARAMS / (2 * dp)) * 2


def test_zero_shards_over_dp_only_with_grid_mpu():
    results = run_ranks(_zero_partitions, 4, (1, 2, 3), True, timeout=180)
    for rank, res in enumerate(results):
        assert res["mpu"]["get_data_parallel_world_size"] == 2
        assert res["mpu"]["get_tensor_model_parallel_world_size"] == 2
        assert res["mpu"]["get_model_parallel_world_size"] == 2  # tp x pp = 2 x 1
        assert res["mpu"]["get_sequence_data_parallel_world_size"] == 2  # dp x cp = 2 x 1
        assert res["mpu"]["get_pipeline_model_parallel_world_size"] == 1
        assert res["mpu"]["get_data_parallel_group_ranks"] == [rank % 2, rank % 2 + 2]
        assert res["mpu"]["get_tensor_model_parallel_src_rank"] == rank - rank % 2
        for stage in (1, 2):
            assert res[stage]["dp_world"] == 2
            assert res[stage]["zero_group"] == [rank % 2, rank % 2 + 2]  # the dp group, never the tp pair
            assert [s.numel() for s in res[stage]["shards"]] == [_expected_flat_partition(2)]
        sizes3 = [s.numel() for s in res[3]["shards"]]
        assert sizes3 == [math.ceil(n / 2) for n in (300, 30, 210, 7)]
    # TP twins (ranks 0 and 1: same dp rank) hold identical shards: the partition never splits a TP pair.
    for stage in (1, 2, 3):
        for a, b in ((0, 1), (2, 3)):
            dp_rank = a // 2
            for n, sa, sb in zip((300, 30, 210, 7), results[a][stage]["shards"], results[b][stage]["shards"]):
                # ZeRO-3 pads a parameter's last shard with uninitialised memory: compare the real elements.
                valid = sa.numel() if stage != 3 else min(sa.numel(), n - dp_rank * math.ceil(n / 2))
                assert torch.equal(sa[:valid], sb[:valid])  # exact: TP twins ran the same replicated computation
    for stage in (1, 2):
        # Before the first step, the dp ranks' fp32 shards laid end to end are the model's parameter vector.
        joined = torch.cat([results[0][stage]["initial"][0], results[2][stage]["initial"][0]])
        assert torch.equal(joined[:N_PARAMS], results[0][stage]["full"])  # exact: a copy, no arithmetic


def test_without_mpu_zero_would_shard_over_tp_ranks_too():
    # The counterfactual that motivates grid.mpu: DeepSpeed alone partitions over all 4 ranks.
    results = run_ranks(_zero_partitions, 4, (1,), False, timeout=120)
    for res in results:
        assert res[1]["dp_world"] == 4
        assert res[1]["zero_group"] == [0, 1, 2, 3]
        assert [s.numel() for s in res[1]["shards"]] == [_expected_flat_partition(4)]
