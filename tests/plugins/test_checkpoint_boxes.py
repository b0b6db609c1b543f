"""Box arithmetic of the layout-independent checkpoint, against independent references: a flat range's boxes
against ``torch.arange``, and every kind's canonical pieces of a TP shard against slicing the dense tensor in
Hugging Face's layout as :func:`_hf_layout` (written here, apart from the library's transforms) makes it."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.plugins.checkpoint import reader as reader_module
from shardline.plugins.checkpoint.boxes import (
    Placement,
    canonical_boxes,
    canonical_tensor,
    flat_boxes,
    from_canonical,
    intersect,
    relative,
    shift,
    split_rows,
    to_canonical,
    volume,
)
from shardline.plugins.checkpoint.reader import CheckpointReader


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


def _hf_layout(kind: str, dense: torch.Tensor, *, vocab: int, n_head: int) -> torch.Tensor:
    """A whole dense shardline tensor in Hugging Face's layout: the reference the library's transforms must match."""
    if kind == "vocab":
        return dense[:vocab]
    if kind == "conv1d":
        return dense.t()
    if kind in ("gpt2_qkv", "gpt2_qkv_bias"):
        d_model = dense.shape[0] // 3
        head_dim = d_model // n_head
        grouped = dense.reshape(n_head, 3, head_dim, *dense.shape[1:]).transpose(0, 1)  # (3, heads, hd, ...)
        flat = grouped.reshape(3 * d_model, *dense.shape[1:])
        return flat if kind == "gpt2_qkv_bias" else flat.t()
    return dense


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
    reference = _hf_layout(kind, dense, vocab=vocab or 0, n_head=4)  # Hugging Face's layout
    whole = Placement(kind=kind, dense=tuple(shape), box=tuple((0, n) for n in shape), vocab=vocab, n_head=4)
    assert torch.equal(canonical_tensor(whole, dense), reference)  # what save_pretrained writes
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


def test_read_part_of_a_vocab_tensor_into_out_reads_its_rows_in_place_and_zeroes_the_padding(tmp_path, monkeypatch):
    """A vocabulary tensor (37 canonical rows, padded to 40 over tp 4): each rank's part read into ``out`` equals
    ``from_canonical`` of its rows (padding zeros), with no whole-part copy into ``out``."""
    from shardline.plugins.checkpoint.boxes import Placement, from_canonical

    w = torch.randn(37, 6, generator=torch.Generator().manual_seed(1))
    folder, _ = _save(tmp_path, {"embed": (w, _rows(37, 6, [10, 20, 30]))})
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: copies.append(self.shape)
                        or real_copy(self, src, *a, **k))
    with CheckpointReader(folder) as reader:
        for rank in range(4):  # rows [10 r, 10 r + 10): the last rank holds 7 real rows and 3 padding rows
            p = Placement("vocab", (40, 6), ((10 * rank, 10 * rank + 10), (0, 6)), vocab=37)
            rows = min(37, 10 * rank + 10) - 10 * rank
            want = from_canonical(p, [w[10 * rank:10 * rank + rows]], dtype=w.dtype)
            out = torch.full((10, 6), float("nan"))
            assert reader.read_part("embed", p, out=out) is out and torch.equal(out, want), rank
            assert torch.equal(reader.read_part("embed", p), want)
        past = Placement("vocab", (40, 6), ((37, 40), (0, 6)), vocab=37)  # padding only: nothing read
        out = torch.full((3, 6), float("nan"))
        assert torch.equal(reader.read_part("embed", past, out=out), torch.zeros(3, 6))
    assert copies == []  # read straight into out: no temporary copied over


@pytest.mark.parametrize("mapped", [True, False])
def test_a_large_piece_is_crc_checked_chunk_by_chunk_on_the_crc_thread(tmp_path, monkeypatch, mapped):
    import crc32c

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
    assert manifest["checksum"] == "crc32c"
    assert piece[3] == crc32c.crc32c(big[:100].numpy().tobytes())  # the writer's CRC (its thread) is the bytes'
    with CheckpointReader(folder, mapped=mapped) as reader:
        assert torch.equal(reader.read("big"), big)
    assert threads and all(t.startswith("shardline-crc") for t in threads)  # each chunk CRC'd off the reader
    # One flipped byte deep in the first piece (its 7th chunk): the read names the file and the tensor.
    file = folder / piece[0]
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    data = bytearray(file.read_bytes())
    data[8 + header_len + 6 * (1 << 16) + 123] ^= 0x01
    file.write_bytes(bytes(data))
    with CheckpointReader(folder, mapped=mapped) as reader, pytest.raises(CheckpointError) as caught:
        reader.read("big")
    assert f"{file}: tensor 'big' (entry {piece[1]!r}) is damaged" in str(caught.value)
    # Cut short after the reader checked the sizes: named too, and the CRC thread is left idle.
    with CheckpointReader(folder, mapped=mapped) as reader:
        file.write_bytes(bytes(data[:8 + header_len + 5 * (1 << 16)]))
        with pytest.raises(CheckpointError, match="'big'.*is cut short"):
            reader.read("big")
    assert files._worker().submit(lambda: 7).result() == 7


def test_the_manifest_is_the_dict_and_a_partial_folder_is_refused(tmp_path):

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


def test_a_pointer_that_names_a_missing_folder_falls_back_to_the_newest_complete_one(tmp_path):
    """What a commit's single fsync after its two renames relies on: a crash that made the pointer's rename
    durable but not the folder's leaves ``latest`` naming a folder that is not there (or still a partial one).
    The folder of checkpoints then resolves, with a warning, to its newest complete checkpoint: the previous."""
    import os
    import time

    from shardline.plugins.checkpoint import files

    w = torch.arange(6.0).reshape(2, 3)
    first, _ = _save(tmp_path, {"w": (w, _rows(2, 3, []))})
    old = tmp_path / "older"
    first.rename(old)  # two complete checkpoints, "older" before "ck"
    os.utime(old / files.MANIFEST, ns=(time.time_ns() - 10**9,) * 2)
    second, _ = _save(tmp_path, {"w": (w + 1, _rows(2, 3, []))})
    (tmp_path / files.POINTER).write_text("ck-next\n")  # the pointer moved, the folder's rename was lost
    (tmp_path / ".ck-next.partial-0123abcd").mkdir()
    with pytest.warns(UserWarning, match=r"latest names ck-next, which is not a complete checkpoint"):
        assert files.resolve(tmp_path) == second
    with CheckpointReader(files.resolve(tmp_path)) as reader:
        assert torch.equal(reader.read("w"), w + 1)


def test_a_reader_that_refused_its_folder_closes_cleanly(tmp_path, monkeypatch):
    """A reader whose constructor raised (no manifest) is still collected without an error in ``__del__``: its
    open files are set up before anything can refuse."""
    import gc
    import sys

    from shardline.plugins.errors import CheckpointError

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        CheckpointReader(tmp_path / "nothing-here")
    gc.collect()
    assert unraisable == []


@pytest.mark.parametrize("kind", ["plain", "vocab"])
def test_read_range_fills_one_buffer_with_the_flat_range(tmp_path, kind):
    from shardline.plugins.checkpoint.names import Entry
    from shardline.plugins.lightning.checkpoint_access import read_range

    w = torch.randn(7, 5, generator=torch.Generator().manual_seed(2))
    saved = [b for r in ((0, 12), (12, 23), (23, 35)) for b in flat_boxes((7, 5), *r)]  # 3 ZeRO partitions
    folder, _ = _save(tmp_path, {"w": (w, saved)})
    dense = (8, 5) if kind == "vocab" else (7, 5)  # a vocabulary padded to 8 rows: the padding reads as zeros
    ref = torch.cat([w, torch.zeros(1, 5)]) if kind == "vocab" else w
    entry = Entry(path="w", name="w", tensor=torch.empty(0), writes=True, is_param=True,
                  placement=Placement(kind=kind, dense=dense, box=((0, dense[0]), (0, 5)), vocab=7))
    size = (folder / files_of(folder)[0]).stat().st_size
    for mapped in (False, True):
        with CheckpointReader(folder, mapped=mapped) as reader:
            for start, stop in [(0, 12), (12, 23), (3, 31), (0, dense[0] * 5), (30, 40 if kind == "vocab" else 35),
                                (7, 8)]:
                got = read_range(reader, entry, "w", start, stop)
                assert got.dtype == w.dtype and torch.equal(got, ref.reshape(-1)[start:stop]), (start, stop)
                # a saved partition, short of the padding rows, is one view of the file's map
                assert (got.untyped_storage().nbytes() == size) == (mapped and (start, stop) in ((0, 12), (12, 23)))


def test_a_saved_zero_range_read_in_its_own_layout_is_one_view_of_the_map(tmp_path):
    """A ZeRO partition's flat range read back in the layout that saved it: its 2-3 boxes lie back to back in the
    rank's file, so the range is one view of the file's map (no fresh memory, no copy), each box still CRC-checked;
    another range, or a reader that does not map, reads into fresh memory with the same values; a damaged box of
    the range is named."""
    from shardline.plugins.checkpoint.names import Entry
    from shardline.plugins.errors import CheckpointError
    from shardline.plugins.lightning.checkpoint_access import read_range

    w = torch.randn(7, 5, generator=torch.Generator().manual_seed(4))
    parts = ((0, 12), (12, 23), (23, 35))
    folder, manifest = _save(tmp_path, {"w": (w, [b for r in parts for b in flat_boxes((7, 5), *r)])})
    size = (folder / manifest["tensors"]["w"]["pieces"][0][0]).stat().st_size
    entry = Entry(path="w", name="w", tensor=torch.empty(0), writes=True, is_param=True,
                  placement=Placement(kind="plain", dense=(7, 5), box=((0, 7), (0, 5))))
    for mapped in (True, False):
        with CheckpointReader(folder, mapped=mapped) as reader:
            for start, stop in (*parts, (3, 31)):
                got = read_range(reader, entry, "w", start, stop)
                assert torch.equal(got, w.reshape(-1)[start:stop]), (mapped, start, stop)
                one_view = got.untyped_storage().nbytes() == size  # the whole file's map is its storage
                assert one_view == (mapped and (start, stop) in parts), (mapped, start, stop)
        assert torch.equal(got, w.reshape(-1)[3:31])  # still valid after the reader closed
    file, key = manifest["tensors"]["w"]["pieces"][3][:2]  # the 2nd partition's 2nd box
    raw = bytearray((folder / file).read_bytes())
    data_start = 8 + int.from_bytes(raw[:8], "little")
    raw[data_start + json.loads(raw[8:data_start])[key]["data_offsets"][0]] ^= 0x20
    (folder / file).write_bytes(bytes(raw))
    with CheckpointReader(folder, mapped=True) as reader:
        assert torch.equal(read_range(reader, entry, "w", 0, 12), w.reshape(-1)[:12])
        with pytest.raises(CheckpointError, match=rf"tensor 'w' \(entry {key!r}\) is damaged"):
            read_range(reader, entry, "w", 12, 23)


def test_a_mapped_file_that_changes_or_cannot_be_mapped_is_named_or_read_without_the_map(tmp_path, monkeypatch):
    """The ways a mapped read can go wrong: a file cut short after its map was made is named "cut short" (a read
    past its end would be SIGBUS), one written in place after its values were read is refused by verify(), one
    the system cannot map is read with readinto, and negative data offsets in a header are refused by name."""
    import errno
    import mmap as mmap_module

    from shardline.plugins.errors import CheckpointError

    a = torch.arange(4096, dtype=torch.float32)
    b = torch.arange(4096, 8192, dtype=torch.float32)
    folder, manifest = _save(tmp_path, {"a": (a, [((0, 4096),)]), "b": (b, [((0, 4096),)])})
    file = folder / manifest["tensors"]["a"]["pieces"][0][0]
    assert file.name == manifest["tensors"]["b"]["pieces"][0][0]  # one file, a then b
    raw = file.read_bytes()
    with CheckpointReader(folder, mapped=True) as reader:
        assert torch.equal(reader.read("a"), a)  # the file is mapped now
        with open(file, "r+b") as f:  # the same inode, cut before b's bytes
            f.truncate(len(raw) - 4096)
        with pytest.raises(CheckpointError, match="'b'.*is cut short"):
            reader.read("b")
    file.write_bytes(raw)
    os.utime(file, ns=(0, 0))  # an old modification time: the write below surely changes it
    with CheckpointReader(folder, mapped=True, defer_checks=True) as reader:
        got = reader.read("b")
        assert got.untyped_storage().nbytes() == len(raw)  # a view of the map
        with open(file, "r+b") as f:  # 4 bytes of b's last element, in place
            f.seek(len(raw) - 4)
            f.write(b"\xff\xff\xff\x7f")
        with pytest.raises(CheckpointError, match=f"{file}: the file changed while it was read"):
            reader.verify()
    file.write_bytes(raw)

    def no_map(*args, **kwargs):
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(mmap_module, "mmap", no_map)
    with CheckpointReader(folder, mapped=True, defer_checks=True) as reader:
        got = reader.read("b")
        reader.verify()
        assert torch.equal(got, b) and got.untyped_storage().nbytes() == b.numel() * 4  # memory of its own
    monkeypatch.undo()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    key = manifest["tensors"]["a"]["pieces"][0][1]
    header[key]["data_offsets"] = [-16384, 0]
    header.pop("__metadata__", None)  # room for the minus sign: the file keeps its size
    text = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)
    assert len(text) == header_len
    file.write_bytes(raw[:8] + text + raw[8 + header_len:])
    for mapped in (True, False):
        with CheckpointReader(folder, mapped=mapped) as reader, pytest.raises(CheckpointError) as caught:
            reader.read("a")
        assert f"{file}: tensor 'a' (entry {key!r}): data_offsets [-16384, 0]" in str(caught.value)


def files_of(folder) -> list[str]:
    """The checkpoint's safetensors files, by name."""
    return sorted(f for f in json.loads((folder / "manifest.json").read_text())["files"] if f.endswith(".safetensors"))


