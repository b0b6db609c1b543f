"""Every results file under bench/results/ names the commit it was measured at, and the README's Measured
section is exactly what bench/update_readme.py generates from them (so no table is edited by hand)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module(name: str):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "bench"))


def test_every_results_file_names_its_commit():
    stamp = _module("_publish").STAMP
    files = sorted((REPO / "bench" / "results").glob("*.md"))
    assert files
    unstamped = [path.name for path in files if stamp.search(path.read_text()) is None]
    assert not unstamped, f"results without a 'Measured at commit' line: {unstamped}"


def test_readme_measured_section_is_the_generated_one():
    generated = _module("update_readme").section()
    assert generated in (REPO / "README.md").read_text(), "run python bench/update_readme.py"


def test_the_stamp_says_whether_the_tree_was_dirty():
    line = _module("_publish").stamp()
    found = _module("_publish").STAMP.search(line)
    assert found and (found["tree"] == "clean tree" or found["tree"].startswith("dirty tree: "))
