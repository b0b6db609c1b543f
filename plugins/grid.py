"""The process grid: parallel degrees (:class:`ParallelDims`) and the process groups built from them (:class:`Grid`).

Rank order is ``tp`` fastest, then ``cp``, then ``dp``, then ``pp`` (Megatron's ``tp-cp-dp-pp``), stated once in
:mod:`shardline.job.placement` (which the profiler reads too)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a TP group is ``tp`` consecutive ranks and stays inside one node (NVLink), while DP, CP and PP groups stride
across nodes (InfiniBand). A group of axis ``a`` is the set of ranks that share every coordinate but ``a``.
Combined axes: ``dp_cp`` (ranks sharing tp and pp: ZeRO's partition group when the sequence is sharded),
``mp`` (ranks sharing cp and dp: the model-parallel group over which a gradient norm is summed) and ``embed``
(the first and last pipeline stage of each (tp, cp, dp) position: tied embeddings).

Expert axes (MoE layers; Megatron's MoE parallel folding). The same ``tp * cp * dp`` ranks of a pipeline stage
are re-read as ``etp * ep * edp``, ``etp`` fastest, on the stage-local index ``i = tp_rank + tp * (cp_rank + cp *
dp_rank)``::

    etp_rank = i % etp,  ep_rank = (i // etp) % ep,  edp_rank = i // (etp * ep)

so an EP group is ``ep`` ranks ``etp`` apart (consecutive when ``etp=1``: inside a node when it fits one), ``etp``
splits each expert's FFN dimension, and ``edp = tp*cp*dp / (etp*ep)`` ranks hold copies of the same experts (the
group over which expert gradients reduce). ``etp*ep`` must divide ``tp*cp*dp``; this version takes ``etp`` in
``{1, tp}`` only (with ``etp = tp`` the etp group is the TP group). With ``etp=1`` and ``tp > 1`` an EP group
takes in TP ranks, which hold the same tokens: the MoE layer splits them (:mod:`shardline.plugins.layers.moe`).
With ``ep = etp = 1`` (the default: a dense job) nothing changes and no expert group is built.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from shardline.job import placement
from shardline.job.annotations import group_desc
from shardline.job.layout import SPMode, expert_degree_problems, expert_fold_problems
from shardline.plugins.errors import ContractError, LayoutError

AXES = placement.AXES
COMBINED_AXES = ("dp_cp", "mp", "embed")
EXPERT_AXES = ("etp", "ep", "edp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism for ``world_size`` ranks; validated at construction.

    ``dp`` is derived as ``world_size / (tp * cp * pp)`` when None. ``gpus_per_node``, when known, enforces that
    a TP group fits inside one node (``tp <= gpus_per_node`` and ``gpus_per_node % tp == 0``). ``ep`` and ``etp``
    fold each stage's ranks for the MoE layers (module docstring; ``edp`` follows).
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int | None = None
    sp: SPMode | str = SPMode.NONE
    gpus_per_node: int | None = None
    ep: int = 1
    etp: int = 1
    _strides: dict = field(init=False, repr=False, compare=False)

    def __init__(self, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None,
                 sp: SPMode | str = "none", gpus_per_node: int | None = None, ep: int = 1, etp: int = 1):
        set_ = object.__setattr__
        set_(self, "world_size", world_size)
        set_(self, "tp", tp)
        set_(self, "pp", pp)
        set_(self, "cp", cp)
        set_(self, "ep", ep)
        set_(self, "etp", etp)
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
        named = {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
                 "etp": self.etp}
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
        return problems + expert_degree_problems(tp=self.tp, ep=self.ep, etp=self.etp)

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
        return problems + expert_fold_problems(tp=self.tp, cp=self.cp, dp=self.dp, ep=self.ep, etp=self.etp)

    def _summary(self) -> str:
        experts = f", ep={self.ep}, etp={self.etp}" if self.has_expert_axes else ""
        return (f"(world_size={self.world_size}, tp={self.tp}, cp={self.cp}, dp={self.dp}, pp={self.pp}, "
                f"sp={self.sp.value!r}{experts}, gpus_per_node={self.gpus_per_node})")

    @property
    def has_expert_axes(self) -> bool:
        """Whether the MoE layers fold the ranks differently from the dense ones (``(ep, etp) != (1, 1)``)."""
        return (self.ep, self.etp) != (1, 1)

    @property
    def edp(self) -> int:
        """The expert-data-parallel degree: ``tp * cp * dp / (etp * ep)`` copies of each expert per stage."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def expert_degrees(self) -> dict[str, int]:
        """``{"etp", "ep", "edp", "pp"}`` degrees, expert rank order (etp fastest)."""
        return {"etp": self.etp, "ep": self.ep, "edp": self.edp, "pp": self.pp}

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on the expert axes: ``{"etp": .., "ep": .., "edp": .., "pp": ..}``."""
        pp_rank = self.coords(rank)["pp"]
        local = rank - pp_rank * self.tp * self.cp * self.dp
        return {"etp": local % self.etp, "ep": (local // self.etp) % self.ep,
                "edp": local // (self.etp * self.ep), "pp": pp_rank}

    def expert_rank_of(self, *, etp: int = 0, ep: int = 0, edp: int = 0, pp: int = 0) -> int:
        """Inverse of :meth:`expert_coords`."""
        coords = {"etp": etp, "ep": ep, "edp": edp, "pp": pp}
        bad = [f"{a}={c}" for a, c in coords.items() if not 0 <= c < self.expert_degrees[a]]
        if bad:
            raise LayoutError(f"expert coordinates {', '.join(bad)} out of range for {self._summary()} "
                              f"(edp={self.edp})")
        return etp + self.etp * (ep + self.ep * edp) + pp * self.tp * self.cp * self.dp

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
        if axis in EXPERT_AXES:
            return self.expert_degrees[axis]
        raise LayoutError(f"unknown axis {axis!r}; expected one of {AXES + COMBINED_AXES + EXPERT_AXES}")

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
        elif axis in EXPERT_AXES:
            return self._expert_groups(axis)
        else:
            raise LayoutError(f"unknown axis {axis!r}; expected one of {AXES + COMBINED_AXES + EXPERT_AXES}")
        fixed = [a for a in AXES if a not in varying]
        groups = []
        for fixed_coords in itertools.product(*(range(getattr(self, a)) for a in fixed)):
            base = dict(zip(fixed, fixed_coords))
            members = [self.rank_of(**base, **dict(zip(varying, vc)))
                       for vc in itertools.product(*(range(getattr(self, a)) for a in varying))]
            groups.append(sorted(members))
        return sorted(groups)

    def _expert_groups(self, axis: str) -> list[list[int]]:
        degrees = self.expert_degrees
        fixed = [a for a in degrees if a != axis]
        groups = []
        for fixed_coords in itertools.product(*(range(degrees[a]) for a in fixed)):
            base = dict(zip(fixed, fixed_coords))
            groups.append(sorted(self.expert_rank_of(**base, **{axis: i}) for i in range(degrees[axis])))
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
        for axis in AXES + COMBINED_AXES + (EXPERT_AXES if self.has_expert_axes else ()):
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
        if self.has_expert_axes:
            lines.append("  rank -> (etp, ep, edp, pp): " + "  ".join(
                f"{r}:({c['etp']},{c['ep']},{c['edp']},{c['pp']})"
                for r, c in ((r, self.expert_coords(r)) for r in range(self.world_size))))
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

    Expert axes (``EXPERT_AXES``) exist when ``dims.has_expert_axes``: ``ep`` and ``edp`` get groups of their own
    (descriptions ``sl:ep``, ``sl:edp``), and ``etp`` is the ``tp`` group itself (``etp = tp``) or None
    (``etp = 1``). On a dense layout (``ep = etp = 1``) none is built unless ``expert_groups=True`` (an MoE model
    at ``ep = 1`` on ``tp > 1`` splits its tokens over TP and reduces expert gradients over ``edp``, the whole
    stage): ``group("ep")`` and ``group("etp")`` are None (size 1, no communication), and ``group("edp")`` is
    refused unless it has one rank.
    """

    def __init__(self, dims: ParallelDims, *, rank: int, groups: dict, group_ranks: dict, backend: str):
        self.dims = dims
        self.global_rank = rank
        self.backend = backend
        self._groups = groups
        self._group_ranks = group_ranks
        self.coords = dims.coords(rank)
        self.expert_coords = dims.expert_coords(rank)

    @classmethod
    def build(cls, dims: ParallelDims, *, backend: str | None = None, expert_groups: bool | None = None) -> Grid:
        """Create every group of every axis (collective: all ranks must call it, in the same order); the expert
        groups when ``expert_groups`` (None: when ``dims.has_expert_axes``)."""
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
        experts = dims.has_expert_axes if expert_groups is None else expert_groups
        built = AXES + COMBINED_AXES + (("ep", "edp") if experts else ())
        for axis in built:
            for ranks in dims.group_ranks(axis):
                # new_group is collective over the whole world: every rank creates every group.
                group = dist.new_group(ranks, backend=backend, group_desc=group_desc(axis))
                if rank in ranks:
                    groups[axis], mine[axis] = group, ranks
        if experts and dims.etp > 1:  # etp = tp (the only other value this version takes)
            groups["etp"], mine["etp"] = groups["tp"], mine["tp"]
        return cls(dims, rank=rank, groups=groups, group_ranks=mine, backend=backend)

    @classmethod
    def stand_in(cls, dims: ParallelDims, *, rank: int, expert_groups: bool | None = None) -> Grid:
        """Rank ``rank``'s grid of ``dims`` without ``torch.distributed``: every group a stand-in (no
        communication), every size, rank and rank list as :meth:`build` would give on that rank."""
        if not 0 <= rank < dims.world_size:
            raise LayoutError(f"rank={rank} is outside the layout's world_size={dims.world_size} {dims._summary()}")
        groups, mine = {}, {}
        experts = dims.has_expert_axes if expert_groups is None else expert_groups
        for axis in AXES + COMBINED_AXES + (("ep", "edp") if experts else ()):
            for ranks in dims.group_ranks(axis):
                if rank in ranks:
                    groups[axis], mine[axis] = StandInGroup(axis, tuple(ranks), rank), list(ranks)
        if experts and dims.etp > 1:
            groups["etp"], mine["etp"] = groups["tp"], mine["tp"]
        return cls(dims, rank=rank, groups=groups, group_ranks=mine, backend="stand-in")

    @property
    def is_stand_in(self) -> bool:
        return self.backend == "stand-in"

    def group(self, axis: str):
        """This rank's process group of ``axis`` (None for ``embed`` on a middle pipeline stage, and for an
        expert axis of size 1)."""
        self._check_axis(axis)
        if axis in EXPERT_AXES and axis not in self._groups and self.dims.size(axis) > 1:
            raise LayoutError(f"no {axis!r} group was built for {self.dims._summary()}: expert groups exist when "
                              "ep > 1 or etp > 1, or when the grid is built with expert_groups=True")
        return self._groups.get(axis)

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group of ``axis`` (empty for ``embed`` on a middle stage)."""
        self._check_axis(axis)
        if axis in EXPERT_AXES and axis not in self._group_ranks:
            return next(g for g in self.dims.group_ranks(axis) if self.global_rank in g)
        return list(self._group_ranks.get(axis, []))

    def rank(self, axis: str) -> int:
        """This rank's index within its group of ``axis``."""
        self._check_axis(axis)
        if axis in AXES:
            return self.coords[axis]
        if axis in EXPERT_AXES:
            return self.expert_coords[axis]
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
        if axis not in AXES + COMBINED_AXES + EXPERT_AXES:
            raise LayoutError(f"unknown axis {axis!r}; expected one of {AXES + COMBINED_AXES + EXPERT_AXES}")
