"""Parameter roles: what a parameter is across the tensor-parallel group, declared where a layer creates it.

A role is one typed value per parameter, stored under one attribute (``ROLE_ATTRIBUTE``); the only other mark
the layers stamp on a parameter is the key of a weight tied across pipeline stages (``TIE_ATTRIBUTE``, set by
:func:`tie`). The strategy derives every gradient synchronisation from these marks at setup
(``HybridParallelStrategy._install_gradient_syncs``, DeepSpeed's gradient-norm flags in
``shardline.plugins.lightning.deepspeed_compat``, and the tied-weight exchange in the pipeline driver), so any
module built from shardline's layers is correct by construction under every layout:

- ``SHARDED(dim)``: this rank holds a slice of the dense parameter along ``dim`` (column/row-parallel weights, the
  vocabulary-parallel embedding). Its gradient is already the dense gradient's slice; DeepSpeed's gradient norm
  counts it on every TP rank.
- ``REPLICATED``: every TP rank holds the whole parameter and computes the same gradient (it saw the same,
  replicated activations). The gradient norm counts it once per TP group.
- ``SEQUENCE_REPLICATED``: every TP rank holds the whole parameter, but under Megatron-SP it is fed only this
  rank's ``s/tp`` tokens (LayerNorm, the row-parallel bias, position embeddings), so each rank's gradient is a
  partial sum: the dense gradient is the sum over the TP group, which the strategy installs as a gradient hook
  (during backward, before any ZeRO bucket reduces it over the data-parallel group).

Tied across pipeline stages: the same Parameter object in layers placed on two pipeline ranks (a model built whole
on every rank), or, for a model built per rank, a copy on each of the two ranks declared with :func:`tie` under
one key; the pipeline driver keeps such weights one.

An undeclared parameter is ``REPLICATED`` (what an ordinary ``nn.Module`` parameter is under TP).
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass

from torch import nn

from shardline.plugins.errors import ContractError

ROLE_ATTRIBUTE = "shardline_role"


class RoleKind(str, enum.Enum):
    SHARDED = "sharded"
    REPLICATED = "replicated"
    SEQUENCE_REPLICATED = "sequence_replicated"


@dataclass(frozen=True)
class ParamRole:
    """``kind`` and, for ``SHARDED``, the ``dim`` of the dense parameter this rank holds a slice of."""

    kind: RoleKind
    dim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, RoleKind):
            raise ContractError(f"ParamRole kind={self.kind!r} must be a RoleKind")
        if (self.kind is RoleKind.SHARDED) != (self.dim is not None):
            raise ContractError(f"ParamRole(kind={self.kind.value}, dim={self.dim!r}): a SHARDED role needs the "
                                "dim it is split along, and only a SHARDED role has one")

    @classmethod
    def sharded(cls, dim: int) -> ParamRole:
        return cls(RoleKind.SHARDED, dim)

    @classmethod
    def replicated(cls, *, sequence_parallel: bool = False) -> ParamRole:
        """Replicated over TP; ``sequence_parallel``: fed sequence-sharded activations (Megatron-SP)."""
        return cls(RoleKind.SEQUENCE_REPLICATED if sequence_parallel else RoleKind.REPLICATED)


def declare(param: nn.Parameter, role: ParamRole) -> nn.Parameter:
    """Give ``param`` its role (returns it). Declaring a different role on a parameter that has one is an
    error: one parameter used by two layers must mean the same thing to both."""
    if not isinstance(param, nn.Parameter):
        raise ContractError(f"roles are declared on nn.Parameter, got {type(param).__name__}")
    if not isinstance(role, ParamRole):
        raise ContractError(f"role={role!r} must be a ParamRole")
    previous = getattr(param, ROLE_ATTRIBUTE, None)
    if previous is not None and previous != role:
        raise ContractError(f"parameter of shape {list(param.shape)} is declared {previous} and now {role}")
    setattr(param, ROLE_ATTRIBUTE, role)
    return param


TIE_ATTRIBUTE = "shardline_tie"


def tie(param: nn.Parameter, key: str) -> nn.Parameter:
    """Declare ``param`` one copy of the weight ``key`` whose other copy lives on another pipeline rank (the
    input embedding of the first stage and the output head of the last). Returns ``param``."""
    setattr(param, TIE_ATTRIBUTE, key)
    return param


def tie_key(param: nn.Parameter) -> str | None:
    """The key :func:`tie` declared, or None."""
    return getattr(param, TIE_ATTRIBUTE, None)


def role_of(param: nn.Parameter) -> ParamRole:
    """The declared role; ``REPLICATED`` when none was declared."""
    return getattr(param, ROLE_ATTRIBUTE, None) or ParamRole(RoleKind.REPLICATED)


def parameters_with(module: nn.Module, kind: RoleKind) -> list[nn.Parameter]:
    """``module``'s parameters (each once) whose role is ``kind``."""
    return [p for p in module.parameters() if role_of(p).kind is kind]


def declare_module(module: nn.Module, *, sequence_parallel: bool) -> nn.Module:
    """Declare every parameter of a replicated module (a norm, a bias-only layer) ``REPLICATED``, or
    ``SEQUENCE_REPLICATED`` when it is fed sequence-sharded activations. Returns the module."""
    for param in module.parameters():
        declare(param, ParamRole.replicated(sequence_parallel=sequence_parallel))
    return module


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose parameters carry their role: replicated over TP, and under Megatron-SP
    (``sequence_parallel=True``) sequence-replicated, so the strategy sums their gradients over TP."""

    def __init__(self, normalized_shape, *, sequence_parallel: bool = False, **kwargs):
        super().__init__(normalized_shape, **kwargs)
        self.sequence_parallel = sequence_parallel
        declare_module(self, sequence_parallel=sequence_parallel)


_SUMMED: weakref.WeakSet = weakref.WeakSet()  # parameters whose gradient hook already sums over TP


def sum_sequence_parallel_gradients(module: nn.Module, *, group) -> int:
    """On every ``SEQUENCE_REPLICATED`` parameter of ``module``, a gradient hook that sums the gradient over
    ``group`` (the TP group): the dense gradient under Megatron-SP. The sum runs during backward, before any ZeRO
    bucket reduces the gradient over the data-parallel group (ZeRO-2/3 reduce while backward runs, so a sum
    after backward would come too late). Installed once per parameter, however often it is called; returns how
    many parameters have it."""
    from shardline.plugins.layers.tp_comm import all_reduce, group_size

    params = parameters_with(module, RoleKind.SEQUENCE_REPLICATED)
    if group_size(group) == 1:
        return 0
    for param in params:
        if param not in _SUMMED:
            param.register_hook(lambda grad, group=group: all_reduce(grad, group=group))
            _SUMMED.add(param)
    return len(params)
