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


# --- the files: written by ShardWriter and AtomicSave, read back by CheckpointReader, in one process ----------

def _save(root, tensors: dict[str, tuple[torch.Tensor, list]], *, max_file_bytes=1 << 30):
    """A committed checkpoint ``root / "ck"`` holding each ``name: (whole tensor, its piece boxes)``."""
    from shardline.plugins.checkpoint import files

    target = files.AtomicSave(root / "ck", files.AtomicSave.new_token())
    target.create()
    writer = files.ShardWriter(target.tmp, rank=0, max_file_bytes=max_file_bytes)
    for name, (whole, boxes) in tensors.items():
        for box in boxes:
            writer.add(name, tuple(whole.shape), box, whole[relative(box, tuple((0, n) for n in whole.shape))])
    writer.flush()
    files.fsync_all(writer.paths)
    manifest = files.build_manifest([writer.records], files.describe_files(target.tmp, writer.written),
                                    {"world_size": 1})
    target.commit(manifest, rank=0)
    return root / "ck", manifest


def _rows(n_rows: int, cols: int, cuts: list[int]) -> list:
    edges = [0, *cuts, n_rows]
    return [((a, b), (0, cols)) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def test_read_into_out_is_the_plain_read_and_its_boxes_are_slices(tmp_path):
    from shardline.plugins.checkpoint.files import CheckpointReader

    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 11, generator=g)
    ranged = flat_boxes((37, 11), 5, 37 * 11 - 4)  # a ZeRO partition's pieces: partial rows both ends
    folder, _ = _save(tmp_path, {"w": (w, _rows(37, 11, [9, 20])), "z": (w.double(), flat_boxes((37, 11), 0, 5)
                                                                         + ranged + flat_boxes((37, 11), 403, 407))})
    with CheckpointReader(folder) as reader:
        assert torch.equal(reader.read("w"), w) and torch.equal(reader.read("z"), w.double())
        for name, ref in (("w", w), ("z", w.double())):
            for box in [((0, 37), (0, 11)), ((9, 20), (0, 11)), ((3, 30), (2, 9)), ((20, 21), (0, 11)),
                        ((0, 1), (5, 11)), *ranged]:
                want = ref[relative(box, ((0, 37), (0, 11)))]
                out = torch.full(want.shape, float("nan"), dtype=ref.dtype)
                got = reader.read(name, box, out=out)
                assert got is out and torch.equal(out, want), (name, box)
                assert torch.equal(reader.read(name, box), want)
        cast = torch.zeros(37, 11, dtype=torch.float64)
        assert reader.read("w", out=cast) is cast and torch.equal(cast, w.double())  # a cast: into out too
        with pytest.raises(Exception, match="out= has shape"):
            reader.read("w", ((0, 2), (0, 11)), out=torch.empty(3, 11))


def test_a_large_piece_is_crc_checked_chunk_by_chunk_on_the_crc_thread(tmp_path, monkeypatch):
    import zlib

    from shardline.plugins.checkpoint import files
    from shardline.plugins.errors import CheckpointError

    monkeypatch.setattr(files, "CHUNK", 1 << 16)  # 64 KiB chunks: a 1 MiB piece is 16 of them
    big = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))
    threads = []
    real = files._RunningCrc._add
    monkeypatch.setattr(files._RunningCrc, "_add", lambda self, data: (threads.append(
        __import__("threading").current_thread().name), real(self, data)))
    folder, manifest = _save(tmp_path, {"big": (big, _rows(256, 1024, [100]))})
    piece = manifest["tensors"]["big"]["pieces"][0]
    assert piece[3] == zlib.crc32(big[:100].numpy().tobytes())  # the writer's CRC (its thread) is the bytes'
    with files.CheckpointReader(folder) as reader:
        assert torch.equal(reader.read("big"), big)
    assert threads and all(t.startswith("shardline-crc") for t in threads)  # each chunk CRC'd off the reader
    # One flipped byte deep in the first piece (its 7th chunk): the read names the file and the tensor.
    file = folder / piece[0]
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    data = bytearray(file.read_bytes())
    data[8 + header_len + 6 * (1 << 16) + 123] ^= 0x01
    file.write_bytes(bytes(data))
    with files.CheckpointReader(folder) as reader, pytest.raises(CheckpointError) as caught:
        reader.read("big")
    assert f"{file}: tensor 'big' (entry {piece[1]!r}) is damaged" in str(caught.value)
    # Cut short after the reader checked the sizes: named too, and the CRC thread is left idle.
    with files.CheckpointReader(folder) as reader:
        file.write_bytes(bytes(data[:8 + header_len + 5 * (1 << 16)]))
        with pytest.raises(CheckpointError, match="'big'.*is cut short"):
            reader.read("big")
    assert files._worker().submit(lambda: 7).result() == 7


def test_the_manifest_is_the_dict_and_a_partial_folder_is_refused(tmp_path):
    import json

    from shardline.plugins.checkpoint import files
    from shardline.plugins.errors import CheckpointError

    w = torch.arange(12.0).reshape(3, 4)
    folder, manifest = _save(tmp_path, {"w": (w, _rows(3, 4, [1])), "v": (w[0], [((0, 4),)])})
    assert json.loads((folder / files.MANIFEST).read_text()) == manifest
    assert (tmp_path / files.POINTER).read_text().strip() == "ck" and not (tmp_path / "latest.tmp").exists()
    partial = tmp_path / ".ck2.partial-0123abcd"
    partial.mkdir()
    (partial / files.MANIFEST).write_text("{")  # a torn manifest in a save's temporary folder
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        files.resolve(partial)
    with pytest.warns(UserWarning, match="ignoring the partial checkpoint"):
        assert files.resolve(tmp_path) == folder


def test_a_reader_that_refused_its_folder_closes_cleanly(tmp_path, monkeypatch):
    """A reader whose constructor raised (no manifest) is still collected without an error in ``__del__``: its
    open files are set up before anything can refuse."""
    import gc
    import sys

    from shardline.plugins.checkpoint.files import CheckpointReader
    from shardline.plugins.errors import CheckpointError

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        CheckpointReader(tmp_path / "nothing-here")
    gc.collect()
    assert unraisable == []


@pytest.mark.parametrize("kind", ["plain", "vocab"])
def test_read_range_fills_one_buffer_with_the_flat_range(tmp_path, kind):
    from shardline.plugins.checkpoint.files import CheckpointReader
    from shardline.plugins.checkpoint.names import Entry
    from shardline.plugins.lightning.checkpoint_access import read_range

    w = torch.randn(7, 5, generator=torch.Generator().manual_seed(2))
    saved = [b for r in ((0, 12), (12, 23), (23, 35)) for b in flat_boxes((7, 5), *r)]  # 3 ZeRO partitions
    folder, _ = _save(tmp_path, {"w": (w, saved)})
    dense = (8, 5) if kind == "vocab" else (7, 5)  # a vocabulary padded to 8 rows: the padding reads as zeros
    ref = torch.cat([w, torch.zeros(1, 5)]) if kind == "vocab" else w
    entry = Entry(path="w", name="w", tensor=torch.empty(0), writes=True, is_param=True,
                  placement=Placement(kind=kind, dense=dense, box=((0, dense[0]), (0, 5)), vocab=7))
    with CheckpointReader(folder) as reader:
        for start, stop in [(0, 12), (12, 23), (3, 31), (0, dense[0] * 5), (30, 40 if kind == "vocab" else 35),
                            (7, 8)]:
            got = read_range(reader, entry, "w", start, stop)
            assert got.dtype == w.dtype and torch.equal(got, ref.reshape(-1)[start:stop]), (start, stop)
