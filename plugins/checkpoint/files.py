"""The checkpoint on disk: shard files of canonical pieces, a manifest written last, atomic commit, ``latest``.

This module writes a checkpoint and resolves which folder a path names; :mod:`.reader` reads one. A checkpoint
is a folder::

    manifest.json                 written last: every tensor's global shape and pieces, every file's size and CRC
    rank-00003-000.safetensors    the pieces rank 3 wrote (one or more files of at most ``max_file_bytes``)
    rank-00003-state.safetensors  rank 3's own state (RNG states, engine counters)
    trainer-state.safetensors     the trainer's state (loops, callbacks, schedulers, hparams), from rank 0

Every file is data: tensors in safetensors, everything else JSON (the two state files are safetensors files
whose header holds their typed JSON, :mod:`.state`). Nothing in a checkpoint is unpickled, so loading one runs
no code, whoever wrote it. Every file name the manifest or ``latest`` gives must name an entry of its folder
(:func:`confined`: no separators, no ``..``, no symbolic link out of it).

A *piece* is a box of one canonical tensor (:mod:`.boxes`) stored as one safetensors entry, with its CRC
(and, over :data:`CHUNK` bytes, a CRC per chunk: a reader that needs some rows of it reads and checks only
their chunks). The manifest's ``checksum`` names the CRC (:mod:`.crc`: CRC-32C since it has the field, zlib's
CRC-32 before); its fields keep the name ``crc32`` for either. Pieces of one tensor never overlap and together
cover it exactly (checked at every read).

Saving is atomic (:class:`AtomicSave`): every rank writes into ``.NAME.partial-TOKEN`` beside the final folder;
each file is written, flushed and fsynced (a rank's files together, :func:`fsync_all`); then rank 0 writes the
manifest into that folder (still a temporary name: no reader takes a ``.partial-`` folder for a checkpoint) and
makes it, the folder's entries and the pointer's new text (``latest.tmp``) durable, renames the folder to ``NAME``
(an existing ``NAME`` is first moved aside, and removed once the renames are durable), then moves the ``latest``
pointer of the parent folder (a rename), and makes both renames durable with one fsync of the parent. A save
killed at any point leaves the previous checkpoint and the pointer as they were; :func:`resolve` ignores the
partial folder with a warning, and the next commit in that folder removes it (:func:`remove_leftovers`; so does
the next fit's start removes the placeholders of asynchronous saves never committed). (A system crash before that
last fsync, on a filesystem that makes the pointer's rename durable before the folder's, leaves ``latest`` naming
a folder that is not there: :func:`resolve` then warns and takes the newest complete checkpoint, the previous one.
So the two renames need no fsync between them.)

CRCs are computed on one thread per process beside the I/O (both CRCs release the GIL): a save's while each large
tensor is written, a read's chunk by chunk while the next chunk is read; every check is made before a read
returns, or, for a reader made with ``defer_checks`` (a load), before its
:meth:`.reader.CheckpointReader.verify` returns.

Format versions: 3 (what a save writes) holds the state files above; 2 and 1 held the same state as
``trainer.pt`` and ``rank-00003.pt``, ``torch.save`` pickles, which this shardline never unpickles on its own:
their tensors read as before, and ``shardline convert --migrate --trust`` (:func:`.convert.migrate`) rewrites such
a checkpoint as version 3 for whoever trusts its author. Version 2 names its CRC in the manifest's ``checksum``
(``"crc32c"``); 1 holds zlib's CRC-32 everywhere. An older reader refuses a newer checkpoint by its version
instead of reporting its CRC-32C values as damage.

One file: the on-disk format (file names, manifest, atomic commit, ``latest``) is stated once, beside the one
code path that writes it and the one that resolves a folder.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import fcntl
import json
import mmap
import os
import secrets
import shutil
import signal
import struct
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from shardline.plugins.checkpoint.boxes import (
    Box,
    volume,
)
from shardline.plugins.checkpoint.crc import WRITTEN, Checksum
from shardline.plugins.errors import CheckpointError, ContractError

FORMAT, VERSION = "shardline-checkpoint", 3
READS = (1, 2, 3)  # the versions this shardline reads (module docstring)
MANIFEST, POINTER, TRAINER_FILE = "manifest.json", "latest", "trainer-state.safetensors"
#: What versions 1 and 2 called the trainer's state file (a ``torch.save`` pickle).
LEGACY_TRAINER_FILE = "trainer.pt"
#: The first version whose state files are data (:mod:`.state`) rather than pickles.
DATA_STATE = 3


def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s own state file (RNG states, engine counters)."""
    return f"rank-{rank:05d}-state.safetensors"


