"""Moved to :mod:`shardline.job.pipeline.render` (pure, below both halves); this name stays for existing code."""

from shardline.job.pipeline.render import *  # noqa: F403 - the whole public surface, unchanged
