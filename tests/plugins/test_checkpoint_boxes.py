"""Box arithmetic of the layout-independent checkpoint, against independent references: a flat range's boxes
against ``torch.arange``, and every kind's canonical pieces of a TP shard against slicing the dense tensor that
``hf._to_hf`` (the Hugging Face exporter, separate code) produces."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.plugins import hf
from shardline.plugins.checkpoint.boxes import (
    Placement,
    canonical_boxes,
    flat_boxes,
    from_canonical,
    intersect,
    relative,
    shift,
    split_rows,
    to_canonical,
    volume,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_flat_boxes_are_exactly_the_range_in_order(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    t = torch.arange(n).reshape(shape)
    boxes = flat_boxes(tuple(shape), start, stop)
    got = [t[tuple(slice(a, b) for a, b in box)].reshape(-1) for box in boxes]
    assert torch.equal(torch.cat(got) if got else torch.empty(0, dtype=t.dtype), torch.arange(start, stop))
    assert len(boxes) <= 2 * len(shape) - 1  # a partial row each side per dim, whole rows once


def test_box_helpers():
    assert intersect(((0, 4), (2, 6)), ((3, 8), (0, 3))) == ((3, 4), (2, 3))
    assert intersect(((0, 2),), ((2, 4),)) is None
    assert relative(((3, 4), (2, 3)), ((2, 5), (0, 6))) == (slice(1, 2), slice(2, 3))
    assert split_rows(((0, 10), (0, 3)), 4) == [((0, 2), (0, 3)), ((2, 5), (0, 3)), ((5, 7), (0, 3)),
                                                 ((7, 10), (0, 3))]
    assert shift(((1, 2), (0, 3)), ((4, 8), (10, 13))) == ((5, 6), (10, 13))
    assert volume(((0, 2), (5, 5))) == 0


def _shards(dense: torch.Tensor, dim: int, tp: int):
    length = dense.shape[dim] // tp
    for r in range(tp):
        box = [(0, n) for n in dense.shape]
        box[dim] = (r * length, (r + 1) * length)
        yield tuple(box), dense.narrow(dim, r * length, length)


@pytest.mark.parametrize("kind, dim, shape, tp", [
    ("plain", 0, (8, 6), 2), ("plain", 1, (6, 8), 4), ("vocab", 0, (64, 6), 4), ("conv1d", 0, (8, 6), 2),
    ("conv1d", 1, (6, 8), 2), ("gpt2_qkv", 0, (3 * 8, 8), 2), ("gpt2_qkv", 0, (3 * 8, 8), 4),
    ("gpt2_qkv_bias", 0, (3 * 8,), 4)])
def test_canonical_pieces_of_every_tp_shard_are_slices_of_the_hf_tensor(kind, dim, shape, tp):
    vocab = 61 if kind == "vocab" else None  # shardline pads 61 rows to 64 for tp 4; the padding is not saved
    dense = torch.randn(shape, dtype=torch.float64)
    if vocab:
        dense[vocab:] = 0
    reference = hf._to_hf(hf.Source("x", kind), dense, vocab=vocab or 0, n_head=4)  # the exporter's own layout
    covered = 0
    for box, local in _shards(dense, dim, tp):
        placement = Placement(kind=kind, dense=tuple(shape), box=box, vocab=vocab, n_head=4)
        assert placement.canonical_shape() == tuple(reference.shape)
        pieces = to_canonical(placement, local)
        assert [b for b, _ in pieces] == canonical_boxes(placement)
        for canonical, piece in pieces:
            assert torch.equal(piece, reference[tuple(slice(a, b) for a, b in canonical)])  # exact: no arithmetic
            covered += volume(canonical)
        assert torch.equal(from_canonical(placement, [p for _, p in pieces], dtype=dense.dtype), local)
    assert covered == reference.numel()  # the shards' pieces tile the canonical tensor exactly
