"""Moved to :mod:`shardline.job.pipeline.schedule` (pure, below both halves); this name stays for existing code."""

from shardline.job.pipeline.schedule import *  # noqa: F403 - the whole public surface, unchanged
