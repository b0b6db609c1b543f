"""The strategy's pipeline glue that needs no processes: default micro-batch count, the module contract."""

from __future__ import annotations

import pytest

from shardline.plugins.errors import ContractError, LayoutError
from shardline.plugins.lightning.pipeline_driver import TARGET_BUBBLE, _require, default_microbatches


def _bubble(p: int, v: int, m: int) -> float:
    return (p - 1) / (v * m + p - 1)


@pytest.mark.parametrize(("batch", "p", "v"), [(64, 2, 1), (64, 4, 1), (96, 8, 1), (64, 4, 2), (30, 3, 1)])
def test_default_microbatches_is_the_smallest_divisor_under_the_target_bubble(batch, p, v):
    m = default_microbatches(batch, p=p, v=v)
    assert batch % m == 0 and (v == 1 or m % p == 0)
    assert _bubble(p, v, m) < TARGET_BUBBLE
    smaller = [k for k in range(1, m) if batch % k == 0 and (v == 1 or k % p == 0)]
    assert all(_bubble(p, v, k) >= TARGET_BUBBLE for k in smaller)  # none smaller would do


def test_small_batch_warns_and_uses_every_sample():
    with pytest.warns(UserWarning, match=r"at most m=4 micro-batches at pp=4.*bubble .* = 0.43"):
        assert default_microbatches(4, p=4, v=1) == 4


def test_interleaved_needs_a_multiple_of_pp():
    with pytest.raises(LayoutError, match="batch size 3 cannot be split.*multiple of pp=2"):
        default_microbatches(3, p=2, v=2)


class _NoPipeline:
    def training_step(self, batch, batch_idx):
        return batch


class _HalfPipeline(_NoPipeline):
    def pipeline_layers(self):
        return []


def test_a_module_without_the_pipeline_contract_is_told_what_to_add():
    with pytest.raises(ContractError, match=r"_NoPipeline cannot run with pp > 1: add pipeline_layers, "
                                            r"pipeline_loss"):
        _require(_NoPipeline())
    with pytest.raises(ContractError, match=r"add pipeline_loss to it —"):
        _require(_HalfPipeline())
