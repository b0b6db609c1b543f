"""Dependency contracts of the pipeline package, read from each module's own import statements.

Checked statically (every ``import``/``from`` anywhere in the module, including inside functions), so the
verdict is about these modules alone and not about what a parent package happens to import.
"""

from __future__ import annotations

from pathlib import Path

import pytest

PIPELINE = Path(__file__).resolve().parents[3] / "plugins" / "pipeline"
#: The schedule layer lives in the pure package below both halves (tests/test_dependency_direction.py checks
#: that package as a whole, at run time too); plugins/pipeline keeps modules of the same names re-exporting it.
SCHEDULE = Path(__file__).resolve().parents[3] / "job" / "pipeline"
SCHEDULE_LAYER = ("actions.py", "simulate.py", "schedule.py", "render.py")


@pytest.mark.parametrize("name", SCHEDULE_LAYER)
def test_schedule_layer_is_pure_python(name, imported_roots):
    imported = imported_roots(SCHEDULE / name)
    assert "torch" not in imported
    assert {n for n in imported if n.startswith("shardline")} <= {
        "shardline", "shardline.job.errors", "shardline.job.placement",
        *(f"shardline.job.pipeline.{m[:-3]}" for m in SCHEDULE_LAYER)}
    assert {n for n in imported_roots(PIPELINE / name) if n.startswith("shardline")} == {
        "shardline", f"shardline.job.pipeline.{name[:-3]}"}


@pytest.mark.parametrize("name", sorted(p.name for p in PIPELINE.glob("*.py")))
def test_pipeline_never_imports_deepspeed_or_lightning(name, imported_roots):
    imported = imported_roots(PIPELINE / name)
    assert not imported & {"deepspeed", "pytorch_lightning", "lightning"}
    assert not any(n.startswith("shardline.plugins.lightning.strategy") for n in imported)


def test_the_checker_sees_imports_inside_functions(tmp_path, imported_roots):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import torch.distributed as dist\n    from deepspeed import x\n")
    assert {"torch", "torch.distributed", "deepspeed"} <= imported_roots(probe)
