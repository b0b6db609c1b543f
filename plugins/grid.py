"""The process grid: parallel degrees (:class:`ParallelDims`) and the process groups built from them (:class:`Grid`).

Rank order is ``tp`` fastest, then ``cp``, then ``dp``, then ``pp`` (Megatron's ``tp-cp-dp-pp``), stated once in
:mod:`shardline.job.placement` (which the profiler reads too)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a TP group is ``tp`` consecutive ranks and stays inside one node (NVLink), while DP, CP and PP groups stride
across nodes (InfiniBand). A group of axis ``a`` is the set of ranks that share every coordinate but ``a``.
Combined axes: ``dp_cp`` (ranks sharing tp and pp: ZeRO's partition group when the sequence is sharded),
``mp`` (ranks sharing cp and dp: the model-parallel group over which a gradient norm is summed) and ``embed``
(the first and last pipeline stage of each (tp, cp, dp) position: tied embeddings).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from shardline.job import placement
from shardline.job.annotations import group_desc
from shardline.job.layout import SPMode
from shardline.plugins.errors import ContractError, LayoutError

AXES = placement.AXES
COMBINED_AXES = ("dp_cp", "mp", "embed")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism for ``world_size`` ranks; validated at construction.

    ``dp`` is derived as ``world_size / (tp * cp * pp)`` when None. ``gpus_per_node``, when known, enforces that
    a TP group fits inside one node (``tp <= gpus_per_node`` and ``gpus_per_node % tp == 0``).
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int | None = None
    sp: SPMode | str = SPMode.NONE
    gpus_per_node: int | None = None
    _strides: dict = field(init=False, repr=False, compare=False)

    def __init__(self, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None,
                 sp: SPMode | str = "none", gpus_per_node: int | None = None):
        set_ = object.__setattr__
        set_(self, "world_size", world_size)
        set_(self, "tp", tp)
        set_(self, "pp", pp)
        set_(self, "cp", cp)
        set_(self, "gpus_per_node", gpus_per_node)
        problems = self._degree_problems(dp)
        try:
            set_(self, "sp", SPMode(sp))
        except ValueError:
            problems.append(f"sp={sp!r} is not one of {[m.value for m in SPMode]}")
            set_(self, "sp", SPMode.NONE)
        if problems:
            raise LayoutError("invalid parallel layout: " + "; ".join(problems))
        model = tp * cp * pp
        set_(self, "dp", world_size // model if dp is None else dp)
        problems = self._layout_problems()
        if problems:
            raise LayoutError(f"invalid parallel layout {self._summary()}: " + "; ".join(problems))
        set_(self, "_strides", placement.strides(self.degrees))

    def _degree_problems(self, dp: int | None) -> list[str]:
        problems = []
        named = {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "cp": self.cp}
        if dp is not None:
            named["dp"] = dp
        if self.gpus_per_node is not None:
            named["gpus_per_node"] = self.gpus_per_node
        for name, value in named.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1")
        if problems:
            return problems
        g = self.gpus_per_node
        if g is not None and (self.tp > g or g % self.tp):
            problems.append(f"tp={self.tp} must fit inside one node of gpus_per_node={g} "
                            f"(tp <= gpus_per_node and gpus_per_node % tp == 0): TP rides NVLink")
        model = self.tp * self.cp * self.pp
        if dp is None and self.world_size % model:
            problems.append(f"world_size={self.world_size} is not divisible by tp*cp*pp = "
                            f"{self.tp}*{self.cp}*{self.pp} = {model}")
        elif dp is not None and model * dp != self.world_size:
            problems.append(f"tp*cp*dp*pp = {self.tp}*{self.cp}*{dp}*{self.pp} = {model * dp} "
                            f"!= world_size={self.world_size}")
        return problems

    def _layout_problems(self) -> list[str]:
        problems = []
        if self.sp is SPMode.MEGATRON and self.tp == 1:
            problems.append("sp='megatron' shards the sequence over the TP group and needs tp > 1 (tp=1)")
        if self.sp in (SPMode.RING, SPMode.ULYSSES) and self.cp == 1:
            problems.append(f"sp={self.sp.value!r} is context parallelism and needs cp > 1 (cp=1)")
        g = self.gpus_per_node
        if g is not None and self.world_size > g and self.world_size % g:
            problems.append(f"world_size={self.world_size} is not a whole number of nodes of "
                            f"gpus_per_node={g}")
        return problems

    def _summary(self) -> str:
        return (f"(world_size={self.world_size}, tp={self.tp}, cp={self.cp}, dp={self.dp}, pp={self.pp}, "
                f"sp={self.sp.value!r}, gpus_per_node={self.gpus_per_node})")

    @property
    def degrees(self) -> dict[str, int]:
        """``{"tp", "cp", "dp", "pp"}`` degrees: the mapping the profiler classifies with."""
        return {axis: getattr(self, axis) for axis in AXES}

    def size(self, axis: str) -> int:
        """Size of one group of ``axis`` (an entry of AXES or COMBINED_AXES)."""
        if axis in AXES:
            return getattr(self, axis)
        if axis == "dp_cp":
            return self.dp * self.cp
        if axis == "mp":
            return self.tp * self.pp
        if axis == "embed":
            return 1 if self.pp == 1 else 2
        raise LayoutError(f"unknown axis {axis!r}; expected one of {AXES + COMBINED_AXES}")

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank``: ``{"tp": .., "cp": .., "dp": .., "pp": ..}``."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise LayoutError(f"rank={rank!r} outside 0..{self.world_size - 1} for {self._summary()}")
        return placement.coords_of(rank, self.degrees)

    def rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Inverse of :meth:`coords`."""
        coords = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        bad = [f"{a}={c}" for a, c in coords.items() if not 0 <= c < getattr(self, a)]
        if bad:
            raise LayoutError(f"coordinates {', '.join(bad)} out of range for {self._summary()}")
        return placement.rank_of(coords, self.degrees)

    def group_ranks(self, axis: str) -> list[list[int]]:
        """Every group of ``axis``, each a sorted list of ranks, groups ordered by their first rank."""
        if axis in AXES:
            varying = (axis,)
        elif axis == "dp_cp":
            varying = ("cp", "dp")
        elif axis == "mp":
            varying = ("tp", "pp")
        elif axis == "embed":
            return self._embed_groups()
        else:
            raise LayoutError(f"unknown axis {axis!r}; expected one of {AXES + COMBINED_AXES}")
        fixed = [a for a in AXES if a not in varying]
        groups = []
        for fixed_coords in itertools.product(*(range(getattr(self, a)) for a in fixed)):
            base = dict(zip(fixed, fixed_coords))
            members = [self.rank_of(**base, **dict(zip(varying, vc)))
                       for vc in itertools.product(*(range(getattr(self, a)) for a in varying))]
            groups.append(sorted(members))
        return sorted(groups)

    def _embed_groups(self) -> list[list[int]]:
        groups = []
        for tp, cp, dp in itertools.product(range(self.tp), range(self.cp), range(self.dp)):
            first = self.rank_of(tp=tp, cp=cp, dp=dp, pp=0)
            last = self.rank_of(tp=tp, cp=cp, dp=dp, pp=self.pp - 1)
            groups.append(sorted({first, last}))
        return sorted(groups)

    def node_of(self, rank: int) -> int | None:
        return None if self.gpus_per_node is None else rank // self.gpus_per_node

    def describe(self) -> str:
        """A readable rank map: every group of every axis, flagging groups that cross a node boundary."""
        lines = [f"ParallelDims{self._summary()}"]
        if self.gpus_per_node is not None:
            n_nodes = max(1, -(-self.world_size // self.gpus_per_node))
            for node in range(n_nodes):
                lo, hi = node * self.gpus_per_node, min(self.world_size, (node + 1) * self.gpus_per_node)
                lines.append(f"  node {node}: ranks {lo}..{hi - 1}")
        for axis in AXES + COMBINED_AXES:
            groups = self.group_ranks(axis)
            crossing = [g for g in groups if self._crosses_nodes(g)]
            note = ""
            if self.gpus_per_node is not None:
                note = f"  ({len(crossing)} of {len(groups)} cross nodes)" if crossing else "  (intra-node)"
            lines.append(f"  {axis:<6} size {self.size(axis)}: "
                         + " ".join("[" + ",".join(map(str, g)) + "]" for g in groups) + note)
        lines.append("  rank -> (tp, cp, dp, pp): " + "  ".join(
            f"{r}:({c['tp']},{c['cp']},{c['dp']},{c['pp']})"
            for r, c in ((r, self.coords(r)) for r in range(self.world_size))))
        return "\n".join(lines)

    def _crosses_nodes(self, ranks: list[int]) -> bool:
        return self.gpus_per_node is not None and len({r // self.gpus_per_node for r in ranks}) > 1


@dataclass(frozen=True)
class StandInGroup:
    """The description of one process group (its axis, its global ranks in group order, and which of them is
    "this" rank) standing where a real group would, with no communicator behind it."""

    axis: str
    ranks: tuple[int, ...]
    rank: int

    def __post_init__(self):
        if self.rank not in self.ranks:
            raise LayoutError(f"stand-in {self.axis} group {list(self.ranks)} does not hold rank {self.rank}")

    def refuse(self, what: str):
        raise ContractError(f"{what} over a stand-in {self.axis} group {list(self.ranks)} (rank {self.rank}): a "
                            "stand-in grid describes a layout for building and counting in one process; it "
                            "cannot communicate (build the model on a Grid.build grid to run it)")


class Grid:
    """The process groups of one :class:`ParallelDims`, created once on every rank and passed explicitly.

    Build it with :meth:`build` after ``torch.distributed`` is initialised. ``grid.group(axis)`` is this rank's
    group of that axis; ``grid.mpu`` is the object DeepSpeed's ``initialize(mpu=...)`` expects, so ZeRO
    partitions over the data-parallel group (``dp_cp`` when the sequence is sharded), never over TP ranks.

    :meth:`stand_in` is the same grid for "rank r of this layout" in any process, with no process group: its
    groups are :class:`StandInGroup` descriptions, so a model built on it
    (on the meta device, say) is exactly rank r's part, while any collective over it is refused.
    """

    def __init__(self, dims: ParallelDims, *, rank: int, groups: dict, group_ranks: dict, backend: str):
        self.dims = dims
        self.global_rank = rank
        self.backend = backend
        self._groups = groups
        self._group_ranks = group_ranks
        self.coords = dims.coords(rank)

    @classmethod
    def build(cls, dims: ParallelDims, *, backend: str | None = None) -> Grid:
        """Create every group of every axis (collective: all ranks must call it, in the same order)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise LayoutError("Grid.build needs torch.distributed initialised first "
                              "(dist.init_process_group, or a Lightning strategy's setup_environment)")
        world = dist.get_world_size()
        if world != dims.world_size:
            raise LayoutError(f"the process group has world_size={world} but the layout says "
                              f"world_size={dims.world_size} {dims._summary()}")
        backend = backend or dist.get_backend()
        rank = dist.get_rank()
        groups, mine = {}, {}
        for axis in AXES + COMBINED_AXES:
            for ranks in dims.group_ranks(axis):
                # new_group is collective over the whole world: every rank creates every group.
                group = dist.new_group(ranks, backend=backend, group_desc=group_desc(axis))
                if rank in ranks:
                    groups[axis], mine[axis] = group, ranks
        return cls(dims, rank=rank, groups=groups, group_ranks=mine, backend=backend)

    @classmethod
    def stand_in(cls, dims: ParallelDims, *, rank: int) -> Grid:
        """Rank ``rank``'s grid of ``dims`` without ``torch.distributed``: every group a stand-in (no
        communication), every size, rank and rank list as :meth:`build` would give on that rank."""
        if not 0 <= rank < dims.world_size:
            raise LayoutError(f"rank={rank} is outside the layout's world_size={dims.world_size} {dims._summary()}")
        groups, mine = {}, {}
        for axis in AXES + COMBINED_AXES:
            for ranks in dims.group_ranks(axis):
                if rank in ranks:
                    groups[axis], mine[axis] = StandInGroup(axis, tuple(ranks), rank), list(ranks)
        return cls(dims, rank=rank, groups=groups, group_ranks=mine, backend="stand-in")

    @property
    def is_stand_in(self) -> bool:
        return self.backend == "stand-in"

    def group(self, axis: str):
        """This rank's process group of ``axis`` (None for ``embed`` on a middle pipeline stage)."""
        self._check_axis(axis)
        return self._groups.get(axis)

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group of ``axis`` (empty for ``embed`` on a middle stage)."""
        self._check_axis(axis)
        return list(self._group_ranks.get(axis, []))

    def rank(self, axis: str) -> int:
        """This rank's index within its group of ``axis``."""
        self._check_axis(axis)
        if axis in AXES:
            return self.coords[axis]
        members = self._group_ranks.get(axis)
        if not members:
            raise LayoutError(f"rank {self.global_rank} belongs to no {axis!r} group")
        return members.index(self.global_rank)

    def size(self, axis: str) -> int:
        self._check_axis(axis)
        return self.dims.size(axis)

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.dims.pp - 1

    @property
    def mpu(self):
        from shardline.plugins.mpu import GridMpu

        return GridMpu(self)

    def describe(self) -> str:
        return self.dims.describe() + f"\n  this rank {self.global_rank}: {self.coords}"

    def _check_axis(self, axis: str) -> None:
        if axis not in AXES + COMBINED_AXES:
            raise LayoutError(f"unknown axis {axis!r}; expected one of {AXES + COMBINED_AXES}")
