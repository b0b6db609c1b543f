"""Fixtures of the profiling tests: the synthetic-trace generator, loaded by path (tests use importlib mode)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("shardline_synthetic_traces",
                                               Path(__file__).with_name("synthetic_traces.py"))
synthetic_traces = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(synthetic_traces)


@pytest.fixture(scope="session")
def synth():
    """The generator module ``tests/profiling/synthetic_traces.py``."""
    return synthetic_traces


@pytest.fixture
def read_both(monkeypatch):
    """``read_both(path)``: read a Kineto file three ways - the Arrow fast path forced on (every chunk it can
    read exactly, whatever the speed policy says), the ordinary msgspec path alone, and the default (the
    native scanner first, where it is built); assert the events, warnings and metadata are equal; return the
    events and how many chunks the Arrow path read."""
    from shardline.profiling.readers import _buffers, _kineto_arrow, kineto

    def read(path):
        used = []
        original = _kineto_arrow.columns_from_text

        def counting(*args, **kwargs):
            out = original(*args, **kwargs)
            used.append(out is not None)
            return out

        default = kineto.read_kineto(path)
        with monkeypatch.context() as patch:
            patch.setattr(_buffers, "NATIVE_ENABLED", False)
            patch.setattr(_kineto_arrow, "columns_from_text", counting)
            patch.setattr(_kineto_arrow, "ENABLED", True)
            patch.setattr(_kineto_arrow, "MIN_BYTES", 0)
            patch.setattr(_kineto_arrow, "MIN_EVENTS_PER_MB", 0)
            fast = kineto.read_kineto(path)
            patch.setattr(_kineto_arrow, "ENABLED", False)
            ordinary = kineto.read_kineto(path)
        import pandas as pd

        for other in (fast, default):
            pd.testing.assert_frame_equal(other.events, ordinary.events)
            assert other.warnings == ordinary.warnings
            assert other.metadata == ordinary.metadata
        return fast.events, sum(used)

    return read