def _reference_crcs():
    """Each checksum's independent implementation: zlib's CRC-32, the crc32c package's CRC-32C."""
    import zlib

    import crc32c

    return {"crc32": zlib.crc32, "crc32c": crc32c.crc32c}


def test_the_checksums_are_the_standard_crcs():
    from shardline.plugins.checkpoint.crc import ALGORITHMS, WRITTEN

    # The CRC catalogue's check values (the CRC of b"123456789") for CRC-32/ISO-HDLC and CRC-32/ISCSI.
    assert ALGORITHMS["crc32"].of(b"123456789") == 0xCBF43926
    assert ALGORITHMS["crc32c"].of(b"123456789") == 0xE3069283
    assert WRITTEN.name == "crc32c"


def test_without_the_crc32c_package_a_save_and_a_read_are_refused_by_name(tmp_path, monkeypatch):
    from shardline.plugins.checkpoint import crc, files
    from shardline.plugins.errors import CheckpointError

    folder, _ = _save(tmp_path, {"w": (torch.ones(2, 3), [((0, 2), (0, 3))])})
    monkeypatch.setattr(crc, "_hardware_crc32c", None)
    with pytest.raises(CheckpointError, match=r"ck/manifest.json: CRC-32C checksums need the 'crc32c' package"):
        CheckpointReader(folder)
    with pytest.raises(CheckpointError, match=r"saving a checkpoint into .*/new: CRC-32C checksums need the 'crc32c'"):
        files.ShardWriter(tmp_path / "new", rank=0)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["crc32", "crc32c"]), st.binary(max_size=3000), st.binary(max_size=3000),
       st.integers(1, 700))
