"""Guardrails of the one-import-root layout: pyproject lists every package, profiling imports without torch,
the console script answers, and no module imports a bare folder name."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from shardline.recipes.cli import main

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"job": "shardline.job", "plugins": "shardline.plugins", "profiling": "shardline.profiling",
         "recipes": "shardline.recipes"}


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _package_folders() -> dict[str, str]:
    """Every folder under the four roots holding an __init__.py, as dotted package -> folder."""
    found = {}
    for folder, package in ROOTS.items():
        for init in sorted((REPO / folder).rglob("__init__.py")):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(REPO / folder)
            dotted = ".".join((package, *rel.parts)) if rel.parts else package
            found[dotted] = init.parent.relative_to(REPO).as_posix()
    return found


def test_every_package_folder_is_listed_and_mapped():
    config = _pyproject()["tool"]["setuptools"]
    folders = _package_folders()
    assert sorted(config["packages"]) == sorted(folders), "pyproject packages != folders with __init__.py"
    assert config["package-dir"] == folders


def test_no_shardline_folder_or_top_level_init():
    assert not (REPO / "shardline").exists()
    assert not (REPO / "__init__.py").exists()


def test_profiling_imports_without_torch():
    # A meta-path blocker makes `import torch` fail, as on a laptop without it; every profiling module must load.
    code = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch.") or name.startswith("shardline.plugins"):
            raise ImportError(f"blocked {name}")
sys.meta_path.insert(0, Block())
import shardline.profiling as p
names = [m.name for m in pkgutil.walk_packages(p.__path__, "shardline.profiling.")]
for name in names:
    importlib.import_module(name)
assert "torch" not in sys.modules
print(len(names))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 3


def test_cli_help_and_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip().startswith("shardline 0.")
    assert main([]) == 0
    assert "usage: shardline" in capsys.readouterr().out


def test_console_script_is_installed():
    exe = shutil.which("shardline")
    if exe is None:
        pytest.skip("the shardline console script is not on PATH (package not installed)")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: shardline" in out.stdout


def _bare_folder_imports(path: Path) -> list[str]:
    """The absolute imports in ``path`` of a bare folder name (``import plugins``, ``from job.x import y``):
    they work only from the repository root, never from an install."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        found += [f"{path.name}:{node.lineno}: {name}" for name in names if name.split(".")[0] in ROOTS]
    return found


def test_no_module_imports_a_bare_folder_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import plugins\nfrom profiling import load\nimport recipes.cli\nfrom job.errors import X\n"
                   "from .pipeline import fine\nimport shardline.job\n")
    assert [line.split(": ")[0] for line in _bare_folder_imports(bad)] == ["bad.py:1", "bad.py:2", "bad.py:3",
                                                                         "bad.py:4"]
    offenders = [hit for folder in (*ROOTS, "tests", "bench") for path in sorted((REPO / folder).rglob("*.py"))
                 for hit in _bare_folder_imports(path)]
    assert not offenders, offenders


def test_ci_runs_exactly_the_readme_test_line():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Test", 1)[1]
    test_line = section.split("```bash", 1)[1].split("```", 1)[0].strip()
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert test_line in ci_lines


def test_plugins_import_is_light_and_registers_strategies_once_lightning_loads():
    code = """
import sys
import shardline.plugins.grid, shardline.job.pipeline.schedule
assert "torch" not in sys.modules and "pytorch_lightning" not in sys.modules, sorted(sys.modules)
import pytorch_lightning
from pytorch_lightning.strategies import StrategyRegistry
assert "shardline_tp2_pp2_zero2" in StrategyRegistry and "shardline" in StrategyRegistry
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("statement", [
    "from shardline.plugins import HybridParallelStrategy",
    "import shardline.plugins.lightning.strategy",
    "import shardline.plugins.lightning.registry as r; r.register_strategies()",
])
def test_strategy_imports_first_in_a_fresh_interpreter(statement):
    # Importing the strategy imports Lightning, whose import registers our names: no cycle may break that.
    code = f"""
{statement}
from pytorch_lightning.strategies import StrategyRegistry
from shardline.plugins.lightning.strategy import HybridParallelStrategy
assert isinstance(StrategyRegistry.get("shardline_tp2_zero3"), HybridParallelStrategy)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd="/")
    # (DeepSpeed prints its accelerator choice to stdout: the last line is ours.)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "ok", out.stderr[-2000:]