def is_state_file(name: str) -> bool:
    """Whether ``name`` is one of a checkpoint's state files (CRC'd whole; shard files' pieces carry theirs)."""
    return name == TRAINER_FILE or (name.startswith("rank-") and name.endswith("-state.safetensors"))


def legacy_name(name: str) -> str:
    """The name a version 1 or 2 checkpoint gave the state file ``name`` (its ``torch.save`` pickle)."""
    if name == TRAINER_FILE:
        return LEGACY_TRAINER_FILE
    return name.removesuffix("-state.safetensors") + ".pt"


def confined(folder: Path, name, *, what: str) -> Path:
    """``folder / name`` where ``name`` (read from a manifest or a pointer: ``what`` says which) names an entry of
    ``folder`` itself, also once symbolic links are resolved; CheckpointError naming it otherwise (``../x``,
    ``/etc/passwd``, a link out of the folder)."""
    ok = (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
          and os.path.basename(name) == name and "\\" not in name)
    path = Path(folder) / name if ok else None
    if ok and os.path.islink(path):  # a plain name's only way out: a link (the folder itself is the caller's)
        ok = os.path.dirname(os.path.realpath(path)) == os.path.realpath(folder)
    if not ok:
        raise CheckpointError(f"{folder}: {what} names {str(name)[:200]!r}, which is not a file of this folder "
                              "(a checkpoint's file names are plain names inside it; links out of it are refused)")
    return path
