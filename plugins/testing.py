"""Run a function on N CPU ranks joined in a real gloo process group, from one test process.

``run_ranks(fn, world_size, *args)`` forks ``world_size`` workers from the calling process (which has already
imported torch, so a worker starts without the imports a fresh interpreter pays for), joins them with
a ``file://`` rendezvous (no ports), runs ``fn(rank, world_size, *args)`` on each with one intra-op thread, and
returns the results in rank order. A worker's exception is re-raised in the caller as :class:`RankFailedError`
naming the rank, with the worker's traceback; a worker that hangs past ``timeout`` or dies without a word is
reported by rank. Every worker is reaped before ``run_ranks`` returns or raises: no orphans.

Results and exceptions travel back pickled, so ``fn`` should return plain values or CPU tensors.

Test hooks the library never reads from the environment are installed here, in each worker before ``fn`` runs:
with ``SHARDLINE_TEST_HANG_AT`` set (``rank=3,axis=tp,op=all_reduce,seq=30``), the injected hang of
:mod:`shardline.plugins.faults.collective_record` (processes the worker forks inherit it).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait as wait_connections
from typing import Any

from shardline.plugins.errors import RankFailedError
from shardline.plugins.faults.processes import die_with_parent

# Once one rank has failed, the others usually block in a collective; give them this long to fail on their own
# (their own error is often the more useful one to show) before they are killed.
_GRACE_AFTER_FAILURE_S = 2.0


def _worker(fn: Callable, rank: int, world_size: int, args: tuple, init_file: str, timeout: float,
            backend: str, conn) -> None:
    die_with_parent()  # a worker must not outlive a test process that was killed
    faulthandler.enable()  # a worker killed by a C++ abort (gloo, NCCL) still prints its Python stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # and a hung one prints it when the caller asks
    status = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        _install_test_hooks()
        if backend == "nccl":  # one GPU per rank; the parent must not have initialised CUDA before forking
            torch.cuda.set_device(rank % torch.cuda.device_count())
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        # Every rank has its connections before any runs fn: a rank that returns at once and exits must not
        # close its sockets while a slower peer is still connecting its gloo mesh ("Connection closed by peer").
        dist.barrier()
        result = fn(rank, world_size, *args)
        # Plain pickle copies tensors by value; multiprocessing's pickler would share their storage through a
        # file-descriptor server that dies with this worker before the caller reads it.
        conn.send_bytes(pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises must reach the caller
        status = 1
        # Only text crosses back: an arbitrary exception object may not pickle, its description always does.
        # The monotonic clock is system-wide, so the caller can tell the first failure from its consequences.
        conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(),
                                      time.monotonic())))
    finally:
        conn.close()
        # Tear down only after reporting: a peer that sees the connection drop must not beat the root cause.
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        # Skip atexit handlers and buffered state inherited from the parent (pytest's, torch's).
        os._exit(status)


def _install_test_hooks() -> None:
    """The faults package's injected hang, from ``SHARDLINE_TEST_HANG_AT`` when it is set (ContractError when it
    does not parse); nothing otherwise (a hook a test installed before forking stays)."""
    from shardline.plugins.faults import collective_record

    text = os.environ.get(collective_record.TEST_HANG_ENV)
    if text:
        collective_record.install_hang(collective_record.InjectedHang.parse(text))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks and return their results.

    Raises :class:`RankFailedError` for the rank that failed first (raised or died), or for the lowest rank still
    running after ``timeout`` seconds; other ranks still running are killed and reaped first.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    ctx = mp.get_context("fork")
    tmpdir = tempfile.mkdtemp(prefix="shardline-ranks-")
    init_file = os.path.join(tmpdir, "rendezvous")
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, name=f"shardline-rank{rank}",
                               args=(fn, rank, world_size, args, init_file, timeout, backend, child_conn))
            proc.start()
            child_conn.close()
            procs.append(proc)
            conns.append(parent_conn)
        return _collect(procs, conns, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        for conn in conns:
            conn.close()
        with contextlib.suppress(OSError):
            for name in os.listdir(tmpdir):
                os.unlink(os.path.join(tmpdir, name))
            os.rmdir(tmpdir)


def _collect(procs: list, conns: list, timeout: float) -> list[Any]:
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    pending = dict(enumerate(conns))
    failures: list[tuple[float, RankFailedError]] = []
    deadline = time.monotonic() + timeout
    while pending:
        now = time.monotonic()
        if now >= deadline:
            break
        ready = wait_connections(list(pending.values()), timeout=min(deadline - now, 1.0))
        for conn in ready:
            rank = next(r for r, c in pending.items() if c is conn)
            del pending[rank]
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                procs[rank].join(timeout=5)
                code = procs[rank].exitcode
                message = ("error", f"worker died without reporting (exit code {code})", "", time.monotonic())
            if message[0] == "ok":
                results[rank] = message[1]
                continue
            if not failures:
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
            failures.append((message[3], RankFailedError(rank, message[1], message[2])))
    if failures:
        # The earliest failure is the cause; later ones are usually peers losing their connection to it.
        raise min(failures, key=lambda item: item[0])[1]
    if pending:
        hung = sorted(pending)
        for rank in hung:  # where each hung rank is stuck goes to stderr before it is killed
            with contextlib.suppress(OSError):
                os.kill(procs[rank].pid, signal.SIGUSR1)
        time.sleep(0.5)
        raise RankFailedError(hung[0], f"timed out after {timeout:g} s; ranks still running: {hung}")
    return results


def adopt_process_group_in_lightning() -> None:
    """Inside a ``run_ranks`` worker: make a Lightning ``Trainer`` use the already-initialised process group.

    Lightning then sees a torchelastic-style launch (processes created externally) and neither launches
    workers nor initialises the group again; the strategy's own setup (grid, DeepSpeed) still runs.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("adopt_process_group_in_lightning() needs an initialised process group (run_ranks)")
    world, rank = dist.get_world_size(), dist.get_rank()
    os.environ.update(TORCHELASTIC_RUN_ID="shardline-run-ranks", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")


def nvme_offload_available() -> bool:
    """Whether DeepSpeed's async_io op (NVMe offload's swapper) can be built here (Debian: libaio-dev)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:  # noqa: BLE001 - any failure to probe means the op cannot be built here
        return False


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter of every thread of process ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie,
    ...), from ``/proc`` (Linux); empty once the process is gone."""
    states = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().split(") ", 1)[1][0])
        except FileNotFoundError:
            continue
    return states


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (absent, or a zombie its parent has not reaped yet)."""
    return all(state in "ZX" for state in thread_states(pid))
