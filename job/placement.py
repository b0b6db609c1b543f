"""Rank order and pipeline-stage placement: the one statement of both, shared by the training side and the profiler.

Pure Python (no torch, no numpy, no plugins), so the profiler imports it on a laptop without torch and the
training side (``shardline.plugins.grid``, the pipeline schedules and driver) imports it as its own rule. Like
:mod:`shardline.job.annotations`, it is a contract both halves read, written down once.

Rank order is ``tp`` fastest, then ``cp``, then ``dp``, then ``pp`` (Megatron's ``tp-cp-dp-pp``)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a TP group is ``tp`` consecutive ranks and stays inside one node (NVLink), while DP, CP and PP groups stride
across nodes (InfiniBand).

Stage placement: with ``pp`` pipeline ranks and ``v`` chunks per rank, stage ``s`` (of ``pp * v``) lives on
pipeline rank ``s % pp`` as its chunk ``s // pp``; pipeline rank ``r`` hosts stages ``r, r + pp, r + 2 pp, ...``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

AXES = ("tp", "cp", "dp", "pp")


def strides(degrees: Mapping[str, int]) -> dict[str, int]:
    """The rank stride of each axis: ``{"tp": 1, "cp": tp, "dp": tp*cp, "pp": tp*cp*dp}``."""
    out, stride = {}, 1
    for axis in AXES:
        out[axis] = stride
        stride *= int(degrees.get(axis, 1))
    return out


def coords_of(rank: int, degrees: Mapping[str, int]) -> dict[str, int]:
    """The ``(tp, cp, dp, pp)`` coordinates of ``rank`` (no range check: callers own the world size)."""
    step = strides(degrees)
    return {axis: (rank // step[axis]) % int(degrees.get(axis, 1)) for axis in AXES}


def rank_of(coords: Mapping[str, int], degrees: Mapping[str, int]) -> int:
    """Inverse of :func:`coords_of` (missing coordinates are 0)."""
    step = strides(degrees)
    return sum(int(coords.get(axis, 0)) * step[axis] for axis in AXES)


def varying_axes(ranks: Iterable[int], degrees: Mapping[str, int]) -> list[str]:
    """The axes along which the coordinates of ``ranks`` differ, in rank order (a group of axis ``a`` varies
    along ``a`` alone)."""
    seen = [coords_of(int(r), degrees) for r in ranks]
    return [axis for axis in AXES if len({c[axis] for c in seen}) > 1]


def stage_rank(stage: int, *, pp: int) -> int:
    """The pipeline rank hosting ``stage``."""
    return stage % pp


def stages_of_rank(rank: int, *, n_stages: int, pp: int) -> list[int]:
    """The stages pipeline rank ``rank`` hosts, in chunk order: ``[rank, rank + pp, ...]``."""
    return list(range(rank, n_stages, pp))
