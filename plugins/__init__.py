"""shardline.plugins: training-side parallelism, grouped by role.

- ``grid`` (ParallelDims, Grid, DeepSpeed's ``mpu`` from ``mpu``), ``errors``, ``testing`` (run_ranks),
  ``sp_memory`` (a live-tensor meter for CPU runs);
- ``layers``: TP/SP math (collective pairs, parallel linears, vocabulary-parallel embedding and loss,
  ring attention, Ulysses); torch only;
- ``pipeline``: schedules as data, their validation and simulation, and the engine that runs them; no
  Lightning or DeepSpeed;
- ``models``: models built from the layers on one decoder skeleton (``models.decoder``): ``models.gpt`` (GPT-2
  style) and ``models.llama`` (the Llama family: RMSNorm, SwiGLU, rotary, grouped-query attention, Qwen2 bias);
- ``lightning``: the Lightning strategy, its registered names, the per-stage DeepSpeed driver, the ZeRO config
  and the StepProfiler callback; the one package here that imports Lightning or DeepSpeed.

The public API is re-exported here, each name imported on first use (so ``import shardline.plugins`` stays
light): HybridParallelStrategy, StepProfiler, ParallelDims, Grid, run_ranks, ColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy, ring_attention, ulysses_attention,
GPT, GPTConfig, Llama, LlamaConfig, RopeScaling.

The strategy names (``"shardline"``, ``"shardline_tp2_pp2_zero2"``, ...) are registered with Lightning as soon as
both this package and ``pytorch_lightning`` are imported, in either order, so
``Trainer(strategy="shardline_tp2_zero3")`` works after ``import shardline.plugins``. Importing this package does
not import Lightning itself: ``shardline.plugins.grid``, the TP/SP layers and the pipeline package stay free of
it (and the schedule module free of torch) until Lightning is actually used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

_LAZY = {
    "HybridParallelStrategy": "shardline.plugins.lightning.strategy",
    "StepProfiler": "shardline.plugins.lightning.profiler_callback",
    "register_strategies": "shardline.plugins.lightning.registry",
    "ParallelDims": "shardline.plugins.grid",
    "Grid": "shardline.plugins.grid",
    "run_ranks": "shardline.plugins.testing",
    "ColumnParallelLinear": "shardline.plugins.layers.tensor_parallel",
    "RowParallelLinear": "shardline.plugins.layers.tensor_parallel",
    "VocabParallelEmbedding": "shardline.plugins.layers.tp_vocab",
    "vocab_parallel_cross_entropy": "shardline.plugins.layers.tp_vocab",
    "ring_attention": "shardline.plugins.layers.sequence_parallel",
    "ulysses_attention": "shardline.plugins.layers.sequence_parallel",
    "GPT": "shardline.plugins.models.gpt",
    "GPTConfig": "shardline.plugins.models.gpt",
    "Llama": "shardline.plugins.models.llama",
    "LlamaConfig": "shardline.plugins.models.llama",
    "RopeScaling": "shardline.plugins.layers.rotary",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardline.plugins' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def _register() -> None:
    importlib.import_module("shardline.plugins.lightning.registry").register_strategies()


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``pytorch_lightning`` is found by the others, runs ``_register`` after it loads."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "pytorch_lightning":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


if "pytorch_lightning" in sys.modules:
    _register()
elif not any(isinstance(f, _RegisterAfterLightning) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterLightning())
