"""The package's floors: ``shardline.job`` below everything, the profiler and the training side meeting only
through it. Every import statement counts, inside functions too (a cycle or an upward arrow moved into a function
is still one), and the pure package also loads in a fresh interpreter with the heavy libraries blocked."""

from __future__ import annotations

import re
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


# ------------------------------------------------------------------ the profiler's floors
PROFILING = REPO / "profiling"
#: The profiler's sub-packages, bottom first: a module imports modules of its own floor and of those below it,
#: never above (the package's ``__init__``, the public API's lazy exports, sits on top of them all).
PROFILING_LAYERS = ("base", "readers", "table", "matching", "attribution", "analyses", "present")
#: The function-local imports of a sibling module there are: lazy entry points, each with its reason (which the
#: importing module states too). ``*``: any sibling.
LAZY_SIBLINGS = {
    ("present.cli", "*"): "the command tree is built with every `shardline` command; each runner loads what it "
                          "runs on first use",
    ("readers.kineto", "readers._kineto_msgspec"): "msgspec's paths only when the native scanner cannot read",
    ("readers.kineto", "readers._kineto_stream"): "ctypes and libc's malloc_trim only for a streamed read",
    ("readers._kineto_stream", "readers._kineto_msgspec"): "msgspec's repair path only for a bare NaN/Infinity",
    ("readers._kineto_columns", "readers._kineto_arrow"): "pyarrow, optional, only for decimal text columns",
}


def _profiling_modules() -> dict[str, Path]:
    out = {}
    for path in _modules("profiling"):
        parts = path.relative_to(PROFILING).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, modules) -> str | None:
    """The module of ``name`` (relative to ``shardline.profiling``, "" for the package itself), or None."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name if name in modules else None


def _profiling_imports() -> list[tuple[str, str, bool, int, str]]:
    """(importer, imported, inside a function, line, import target as written) for every import statement of a
    profiling module naming a module of ``shardline.profiling`` (relative imports resolved; a module that calls
    ``importlib.import_module`` also imports every module its string constants name)."""
    import ast

    modules = _profiling_modules()
    edges = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        dynamic = any(isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                      == "import_module" for node in ast.walk(tree))

        def visit(node, local: bool, name=name, package=package, dynamic=dynamic) -> None:
            for child in ast.iter_child_nodes(node):
                inside = local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                targets = []
                if isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = package.split(".") if package else []
                        base = base[:len(base) - (child.level - 1)] if child.level > 1 else base
                        if child.level - 1 > len(package.split(".") if package else []):
                            targets = ["<outside shardline.profiling>." + (child.module or "")]
                            base = None
                        if base is not None:
                            root = ".".join(["shardline", "profiling", *base, *([child.module] if child.module
                                                                                 else [])])
                            targets = [f"{root}.{alias.name}" for alias in child.names]
                    else:
                        targets = [f"{child.module}.{alias.name}" for alias in child.names]
                elif dynamic and isinstance(child, ast.Constant) and isinstance(child.value, str) \
                        and re.fullmatch(r"(shardline\.profiling)?(\.[a-z_0-9]+)+", child.value):
                    value = child.value
                    targets = [value if value.startswith("shardline") else f"shardline.profiling.{package}{value}"
                               .replace("profiling..", "profiling.")]
                exact = isinstance(child, ast.Constant)  # a string names a module exactly, or nothing
                for target in targets:
                    if exact and target.removeprefix("shardline.profiling").lstrip(".") not in modules:
                        continue
                    if target.startswith("<outside"):
                        edges.append((name, target, inside, child.lineno, target))
                    elif target == "shardline.profiling" or target.startswith("shardline.profiling."):
                        found = _resolve(target.removeprefix("shardline.profiling").lstrip("."), modules)
                        if found is not None and found != name:
                            edges.append((name, found, inside, child.lineno, target))
                visit(child, inside)

        visit(tree, False)
    return edges


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None (depth-first, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def test_the_profiler_has_no_import_cycle_counting_every_import_statement():
    graph: dict[str, set[str]] = {}
    for importer, imported, *_ in _profiling_imports():
        graph.setdefault(importer, set()).add(imported)
    assert len(graph) > 30, sorted(graph)  # the walk sees the package
    assert {"table.load", "attribution.core", "present.report_sections"} <= graph[""]  # and the lazy exports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself finds one


def test_the_profilers_sub_packages_import_only_downward():
    modules = _profiling_modules()
    floors = {name: name.split(".")[0] for name in modules if name}
    assert set(floors.values()) == set(PROFILING_LAYERS), "every profiling module sits in a declared floor"
    upward = [f"{importer} -> {imported} (line {line})" for importer, imported, _, line, _ in _profiling_imports()
              if importer and (imported == "" or imported.startswith("<")
                               or PROFILING_LAYERS.index(floors[importer]) < PROFILING_LAYERS.index(floors[imported]))]
    assert not upward, upward


#: Inside ``analyses``, a star around the attribution: the only imports between its modules, each of the what-if's
#: own parts (its scenario types and context, its pipeline scenario); no analysis calls another's entry point.
ANALYSES_IMPORTS = {("analyses.what_if", "analyses.scenario"), ("analyses.what_if", "analyses.what_if_pipeline"),
                    ("analyses.what_if_pipeline", "analyses.scenario")}


def test_the_analyses_import_no_other_analysis():
    found = {(importer, imported) for importer, imported, *_ in _profiling_imports()
             if importer.startswith("analyses.") and imported.startswith("analyses.") and importer != imported}
    assert found == ANALYSES_IMPORTS


def test_the_profiler_imports_no_sibling_inside_a_function_but_its_lazy_entry_points():
    local = [(importer, imported, line) for importer, imported, inside, line, _ in _profiling_imports() if inside]
    unexplained = [f"{importer}:{line} -> {imported}" for importer, imported, line in local
                   if (importer, imported) not in LAZY_SIBLINGS and (importer, "*") not in LAZY_SIBLINGS]
    assert not unexplained, unexplained
    assert {(i, m) for i, m, _ in local} >= {k for k in LAZY_SIBLINGS if k[1] != "*"}, "an allowance no longer used"


def test_the_profiler_loads_with_the_training_side_and_the_planner_blocked():
    code = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("shardline.plugins", "shardline.recipes")) or name.split(".")[0] == "torch":
            raise ImportError(f"blocked {name}")
sys.meta_path.insert(0, Block())
import shardline.profiling as profiling
names = [m.name for m in pkgutil.walk_packages(profiling.__path__, "shardline.profiling.")]
for name in names:
    importlib.import_module(name)
for name in profiling.__all__:
    assert getattr(profiling, name) is not None, name
import types
assert all(isinstance(getattr(profiling, n), types.FunctionType) for n in ("breakdown", "load", "report_sections")), \
    "an export shadowed by a module of the same name"
print(len(names))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip()) >= 40
