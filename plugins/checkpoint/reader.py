"""Reading a checkpoint (:mod:`.files` has the format and the writing side): :class:`CheckpointReader` reads boxes
of canonical tensors from a committed checkpoint folder, each piece checked against its CRC in the manifest.

One file, one class: reading, mapping, read-ahead and the CRC checks (inline or on the CRC thread, deferred to
:meth:`CheckpointReader.verify`) share the reader's open files, maps and pending checks.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import math
import mmap
import os
import stat
import struct
import warnings
from pathlib import Path

import torch

from shardline.plugins.checkpoint import files, state
from shardline.plugins.checkpoint.boxes import (
    Box,
    Placement,
    TensorKind,
    canonical_boxes,
    full,
    intersect,
    read_part,
    relative,
    volume,
)
from shardline.plugins.checkpoint.crc import LEGACY, algorithm
from shardline.plugins.checkpoint.files import _NAMES, FORMAT, MANIFEST, READS
from shardline.plugins.errors import CheckpointError

#: A deferred-check reader waits for its oldest CRCs while more than this many bytes read into memory are
#: waiting for one, so that temporaries read for a box are not all kept alive when the reads outrun the CRC
#: thread (a mapped read's bytes are the page cache's, which the kernel can drop: they do not count).
PENDING_BYTES = 256 << 20
# madvise(MADV_WILLNEED) before a mapped span is read (Linux, macOS; None elsewhere): the kernel reads the span
# ahead in one go instead of faulting it in page by page, which a cold load's CRC pass would otherwise wait on
_WILLNEED = getattr(mmap, "MADV_WILLNEED", None)
WILLNEED_MIN = 128 << 10


def _fill(handle, view) -> int:
    """Read into all of ``view`` (a filesystem may return short reads before the end); the bytes read, fewer only
    at the end of the file."""
    got = 0
    while got < len(view):
        n = handle.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _count(value) -> bool:
    """A whole number >= 0 (not a bool), as the manifest's sizes, shapes and CRCs are."""
    return type(value) is int and value >= 0


def _identity(stat: os.stat_result) -> tuple[int, int]:
    """What tells an open file from the same file written to since: its size and modification time (the reader
    stats its own handle, whose device and inode cannot change)."""
    return stat.st_size, stat.st_mtime_ns


