"""Packaged recipes per model size (``<model>.yaml``), written by :mod:`.generate`."""