#: In the placeholder an asynchronous save leaves at its final name until its commit (:meth:`AtomicSave.reserve`).
PENDING = "shardline-pending"
#: The phases of a save at which a test may have a rank killed (:func:`kill_save_at`).
PHASES = ("before_shards", "mid_shard", "before_manifest", "before_pointer")
_kill_at: tuple[str, int | None] | None = None  # the test hook; nothing in the library sets it

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``"F32"``), as the manifest records it."""
    return _NAMES[name]


def kill_save_at(spec: str | None) -> None:
    """Test hook, installed by a test in its rank process: ``"PHASE"`` or ``"PHASE:RANK"`` makes that rank (every
    rank without one) SIGKILL itself when a save reaches ``PHASE`` (one of :data:`PHASES`), to prove that a save
    killed anywhere leaves the previous checkpoint loadable; None removes it."""
    global _kill_at
    if spec is None:
        _kill_at = None
        return
    where, _, who = spec.partition(":")
    if where not in PHASES or (who and not who.isdigit()):
        raise ContractError(f"kill_save_at({spec!r}): expected PHASE or PHASE:RANK, PHASE one of {PHASES}")
    _kill_at = (where, int(who) if who else None)


def phase(name: str, rank: int) -> None:
    """Where a save reaches phase ``name``: the test hook's kill, if one was installed for it."""
    if _kill_at is not None and _kill_at[0] == name and _kill_at[1] in (None, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def _bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


#: Pieces larger than this get their CRC computed in a thread beside the write of their bytes (the CRC releases
#: the GIL on large buffers) and a CRC per chunk of this size in the manifest; a read goes in chunks of this
#: size, each CRC'd while the next is read.
CHUNK = 8 << 20
_POOLS: dict[str, tuple[int, ThreadPoolExecutor]] = {}


def _pool(name: str, workers: int) -> ThreadPoolExecutor:
    """This process's thread pool ``shardline-<name>``, made on first use in each process (a pool made before a
    fork has no thread in the child) and kept (threads cost to start)."""
    made = _POOLS.get(name)
    if made is None or made[0] != os.getpid():
        made = _POOLS[name] = (os.getpid(), ThreadPoolExecutor(max_workers=workers,
                                                               thread_name_prefix=f"shardline-{name}"))
    return made[1]


def _worker() -> ThreadPoolExecutor:
    """This process's one CRC thread. One worker runs its tasks in submission order, so a running CRC can be
    chained chunk by chunk."""
    return _pool("crc", 1)


class _RunningCrc:
    """A CRC of consecutive chunks, each added on the CRC thread (in order) while the caller does I/O."""

    def __init__(self, checksum: Checksum):
        self.of, self.value, self._last = checksum.of, 0, None

    def _add(self, data) -> None:
        self.value = self.of(data, self.value)

    def add(self, data) -> None:
        if len(data) < CHUNK // 8:  # not worth a hand-off
            if self._last is not None:
                self._last.result()
            self._add(data)
            return
        self._last = _worker().submit(self._add, data)

    def result(self) -> int:
        if self._last is not None:
            self._last.result()
        return self.value


def _fsync(path: Path) -> None:
    """fsync a file or a folder (a folder: its entries, i.e. the names created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(paths: list[Path]) -> None:
    """fsync every file (or folder) of ``paths``, together: the filesystem commits them in one journal
    transaction where it can (ext4, xfs) instead of one after another. Returns once all are durable."""
    if len(paths) <= 1:
        for path in paths:
            _fsync(path)
        return
    pending = [_pool("fsync", 4).submit(_fsync, path) for path in paths[1:]]
    _fsync(paths[0])
    for future in pending:
        future.result()


#: O_DIRECT's alignment of a buffer's address, a file offset and a length: 4096 covers every logical block size in
#: use. A file of at least :data:`DIRECT_MIN` bytes is written with O_DIRECT where the platform and the file
#: system take it, through two bounce buffers of :data:`BOUNCE` bytes (a multiple of ALIGN).
ALIGN, DIRECT_MIN, BOUNCE = 4096, 32 << 20, 8 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (macOS): plain writes
#: A write refused with one of these on an O_DIRECT descriptor is retried through the page cache.
_REFUSED = frozenset(getattr(errno, name) for name in ("EINVAL", "EOPNOTSUPP", "ENOTSUP") if hasattr(errno, name))
_BOUNCE: dict[int, tuple[threading.Lock, list[mmap.mmap]]] = {}
#: A plain file's writes under this many bytes are gathered into one write of about this size.
_COALESCE = 1 << 20


def _writeback_starter():
    """Linux's ``sync_file_range`` (through libc), or None where there is none (macOS, other libcs)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _writeback_starter()
_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages; do not wait for them


def start_writeback(fd: int) -> None:
    """Have the kernel start writing ``fd``'s dirty pages to the device now, without waiting: the fsync that
    makes the file durable later then finds them on their way, and the rank's other work (its small files,
    its record) runs beside the device's, and the fsync waits only for what is still in flight. Advice only:
    where the call is missing or fails, nothing changes."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _write_all(fd: int, view: memoryview) -> None:
    """Write all of ``view`` at ``fd``'s offset. An O_DIRECT write the file system refuses (``_REFUSED``: some
    accept the flag and refuse the write) clears the flag and goes through the page cache."""
    while len(view):
        try:
            n = os.write(fd, view)
        except OSError as e:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if e.errno not in _REFUSED or not flags & _O_DIRECT:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
            continue
        view = view[n:]


def _settled(future: Future) -> None:
    """Wait until ``future`` is done, whatever interrupts the wait (a Ctrl-C): its write must not outlive the
    descriptor or the buffer it writes from. Its own error is left in it."""
    while not future.done():
        try:
            concurrent.futures.wait([future])
        except BaseException:  # noqa: BLE001 - the interrupt is already on its way up through the caller
            continue


class _Sink:
    """A new file's bytes, streamed. A large file (``direct``) goes past the page cache (O_DIRECT) through two
    page-aligned :data:`BOUNCE` buffers, one written by a thread while the caller fills the other: a checkpoint
    fills no page cache, so it causes no reclaim and no dirty-page throttling while it is written and leaves
    nothing of itself in memory after, the reason DeepSpeed's FastPersist writes this way. The file's tail is
    written padded to :data:`ALIGN` and cut back to its length. Where the platform or the file system refuses
    O_DIRECT (macOS, tmpfs before Linux 6.6, some FUSE) and for a small file, plain writes. Durability is still
    the caller's fsync (the file's size and the device's cache)."""

    def __init__(self, path: Path, *, direct: bool):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self.size, self.fill, self.cur, self.pending = 0, 0, 0, None
        self.lock = self.bufs = None
        self.small = bytearray()  # a plain file's small writes, coalesced (many small tensors: few syscalls)
        if direct and _O_DIRECT:
            try:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | _O_DIRECT)
            except OSError:
                return
            try:
                self.lock, self.bufs = self._buffers()
            except BaseException:
                os.close(self.fd)
                raise

    @staticmethod
    def _buffers() -> tuple[threading.Lock | None, list[mmap.mmap]]:
        """This process's two bounce buffers (kept: fresh memory costs its page faults each time), or two new ones
        while another sink holds them."""
        made = _BOUNCE.get(os.getpid())
        if made is None:
            made = _BOUNCE[os.getpid()] = (threading.Lock(), [mmap.mmap(-1, BOUNCE), mmap.mmap(-1, BOUNCE)])
        if made[0].acquire(blocking=False):
            return made
        return None, [mmap.mmap(-1, BOUNCE), mmap.mmap(-1, BOUNCE)]

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        self.size += len(data)
        if self.bufs is None:
            if len(data) < _COALESCE:
                self.small += data
                if len(self.small) >= _COALESCE:
                    self._flush_small()
            else:
                self._flush_small()
                _write_all(self.fd, data)
            return
        pos = 0
        while pos < len(data):
            n = min(BOUNCE - self.fill, len(data) - pos)
            self.bufs[self.cur][self.fill:self.fill + n] = data[pos:pos + n]
            self.fill, pos = self.fill + n, pos + n
            if self.fill == BOUNCE:
                self._submit(BOUNCE)

    def _flush_small(self) -> None:
        if self.small:
            with memoryview(self.small) as view:
                _write_all(self.fd, view)
            self.small = bytearray()

    def _submit(self, n: int) -> None:
        self._wait()  # the other buffer's write: it is the one filled next
        self.pending = _pool("direct", 1).submit(_write_all, self.fd, memoryview(self.bufs[self.cur])[:n])
        self.cur, self.fill = self.cur ^ 1, 0

    def _wait(self) -> None:
        """The thread's write, done (its error raised here). Kept pending until it is: an interrupted wait leaves
        it for :meth:`close` to settle."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def drain(self) -> None:
        """The whole blocks written so far are in the file (the mid-shard kill hook), the rest (under
        :data:`ALIGN` bytes) moved to the front of the buffer; a plain file's writes all."""
        if self.bufs is None:
            self._flush_small()
            return
        self._wait()
        whole = self.fill - self.fill % ALIGN
        if whole:
            buf = self.bufs[self.cur]
            _write_all(self.fd, memoryview(buf)[:whole])
            buf[:self.fill - whole] = buf[whole:self.fill]
            self.fill -= whole

    def close(self, *, ok: bool) -> None:
        try:
            if ok:
                self._flush_small()
            if self.bufs is not None:
                if ok:
                    self._wait()
                elif self.pending is not None:  # its write ends before its descriptor closes; the caller's error stands
                    _settled(self.pending)
                    self.pending = None
                if ok and self.fill:
                    padded = self.fill + (-self.fill % ALIGN)
                    buf = self.bufs[self.cur]
                    buf[self.fill:padded] = bytes(padded - self.fill)
                    _write_all(self.fd, memoryview(buf)[:padded])
                    os.ftruncate(self.fd, self.size)
            elif ok:  # a plain file: its pages are dirty in the page cache until the caller's fsync
                start_writeback(self.fd)
        finally:
            if self.pending is not None:  # an error above: still no close under a running write
                _settled(self.pending)
            if self.lock is not None:
                self.lock.release()
            os.close(self.fd)


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], *, rank: int, sync: bool = True
                      ) -> dict[str, tuple[int, list[int] | None]]:
    """Write ``tensors`` as one safetensors file, streamed tensor by tensor (no second copy in memory; a file of
    :data:`DIRECT_MIN` bytes or more past the page cache, :class:`_Sink`), flushed and fsynced (``sync=False``:
    the caller fsyncs it, e.g. with :func:`fsync_all`); returns each key's ``(CRC, CRC of each CHUNK bytes or
    None)`` (:data:`~.crc.WRITTEN`): a tensor over :data:`CHUNK` bytes gets the chunks' CRCs (for partial reads,
    :mod:`.crc`), computed on the CRC thread while its bytes are written."""
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
    direct = offset >= DIRECT_MIN
    # safetensors aligns the data to 8 bytes (and takes trailing spaces in the header); a direct file's to ALIGN,
    # so that each tensor's bytes start on a page of the file as they do on a page of a map of it
    blob += b" " * (-(8 + len(blob)) % (ALIGN if direct else 8))
    crcs: dict[str, tuple | Future] = {}
    sink, ok = _Sink(path, direct=direct), False
    try:
        sink.write(struct.pack("<Q", len(blob)) + blob)
        for i, (key, tensor) in enumerate(tensors):
            data = _bytes(tensor)
            crcs[key] = (_worker().submit(WRITTEN.chunked, data, CHUNK) if len(data) > CHUNK
                         else (WRITTEN.of(data), None))
            sink.write(data)
            if i == 0 and _kill_at is not None:
                sink.drain()
                phase("mid_shard", rank)
        ok = True
    finally:
        sink.close(ok=ok)
    if sync:
        _fsync(path)
    return _crc_results(crcs)


