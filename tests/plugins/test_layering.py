"""The folders show the layers: layer math, the pipeline and the models import neither Lightning nor DeepSpeed
(statically, every import statement including those inside functions, and at run time in a fresh interpreter),
and the public API is importable from ``shardline.plugins``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
FREE_OF_ADAPTERS = ("layers", "pipeline", "models", "faults")
FORBIDDEN = {"deepspeed", "pytorch_lightning", "lightning", "lightning_fabric"}
PUBLIC = ("HybridParallelStrategy", "StepProfiler", "ParallelDims", "Grid", "run_ranks", "ColumnParallelLinear",
          "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "ring_attention",
          "ulysses_attention", "GPT", "GPTConfig")


@pytest.mark.parametrize("path", [p for folder in FREE_OF_ADAPTERS for p in sorted((PLUGINS / folder).glob("*.py"))],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_layer_pipeline_and_model_modules_never_import_lightning_or_deepspeed(path, imported_roots):
    imported = imported_roots(path)
    assert not imported & FORBIDDEN, f"{path}: imports {sorted(imported & FORBIDDEN)}"
    assert not any(name.startswith("shardline.plugins.lightning") for name in imported), path


def test_they_load_without_lightning_and_deepspeed_in_a_fresh_interpreter():
    code = f"""
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {sorted(FORBIDDEN)!r}:
            raise ImportError(f"blocked {{name}}")
sys.meta_path.insert(0, Block())
count = 0
for folder in {FREE_OF_ADAPTERS!r}:
    package = importlib.import_module("shardline.plugins." + folder)
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
        count += 1
print(count)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip().splitlines()[-1]) >= 15


def test_the_public_api_is_reexported():
    import shardline.plugins as plugins

    for name in PUBLIC:
        assert getattr(plugins, name) is not None, name
    assert plugins.GPT.__module__ == "shardline.plugins.models.gpt"
    assert plugins.HybridParallelStrategy.__module__ == "shardline.plugins.lightning.strategy"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        plugins.Nope  # noqa: B018


#: DeepSpeed's undocumented state that shardline relies on (parameter and optimizer internals).
DEEPSPEED_PRIVATE = ("ds_id", "ds_shape", "ds_tensor", "ds_status", "grad_accum", "parameter_offload",
                     "fwd_pre_hook", "get_param_coordinator", "_invalidate_trace", "is_invalid_trace",
                     "scale_if_loss", "torch_autocast_z0_gradscaler", "ds_pipe_replicated", "model_parallel",
                     "tensor_model_parallel", "partition_dim", "single_partition_of_fp32_groups")


def _sources():
    root = PLUGINS.parent
    return [p for folder in ("plugins", "recipes") for p in sorted((root / folder).rglob("*.py"))]


def test_deepspeed_private_state_is_touched_in_one_file():
    import re

    users = {}
    for path in _sources():
        text = path.read_text()
        found = [name for name in DEEPSPEED_PRIVATE if re.search(rf"\b{re.escape(name)}\b", text)]
        if found:
            users[f"{path.parent.name}/{path.name}"] = found
    assert set(users) == {"lightning/deepspeed_compat.py"}, users


def test_no_attribute_is_forced_onto_another_object():
    # object.__setattr__ only on an object's own (frozen) self: never on the user's module.
    import re

    offenders = [f"{path.name}:{i}" for path in _sources()
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"object\.__setattr__\((?!self\b)", line)]
    assert not offenders, offenders
