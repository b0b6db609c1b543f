"""Shared test settings: where the real trace corpus lives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# One setting for the real-trace corpus; a user's clone without it skips those tests with the reason.
TRACES_DIR = Path(os.environ.get("SHARDLINE_TRACES", REPO.parent / "shared" / "traces"))


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not TRACES_DIR.is_dir():
        pytest.skip(f"trace corpus not found at {TRACES_DIR} (set SHARDLINE_TRACES to its folder)")
    return TRACES_DIR
