"""Shared test settings: where the real trace corpus lives."""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import sys
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
