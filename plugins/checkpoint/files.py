"""The checkpoint on disk: shard files of canonical pieces, a manifest written last, atomic commit, ``latest``.

A checkpoint is a folder::

    manifest.json                 written last: every tensor's global shape and pieces, every file's size and CRC
    rank-00003-000.safetensors    the pieces rank 3 wrote (one or more files of at most ``max_file_bytes``)
    rank-00003.pt                 rank 3's own state (RNG states, engine counters; torch.save of plain values)
    trainer.pt                    the trainer's state (loops, callbacks, schedulers, hparams), from rank 0

A *piece* is a box of one canonical tensor (:mod:`.boxes`) stored as one safetensors entry, with its CRC-32.
Pieces of one tensor never overlap and together cover it exactly (checked at every read).

Saving is atomic (:class:`AtomicSave`): every rank writes into ``.NAME.partial-TOKEN`` beside the final folder;
each file is written, flushed and fsynced; then rank 0 writes the manifest (itself via a temporary name and a
rename), renames the folder to ``NAME`` (an existing ``NAME`` is first moved aside and removed after), and only
then moves the ``latest`` pointer of the parent folder. A save killed at any point leaves the previous checkpoint
and the pointer as they were; :func:`resolve` ignores the partial folder with a warning.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import struct
import warnings
import zlib
from pathlib import Path

import torch

from shardline.plugins.checkpoint.boxes import (
    Box,
    Placement,
    canonical_boxes,
    from_canonical,
    full,
    intersect,
    relative,
    volume,
)
from shardline.plugins.errors import CheckpointError

FORMAT, VERSION = "shardline-checkpoint", 1
MANIFEST, POINTER, TRAINER_FILE = "manifest.json", "latest", "trainer.pt"
#: Test hook: ``PHASE`` or ``PHASE:RANK`` makes that rank SIGKILL itself when the save reaches ``PHASE``
#: (one of ``PHASES``), to prove a save killed anywhere leaves the previous checkpoint loadable.
KILL_ENV = "SHARDLINE_TEST_KILL_SAVE_AT"
PHASES = ("before_shards", "mid_shard", "before_manifest", "before_pointer")

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_NAMES = {v: k for k, v in _DTYPES.items()}


def phase(name: str, rank: int) -> None:
    """The test hook (``KILL_ENV``); nothing happens unless it names this phase (and rank)."""
    want = os.environ.get(KILL_ENV)
    if not want:
        return
    where, _, who = want.partition(":")
    if where == name and (not who or int(who) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


def _bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(_bytes(tensor))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], *, rank: int) -> dict[str, int]:
    """Write ``tensors`` as one safetensors file, streamed tensor by tensor (no second copy in memory), flushed
    and fsynced; returns each key's CRC-32."""
    header, offset = {}, 0
    for key, tensor in tensors:
        if tensor.dtype not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {key!r} has dtype {tensor.dtype}, which a checkpoint cannot hold")
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
    crcs = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for i, (key, tensor) in enumerate(tensors):
            data = _bytes(tensor)
            crcs[key] = zlib.crc32(data)
            f.write(data)
            if i == 0:
                f.flush()
                phase("mid_shard", rank)
        f.flush()
        os.fsync(f.fileno())
    return crcs


