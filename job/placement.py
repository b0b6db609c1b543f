"""Rank order and pipeline-stage placement: the one statement of both, shared by the training side and the profiler.

Pure Python (no torch, no numpy, no plugins), so the profiler imports it on a laptop without torch and the
training side (``shardline.plugins.grid``, the pipeline schedules and driver) imports it as its own rule. Like
:mod:`shardline.job.annotations`, it is a contract both halves read, written down once.

Rank order is ``tp`` fastest, then ``cp``, then ``dp``, then ``pp`` (Megatron's ``tp-cp-dp-pp``)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a TP group is ``tp`` consecutive ranks and stays inside one node (NVLink), while DP, CP and PP groups stride
across nodes (InfiniBand).

Stage placement: with ``pp`` pipeline ranks and ``v`` chunks per rank, stage ``s`` (of ``pp * v``) is chunk
``s // pp`` of its rank. Two placements (``style``):

- ``"loop"`` (the default; GPipe, 1F1B, interleaved 1F1B): stage ``s`` lives on pipeline rank ``s % pp``, so rank
  ``r`` hosts stages ``r, r + pp, r + 2 pp, ...``.
- ``"v"`` (ZB-V, DualPipeV): the chunks zig-zag, even chunks going down the ranks and odd chunks coming back up:
  stage ``s`` lives on rank ``s % pp`` when ``s // pp`` is even and on ``pp - 1 - s % pp`` when it is odd. With two
  chunks rank ``r`` hosts stages ``r`` and ``2 pp - 1 - r`` (a V: the first and the last stage share rank 0, and
  the two middle stages ``pp - 1`` and ``pp`` share rank ``pp - 1``, so that hop costs no transfer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .errors import ScheduleError

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


PLACEMENTS = ("loop", "v")


def _check_style(style: str) -> None:
    if style not in PLACEMENTS:
        raise ScheduleError(f"unknown stage placement style={style!r}; expected one of {list(PLACEMENTS)}")


def stage_rank(stage: int, *, pp: int, style: str = "loop") -> int:
    """The pipeline rank hosting ``stage`` under placement ``style`` (see the module docstring)."""
    _check_style(style)
    if style == "v" and (stage // pp) % 2 == 1:
        return pp - 1 - stage % pp
    return stage % pp


def stages_of_rank(rank: int, *, n_stages: int, pp: int, style: str = "loop") -> list[int]:
    """The stages pipeline rank ``rank`` hosts, in chunk order: ``[rank, rank + pp, ...]`` for ``"loop"``,
    ``[rank, 2 pp - 1 - rank, 2 pp + rank, ...]`` for ``"v"``."""
    _check_style(style)
    if style == "loop":
        return list(range(rank, n_stages, pp))
    return [c * pp + (rank if c % 2 == 0 else pp - 1 - rank) for c in range(n_stages // pp)]
