"""shardline.plugins: training-side parallelism (process grid, TP/SP layers, pipeline engine, strategy).

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
    "HybridParallelStrategy": "shardline.plugins.strategy",
    "StepProfiler": "shardline.plugins.profiler_callback",
    "register_strategies": "shardline.plugins.registry",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardline.plugins' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def _register() -> None:
    importlib.import_module("shardline.plugins.registry").register_strategies()


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