def _crc_results(crcs: dict[str, tuple | Future]) -> dict[str, tuple[int, list[int] | None]]:
    """Each key's CRCs, waiting for those the CRC thread still computes."""
    return {key: value.result() if isinstance(value, Future) else value for key, value in crcs.items()}


def file_crc(path: Path, checksum: Checksum | None = None) -> int:
    """The CRC (``checksum``, default :data:`~.crc.WRITTEN`) of a whole file."""
    checksum, value = checksum or WRITTEN, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            value = checksum.of(chunk, value)
    return value


class ShardWriter:
    """One rank's pieces, written to ``rank-RRRRR-III.safetensors`` files of at most ``max_file_bytes`` each
    (a piece larger than that gets a file alone). ``records`` lists ``(tensor name, shape, dtype, file, key,
    box, crc, chunks)`` per piece for the manifest (``chunks``: ``(chunk bytes, [CRC per chunk])`` for a piece
    over :data:`CHUNK` bytes, else None). Its files are written but not yet fsynced: :attr:`paths` for
    :func:`fsync_all`, with the rank's other files."""

    def __init__(self, folder: Path, *, rank: int, max_file_bytes: int = 1 << 30):
        WRITTEN.require(f"saving a checkpoint into {folder}")
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

    @property
    def paths(self) -> list[Path]:
        return [self.folder / name for name in self.written]

    def flush(self) -> None:
        if not self.pending:
            return
        file = f"rank-{self.rank:05d}-{self.files:03d}.safetensors"
        crcs = write_safetensors(self.folder / file, [(key, t) for key, t, *_ in self.pending], rank=self.rank,
                                 sync=False)
        for key, tensor, shape, name, box in self.pending:
            value, parts = crcs[key]
            self.records.append((name, list(shape), _DTYPES[tensor.dtype], file, key,
                                 [list(b) for b in box], value, None if parts is None else (CHUNK, parts)))
        self.files += 1
        self.pending, self.size = [], 0


