"""Moved to :mod:`shardline.job.pipeline.simulate` (pure, below both halves); this name stays for existing code."""

from shardline.job.pipeline.simulate import *  # noqa: F403 - the whole public surface, unchanged
