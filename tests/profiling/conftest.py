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
