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
_BUILD_OPS = """
import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
from deepspeed.ops import op_builder
for name in sys.argv[1:]:
    builder = getattr(op_builder, name)()
    if builder.is_compatible(verbose=False):
        builder.load(verbose=False)
"""
_builder: dict[str, subprocess.Popen] = {}


def pytest_collection_modifyitems(session, config, items):
    needing = [item for item in items if item.get_closest_marker("jit_ops")]
    if not needing or importlib.util.find_spec("deepspeed") is None:
        return
    items[:] = [item for item in items if not item.get_closest_marker("jit_ops")] + needing
    log = tempfile.NamedTemporaryFile(prefix="shardline-jit-ops-", suffix=".log", delete=False)
    env = {**os.environ, "MAX_JOBS": "2"}
    _builder["process"] = subprocess.Popen([sys.executable, "-c", _BUILD_OPS, *JIT_OPS], stdout=log,
                                           stderr=subprocess.STDOUT, env=env, preexec_fn=lambda: os.nice(10))
    log.close()


def pytest_unconfigure(config):
    process = _builder.pop("process", None)
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)  # the session ended before the build (an interrupted run, -x)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
