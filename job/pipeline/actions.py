"""The data a pipeline schedule is made of: :class:`Action`, :class:`Schedule`, and their compact text form.

Placement. Stages form a chain ``0 .. S-1``; activations flow from stage ``s`` to ``s + 1`` and gradients from
``s + 1`` back to ``s``. With ``p`` ranks and ``v = S / p`` chunks per rank, stage ``s`` is chunk ``s // p`` of
its rank, and a schedule states which rank by its ``placement`` (:mod:`shardline.job.placement`): ``"loop"``
(the default) puts chunk ``c`` of rank ``r`` at stage ``c * p + r`` (stage ``s`` on rank ``s % p``); ``"v"``
(ZB-V, DualPipeV) zig-zags, odd chunks running back up the ranks, so with two chunks rank ``r`` hosts stages
``r`` and ``2 p - 1 - r``. ``v == 1`` is the plain pipeline (both placements agree there).

Actions. An action is ``(kind, stage, microbatch)``, always executed on the rank that hosts ``stage``:

====  ===========  ======================================================================================
code  kind         meaning (``s`` = the action's stage, ``i`` = its micro-batch)
====  ===========  ======================================================================================
F     forward      run stage ``s`` forward on micro-batch ``i``
B     backward     backward of stage ``s`` for ``i`` (input and weight gradients; input only if a W follows)
W     weight       the weight-gradient half of a split backward (the zero-bubble schedules place it)
SA    send_act     send stage ``s``'s output activation of ``i`` to stage ``s + 1``
RA    recv_act     receive stage ``s``'s input activation of ``i`` from stage ``s - 1``
SG    send_grad    send the gradient of stage ``s``'s input for ``i`` to stage ``s - 1``
RG    recv_grad    receive the gradient of stage ``s``'s output for ``i`` from stage ``s + 1``
====  ===========  ======================================================================================

The peer of a send/recv is implied by its kind (the chain has no other edges), so it is a derived property
(:attr:`Action.peer_stage`) rather than a field that could disagree with the chain.

Text form. One token per action: ``<code><microbatch>`` optionally followed by ``@<stage>``, e.g. ``F3``,
``SG0@5``. The ``@stage`` suffix may be left out only when every rank hosts exactly one stage (then the stage is
the rank); :meth:`Schedule.to_text` writes it exactly when ``n_chunks > 1``. The codes are unambiguous because the
one-letter codes (F, B, W) are not prefixes of the two-letter ones (S*, R*). A whole schedule is::

    schedule <name> ranks=<p> stages=<S> microbatches=<m>
    r0: F0 SA0 F1 SA1 RG0 B0 RG1 B1
    r1: RA0 F0 B0 SG0 RA1 F1 B1 SG1

A schedule whose placement is not the default ``loop`` says so at the end of its header line
(``... microbatches=<m> placement=v``). ``Schedule.from_text(s.to_text()) == s`` for every schedule ``s``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .. import placement as _placement
from ..errors import ScheduleError


class ActionKind(str, enum.Enum):
    """Kinds of pipeline action. Values are the action names of ``shardline.job.annotations.PP_ACTIONS``."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"

    @property
    def code(self) -> str:
        return _CODE_OF[self]

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT)

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)


_CODE_OF = {ActionKind.FORWARD: "F", ActionKind.BACKWARD: "B", ActionKind.WEIGHT: "W",
            ActionKind.SEND_ACT: "SA", ActionKind.RECV_ACT: "RA", ActionKind.SEND_GRAD: "SG",
            ActionKind.RECV_GRAD: "RG"}
_KIND_OF_CODE = {code: kind for kind, code in _CODE_OF.items()}
# Direction of the peer along the chain, per communication kind.
_PEER_STEP = {ActionKind.SEND_ACT: +1, ActionKind.RECV_ACT: -1, ActionKind.SEND_GRAD: -1, ActionKind.RECV_GRAD: +1}
# The kind at the other end of each communication kind.
PARTNER_KIND = {ActionKind.SEND_ACT: ActionKind.RECV_ACT, ActionKind.RECV_ACT: ActionKind.SEND_ACT,
                ActionKind.SEND_GRAD: ActionKind.RECV_GRAD, ActionKind.RECV_GRAD: ActionKind.SEND_GRAD}
