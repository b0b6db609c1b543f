"""Shared test settings: where the real trace corpus lives."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# One setting for the real-trace corpus; a user's clone without it skips those tests with the reason.
TRACES_DIR = Path(os.environ.get("SHARDLINE_TRACES", REPO.parent / "shared" / "traces"))


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not TRACES_DIR.is_dir():
        pytest.skip(f"trace corpus not found at {TRACES_DIR} (set SHARDLINE_TRACES to its folder)")
    return TRACES_DIR


@pytest.fixture(scope="session", autouse=True)
def _deepspeed_lazy_import_before_forking():
    """``deepspeed.initialize`` imports DeepSpeed's Muon optimizer lazily (its ZeRO optimizer check), and that
    module calls ``torch.compile`` at import, which imports ``torch._inductor``: about 3 s of CPU in every rank
    that ``run_ranks`` forks, on every run (6 s of wall time for 4 ranks on 2 cores). Imported here once, before
    the first fork, the ranks inherit it. Only when a collected test module has imported DeepSpeed, so a run of
    the profiler's tests alone never pays it; the ranks import exactly what they would have imported anyway."""
    if "deepspeed" in sys.modules:
        # torch.jit's deprecation notices from that import are torch's and DeepSpeed's, not the first test's
        with contextlib.suppress(ImportError), warnings.catch_warnings():  # ImportError: another DeepSpeed
            warnings.simplefilter("ignore", DeprecationWarning)
            importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")


@pytest.fixture(autouse=True)
def _no_inherited_lightning_seed(monkeypatch):
    """A test that runs LightningCLI or seed_everything leaves PL_GLOBAL_SEED in the environment, which changes
    the DistributedSampler order of every later Trainer (and the forked ranks inherit it): each test starts
    without it, so no result depends on test order."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)


def _imported_roots(path: Path) -> set[str]:
    """Module names imported anywhere in ``path`` (inside functions too), with their top-level packages
    (``torch.distributed`` -> ``torch.distributed`` and ``torch``); relative imports are not counted."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names | {name.split(".")[0] for name in names}


@pytest.fixture(scope="session")
def imported_roots():
    """``imported_roots(path)``: the static import check the dependency-contract tests share."""
    return _imported_roots


# ------------------------------------------------------------------ DeepSpeed's C++ ops, built beside the tests
# DeepSpeed JIT-compiles a C++ op on its first use into torch's extension cache (~/.cache/torch_extensions): on
# a fresh machine async_io (NVMe offload) takes ~2.6 min of the 2 cores and cpu_adam (DeepSpeedCPUAdam) ~45 s,
# inside the first test that loads them. When the collected tests need them (marker ``jit_ops``), a process at a
# low CPU priority (nice 10) builds them from the start of the session, mostly on the CPU the single-process
# tests leave idle, and those tests run last. A test that arrives first waits on torch's build lock and loads the
# result: the same op, built once, as without this. The builder's SIGTERM handler raises, so an interrupted build
# releases torch's lock (a killed one would leave it, and the next build would wait on it forever).
JIT_OPS = ("CPUAdamBuilder", "AsyncIOBuilder")
# The builder is started through a launcher that exits at once, so it is nobody's child: the tests that check
# that no process of theirs is left (psutil children of this process) do not see it.
_LAUNCH = """
import os, subprocess, sys
log = open(sys.argv[1], "ab")
builder = subprocess.Popen([sys.executable, "-c", sys.argv[2], *sys.argv[3:]], stdout=log, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=lambda: os.nice(10),
                           env={**os.environ, "MAX_JOBS": "2"})
print(builder.pid)
"""
_BUILD_OPS = """
import os, signal, sys
def stop(*_):  # the compilers ninja runs too (this process leads their group), then unwind: the lock is released
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(os.getpgrp(), signal.SIGTERM)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
from deepspeed.ops import op_builder
for name in sys.argv[1:]:
    builder = getattr(op_builder, name)()
    if builder.is_compatible(verbose=False):
        builder.load(verbose=False)
"""
_builder: dict[str, int] = {}


def pytest_collection_modifyitems(session, config, items):
    needing = [item for item in items if item.get_closest_marker("jit_ops")]
    if not needing or config.option.collectonly or importlib.util.find_spec("deepspeed") is None:
        return
    items[:] = [item for item in items if not item.get_closest_marker("jit_ops")] + needing
    _remove_stale_build_locks()
    log = Path(tempfile.gettempdir()) / f"shardline-jit-ops-{os.getpid()}.log"
    launched = subprocess.run([sys.executable, "-c", _LAUNCH, str(log), _BUILD_OPS, *JIT_OPS], capture_output=True,
                              text=True, timeout=60)
    if launched.returncode == 0 and launched.stdout.strip().isdigit():
        _builder["pid"] = int(launched.stdout.strip())


STALE_LOCK_S = 1800  # no op here builds for half an hour


def _remove_stale_build_locks() -> None:
    """torch's build lock (``<op>/lock`` in the extension cache) is released in a ``finally``: a rank killed mid-
    build (a test's timeout, an interrupted run) leaves it, and every later build of that op waits on it forever.
    A lock older than any build is such a leftover: removed, with a warning naming it."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    for lock in root.glob("*/lock") if root.is_dir() else ():
        with contextlib.suppress(OSError):
            if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                lock.unlink()
                warnings.warn(f"removed the stale build lock {lock} (left by a build that was killed)",
                              stacklevel=1)


def _alive(pid: int) -> bool:
    """The builder still runs: ``pid`` exists, is not a zombie (nobody reaps it) and is still the builder (its
    command line holds the build script; a finished builder's pid may have been reused)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and b"deepspeed.ops import op_builder" in command


def pytest_unconfigure(config):
    pid = _builder.pop("pid", None)
    if pid is None or not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)  # the session ended before the build (an interrupted run, -x, -k)
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