def describe_files(folder: Path, names: list[str], crcs: dict[str, int] | None = None) -> dict[str, dict]:
    """Size (and, for the state files, CRC: from ``crcs`` where the writer computed it, else read back) of each
    of ``names`` in ``folder``, as the rank that wrote them sees them (on a network filesystem another rank's view
    may lag). A shard file's CRCs are its pieces'."""
    crcs = crcs or {}

    def crc32(name):
        if name in crcs:
            return crcs[name]
        return None if name.endswith(".safetensors") and not is_state_file(name) else file_crc(folder / name)

    return {name: {"size": (folder / name).stat().st_size, "crc32": crc32(name)} for name in names}


def write_small(data: bytes, path: Path) -> int:
    """Write ``data`` (a small file: a state file's bytes) to ``path``, not yet fsynced; returns its CRC."""
    with open(path, "wb") as f:
        f.write(data)
    return WRITTEN.of(data)


def _manifest_text(manifest: dict) -> str:
    """The manifest as JSON, one tensor and one file a line: readable, and written by the C encoder (``indent``
    would make ``json`` use its pure-Python one, much slower on a large manifest)."""
    def block(mapping: dict) -> str:
        rows = (f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in mapping.items())
        return "{\n" + ",\n".join(rows) + "\n }"

    top = [f" {json.dumps(k)}: {block(v) if k in ('files', 'tensors') and v else json.dumps(v)}"
           for k, v in manifest.items()]
    return "{\n" + ",\n".join(top) + "\n}\n"