class CheckpointReader:
    """Reads boxes of canonical tensors from a checkpoint folder, verifying every piece it touches (its CRC) and
    that the pieces cover each box exactly. Raises CheckpointError naming the file and the tensor.

    ``mapped=True`` (what a load uses; the default is False): a piece read whole (or some rows of it) is returned as
    a view of a private, copy-on-write memory map of its file instead of being read into fresh memory: the kernel's
    page-cache pages are mapped, not copied, and no anonymous memory is faulted in and zeroed for it (that
    fault-in can cost more than the read itself). Writing to such a view copies the pages it touches (the
    file never changes); the view stays valid after :meth:`close`, and the map goes when the last view does. A
    caller that keeps a value (an optimizer state) must copy it (:func:`~shardline.plugins.layers.tp_comm.owned`
    does: the view's storage is the whole file), or a deleted checkpoint's disk space stays held; ``torch.save`` of
    such a view writes the whole file (it saves storages); and every page read through a map stays in the process's
    RSS (reclaimable) while the map lives. Hence the default: a reader whose values a caller keeps, saves or streams
    (``shardline convert``) reads into memory of their own. A read into ``out=``, a piece not aligned to its dtype,
    and ``mapped=False`` read with ``readinto``; so does a file the system cannot map. Each span is read ahead
    with ``madvise(MADV_WILLNEED)``. A mapped value is read twice: by its CRC and again when it is used, from the
    same page-cache pages. A file cut short after it was mapped reads with ``readinto`` (and is named "cut short");
    :meth:`verify` refuses a file whose size or modification time changed since it was mapped. What it cannot see:
    a write between :meth:`verify` and the use of a value, and a page the kernel dropped and read again from a
    device that now returns other bytes (a value read into memory of its own is checked as used). A file truncated
    while one of its views is in use raises SIGBUS, as any memory-mapped reader (safetensors,
    ``torch.load(mmap=True)``) does. shardline never rewrites a committed checkpoint in place.

    ``defer_checks=True``: a read returns once its bytes are in memory, its CRCs still running on the CRC thread;
    :meth:`verify` waits for all of them and raises on the first mismatch. For a caller that reads everything
    before it uses anything (a load: nothing is set before every rank has verified): the reads no longer wait,
    piece by piece, for the CRC of each piece's last chunk. Until :meth:`verify` returns, what a read returned
    (or wrote into ``out=``) is unchecked and must not be written to: the CRC may still be reading it. Without
    it (the default) every read is checked before it returns."""

    def __init__(self, folder: str | os.PathLike, *, defer_checks: bool = False, mapped: bool = False):
        self._files: dict[Path, object] = {}  # first: close() (and __del__) must work on a reader that refused
        # each file's memory map, its bytes as a uint8 tensor and as a memoryview over it, and its identity
        # (``mapped``, :meth:`_map`)
        self._maps: dict[Path, tuple[mmap.mmap, torch.Tensor, tuple, memoryview] | None] = {}
        self.mapped = mapped
        # deferred checks, oldest first: (callable giving the CRC, want, message, verified set, key, bytes)
        self._pending: collections.deque[tuple] = collections.deque()
        self._queued: set[tuple] = set()  # their keys: checks to come count as made (a piece is CRC'd once)
        self._pending_bytes, self._failed = 0, None
        self.defer_checks = defer_checks
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        try:
            self.manifest = json.loads(files.confined(self.folder, MANIFEST, what="the folder").read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{self.folder}: no {MANIFEST} (not a checkpoint, or an interrupted save)") from None
        except (OSError, ValueError, RecursionError) as error:
            raise CheckpointError(f"{path}: not a readable manifest ({str(error)[:200]})") from None
        version = self.manifest.get("version") if isinstance(self.manifest, dict) else None
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT or version not in READS:
            found = self.manifest.get("format") if isinstance(self.manifest, dict) else None
            raise CheckpointError(f"{path}: format {repr(found)[:80]} version {repr(version)[:80]}; this "
                                  f"shardline reads {FORMAT!r} versions {', '.join(map(str, READS))}")
        if version >= 2 and "checksum" not in self.manifest:
            raise CheckpointError(f"{path}: version {version} names its checksum, this manifest has no 'checksum'")
        for key in ("files", "tensors"):
            if not isinstance(self.manifest.get(key), dict):
                raise CheckpointError(f"{path}: no {key!r} table (a manifest maps its files and its tensors)")
        self.version = version
        where = str(self.folder)
        for name, info in self.manifest["files"].items():  # one stat per file (a load makes a reader per rank)
            files.confined(self.folder, name, what=f"{MANIFEST}'s 'files'")
            if not isinstance(info, dict) or type(info.get("size")) is not int:
                raise CheckpointError(f"{path}: file {name!r} has no size ({str(info)[:80]})")
            try:
                found = os.stat(os.path.join(where, name))
            except OSError:
                found = None
            if found is None or not stat.S_ISREG(found.st_mode):
                raise CheckpointError(f"{self.folder / name}: listed in the manifest but missing")
            if found.st_size != info["size"]:
                raise CheckpointError(f"{self.folder / name}: {found.st_size} bytes, the manifest says "
                                      f"{info['size']} (truncated or replaced)")
        self.tensors: dict[str, dict] = self.manifest["tensors"]
        self.checksum = algorithm(self.manifest["checksum"], path) if "checksum" in self.manifest else LEGACY
        self.checksum.require(path)
        self._crc = self.checksum.direct()  # the CRC function itself (checked present just now)
        self._headers: dict[str, tuple[int, dict]] = {}
        self._paths: dict[str, Path] = {}
        self._boxes: dict[str, list[tuple[str, str, Box, int]]] = {}
        self._checked_tensors: dict[str, tuple[tuple[int, ...], str]] = {}
        self._by_box: dict[str, dict[Box, tuple[str, str, int]]] = {}  # read_flat's, per tensor
        self._verified: set[tuple[str, str]] = set()
        self._verified_chunks: set[tuple[str, str, int]] = set()
        chunks = self.manifest.get("chunk_crc32")
        if chunks is not None and not (isinstance(chunks, dict) and type(chunks.get("bytes")) is int
                                       and chunks["bytes"] > 0 and chunks["bytes"] % 8 == 0
                                       and isinstance(chunks.get("pieces"), dict)):
            raise CheckpointError(f"{path}: 'chunk_crc32' is not {{'bytes': N, 'pieces': {{...}}}}")
        self._chunk_bytes = chunks["bytes"] if chunks else 0
        self._chunks: dict[str, dict[str, list[int]]] = chunks["pieces"] if chunks else {}

    def _path(self, file: str) -> Path:
        """The path of one of the checkpoint's files (made once: a load asks for it per piece); only a file the
        manifest lists (each confined to the folder when the reader was made)."""
        path = self._paths.get(file)
        if path is None:
            if not isinstance(file, str) or file not in self.manifest["files"]:
                raise CheckpointError(f"{self.folder / MANIFEST}: a piece names the file {str(file)[:200]!r}, which "
                                      "its 'files' do not list")
            path = self._paths[file] = self.folder / file
        return path

    def _header(self, file: str) -> tuple[int, dict]:
        """``(where the data starts, the safetensors header)`` of one of the checkpoint's files."""
        if file not in self._headers:
            path = self._path(file)
            try:
                f = self._handle(path)
                f.seek(0)
                size = struct.unpack("<Q", f.read(8))[0]
                room = os.fstat(f.fileno()).st_size - 8
                if size > room:
                    raise ValueError(f"its header length field says {size} bytes, the file has {room} after it")
                header = json.loads(f.read(size))
            except (OSError, ValueError, struct.error, RecursionError) as error:
                raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None
            self._headers[file] = (8 + size, header)
        return self._headers[file]

    def has_state(self, name: str) -> bool:
        """Whether the checkpoint holds the state file ``name`` (:func:`.files.rank_file`, ``TRAINER_FILE``),
        under its version 1-2 name in such a checkpoint."""
        return (name if self.version >= files.DATA_STATE else files.legacy_name(name)) in self.manifest["files"]

    def state_file(self, name: str, *, trust_pickle: bool = False):
        """The value of the state file ``name`` (:mod:`.state`), its CRC checked against the manifest.

        A version 1-2 checkpoint holds it as a ``torch.save`` pickle (:func:`.files.legacy_name`), which is
        unpickled only with ``trust_pickle`` (unpickling runs whatever code the file names); without it,
        CheckpointError naming the file and the way to migrate it."""
        if self.version >= files.DATA_STATE:
            return state.decode(self._small_bytes(name), path=str(self.folder / name))
        legacy = files.legacy_name(name)
        if not trust_pickle:
            raise CheckpointError(
                f"{self.folder / legacy}: a pickle (this checkpoint is format version {self.version}, whose state "
                "files are torch.save pickles; unpickling one runs whatever code its author put in it), so it is not "
                "loaded. If you trust whoever wrote this checkpoint, rewrite it as a version "
                f"{files.VERSION} checkpoint, which holds no pickle: shardline convert --migrate --trust "
                f"{self.folder} NEW_FOLDER")
        data = self._small_bytes(legacy)
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except Exception as error:  # noqa: BLE001 - whatever the unpickler raised, named with the file
            raise CheckpointError(f"{self.folder / legacy}: not a readable torch.save file ({error})") from None

    def _small_bytes(self, name: str) -> bytes:
        """The bytes of the small file ``name``, checked against the manifest's size and CRC."""
        path = self.folder / name
        info = self.manifest["files"].get(name)
        if info is None:
            raise CheckpointError(f"{path}: not listed in the manifest")
        data = path.read_bytes()
        if len(data) != info["size"] or self.checksum.of(data) != info.get("crc32"):
            raise CheckpointError(f"{path}: its CRC does not match the manifest (damaged)")
        return data

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensor(name)[0]

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype name (``"F32"``) tensor ``name`` was saved in."""
        return self._tensor(name)[1]

    def _tensor(self, name: str) -> tuple[tuple[int, ...], str]:
        """``(shape, dtype name)`` of tensor ``name``, its manifest entry checked once (a misshapen one is a
        CheckpointError naming it, never a KeyError or TypeError from deep inside a read)."""
        made = self._checked_tensors.get(name)
        if made is not None:
            return made
        if name not in self.tensors:
            raise CheckpointError(f"{self.folder}: no tensor {name!r} in the checkpoint")
        entry = self.tensors[name]

        def bad(what: str) -> CheckpointError:
            return CheckpointError(f"{self.folder / MANIFEST}: tensor {name!r}: {what}")

        if not isinstance(entry, dict):
            raise bad(f"its entry is a {type(entry).__name__}, not {{'shape', 'dtype', 'pieces'}}")
        shape, dtype, pieces = entry.get("shape"), entry.get("dtype"), entry.get("pieces")
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            raise bad(f"shape {str(shape)[:80]} is not a list of whole numbers >= 0")
        if not isinstance(dtype, str) or dtype not in _NAMES:
            raise bad(f"dtype {str(dtype)[:40]!r} is not one of {sorted(_NAMES)}")
        if not isinstance(pieces, list):
            raise bad(f"pieces {str(pieces)[:80]} is not a list")
        for piece in pieces:
            ok = isinstance(piece, list) and len(piece) == 4 and isinstance(piece[0], str) \
                and isinstance(piece[1], str) and _count(piece[3]) and isinstance(piece[2], list) \
                and len(piece[2]) == len(shape) and all(
                    isinstance(ab, list) and len(ab) == 2 and _count(ab[0]) and _count(ab[1]) and ab[0] <= ab[1] <= n
                    for ab, n in zip(piece[2], shape, strict=False))
            if not ok:
                raise bad(f"piece {str(piece)[:120]} is not [file, key, box inside {shape}, crc]")
        made = self._checked_tensors[name] = (tuple(shape), dtype)
        return made

    def read(self, name: str, box: Box | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``box`` (default: all) of canonical tensor ``name``, in the dtype it was saved in; or, with
        ``out`` (a tensor of the box's shape, any dtype), written into ``out`` and ``out`` returned. Pieces read
        straight into ``out`` (or into the result) wherever their place there is contiguous: a load in the saving
        layout, or whole rows of the tensor, costs no copy."""
        whole, dtype_name = self._tensor(name)
        box = full(whole) if box is None else tuple(map(tuple, box))
        shape, dtype = tuple(b - a for a, b in box), _NAMES[dtype_name]
        if out is not None and tuple(out.shape) != shape:
            raise CheckpointError(f"{self.folder}: tensor {name!r} box {box}: out= has shape {list(out.shape)}, "
                                  f"not {list(shape)}")
        if out is not None and (out.dtype != dtype or not out.is_contiguous()):
            return out.copy_(self.read(name, box))  # a cast (or a strided target): read, then one copy
        pieces = self._pieces(name)
        exact = [p for p in pieces if p[2] == box]
        if exact:  # the piece is the box (a load in the saving layout): no assembly, no second copy
            file, key, piece_box, value = exact[0]
            return self._piece(file, key, value, name, box, out=out)
        result = torch.empty(shape, dtype=dtype) if out is None else out
        covered = 0
        for file, key, piece_box, value in pieces:
            common = intersect(box, piece_box)
            if common is None:
                continue
            target = result[relative(common, box)]
            if common == piece_box and target.is_contiguous():  # the whole piece, to one run of ``result``
                self._piece(file, key, value, name, piece_box, out=target)
            elif self._few_rows(file, key, common, piece_box):  # only the chunks holding the rows needed
                r0, r1 = (c - piece_box[0][0] for c in common[0])
                rows = self._rows(file, key, name, piece_box, r0, r1)
                target.copy_(rows[(slice(None), *relative(common[1:], piece_box[1:]))])
            else:
                target.copy_(self._piece(file, key, value, name, piece_box)[relative(common, piece_box)])
            covered += volume(common)
        if covered != volume(box):
            raise CheckpointError(f"{self.folder}: tensor {name!r} box {box}: its pieces cover {covered} of "
                                  f"{volume(box)} elements (a piece is missing or two overlap)")
        return result

    def read_flat(self, name: str, boxes: list[Box]) -> torch.Tensor | None:
        """``boxes`` of canonical tensor ``name`` flattened and joined, as one view of a file's map, where each
        box is one of its pieces and they lie back to back in one file in this order (a ZeRO partition's range
        loaded in the layout that saved it: :func:`~shardline.plugins.lightning.checkpoint_access.read_range`);
        each piece is checked as :meth:`read` checks it. None where they do not (or the reader does not map):
        read them one by one."""
        if not self.mapped or name not in self.tensors or not boxes:
            return None
        by_box = self._by_box.get(name)
        if by_box is None:
            by_box = self._by_box[name] = {box: (file, key, value) for file, key, box, value in self._pieces(name)}
        found = []
        for box in boxes:
            try:
                hit = by_box.get(box)
            except TypeError:  # a box of lists: the manifest's boxes are tuples here
                hit = by_box.get(tuple(map(tuple, box)))
            if hit is None:
                return None
            found.append(hit)
        file = found[0][0]
        if len(found) > 1 and any(f != file for f, _, _ in found):
            return None
        spans = [self._entry(file, key, name, box) for (_, key, _), box in zip(found, boxes, strict=True)]
        path, start, _, dtype, (a, _) = spans[0]
        if len(spans) > 1 and (any(d != dtype for *_, d, _ in spans)
                               or any(x[4][1] != y[4][0] for x, y in zip(spans, spans[1:]))):
            return None
        whole = self._span(path, start + a, spans[-1][4][1] - a) if (start + a) % dtype.itemsize == 0 else None
        if whole is None:
            return None
        for (_, key, value), (*_, (lo, hi)) in zip(found, spans, strict=True):
            self._check_mapped(path, file, key, value, name, start + lo, start + hi)  # each piece's own CRC
        return whole.view(dtype)

    def _pieces(self, name: str) -> list[tuple[str, str, Box, int]]:
        """``name``'s pieces from the manifest, their boxes as tuples (made once per tensor)."""
        made = self._boxes.get(name)
        if made is None:
            self._tensor(name)  # the entry checked
            made = self._boxes[name] = [(file, key, tuple(map(tuple, box)), value)
                                        for file, key, box, value in self.tensors[name]["pieces"]]
        return made

    def read_part(self, name: str, placement: Placement, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The part ``placement.box`` of canonical tensor ``name`` in shardline's own layout (its canonical
        pieces read and reassembled, :func:`~.boxes.from_canonical`); with ``out`` (shaped like the box), into
        it. A ``plain`` part is read straight into ``out``, and so are a ``vocab`` part's canonical rows (its
        padding rows past the vocabulary zeroed): no temporary, no second copy."""
        if out is not None and placement.kind is TensorKind.PLAIN:
            return self.read(name, canonical_boxes(placement)[0], out=out)
        if out is not None and placement.kind is TensorKind.VOCAB:
            boxes = canonical_boxes(placement)
            rows = boxes[0][0][1] - boxes[0][0][0] if boxes else 0
            if rows:
                self.read(name, boxes[0], out=out[:rows])
            out[rows:].zero_()
            return out
        value = read_part(placement, lambda box: self.read(name, box), dtype=torch.float32)
        return value if out is None else out.copy_(value)

    def _handle(self, path: Path):
        """An open file of the checkpoint, kept for the reader's life (:meth:`close`)."""
        handle = self._files.get(path)
        if handle is None:
            handle = self._files[path] = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        return handle

    def _map(self, path: Path) -> tuple[mmap.mmap, torch.Tensor, tuple] | None:
        """A private map of ``path`` over the reader's own handle (the file its header was read from), its bytes
        as a uint8 tensor and the file's ``(size, mtime)`` then; None for an empty file or one the
        system cannot map (a file system without mmap, no address space): ``readinto`` reads it instead."""
        fd = self._handle(path).fileno()
        try:
            stat = os.fstat(fd)
            if not stat.st_size:
                return None
            # ACCESS_COPY: a write to a view copies its pages; the file is never changed
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):
            return None
        return mapping, torch.frombuffer(mapping, dtype=torch.uint8), _identity(stat), memoryview(mapping)

    def _span(self, path: Path, offset: int, nbytes: int) -> torch.Tensor | None:
        """Bytes ``[offset, offset + nbytes)`` of ``path`` as a uint8 view of the file's private memory map (made
        on first use), or None: not ``mapped``, nothing to map, or the file ends before them (the caller's
        ``readinto`` then names the piece cut short)."""
        if not self.mapped or nbytes <= 0:
            return None
        if path not in self._maps:
            self._maps[path] = self._map(path)
        if self._maps[path] is None or offset < 0:
            return None
        mapping, whole, *_ = self._maps[path]
        # the file as it is now: one cut short since it was mapped reads past its end with readinto (named
        # "cut short") instead of faulting (SIGBUS) on pages the file no longer has
        if offset + nbytes > min(whole.numel(), os.fstat(self._handle(path).fileno()).st_size):
            return None
        # one read-ahead of the whole span, not a page fault (and a small read) per page; a span under
        # WILLNEED_MIN is left to the read-around of its first fault (Linux reads read_ahead_kb around it, 128 KiB
        # by default), which spares a system call per small piece
        if _WILLNEED is not None and nbytes >= WILLNEED_MIN:
            start = offset - offset % mmap.PAGESIZE
            with contextlib.suppress(OSError):
                mapping.madvise(_WILLNEED, start, offset + nbytes - start)
        return whole[offset:offset + nbytes]

    def _checked(self, key: tuple) -> bool:
        """Whether the piece ``(file, key)`` or chunk ``(file, key, i)`` was verified, or is to be (deferred)."""
        return key in self._verified or key in self._verified_chunks or key in self._queued

    def _check(self, crc_of, want: int, message, verified: set, key: tuple, nbytes: int) -> None:
        """Check the CRC ``crc_of`` (an int, or a callable giving it) ``== want`` now, or by :meth:`verify`
        (``defer_checks``); ``key`` joins ``verified`` (:attr:`_verified` or :attr:`_verified_chunks`) once it
        passed; ``message()`` is the error otherwise. A CRC already computed is compared at once, also when
        deferred (its failure is kept for :meth:`verify`): nothing is left to wait for."""
        if type(crc_of) is int:
            if crc_of == want:
                verified.add(key)
            elif not self.defer_checks:
                raise CheckpointError(message())
            elif self._failed is None:
                self._failed = message()
            return
        if not self.defer_checks:
            if crc_of() != want:
                raise CheckpointError(message())
            verified.add(key)
            return
        self._pending.append((crc_of, want, message, verified, key, nbytes))
        self._queued.add(key)
        self._pending_bytes += nbytes
        while self._pending_bytes > PENDING_BYTES and len(self._pending) > 1:
            self._settle()

    def _settle(self) -> None:
        """Wait for the oldest deferred check; a failure is kept for :meth:`verify`. The check leaves the queue
        only once its CRC is done (an interrupt leaves it for :meth:`close` to wait for)."""
        crc_of, want, message, verified, key, nbytes = self._pending[0]
        ok = crc_of() == want
        self._pending.popleft()
        self._queued.discard(key)
        self._pending_bytes -= nbytes
        if ok:
            verified.add(key)
        elif self._failed is None:
            self._failed = message()

    def verify(self) -> None:
        """Wait for every deferred check (``defer_checks``); CheckpointError on the first that failed, after all
        the others were waited for (no CRC runs over a caller's buffer once this returns or raises)."""
        while self._pending:
            self._settle()
        failed, self._failed = self._failed, None
        if failed is not None:
            raise CheckpointError(failed)
        for path, mapped in self._maps.items():  # a mapped value is read again when used: its file must not change
            if mapped is not None and _identity(os.fstat(self._handle(path).fileno())) != mapped[2]:
                raise CheckpointError(f"{path}: the file changed while it was read (size or modification time); "
                                      "its values are not used")

    def close(self) -> None:
        for crc_of, *_ in self._pending:  # no CRC left running over a caller's buffer
            with contextlib.suppress(Exception):
                crc_of()
        self._pending.clear()
        self._queued.clear()
        self._pending_bytes = 0
        for handle in self._files.values():
            handle.close()
        self._files.clear()
        self._maps.clear()  # each map goes with the last view a read returned of it

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, kind, *exc) -> None:
        unverified = len(self._pending) + (self._failed is not None)
        self.close()
        if kind is None and unverified:
            warnings.warn(f"{self.folder}: {unverified} deferred CRC checks were never verified (call verify())",
                          stacklevel=2)

    def __del__(self) -> None:
        self.close()

    def _entry(self, file: str, key: str, name: str, box: Box):
        """``(path, where the data starts, shape, dtype, (begin, end) data offsets)`` of a piece's safetensors
        entry, checked against its box in the manifest."""
        start, header = self._headers[file] if file in self._headers else self._header(file)
        info = header.get(key)
        dtype = _NAMES.get(info.get("dtype")) if type(info) is dict else None
        if dtype is None:
            raise CheckpointError(f"{self._path(file)}: tensor {name!r} (entry {key!r}) is not in the file's header")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        shape = tuple(shape) if isinstance(shape, list) and all(type(d) is int for d in shape) else None
        if shape != tuple([hi - lo for lo, hi in box]):
            raise CheckpointError(f"{self._path(file)}: tensor {name!r} (entry {key!r}) has shape "
                                  f"{str(info.get('shape'))[:80]}, the manifest says box {box}")
        nbytes = math.prod(shape) * dtype.itemsize if min(shape, default=0) >= 0 else 0  # volume(box)
        if not (type(offsets) is list and len(offsets) == 2 and type(offsets[0]) is int and type(offsets[1]) is int
                and 0 <= offsets[0] and offsets[1] - offsets[0] == nbytes):
            raise CheckpointError(f"{self._path(file)}: tensor {name!r} (entry {key!r}): data_offsets {offsets} do "
                                  f"not hold {nbytes} bytes of {info['dtype']} {list(shape)} (a damaged header)")
        return self._path(file), start, shape, dtype, offsets

    def _few_rows(self, file: str, key: str, common: Box, piece_box: Box) -> bool:
        """Whether to read only the rows of ``common`` from the piece: it has chunk CRCs and those rows are at
        most 3/4 of it (else one whole read checks it once for later boxes)."""
        listed = self._chunks.get(file)
        if not isinstance(listed, dict) or key not in listed:
            return False
        return 4 * (common[0][1] - common[0][0]) <= 3 * (piece_box[0][1] - piece_box[0][0])

    def _rows(self, file: str, key: str, name: str, box: Box, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` (along dim 0, relative to the piece) of the piece ``box``: only the chunks that hold
        them are read, each checked against its CRC in the manifest (on the CRC thread, beside the reads)."""
        path, start, shape, dtype, (a, b) = self._entry(file, key, name, box)
        size, crcs = self._chunk_bytes, self._chunks[file][key]
        if not isinstance(crcs, list) or len(crcs) != -(-(b - a) // size):
            listed = f"{len(crcs)} chunk CRCs" if isinstance(crcs, list) else f"chunk CRCs {crcs!r}"
            raise CheckpointError(f"{self.folder / MANIFEST}: tensor {name!r} (entry {key!r} of {file}) lists "
                                  f"{listed} for {b - a} bytes in chunks of {size}")
        row = (b - a) // shape[0]
        c0, c1 = r0 * row // size, -(-(r1 * row) // size)
        lo, hi = c0 * size, min(c1 * size, b - a)
        buf = self._span(path, start + a + lo, hi - lo) if (start + a) % dtype.itemsize == 0 else None
        handle = None
        if buf is None:
            buf = torch.empty(hi - lo, dtype=torch.uint8)
            handle = self._handle(path)
            handle.seek(start + a + lo)
        data = memoryview(buf.numpy())
        checks, got = [], 0
        try:
            for i in range(c0, c1):
                chunk = data[got:got + min(size, hi - lo - got)]
                if handle is not None and _fill(handle, chunk) != len(chunk):
                    raise CheckpointError(f"{path}: tensor {name!r} (entry {key!r}) is cut short (chunk {i} of "
                                          f"{len(crcs)})")
                if not self._checked((file, key)) and not self._checked((file, key, i)):
                    checks.append((i, len(chunk), files._worker().submit(self.checksum.of, chunk)))
                got += len(chunk)
            for n, (i, nbytes, check) in enumerate(checks):
                def message(i=i):
                    return (f"{path}: tensor {name!r} (entry {key!r}) is damaged: chunk {i} of {len(crcs)} does not "
                            "match its CRC in the manifest")

                self._check(check.result, crcs[i], message, self._verified_chunks, (file, key, i),
                            nbytes if handle is not None else 0)
                checks[n] = (i, nbytes, None)  # in _pending now, or checked
        finally:  # no CRC left running over this buffer once we raise (unless _pending holds it)
            for *_, check in checks:
                if check is not None:
                    check.exception()
        return buf[r0 * row - lo:r1 * row - lo].view(dtype).reshape(r1 - r0, *shape[1:])

    def _check_mapped(self, path: Path, file: str, key: str, value: int, name: str, lo: int, hi: int) -> None:
        """The CRC check of the piece ``(file, key)`` over bytes ``[lo, hi)`` of its file's map (made by
        :meth:`_span`), the first time the piece is read."""
        checked = (file, key)
        if checked in self._verified or checked in self._queued:
            return
        data = self._maps[path][3][lo:hi]
        if hi - lo < files.CHUNK // 8:  # not worth a hand-off (as _RunningCrc.add): checked here and now
            result = self._crc(data)
            if result == value:
                self._verified.add(checked)
                return
        else:
            running = files._RunningCrc(self.checksum)
            for at in range(0, hi - lo, files.CHUNK):
                running.add(data[at:at + files.CHUNK])
            result = running.result

        def message():
            return f"{path}: tensor {name!r} (entry {key!r}) is damaged: its CRC does not match the manifest"

        self._check(result, value, message, self._verified, checked, 0)  # 0: page cache, not held memory

    def _piece(self, file: str, key: str, value: int, name: str, box: Box, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """One piece: a view of the file's map (``mapped``, no ``out``: :meth:`_span`), or read into ``out``
        (contiguous and of the piece's dtype and shape, where given; else fresh memory) with sequential
        ``readinto`` calls of :data:`~.files.CHUNK` bytes (the kernel reads ahead); its CRC checked the first time,
        chunk by chunk on the CRC thread while the caller reads on."""
        path, start, shape, dtype, (a, b) = self._entry(file, key, name, box)
        mapped = None if out is not None or (start + a) % dtype.itemsize else self._span(path, start + a, b - a)
        if mapped is not None:
            self._check_mapped(path, file, key, value, name, start + a, start + b)
            return mapped.view(dtype).view(shape)
        check = not self._checked((file, key))
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous():
            raise CheckpointError(f"{path}: tensor {name!r} (entry {key!r}): out= is {out.dtype} "
                                  f"{list(out.shape)}, the piece {dtype} {list(shape)}")
        data = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(bytearray())
        running, got = files._RunningCrc(self.checksum) if check else None, 0
        handle = self._handle(path)
        handle.seek(start + a)
        while got < b - a:
            chunk = data[got:min(got + files.CHUNK, b - a)]
            n = _fill(handle, chunk)
            if running is not None and n:
                running.add(chunk[:n])
            got += n
            if n < len(chunk):
                break
        if got != b - a:
            if running is not None:
                running.result()
            raise CheckpointError(f"{path}: tensor {name!r} (entry {key!r}) is cut short ({got} of {b - a} bytes)")
        if running is not None:
            def message():
                return f"{path}: tensor {name!r} (entry {key!r}) is damaged: its CRC does not match the manifest"

            self._check(running.result, value, message, self._verified, (file, key), b - a)
        return out


__all__ = ["PENDING_BYTES", "WILLNEED_MIN", "CheckpointReader"]
