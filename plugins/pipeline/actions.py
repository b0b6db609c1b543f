"""Moved to :mod:`shardline.job.pipeline.actions` (pure, below both halves); this name stays for existing code."""

from shardline.job.pipeline.actions import *  # noqa: F403 - the whole public surface, unchanged