def build_manifest(records: list[list[tuple]], files: dict[str, dict], meta: dict) -> dict:
    """The manifest from every rank's piece records and the files every rank wrote (:func:`describe_files`).

    ``checksum`` names the CRC of every ``crc32`` field and chunk list (:data:`~.crc.WRITTEN`; a manifest without
    it holds zlib's CRC-32). The large pieces' chunk CRCs go into the optional top-level ``chunk_crc32``
    (``{"bytes": chunk size, "pieces": {file: {key: [CRC, ...]}}}``): a reader without it reads whole pieces, as
    version 1 always did."""
    tensors: dict[str, dict] = {}
    chunks: dict[str, dict[str, list[int]]] = {}
    sizes = set()
    for rank_records in records:
        for name, shape, dtype, file, key, box, value, parts in rank_records:
            entry = tensors.setdefault(name, {"shape": shape, "dtype": dtype, "pieces": []})
            if entry["shape"] != shape or entry["dtype"] != dtype:
                raise CheckpointError(f"ranks disagree on tensor {name!r}: {entry['shape']} {entry['dtype']} vs "
                                      f"{shape} {dtype} (in {file})")
            entry["pieces"].append([file, key, box, value])
            if parts is not None:
                sizes.add(parts[0])
                chunks.setdefault(file, {})[key] = parts[1]
    if len(sizes) > 1:
        raise CheckpointError(f"ranks wrote chunk CRCs of different chunk sizes: {sorted(sizes)}")
    extra = {"chunk_crc32": {"bytes": sizes.pop(), "pieces": dict(sorted(chunks.items()))}} if chunks else {}
    return {"format": FORMAT, "version": VERSION, "checksum": WRITTEN.name, **meta,
            "files": dict(sorted(files.items())), "tensors": dict(sorted(tensors.items())), **extra}