def test_crc_combine_and_chunked_are_the_crc_of_the_whole(name, a, b, chunk):
    from shardline.plugins.checkpoint.crc import ALGORITHMS

    crc, ref = ALGORITHMS[name], _reference_crcs()[name]
    assert crc.combine(ref(a), ref(b), len(b)) == ref(a + b)
    whole, parts = crc.chunked(a + b, chunk)
    assert whole == ref(a + b)
    assert parts == [ref((a + b)[i:i + chunk]) for i in range(0, len(a + b), chunk)]


def test_a_version_1_checkpoint_of_zlibs_crc32_reads_and_bad_versions_or_checksums_are_refused(tmp_path,
                                                                                                 monkeypatch):
    """Version 1 (before the ``checksum`` field) holds zlib's CRC-32 everywhere: its pieces, chunks and
    (trusted) pickled state file read, and damage to it is still found; untrusted, the pickle is refused,
    naming it. A version-2 manifest without ``checksum``, an unknown checksum and an unknown version are
    refused, naming the manifest."""
    import io
    import zlib

    from shardline.plugins.checkpoint import crc, files
    from shardline.plugins.errors import CheckpointError

    monkeypatch.setattr(files, "CHUNK", 256)
    monkeypatch.setattr(files, "WRITTEN", crc.LEGACY)  # write as before the field
    w = torch.randn(100, 7, generator=torch.Generator().manual_seed(5))
    folder, manifest = _save(tmp_path, {"w": (w, _rows(100, 7, [60]))})
    buffer = io.BytesIO()
    torch.save({"step": 3}, buffer)
    small = files.write_small(buffer.getbuffer(), folder / files.LEGACY_TRAINER_FILE)
    monkeypatch.undo()
    assert manifest["checksum"] == "crc32" and small == zlib.crc32(buffer.getbuffer())
    first = manifest["tensors"]["w"]["pieces"][0]
    assert first[3] == zlib.crc32(w[:60].numpy().tobytes())  # an independent CRC-32 of the piece's bytes
    assert manifest["chunk_crc32"]["pieces"][first[0]][first[1]][0] == zlib.crc32(w[:60].numpy().tobytes()[:256])
    old = {k: v for k, v in manifest.items() if k != "checksum"}
    old["version"] = 1
    old["files"][files.LEGACY_TRAINER_FILE] = {"size": len(buffer.getbuffer()), "crc32": small}
    (folder / files.MANIFEST).write_text(json.dumps(old))
    with CheckpointReader(folder) as reader:
        assert reader.checksum is crc.LEGACY
        assert torch.equal(reader.read("w", ((70, 80), (0, 7))), w[70:80])  # chunks: a partial read
        assert len(reader._verified_chunks) == 2 and not reader._verified
        assert torch.equal(reader.read("w"), w)
        assert reader.state_file(files.TRAINER_FILE, trust_pickle=True) == {"step": 3}
        with pytest.raises(CheckpointError, match=r"trainer.pt: a pickle \(this checkpoint is format version 1.*"
                                                  r"shardline convert --migrate --trust"):
            reader.state_file(files.TRAINER_FILE)
    file, key = first[:2]
    raw = bytearray((folder / file).read_bytes())
    raw[-3] ^= 0x40  # the file's last piece
    (folder / file).write_bytes(bytes(raw))
    with CheckpointReader(folder) as reader, pytest.raises(CheckpointError, match="'w'.*is damaged"):
        reader.read("w")
    for bad, match in (({**old, "checksum": "md5"}, r"manifest.json: checksum 'md5' is not one this shardline reads"),
                       ({**old, "version": 2}, r"manifest.json: version 2 names its checksum, this manifest has no"),
                       ({**old, "version": 4}, r"manifest.json: format 'shardline-checkpoint' version 4; this "
                                               r"shardline reads 'shardline-checkpoint' versions 1, 2, 3")):
        (folder / files.MANIFEST).write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=match):
            CheckpointReader(folder)


