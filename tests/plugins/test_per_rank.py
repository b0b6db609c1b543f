"""Per-rank construction: a model built for rank r of a layout (here on a stand-in grid, in one process) holds
only rank r's pipeline stages and, within them, its TP shards, each exactly the dense model's slice; every other
layer is a placeholder with nothing drawn or allocated; a tied head on the last stage is a declared copy of the
first stage's embedding. On the meta device the same construction counts a rank's exact parameter bytes."""

from __future__ import annotations

import pytest
import torch

from shardline.plugins.grid import Grid, ParallelDims
from shardline.plugins.layers.roles import RoleKind, role_of, tie_key
from shardline.plugins.models.decoder import LayerPlaceholder, hosted_layers
from shardline.plugins.models.gpt import GPT, GPTConfig
from shardline.plugins.models.llama import Llama, LlamaConfig

GPT_CFG = GPTConfig(vocab_size=30, seq_len=8, n_layer=4, n_head=4, d_model=16, tie_embeddings=True)
LLAMA_CFG = LlamaConfig(vocab_size=30, seq_len=8, n_layer=4, n_head=4, n_kv_head=2, d_model=16, d_ff=24,
                        tie_embeddings=True)


def _dense_slice(dense: torch.Tensor, local: torch.Tensor, role, *, tp: int, tp_rank: int) -> torch.Tensor:
    if role.kind is not RoleKind.SHARDED:
        return dense
    padded = list(dense.shape)
    padded[role.dim] = local.shape[role.dim] * tp
    pad = [0, 0] * (dense.dim() - 1 - role.dim) + [0, padded[role.dim] - dense.shape[role.dim]]
    return torch.nn.functional.pad(dense, pad).chunk(tp, dim=role.dim)[tp_rank]


@pytest.mark.parametrize(("cls", "config"), [(GPT, GPT_CFG), (Llama, LLAMA_CFG)], ids=["gpt", "llama"])
@pytest.mark.parametrize(("tp", "pp", "chunks"), [(1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 3, 1)])
def test_each_rank_builds_exactly_its_stages_and_shards(cls, config, tp, pp, chunks):
    dense = dict(cls(config, seed=5).named_parameters())
    dims = ParallelDims(tp * pp, tp=tp, pp=pp)
    covered = set()
    for rank in range(dims.world_size):
        grid = Grid.stand_in(dims, rank=rank)
        model = cls(config, grid=grid, seed=5, chunks=chunks)
        layers = model.pipeline_layers()
        hosted = hosted_layers(len(layers), grid, chunks=chunks)
        for index, layer in enumerate(layers):
            assert isinstance(layer, LayerPlaceholder) == (index not in hosted), (rank, index)
            assert isinstance(layer, LayerPlaceholder) or any(True for _ in layer.parameters())
        for name, param in model.named_parameters():
            key = tie_key(param) if name == "head.weight" else None  # the last stage's copy of the embedding
            want = _dense_slice(dense[key or name].detach(), param, role_of(param), tp=tp, tp_rank=grid.rank("tp"))
            assert torch.equal(param.detach(), want), (rank, name)  # exact: the same draws, sliced
            # in storage of its own: a slice that shares the dense draw's storage keeps the dense weight alive
            assert param.untyped_storage().nbytes() == param.numel() * param.element_size(), (rank, name)
            covered.add(key or name)
        if config.tie_embeddings and grid.is_last_stage and not grid.is_first_stage:
            assert tie_key(model.head.weight) == "embedding.wte.weight"
    assert covered == set(dense)  # together the ranks hold the whole model


def test_meta_construction_counts_a_ranks_parameter_bytes_without_allocating():
    config = LlamaConfig(vocab_size=32000, seq_len=64, n_layer=8, n_head=16, n_kv_head=4, d_model=1024,
                         d_ff=2816)
    dims = ParallelDims(4, tp=2, pp=2)
    total = 0
    for rank in range(4):
        model = Llama(config, grid=Grid.stand_in(dims, rank=rank), device="meta")
        params = list(model.parameters())
        assert all(p.device.type == "meta" for p in params)
        total += sum(p.numel() for p in params)
    dense = sum(p.numel() for p in Llama(config, device="meta").parameters())
    # tp2 x pp2: every element once over the 4 ranks except the replicated norms, held by both TP ranks
    norms = (2 * config.n_layer + 1) * config.d_model
    assert total == dense + norms


def test_a_pipeline_cut_with_more_stages_than_layers_is_refused():
    from shardline.plugins.errors import LayoutError

    with pytest.raises(LayoutError, match=r"cannot cut 6 layers into n_stages=8"):
        GPT(GPT_CFG, grid=Grid.stand_in(ParallelDims(2, pp=2), rank=0), chunks=4)