class AtomicSave:
    """The folder a save writes into, and its commit (module docstring). Every rank calls :meth:`create` and
    writes into :attr:`tmp`; rank 0 calls :meth:`commit`. The folder must be on a filesystem every rank shares."""

    def __init__(self, final: Path, token: str):
        self.final = Path(final)
        self.tmp = self.final.parent / f".{self.final.name}.partial-{token}"
        self.begun = time.time()  # what the commit's clean-up calls older (remove_leftovers)

    #: A token's random bytes (written as twice as many hex digits): one non-negative int64 carries it between
    #: ranks, so at most 7.
    TOKEN_BYTES = 4
    assert TOKEN_BYTES <= 7

    @staticmethod
    def new_token() -> str:
        return secrets.token_hex(AtomicSave.TOKEN_BYTES)

    def create(self) -> None:
        """Make :attr:`tmp` (every rank may call it; the token is new, so the folder is this save's alone)."""
        self.tmp.mkdir(parents=True, exist_ok=True)

    def reserve(self) -> None:
        """Rank 0, for an asynchronous save: an empty folder at :attr:`final` (holding only a :data:`PENDING`
        marker) until the commit replaces it, so the name is taken at once (Lightning versions the next file name
        and links ``last.ckpt`` to it); :func:`resolve` refuses one, naming the newest complete checkpoint beside
        it. A checkpoint already at that name stays there until the commit replaces it."""
        if not os.path.lexists(self.final):
            self.final.mkdir()
            (self.final / PENDING).write_text(self.tmp.name + "\n")

    def unreserve(self) -> None:
        """Rank 0, after the asynchronous save failed: remove its placeholder (never a checkpoint)."""
        if is_placeholder(self.final):
            shutil.rmtree(self.final, ignore_errors=True)

    def commit(self, manifest: dict, *, rank: int) -> None:
        """Rank 0, once every rank's files are durable: the manifest, then the rename, then ``latest``. The
        manifest and the folder's entries are durable before the rename; the pointer's new text is staged and
        made durable together with the manifest, under a name no reader looks at (``latest.tmp``), so moving it
        is one rename; one fsync of the parent then makes both renames durable (the module docstring says why
        no fsync is needed between them); a ``NAME`` it replaced is removed only after that."""
        phase("before_manifest", rank)
        # Straight under its name: the folder is still ``.NAME.partial-*``, which no reader takes for a checkpoint.
        (self.tmp / MANIFEST).write_text(_manifest_text(manifest))
        pointer = self.final.parent / (POINTER + ".tmp")
        pointer.write_text(self.final.name + "\n")
        fsync_all([self.tmp / MANIFEST, pointer, self.tmp])  # the manifest, the staged pointer, the folder's names
        old = None
        if self.final.exists():
            old = self.final.parent / f".{self.final.name}.old-{self.tmp.name.rsplit('-', 1)[-1]}"
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        phase("before_pointer", rank)
        os.replace(pointer, self.final.parent / POINTER)
        _fsync(self.final.parent)  # both renames
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        remove_leftovers(self.final.parent, before=self.begun)


#: Seconds by which a leftover must predate ``before`` (file times come from the kernel's coarse clock, which can
#: lag ``time.time()``): a save interrupted just before another began is removed at the commit after that.
MTIME_SLACK = 2.0