def _count_reads(reader) -> list[int]:
    """Bytes each ``readinto`` of ``reader`` returned, and each view of a file's map it took, from now on."""
    counts: list[int] = []
    real, span = reader._handle, reader._span

    def counted_span(path, offset, nbytes):
        view = span(path, offset, nbytes)
        counts.append(0 if view is None else view.numel())
        return view

    reader._span = counted_span

    class Counting:
        def __init__(self, handle):
            self.handle = handle

        def seek(self, *args):
            return self.handle.seek(*args)

        def read(self, *args):
            return self.handle.read(*args)

        def fileno(self):
            return self.handle.fileno()

        def readinto(self, buf):
            n = self.handle.readinto(buf)
            counts.append(n)
            return n

    reader._handle = lambda path: Counting(real(path))
    return counts


@pytest.mark.parametrize("mapped", [True, False])
def test_rows_of_a_large_piece_read_only_their_chunks_each_checked(tmp_path, monkeypatch, mapped):
    """A 100 x 7 float32 piece (2800 bytes) in 256-byte chunks (11 CRCs in the manifest): rows 40-50 read 2 chunks
    (bytes 1120-1400); damage outside them is not read, damage inside is named with its chunk; a manifest without
    chunk CRCs (older writer) reads the whole piece, with the same values."""

    from shardline.plugins.checkpoint import files
    from shardline.plugins.errors import CheckpointError

    monkeypatch.setattr(files, "CHUNK", 256)
    w = torch.randn(100, 7, generator=torch.Generator().manual_seed(2))
    folder, manifest = _save(tmp_path, {"w": (w, [((0, 100), (0, 7))]), "small": (w[:2], [((0, 2), (0, 7))])})
    (file, key, _, _), = manifest["tensors"]["w"]["pieces"]
    crcs = manifest["chunk_crc32"]["pieces"][file][key]
    assert manifest["chunk_crc32"]["bytes"] == 256 and len(crcs) == 11
    assert all(k.startswith("w@") for k in manifest["chunk_crc32"]["pieces"][file])  # 56 bytes: no chunks
    box = ((40, 50), (2, 5))
    with CheckpointReader(folder, mapped=mapped) as reader:
        counts = _count_reads(reader)
        assert torch.equal(reader.read("w", box), w[40:50, 2:5])
        assert sum(counts) == 512  # chunks 4 and 5
        assert torch.equal(reader.read("w", ((0, 100), (0, 7))), w)  # then whole: all of it, checked
        assert sum(counts) == 512 + 2800
        assert torch.equal(reader.read("w", ((10, 12), (0, 7))), w[10:12])  # checked already: its chunk only
        assert sum(counts) == 512 + 2800 + 256
    with open(folder / file, "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
    raw = bytearray((folder / file).read_bytes())
    offset = dict(json.loads(raw[8:data_start]))[key]["data_offsets"][0]

    def flipped(at: int) -> None:
        damaged = bytearray(raw)
        damaged[data_start + offset + at] ^= 0x10
        (folder / file).write_bytes(bytes(damaged))

    flipped(100)  # chunk 0: not among the rows read
    with CheckpointReader(folder, mapped=mapped) as reader:
        assert torch.equal(reader.read("w", box), w[40:50, 2:5])
        with pytest.raises(CheckpointError, match=r"tensor 'w' .* is damaged"):
            reader.read("w")
    flipped(1300)  # chunk 5: named
    with CheckpointReader(folder, mapped=mapped) as reader, pytest.raises(CheckpointError) as caught:
        reader.read("w", box)
    assert f"{folder / file}: tensor 'w' (entry {key!r}) is damaged: chunk 5 of 11" in str(caught.value)
    spans = json.dumps(json.loads(raw[8:data_start])[key]["data_offsets"], separators=(",", ":")).encode()
    assert raw.count(spans) == 1 and spans.endswith(b"0]")
    (folder / file).write_bytes(bytes(raw).replace(spans, spans[:-2] + b"4]"))  # a damaged header, same length
    with (CheckpointReader(folder, mapped=mapped) as reader,
          pytest.raises(CheckpointError, match=r"data_offsets .* do not hold")):
        reader.read("w", box)
    (folder / file).write_bytes(bytes(raw))
    old = json.loads((folder / files.MANIFEST).read_text())
    del old["chunk_crc32"]
    (folder / files.MANIFEST).write_text(json.dumps(old))
    with CheckpointReader(folder, mapped=mapped) as reader:
        counts = _count_reads(reader)
        assert torch.equal(reader.read("w", box), w[40:50, 2:5]) and sum(counts) == 2800
    for bad, match in (({"bytes": 0, "pieces": {}}, "'chunk_crc32' is not"),
                       ({"bytes": True, "pieces": {}}, "'chunk_crc32' is not"),
                       ({"bytes": 256, "pieces": {file: {key: crcs[:-1]}}}, "lists 10 chunk CRCs for 2800 bytes"),
                       ({"bytes": 256, "pieces": {file: {key: 7}}}, "lists chunk CRCs 7 for 2800 bytes")):
        (folder / files.MANIFEST).write_text(json.dumps({**old, "chunk_crc32": bad}))
        with pytest.raises(CheckpointError, match=match):
            with CheckpointReader(folder, mapped=mapped) as reader:
                reader.read("w", box)


def test_a_state_file_reads_back_and_is_refused_when_damaged_or_unlisted(tmp_path):
    from shardline.plugins.checkpoint import files, state
    from shardline.plugins.errors import CheckpointError

    folder, manifest = _save(tmp_path, {"w": (torch.ones(2, 3), [((0, 2), (0, 3))])})
    data = state.encode({"loops": {"step": 7}, "rng": torch.arange(5)})
    crc = files.write_small(data, folder / files.TRAINER_FILE)
    manifest["files"][files.TRAINER_FILE] = {"size": len(data), "crc32": crc}
    (folder / files.MANIFEST).write_text(json.dumps(manifest))
    with CheckpointReader(folder) as reader:
        got = reader.state_file(files.TRAINER_FILE)
        assert got["loops"] == {"step": 7} and torch.equal(got["rng"], torch.arange(5))
        with pytest.raises(CheckpointError, match=r"rank-00009-state.safetensors: not listed in the manifest"):
            reader.state_file(files.rank_file(9))
    raw = bytearray((folder / files.TRAINER_FILE).read_bytes())
    raw[len(raw) // 2] ^= 0x20
    (folder / files.TRAINER_FILE).write_bytes(bytes(raw))
    with CheckpointReader(folder) as reader, pytest.raises(
            CheckpointError, match=rf"{files.TRAINER_FILE}: its CRC does not match the manifest \(damaged\)"):
        reader.state_file(files.TRAINER_FILE)


def test_deferred_checks_return_the_bytes_at_once_and_verify_names_the_damage(tmp_path, monkeypatch):
    """``defer_checks``: reads return before their CRCs finish; :meth:`verify` waits for every one and raises on
    the first damaged piece or chunk, naming it; what was checked and passed counts as verified."""
    from shardline.plugins.checkpoint import files
    from shardline.plugins.errors import CheckpointError

    monkeypatch.setattr(files, "CHUNK", 256)
    w = torch.randn(100, 7, generator=torch.Generator().manual_seed(6))  # 2800 bytes: 11 chunks
    folder, manifest = _save(tmp_path, {"w": (w, [((0, 100), (0, 7))]), "v": (w[:3].clone(), [((0, 3), (0, 7))])})
    with CheckpointReader(folder, defer_checks=True) as reader:
        assert torch.equal(reader.read("w"), w) and torch.equal(reader.read("w", ((40, 50), (0, 7))), w[40:50])
        # still to come: the whole piece's check; rows 40-50 read after it are not CRC'd again
        assert len(reader._pending) == 1 and not reader._verified and not reader._verified_chunks
        reader.verify()
        assert not reader._pending and len(reader._verified) == 1 and not reader._queued
    file, key = manifest["tensors"]["w"]["pieces"][0][:2]
    raw = bytearray((folder / file).read_bytes())
    with open(folder / file, "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
    offset = json.loads(raw[8:data_start])[key]["data_offsets"][0]
    raw[data_start + offset + 5 * 256 + 9] ^= 0x04  # chunk 5 of w
    (folder / file).write_bytes(bytes(raw))
    for box, match in ((((40, 50), (0, 7)), "chunk 5 of 11 does not match"), (None, "its CRC does not match")):
        with CheckpointReader(folder, defer_checks=True) as reader:
            got = reader.read("w", box)  # no raise: the check is deferred
            assert got.shape == ((10, 7) if box else (100, 7))
            assert torch.equal(reader.read("v"), w[:3])
            with pytest.raises(CheckpointError, match=rf"tensor 'w' \(entry {key!r}\) is damaged: {match}"):
                reader.verify()
            assert not reader._pending and len(reader._verified) == 1  # v's check passed and counts
        with CheckpointReader(folder) as reader, pytest.raises(CheckpointError, match=match):
            reader.read("w", box)  # the default: checked before the read returns
    # Over PENDING_BYTES read into memory waiting, the oldest check is waited for at once; its failure still
    # comes from verify. Mapped reads hold no memory of their own (page cache): they do not count.
    monkeypatch.setattr(reader_module, "PENDING_BYTES", 1000)
    with CheckpointReader(folder, defer_checks=True, mapped=True) as reader:
        reader.read("w")
        reader.read("v")
        assert len(reader._pending) == 2 and reader._pending_bytes == 0
        with pytest.raises(CheckpointError, match="'w'.*is damaged: its CRC does not match"):
            reader.verify()
    with CheckpointReader(folder, defer_checks=True, mapped=False) as reader:
        reader.read("w")  # 2800 bytes: alone in the queue, it stays
        assert len(reader._pending) == 1
        reader.read("v")
        assert [p[4] for p in reader._pending] == [(file, manifest["tensors"]["v"]["pieces"][0][1])]
        assert reader._failed is not None and not reader._verified  # w's, settled early, kept for verify
        with pytest.raises(CheckpointError, match="'w'.*is damaged: its CRC does not match"):
            reader.verify()
        assert len(reader._verified) == 1 and reader._failed is None
    # Leaving without verify(): close() waits for the CRCs, and the reader says nothing was verified.
    with pytest.warns(UserWarning, match="1 deferred CRC checks were never verified"):
        with CheckpointReader(folder, defer_checks=True) as reader:
            reader.read("v")
    assert not reader._pending


@pytest.mark.parametrize("mapped", [True, False])
def test_a_zero3_range_of_a_tp_piece_reads_about_its_own_bytes(tmp_path, monkeypatch, mapped):
    """The resharding case the chunks are for: a tensor saved as 2 tensor-parallel row halves, read as the 4
    flat ZeRO-3 ranges of another layout; each range reads its own bytes plus at most a chunk at either end."""
    from shardline.plugins.checkpoint import files

    monkeypatch.setattr(files, "CHUNK", 1024)
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(3))  # 12 KiB
    folder, _ = _save(tmp_path, {"w": (w, _rows(64, 48, [32]))})
    flat = w.reshape(-1)
    for part in range(4):
        start, stop = part * 768 - (5 if part else 0), (part + 1) * 768 + (7 if part < 3 else 0)
        with CheckpointReader(folder, mapped=mapped) as reader:
            counts = _count_reads(reader)
            got = torch.cat([reader.read("w", box).reshape(-1) for box in flat_boxes((64, 48), start, stop)])
        assert torch.equal(got, flat[start:stop]), part
        assert sum(counts) <= 4 * (stop - start) + 4 * 1024, (part, sum(counts))


def test_set_state_adopts_a_value_read_for_it_alone_and_copies_a_view():
    """ZeRO-0's optimizer state is set from the loaded tensor itself when it owns its storage (no second copy, as
    torch's Optimizer.load_state_dict adopts the loaded tensors); a view of a larger buffer is copied, so the
    state does not keep the rest of the buffer alive."""
    from shardline.plugins.checkpoint.names import Entry
    from shardline.plugins.lightning.checkpoint_access import Access

    param = torch.nn.Parameter(torch.zeros(4, 3))
    optimizer = torch.optim.AdamW([param])
    access = Access(optimizer)
    entry = Entry(path="w", name="w", tensor=param, writes=True, is_param=True,
                  placement=Placement(kind="plain", dense=(4, 3), box=((0, 4), (0, 3))))
    own = torch.randn(4, 3)
    access.set_state(entry, "exp_avg", own, step=5)
    assert optimizer.state[param]["exp_avg"].data_ptr() == own.data_ptr() \
        and float(optimizer.state[param]["step"]) == 5.0
    bigger = torch.randn(10, 3)
    access.set_state(entry, "exp_avg_sq", bigger[2:6], step=5)
    state = optimizer.state[param]["exp_avg_sq"]
    assert torch.equal(state, bigger[2:6]) and state.untyped_storage().data_ptr() != bigger.untyped_storage().data_ptr()
    flat = torch.randn(12)  # a whole buffer of another shape: reshaped, still adopted
    access.set_state(entry, "exp_avg", flat, step=5)
    assert optimizer.state[param]["exp_avg"].data_ptr() == flat.data_ptr()
    assert torch.equal(optimizer.state[param]["exp_avg"], flat.reshape(4, 3))


@pytest.mark.parametrize("replicas", [1, 2])
def test_private_pieces_share_no_memory_and_are_copied_once(monkeypatch, replicas):
    """An asynchronous save's pieces (``Access.pieces(private=True)``) share no memory with the weights or the
    optimizer state, and each value is copied once: the whole value where one replica writes it, only the
    replica's rows where two do (those rows were a copy already). A synchronous save's (``private=False``) are
    views of the live tensors where one replica writes them: no copy at all. ZeRO-0 in float32 on a real torch
    AdamW after a step: the whole-value path."""
    from shardline.plugins.checkpoint.names import Entry
    from shardline.plugins.lightning.checkpoint_access import Access

    param = torch.nn.Parameter(torch.randn(6, 5))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.randn(6, 5)
    optimizer.step()
    live = [param, *(optimizer.state[param][k] for k in ("exp_avg", "exp_avg_sq"))]
    storages = {t.untyped_storage().data_ptr() for t in live}
    entry = Entry(path="w", name="w", tensor=param, writes=True, is_param=True,
                  placement=Placement(kind="plain", dense=(6, 5), box=((0, 6), (0, 5))))
    clones, real = [], torch.Tensor.clone

    def counted(self, *args, **kwargs):
        clones.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counted)
    for private in (False, True):
        clones.clear()
        got = [list(Access(optimizer).pieces(entry, ["exp_avg", "exp_avg_sq"], replicas=replicas, replica=r,
                                             private=private)) for r in range(replicas)]
        for r, pieces in enumerate(got):
            assert [name for name, _, _ in pieces] == ["w", "optimizer.exp_avg/w", "optimizer.exp_avg_sq/w"]
            for (name, box, piece), value in zip(pieces, live, strict=True):
                assert torch.equal(piece, value.detach()[relative(box, ((0, 6), (0, 5)))]), (name, r)
            shared = [piece.untyped_storage().data_ptr() in storages for _, _, piece in pieces]
            assert shared == [not private and replicas == 1] * 3, (private, r)
        # a copy per value: whole (6, 5) values with one replica, (3, 5) rows with two; none for a sync save's
        # single replica
        want = ([(6, 5)] * 3 if private else []) if replicas == 1 else [(3, 5)] * 3 * replicas
        assert clones == want, (private, clones)
