"""Shard files of :data:`files.DIRECT_MIN` bytes or more are written past the page cache (O_DIRECT, through two
aligned bounce buffers): the bytes on disk are safetensors' own reading of the tensors, whatever the sizes, and a
file system or a write that refuses O_DIRECT still gets the file, through the page cache."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import sys

import pytest
import torch
from safetensors.torch import load_file

from shardline.plugins.checkpoint import files
from shardline.plugins.checkpoint.files import ALIGN, DIRECT_MIN, _Sink, write_safetensors


def _tensors(total: int) -> list[tuple[str, torch.Tensor]]:
    """Tensors of odd sizes and mixed dtypes, about ``total`` bytes, none a multiple of a page or a chunk."""
    g = torch.Generator().manual_seed(7)
    big = (total - 2 * files.CHUNK) // 4 + 3
    return [("a.weight", torch.randn(3, 1001, generator=g)),
            ("b.weight", torch.randn(big, generator=g)),
            ("c.half", torch.randn(files.CHUNK // 2 + 5, generator=g).half()),
            ("d.ints", torch.arange(files.CHUNK // 8 + 11, dtype=torch.int64)),
            ("e.empty", torch.zeros(0)),
            ("f.last", torch.randn(17, generator=g).bfloat16())]


def _direct_supported(folder) -> bool:
    """Whether the file system of ``folder`` takes O_DIRECT (tmpfs before Linux 6.6 does not)."""
    try:
        probe = os.open(folder / "probe-direct", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    os.close(probe)
    return True


def _record_direct(monkeypatch) -> list[bool]:
    """Whether each ``_write_all`` call found its file descriptor in O_DIRECT."""
    seen, real = [], files._write_all

    def spy(fd, view):
        seen.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        return real(fd, view)

    monkeypatch.setattr(files, "_write_all", spy)
    return seen


def _same(path, tensors) -> None:
    back = load_file(str(path))
    assert list(back) == [k for k, _ in tensors] or set(back) == {k for k, _ in tensors}
    for key, t in tensors:
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key


def test_a_large_file_goes_past_the_page_cache_and_reads_back_exactly(tmp_path, monkeypatch):
    tensors = _tensors(DIRECT_MIN + 12345)
    seen = _record_direct(monkeypatch)
    path = tmp_path / "big.safetensors"
    crcs = write_safetensors(path, tensors, rank=0)
    supported = _direct_supported(tmp_path)
    assert seen and all(seen) == supported, seen  # every write O_DIRECT where the file system takes it
    _same(path, tensors)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + n) % ALIGN == 0  # each tensor's bytes start on a page of the file
    data = sum(t.numel() * t.element_size() for _, t in tensors)
    assert path.stat().st_size == 8 + n + data  # the padded tail block cut back
    assert crcs["b.weight"][0] == files.WRITTEN.of(files._bytes(tensors[1][1]))


def test_a_small_file_is_written_through_the_page_cache_with_8_byte_alignment(tmp_path, monkeypatch):
    tensors = [("x", torch.randn(5)), ("y", torch.arange(3))]
    seen = _record_direct(monkeypatch)
    path = tmp_path / "small.safetensors"
    write_safetensors(path, tensors, rank=0)
    assert seen and not any(seen)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + n) % 8 == 0 and (8 + n) < ALIGN
    _same(path, tensors)


def test_a_file_system_or_a_write_that_refuses_o_direct_still_gets_the_file(tmp_path, monkeypatch):
    tensors = _tensors(DIRECT_MIN + 1)
    real_fcntl = fcntl.fcntl

    def refuse_setfl(fd, cmd, arg=0):  # a file system without O_DIRECT (tmpfs before Linux 6.6)
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(files.fcntl, "fcntl", refuse_setfl)
    write_safetensors(tmp_path / "a.safetensors", tensors, rank=0)
    _same(tmp_path / "a.safetensors", tensors)
    monkeypatch.setattr(files.fcntl, "fcntl", real_fcntl)

    real_write, refused = os.write, []

    def refuse_direct_write(fd, view):  # a file system that takes the flag and refuses the write
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, view)

    monkeypatch.setattr(files.os, "write", refuse_direct_write)
    write_safetensors(tmp_path / "b.safetensors", tensors, rank=0)
    monkeypatch.setattr(files.os, "write", real_write)
    _same(tmp_path / "b.safetensors", tensors)
    assert len(refused) == 1 or not refused  # refused once, then through the page cache (or no O_DIRECT here)


def test_drain_puts_every_whole_block_in_the_file_and_close_the_rest(tmp_path):
    path = tmp_path / "drained"
    payload = os.urandom(3 * ALIGN + 100)
    sink = _Sink(path, direct=True)
    if sink.bufs is None:
        sink.close(ok=False)
        pytest.skip("this file system takes no O_DIRECT")
    sink.write(payload[:ALIGN + 7])
    sink.drain()
    assert path.read_bytes() == payload[:ALIGN]  # what a kill now would leave
    sink.write(payload[ALIGN + 7:])
    sink.close(ok=True)
    assert path.read_bytes() == payload


def test_a_failing_write_closes_the_file_and_frees_the_buffers_for_the_next(tmp_path, monkeypatch):
    tensors = _tensors(DIRECT_MIN + 1)
    real_write, calls = os.write, []

    def no_space(fd, view):
        calls.append(len(view))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, view)

    monkeypatch.setattr(files.os, "write", no_space)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="No space"):
        write_safetensors(tmp_path / "full.safetensors", tensors, rank=0)
    monkeypatch.setattr(files.os, "write", real_write)
    assert len(os.listdir("/proc/self/fd")) == before  # the file was closed
    made = files._BOUNCE.get(os.getpid())
    assert made is None or made[0].acquire(blocking=False)  # the buffers are free again
    if made is not None:
        made[0].release()
    write_safetensors(tmp_path / "next.safetensors", tensors, rank=0)
    _same(tmp_path / "next.safetensors", tensors)


def test_any_chunk_size_still_writes_aligned_blocks(tmp_path, monkeypatch):
    """The CRC chunk size (tests set it to a few hundred bytes) does not size the bounce buffers."""
    monkeypatch.setattr(files, "CHUNK", 1000)
    seen = _record_direct(monkeypatch)
    tensors = [("w", torch.randn(DIRECT_MIN // 4 + 333)), ("b", torch.randn(7))]
    write_safetensors(tmp_path / "odd.safetensors", tensors, rank=0)
    _same(tmp_path / "odd.safetensors", tensors)
    assert seen and all(seen) == bool(files._O_DIRECT)


def test_an_interrupted_wait_still_lets_the_write_end_before_the_file_closes(tmp_path, monkeypatch):
    """A Ctrl-C while the caller waits for the writer thread: ``close(ok=False)`` waits for that write before it
    closes the descriptor (else the thread would write into whatever file reuses the number)."""
    import signal
    import time

    events, real_write, real_close = [], os.write, os.close

    def slow_write(fd, view):
        time.sleep(0.3)
        events.append(("write", fd))
        return real_write(fd, view[:files.BOUNCE // 2])  # a buffer in two partial writes, 0.6 s

    def close(fd):
        events.append(("close", fd))
        return real_close(fd)

    sink = _Sink(tmp_path / "interrupted", direct=True)
    if sink.bufs is None:
        sink.close(ok=False)
        pytest.skip("this file system takes no O_DIRECT")
    monkeypatch.setattr(files.os, "write", slow_write)
    monkeypatch.setattr(files.os, "close", close)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
        with pytest.raises(KeyboardInterrupt):
            sink.write(bytes(3 * files.BOUNCE))  # the second submit waits for the first buffer's many writes
        sink.close(ok=False)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, previous)
    assert events[-1][0] == "close" and ("close", sink.fd) not in events[:-1]
    assert sum(kind == "write" for kind, _ in events) >= 2
    made = files._BOUNCE[os.getpid()]
    assert made[0].acquire(blocking=False)  # released, after the write ended
    made[0].release()


def test_a_platform_without_o_direct_writes_plainly(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_O_DIRECT", 0)
    seen = _record_direct(monkeypatch)
    tensors = _tensors(DIRECT_MIN + 1)
    before = len(os.listdir("/proc/self/fd"))
    write_safetensors(tmp_path / "plain.safetensors", tensors, rank=0)
    assert len(os.listdir("/proc/self/fd")) == before
    assert seen and not any(seen)
    _same(tmp_path / "plain.safetensors", tensors)


def test_a_small_file_of_many_tensors_is_written_in_few_writes(tmp_path, monkeypatch):
    """The plain path gathers small tensors (as ``BufferedWriter`` did before the sink): 3000 tensors, a few
    writes; a failed save writes nothing it had gathered."""
    g = torch.Generator().manual_seed(3)
    tensors = [(f"t{i}", torch.randn(1 + i % 17, generator=g)) for i in range(3000)]
    calls, real = [], os.write

    def counted(fd, view):
        calls.append(len(view))
        return real(fd, view)

    monkeypatch.setattr(files.os, "write", counted)
    write_safetensors(tmp_path / "many.safetensors", tensors, rank=0)
    assert len(calls) <= 3, calls
    _same(tmp_path / "many.safetensors", tensors)

    sink = _Sink(tmp_path / "failed", direct=False)
    sink.write(b"x" * 100)
    sink.close(ok=False)
    assert (tmp_path / "failed").read_bytes() == b""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_a_plain_file_starts_its_writeback_when_its_writes_end(tmp_path, monkeypatch):
    """A plain (page-cache) file asks the kernel to start writing its dirty pages when its sink closes, so the
    caller's fsync finds them on their way: the real ``sync_file_range`` through libc (a wrong signature fails
    with EINVAL or EBADF here), once per plain file, never for an O_DIRECT file or a failed write."""
    assert files._SYNC_FILE_RANGE is not None
    with open(tmp_path / "probe", "wb") as f:
        f.write(b"y" * 10000)
        f.flush()
        assert files._SYNC_FILE_RANGE(f.fileno(), 0, 0, files._SYNC_FILE_RANGE_WRITE) == 0
    assert files._SYNC_FILE_RANGE(-1, 0, 0, files._SYNC_FILE_RANGE_WRITE) == -1
    assert ctypes.get_errno() == errno.EBADF
    started, real = [], files.start_writeback

    def seen(fd):
        started.append(os.fstat(fd).st_size)
        real(fd)

    monkeypatch.setattr(files, "start_writeback", seen)
    small = [("x", torch.randn(1000)), ("y", torch.arange(7))]
    write_safetensors(tmp_path / "small.safetensors", small, rank=0)
    assert started == [(tmp_path / "small.safetensors").stat().st_size]  # every byte written by then
    _same(tmp_path / "small.safetensors", small)
    monkeypatch.setattr(files, "DIRECT_MIN", 1 << 16)
    big = [("z", torch.randn(50000))]  # 200 kB: O_DIRECT at this DIRECT_MIN
    write_safetensors(tmp_path / "big.safetensors", big, rank=0)
    _same(tmp_path / "big.safetensors", big)
    sink = _Sink(tmp_path / "failed", direct=False)
    sink.write(b"x" * 100)
    sink.close(ok=False)
    # the direct file and the failed one started nothing (where O_DIRECT is refused, the big file is plain too)
    assert len(started) == (1 if _direct_supported(tmp_path) else 2), started