def file_crc(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            value = zlib.crc32(chunk, value)
    return value


class ShardWriter:
    """One rank's pieces, written to ``rank-RRRRR-III.safetensors`` files of at most ``max_file_bytes`` each
    (a piece larger than that gets a file alone). ``records`` lists ``(tensor name, shape, dtype, file, key,
    box, crc)`` per piece for the manifest."""

    def __init__(self, folder: Path, *, rank: int, max_file_bytes: int = 1 << 30):
        self.folder, self.rank, self.limit = folder, rank, max_file_bytes
        self.pending: list[tuple[str, torch.Tensor, tuple, str, Box]] = []
        self.size, self.files = 0, 0
        self.records: list[tuple] = []

    def add(self, name: str, shape: tuple[int, ...], box: Box, tensor: torch.Tensor) -> None:
        if volume(box) == 0:
            return
        if tuple(tensor.shape) != tuple(b - a for a, b in box):
            raise CheckpointError(f"piece of {name!r}: tensor {list(tensor.shape)} does not fill box {box}")
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.limit:
            self.flush()
        key = f"{name}@{len(self.records) + len(self.pending)}"
        self.pending.append((key, tensor, tuple(shape), name, box))
        self.size += nbytes

    @property
    def written(self) -> list[str]:
        return [f"rank-{self.rank:05d}-{i:03d}.safetensors" for i in range(self.files)]

    def flush(self) -> None:
        if not self.pending:
            return
        file = f"rank-{self.rank:05d}-{self.files:03d}.safetensors"
        crcs = write_safetensors(self.folder / file, [(key, t) for key, t, *_ in self.pending], rank=self.rank)
        for key, tensor, shape, name, box in self.pending:
            self.records.append((name, list(shape), _DTYPES[tensor.dtype], file, key,
                                 [list(b) for b in box], crcs[key]))
        self.files += 1
        self.pending, self.size = [], 0


def describe_files(folder: Path, names: list[str]) -> dict[str, dict]:
    """Size (and, for the small ``.pt`` files, CRC-32) of each of ``names`` in ``folder``, as the rank that wrote
    them sees them (on a network filesystem another rank's view may lag)."""
    return {name: {"size": (folder / name).stat().st_size,
                   "crc32": None if name.endswith(".safetensors") else file_crc(folder / name)} for name in names}


def build_manifest(records: list[list[tuple]], files: dict[str, dict], meta: dict) -> dict:
    """The manifest from every rank's piece records and the files every rank wrote (:func:`describe_files`)."""
    tensors: dict[str, dict] = {}
    for rank_records in records:
        for name, shape, dtype, file, key, box, value in rank_records:
            entry = tensors.setdefault(name, {"shape": shape, "dtype": dtype, "pieces": []})
            if entry["shape"] != shape or entry["dtype"] != dtype:
                raise CheckpointError(f"ranks disagree on tensor {name!r}: {entry['shape']} {entry['dtype']} vs "
                                      f"{shape} {dtype} (in {file})")
            entry["pieces"].append([file, key, box, value])
    return {"format": FORMAT, "version": VERSION, **meta, "files": dict(sorted(files.items())),
            "tensors": dict(sorted(tensors.items()))}


class AtomicSave:
    """The folder a save writes into, and its commit (module docstring). Every rank calls :meth:`create` and
    writes into :attr:`tmp`; rank 0 calls :meth:`commit`. The folder must be on a filesystem every rank shares."""

    def __init__(self, final: Path, token: str):
        self.final = Path(final)
        self.tmp = self.final.parent / f".{self.final.name}.partial-{token}"

    @staticmethod
    def new_token() -> str:
        return secrets.token_hex(4)

    def create(self) -> None:
        """Make :attr:`tmp` (every rank may call it; the token is new, so the folder is this save's alone)."""
        self.tmp.mkdir(parents=True, exist_ok=True)

    def commit(self, manifest: dict, *, rank: int) -> None:
        phase("before_manifest", rank)
        staged = self.tmp / (MANIFEST + ".tmp")
        with open(staged, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, self.tmp / MANIFEST)
        _fsync_dir(self.tmp)
        old = None
        if self.final.exists():
            old = self.final.parent / f".{self.final.name}.old-{self.tmp.name.rsplit('-', 1)[-1]}"
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        _fsync_dir(self.final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        phase("before_pointer", rank)
        pointer = self.final.parent / (POINTER + ".tmp")
        pointer.write_text(self.final.name + "\n")
        with open(pointer) as f:
            os.fsync(f.fileno())
        os.replace(pointer, self.final.parent / POINTER)
        _fsync_dir(self.final.parent)


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def resolve(path: str | os.PathLike) -> Path:
    """The complete checkpoint folder ``path`` names: a checkpoint itself, or a folder of checkpoints (its
    ``latest`` pointer, else its newest complete checkpoint). Partial saves beside it are ignored with a
    warning; a partial or missing one named directly raises CheckpointError."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    if path.is_dir() and ((not path.name.startswith(".") and (path / POINTER).exists()) or _complete(path)
                          or any(".partial-" in p.name for p in path.iterdir())):
        return _newest(path)
    if path.is_dir() and any(path.iterdir()) and not (path / TRAINER_FILE).exists():
        raise CheckpointError(f"{path}: not a shardline checkpoint (no {MANIFEST}) nor a folder of them")
    moved = sorted(path.parent.glob(f".{path.name}.old-*")) if path.parent.is_dir() else []
    if moved and is_checkpoint(moved[-1]):
        warnings.warn(f"{path} is missing but {moved[-1].name} is complete (a save replacing it was "
                      "interrupted between two renames); loading that", stacklevel=2)
        return moved[-1]
    if path.is_dir():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {MANIFEST}, which a save writes last): "
                              "the save that wrote it was interrupted")
    raise CheckpointError(f"{path}: no such checkpoint")


def _complete(root: Path) -> list[Path]:
    """The complete checkpoints in the folder ``root``."""
    return [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and is_checkpoint(p)]


def _newest(root: Path) -> Path:
    """In a folder of checkpoints: the one its ``latest`` pointer names, else the newest complete one; its
    partial saves are ignored with a warning."""
    for partial in sorted(root.glob(".*.partial-*")):
        warnings.warn(f"ignoring the partial checkpoint {partial} (a save was interrupted before its manifest "
                      "was committed)", stacklevel=3)
    pointer = root / POINTER
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if is_checkpoint(target):
            return target
        warnings.warn(f"{pointer} names {target.name}, which is not a complete checkpoint; using the newest "
                      "complete one", stacklevel=3)
    complete = _complete(root)
    if not complete:
        raise CheckpointError(f"{root}: holds no complete checkpoint")
    return max(complete, key=lambda p: (p / MANIFEST).stat().st_mtime_ns)


class CheckpointReader:
    """Reads boxes of canonical tensors from a checkpoint folder, verifying every piece it touches (its CRC) and
    that the pieces cover each box exactly. Raises CheckpointError naming the file and the tensor."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        try:
            self.manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{self.folder}: no {MANIFEST} (not a checkpoint, or an interrupted save)") from None
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{path}: not a readable manifest ({error})") from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise CheckpointError(f"{path}: format {self.manifest.get('format')!r} version "
                                  f"{self.manifest.get('version')!r}; this shardline reads {FORMAT!r} {VERSION}")
        for name, info in self.manifest["files"].items():
            file = self.folder / name
            if not file.is_file():
                raise CheckpointError(f"{file}: listed in the manifest but missing")
            if file.stat().st_size != info["size"]:
                raise CheckpointError(f"{file}: {file.stat().st_size} bytes, the manifest says {info['size']} "
                                      "(truncated or replaced)")
        self.tensors: dict[str, dict] = self.manifest["tensors"]
        self._headers: dict[str, tuple[int, dict]] = {}
        self._verified: set[tuple[str, str]] = set()

    def _header(self, file: str) -> tuple[int, dict]:
        """``(where the data starts, the safetensors header)`` of one of the checkpoint's files."""
        if file not in self._headers:
            path = self.folder / file
            try:
                with open(path, "rb") as f:
                    size = struct.unpack("<Q", f.read(8))[0]
                    header = json.loads(f.read(size))
            except (OSError, ValueError, struct.error) as error:
                raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None
            self._headers[file] = (8 + size, header)
        return self._headers[file]

    def small_file(self, name: str):
        """A ``.pt`` file of plain values, its CRC checked against the manifest."""
        path = self.folder / name
        info = self.manifest["files"].get(name)
        if info is None:
            raise CheckpointError(f"{path}: not listed in the manifest")
        if file_crc(path) != info["crc32"]:
            raise CheckpointError(f"{path}: CRC-32 does not match the manifest (damaged)")
        return torch.load(path, map_location="cpu", weights_only=False)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """The ``box`` (default: all) of canonical tensor ``name``, in the dtype it was saved in."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.folder}: no tensor {name!r} in the checkpoint")
        entry = self.tensors[name]
        box = full(entry["shape"]) if box is None else tuple(tuple(b) for b in box)
        exact = [p for p in entry["pieces"] if tuple(tuple(b) for b in p[2]) == box]
        if exact:  # the piece is the box (a load in the saving layout): no assembly, no second copy
            file, key, piece_box, value = exact[0]
            return self._piece(file, key, value, name, box)
        out = torch.empty(tuple(b - a for a, b in box), dtype=_NAMES[entry["dtype"]])
        covered = 0
        for file, key, piece_box, value in entry["pieces"]:
            piece_box = tuple(tuple(b) for b in piece_box)
            common = intersect(box, piece_box)
            if common is None:
                continue
            data = self._piece(file, key, value, name, piece_box)
            out[relative(common, box)] = data[relative(common, piece_box)]
            covered += volume(common)
        if covered != volume(box):
            raise CheckpointError(f"{self.folder}: tensor {name!r} box {box}: its pieces cover {covered} of "
                                  f"{volume(box)} elements (a piece is missing or two overlap)")
        return out

    def read_part(self, name: str, placement: Placement) -> torch.Tensor:
        """The part ``placement.box`` of canonical tensor ``name`` in shardline's own layout (its canonical
        pieces read and reassembled, :func:`~.boxes.from_canonical`)."""
        pieces = [self.read(name, box) for box in canonical_boxes(placement)]
        return from_canonical(placement, pieces, dtype=pieces[0].dtype if pieces else torch.float32)

    def _piece(self, file: str, key: str, value: int, name: str, box: Box) -> torch.Tensor:
        """One piece, read with one sequential ``readinto`` (the kernel reads ahead; a memory map would fault
        page by page on a cold file) and its CRC checked the first time."""
        start, header = self._header(file)
        info = header.get(key)
        path = self.folder / file
        if not isinstance(info, dict) or info.get("dtype") not in _NAMES:
            raise CheckpointError(f"{path}: tensor {name!r} (entry {key!r}) is not in the file's header")
        shape, (a, b) = tuple(info["shape"]), info["data_offsets"]
        if shape != tuple(hi - lo for lo, hi in box):
            raise CheckpointError(f"{path}: tensor {name!r} (entry {key!r}) has shape {list(shape)}, the manifest "
                                  f"says box {box}")
        data = torch.empty(b - a, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(start + a)
            got = f.readinto(memoryview(data.numpy())) if b > a else 0
        if got != b - a:
            raise CheckpointError(f"{path}: tensor {name!r} (entry {key!r}) is cut short ({got} of {b - a} bytes)")
        if (file, key) not in self._verified:
            if crc(data) != value:
                raise CheckpointError(f"{path}: tensor {name!r} (entry {key!r}) is damaged: its CRC-32 does not match "
                                      "the manifest")
            self._verified.add((file, key))
        return data.view(_NAMES[info["dtype"]]).reshape(shape)


__all__ = ["AtomicSave", "CheckpointReader", "FORMAT", "KILL_ENV", "MANIFEST", "PHASES", "POINTER",
           "ShardWriter", "build_manifest", "crc", "describe_files", "is_checkpoint", "phase", "resolve"]