def remove_leftovers(folder: Path, *, before: float, partials: bool = True) -> list[str]:
    """Remove from ``folder`` what interrupted saves left there before the time ``before``: their ``.NAME.partial-*``
    folders (full-size, never loadable; kept with ``partials=False``) and asynchronous saves' placeholders (which
    would make Lightning give the next save of that name a ``-v1``). Called by rank 0 after each commit
    (``before``: that save's start; one run has one save in flight at a time) and, for the placeholders alone, at
    the start of a fit (``before``: now; a resumed run still warns of the partial folders it skips). Two runs must
    therefore not share a checkpoint folder. Returns the names removed."""
    removed, before = [], before - MTIME_SLACK
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for path in entries:
        try:
            stale = path.lstat().st_mtime < before and not path.is_symlink() and path.is_dir()
        except OSError:
            continue
        partial = path.name.startswith(".") and ".partial-" in path.name
        if stale and ((partial and partials) or is_placeholder(path)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def is_placeholder(path: Path) -> bool:
    """An asynchronous save's placeholder (:meth:`AtomicSave.reserve`): its commit has not happened."""
    return (Path(path) / PENDING).is_file() and not is_checkpoint(path)


def resolve(path: str | os.PathLike) -> Path:
    """The complete checkpoint folder ``path`` names: a checkpoint itself, or a folder of checkpoints (its
    ``latest`` pointer, else its newest complete checkpoint). Partial saves beside it are ignored with a
    warning; a partial or missing one named directly raises CheckpointError."""
    path = Path(path)
    if ".partial-" in path.name and path.name.startswith("."):
        raise CheckpointError(f"{path}: incomplete checkpoint (a save's temporary folder, renamed into place only "
                              "once its manifest is durable): the save that wrote it was interrupted")
    if is_checkpoint(path):
        return path
    if is_placeholder(path):
        try:
            beside = f"the newest complete checkpoint beside it is {_newest(path.resolve().parent, quiet=True)}"
        except CheckpointError:
            beside = "there is no complete checkpoint beside it"
        raise CheckpointError(f"{path}: an incomplete checkpoint (an asynchronous save that was never committed: the "
                              f"run ended before its commit); {beside}. Name a complete one.")
    if path.is_file():
        raise CheckpointError(f"{path}: a file, not a shardline checkpoint folder (shardline loads only its own "
                              "checkpoints, and never unpickles a file such as a Lightning .ckpt or torch.save)")
    if path.is_dir() and _deepspeed_native(path):
        raise CheckpointError(f"{path}: a DeepSpeed checkpoint (its model and optimizer states are torch.save "
                              "pickles, which shardline never loads); shardline loads only its own checkpoints")
    if path.is_dir() and ((not path.name.startswith(".") and (path / POINTER).exists()) or _complete(path)
                          or any(".partial-" in p.name for p in path.iterdir())):
        return _newest(path)
    if path.is_dir() and any(path.iterdir()) and not any(
            (path / name).exists() for name in (TRAINER_FILE, LEGACY_TRAINER_FILE)):
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


def _deepspeed_native(path: Path) -> bool:
    """Whether ``path`` looks like DeepSpeed's own checkpoint (``global_stepN/mp_rank_00_model_states.pt``)."""
    return any(path.glob("mp_rank_*_model_states.pt")) or any(path.glob("*/mp_rank_*_model_states.pt"))


def _complete(root: Path) -> list[Path]:
    """The complete checkpoints in the folder ``root``."""
    return [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and is_checkpoint(p)]


def _newest(root: Path, *, quiet: bool = False) -> Path:
    """In a folder of checkpoints: the one its ``latest`` pointer names, else the newest complete one; its
    partial saves are ignored with a warning (none with ``quiet``)."""
    for partial in [] if quiet else sorted(root.glob(".*.partial-*")):
        warnings.warn(f"ignoring the partial checkpoint {partial} (a save was interrupted before its manifest "
                      "was committed)", stacklevel=3)
    pointer = root / POINTER
    if pointer.is_file():
        target = confined(root, pointer.read_text(errors="replace").strip(), what=f"the pointer {POINTER!r}")
        if is_checkpoint(target):
            return target
        if not quiet:
            warnings.warn(f"{pointer} names {target.name}, which is not a complete checkpoint; using the newest "
                          "complete one", stacklevel=3)
    complete = _complete(root)
    if not complete:
        raise CheckpointError(f"{root}: holds no complete checkpoint")
    return max(complete, key=lambda p: (p / MANIFEST).stat().st_mtime_ns)


__all__ = ["AtomicSave", "CHUNK", "DATA_STATE", "FORMAT", "LEGACY_TRAINER_FILE", "MANIFEST", "PENDING", "PHASES",
           "POINTER", "READS", "ShardWriter", "TRAINER_FILE", "build_manifest", "confined", "describe_files",
           "dtype_of", "fsync_all", "is_checkpoint", "is_placeholder", "is_state_file", "kill_save_at",
           "legacy_name", "phase", "rank_file", "remove_leftovers", "resolve", "write_small"]
