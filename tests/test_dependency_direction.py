"""The package's floors: ``shardline.job`` below everything, the profiler and the training side meeting only
through it. Every import statement counts, inside functions too (a cycle or an upward arrow moved into a function
is still one), and the pure package also loads in a fresh interpreter with the heavy libraries blocked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numpy", "pandas", "pytorch_lightning", "lightning", "deepspeed")


def _modules(folder: str) -> list[Path]:
    return sorted(p for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _shardline_imports(path: Path, imported_roots) -> set[str]:
    return {name for name in imported_roots(path) if name.startswith("shardline.")}


@pytest.mark.parametrize("path", _modules("job"), ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_job_package_imports_only_itself_and_the_standard_library(path, imported_roots):
    imported = imported_roots(path)
    upward = {n for n in imported if n.startswith(("shardline.plugins", "shardline.profiling", "shardline.recipes"))}
    assert not upward, f"{path}: imports {sorted(upward)}"
    assert not imported & set(HEAVY), f"{path}: imports {sorted(imported & set(HEAVY))}"


def test_the_profiler_never_imports_the_training_side_or_the_planner(imported_roots):
    offenders = {p.name: sorted(n for n in _shardline_imports(p, imported_roots)
                                if n.startswith(("shardline.plugins", "shardline.recipes")))
                 for p in _modules("profiling")}
    assert not {k: v for k, v in offenders.items() if v}


def test_the_training_side_reaches_the_profiler_only_from_its_callback(imported_roots):
    """``StepProfiler`` runs the profiler on the traces it wrote; nothing else of plugins imports profiling, and
    nothing of plugins imports the planner (recipes sits above both)."""
    found = {p.relative_to(REPO).as_posix(): sorted(n for n in _shardline_imports(p, imported_roots)
                                                    if n.startswith(("shardline.profiling", "shardline.recipes")))
             for p in _modules("plugins")}
    found = {k: v for k, v in found.items() if v}
    assert set(found) <= {"plugins/lightning/profiler_callback.py"}, found
    assert not any(n.startswith("shardline.recipes") for names in found.values() for n in names), found


def test_the_job_package_loads_with_the_heavy_libraries_and_the_other_halves_blocked():
    code = f"""
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r} or name.startswith(("shardline.plugins", "shardline.profiling",
                                                               "shardline.recipes")):
            raise ImportError(f"blocked {{name}}")
sys.meta_path.insert(0, Block())
import shardline.job as job
names = [m.name for m in pkgutil.walk_packages(job.__path__, "shardline.job.")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip()) >= 7