_TOKEN_RE = re.compile(r"^(F|B|W|SA|RA|SG|RG)(\d+)(?:@(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: ``kind`` applied to ``microbatch`` at ``stage`` (the local stage, for comms too)."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __init__(self, kind: ActionKind | str, stage: int, microbatch: int):
        try:
            kind = ActionKind(kind) if kind not in _KIND_OF_CODE else _KIND_OF_CODE[kind]
        except ValueError:
            raise ScheduleError(f"unknown action kind {kind!r}; expected one of "
                                f"{[k.value for k in ActionKind]} or codes {list(_KIND_OF_CODE)}") from None
        for name, value in (("stage", stage), ("microbatch", microbatch)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"action {kind.code}: {name}={value!r} must be an integer >= 0")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "stage", stage)
        object.__setattr__(self, "microbatch", microbatch)

    @property
    def peer_stage(self) -> int | None:
        """The stage at the other end of a send/recv (None for compute actions)."""
        step = _PEER_STEP.get(self.kind)
        return None if step is None else self.stage + step

    def partner(self) -> Action:
        """The action that completes this send/recv on the peer stage."""
        if self.kind.is_compute:
            raise ScheduleError(f"{self} is a compute action and has no communication partner")
        return Action(PARTNER_KIND[self.kind], self.peer_stage, self.microbatch)

    def token(self, *, with_stage: bool = True) -> str:
        return f"{self.kind.code}{self.microbatch}" + (f"@{self.stage}" if with_stage else "")

    def __str__(self) -> str:
        return self.token()

    def __repr__(self) -> str:
        return f"Action({self.token()})"


def parse_action(token: str, *, rank: int | None = None) -> Action:
    """Parse one token (``F3``, ``SG0@5``). Without ``@stage`` the stage is ``rank`` (needs ``rank``)."""
    match = _TOKEN_RE.match(token.strip())
    if not match:
        raise ScheduleError(f"cannot parse action token {token!r}; expected <code><microbatch>[@<stage>] with "
                            f"code in {list(_KIND_OF_CODE)}")
    code, mb, stage = match.groups()
    if stage is None:
        if rank is None:
            raise ScheduleError(f"token {token!r} has no @stage and no rank to infer it from")
        stage = rank
    return Action(_KIND_OF_CODE[code], int(stage), int(mb))


def _positive(name: str, value) -> list[str]:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        return [f"{name}={value!r} must be an integer >= 1"]
    return []


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered actions plus the shape of the pipeline they run on.

    ``actions[r]`` is rank ``r``'s program and ``placement`` the stage -> rank rule (``"loop"`` or ``"v"``, see
    the module docstring). Construction checks only the metadata (positive sizes, stages a multiple of ranks,
    every action on a rank that hosts its stage, indices in range); :func:`validate` proves the rest (data flow,
    send/recv matching, deadlock freedom).
    """

    name: str
    n_ranks: int
    n_stages: int
    n_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    placement: str = "loop"

    def __init__(self, actions: Sequence[Iterable[Action]], *, n_stages: int, n_microbatches: int,
                 name: str = "custom", placement: str = "loop"):
        actions = tuple(tuple(rank_actions) for rank_actions in actions)
        n_ranks = len(actions)
        problems = (_positive("n_ranks", n_ranks) + _positive("n_stages", n_stages)
                    + _positive("n_microbatches", n_microbatches))
        if not problems and n_stages % n_ranks:
            problems.append(f"n_stages={n_stages} is not a multiple of n_ranks={n_ranks}")
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_]+", name):
            # The name goes into trace annotations (pp_batch_name), whose pattern allows [a-z0-9_].
            problems.append(f"name={name!r} must be a non-empty word of [a-z0-9_]")
        if placement not in _placement.PLACEMENTS:
            problems.append(f"placement={placement!r} must be one of {list(_placement.PLACEMENTS)}")
        if problems:
            raise ScheduleError("invalid schedule: " + "; ".join(problems))
        for rank, rank_actions in enumerate(actions):
            for step, action in enumerate(rank_actions):
                if not isinstance(action, Action):
                    raise ScheduleError(f"rank {rank}, step {step}: {action!r} is not an Action")
                if action.stage >= n_stages or action.microbatch >= n_microbatches:
                    raise ScheduleError(f"rank {rank}, step {step}: {action} is out of range for "
                                        f"n_stages={n_stages}, n_microbatches={n_microbatches}")
                home = _placement.stage_rank(action.stage, pp=n_ranks, style=placement)
                if home != rank:
                    raise ScheduleError(f"rank {rank}, step {step}: {action} acts on stage {action.stage}, "
                                        f"which lives on rank {home} under placement {placement!r} with "
                                        f"n_ranks={n_ranks}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "n_ranks", n_ranks)
        object.__setattr__(self, "n_stages", n_stages)
        object.__setattr__(self, "n_microbatches", n_microbatches)
        object.__setattr__(self, "actions", actions)
        object.__setattr__(self, "placement", placement)

    @property
    def forward_only(self) -> bool:
        """No backward (or weight) action anywhere: an evaluation schedule (forwards and their transfers)."""
        return not any(a.kind in (ActionKind.BACKWARD, ActionKind.WEIGHT) for prog in self.actions for a in prog)

    @property
    def n_chunks(self) -> int:
        """Stages per rank (``v``)."""
        return self.n_stages // self.n_ranks

    def rank_of_stage(self, stage: int) -> int:
        return _placement.stage_rank(stage, pp=self.n_ranks, style=self.placement)

    def stages_of_rank(self, rank: int) -> list[int]:
        """Stages hosted by ``rank``, in chunk order: ``[rank, rank + p, ...]`` (``"loop"``) or
        ``[rank, 2 p - 1 - rank, ...]`` (``"v"``)."""
        return _placement.stages_of_rank(rank, n_stages=self.n_stages, pp=self.n_ranks, style=self.placement)

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    def to_text(self) -> str:
        with_stage = self.n_chunks > 1
        lines = [f"schedule {self.name} ranks={self.n_ranks} stages={self.n_stages} "
                 f"microbatches={self.n_microbatches}" + ("" if self.placement == "loop" else
                                                          f" placement={self.placement}")]
        for rank, rank_actions in enumerate(self.actions):
            lines.append(f"r{rank}: " + " ".join(a.token(with_stage=with_stage) for a in rank_actions))
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Inverse of :meth:`to_text`; blank lines and ``#`` comments are ignored."""
        lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
        lines = [ln for ln in lines if ln]
        header = re.fullmatch(r"schedule\s+(\S+)\s+ranks=(\d+)\s+stages=(\d+)\s+microbatches=(\d+)"
                              r"(?:\s+placement=(\S+))?", lines[0]) if lines else None
        if header is None:
            raise ScheduleError("schedule text must start with 'schedule <name> ranks=<p> stages=<S> "
                                f"microbatches=<m> [placement=<loop|v>]'; got {lines[0] if lines else text!r}")
        name, n_ranks, n_stages, n_mb = header.group(1), *map(int, header.groups()[1:4])
        placement = header.group(5) or "loop"
        programs: dict[int, list[Action]] = {}
        for line in lines[1:]:
            match = re.fullmatch(r"r(\d+):(.*)", line)
            if match is None:
                raise ScheduleError(f"cannot parse schedule line {line!r}; expected 'r<rank>: <tokens>'")
            rank = int(match.group(1))
            if rank in programs or rank >= n_ranks:
                raise ScheduleError(f"schedule line for rank {rank} is duplicated or outside 0..{n_ranks - 1}")
            infer = rank if n_stages == n_ranks else None
            programs[rank] = [parse_action(tok, rank=infer) for tok in match.group(2).split()]
        missing = sorted(set(range(n_ranks)) - set(programs))
        if missing:
            raise ScheduleError(f"schedule text has no line for ranks {missing}")
        return cls([programs[r] for r in range(n_ranks)], n_stages=n_stages, n_microbatches=n_mb, name=name,
                   placement=placement)
