"""Which canonical tensor every parameter of a module is, and which part of it this rank holds.

Canonical names are layout-independent. For a shardline decoder model (:class:`~.models.decoder.DecoderLM`:
GPT-2, the Llama family) anywhere inside the module they are the Hugging Face names, orientation and fused-tensor
split of the families' tables (:meth:`shardline.job.family.Family.hf_table`; q/k/v and gate/up as their separate
tensors, GPT-2's Conv1D transposed, the vocabulary without its padding), so a checkpoint converts to a Hugging Face
folder by renaming nothing. Every other parameter (and persistent buffer) keeps its module path, and its declared
role says which slice a rank holds. A weight tied across pipeline stages is saved once, by the stage that owns it.

Each rank's entry says whether it is the rank that writes that part (:attr:`Entry.writes`): the part of a
``SHARDED`` parameter is written by its TP rank, a replicated one by TP rank 0 only; and the data-parallel
replicas (ZeRO's ``dp x cp`` group) split every part along its first dim, each writing one slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardline.job.families import family_of_config
from shardline.plugins.checkpoint.boxes import Placement, TensorKind, full
from shardline.plugins.layers.roles import RoleKind, role_of
from shardline.plugins.torch_compat import buffer_table, non_persistent_buffers, parameter_table

#: The canonical name of optimizer state ``key`` (Adam: ``exp_avg``, ``exp_avg_sq``) of canonical tensor ``name``.
STATE = "optimizer.{key}/{name}"


@dataclass
class Entry:
    """One tensor of this rank: ``path`` in the module, ``name`` canonical, ``placement`` in the canonical
    tensor; ``tensor`` the parameter or buffer; ``writes`` whether this TP rank writes it."""

    path: str
    name: str
    tensor: torch.Tensor
    placement: Placement
    writes: bool
    is_param: bool

    def local_shape(self) -> tuple[int, ...]:
        """The rank's whole (tensor-parallel part) shape, also under ZeRO-3 (which keeps a partition)."""
        return tuple(b - a for a, b in self.placement.box)


def rank_placement(tensor: torch.Tensor, shape: tuple[int, ...], kind: TensorKind = TensorKind.PLAIN, *, tp: int,
                   tp_rank: int, is_param: bool = True, vocab: int | None = None,
                   n_head: int | None = None) -> Placement:
    """Where this rank's ``tensor`` (its whole tensor-parallel part of ``shape``) sits in the dense tensor: all of
    it, but along the dim a ``SHARDED`` parameter's role names, where TP rank ``r`` of ``tp`` holds its ``r``-th
    block."""
    dense, box = list(shape), [(0, n) for n in shape]
    role = role_of(tensor) if is_param else None
    if role is not None and role.kind is RoleKind.SHARDED:
        length = shape[role.dim]
        dense[role.dim] = length * tp
        box[role.dim] = (tp_rank * length, (tp_rank + 1) * length)
    return Placement(kind=kind, dense=tuple(dense), box=tuple(box), vocab=vocab, n_head=n_head)


def _decoders(module: nn.Module, modules=None, *, tables: bool = True) -> list[tuple[str, nn.Module, dict | None]]:
    """``(prefix, model, table)`` for every shardline decoder model inside ``module`` (``modules``: its
    ``named_modules()``, where the caller has them); ``tables=False``: ``None`` for the table (which costs a
    build of the model's name table, its family's :meth:`~shardline.job.family.Family.hf_table`)."""
    from shardline.plugins.models.decoder import DecoderLM

    found = []
    for prefix, sub in module.named_modules() if modules is None else modules:
        if isinstance(sub, DecoderLM):
            table = None
            if tables:
                table = sub.family.hf_table(sub.config)
            found.append((prefix + "." if prefix else "", sub, table))
    return found


def hf_config_of(model: nn.Module) -> tuple[str, dict]:
    """``(Hugging Face architecture, config.json)`` of a shardline decoder model: the folder's it was loaded from
    (``model.hf_config``, set by :func:`shardline.plugins.hf.from_pretrained`), else its family's mapping of its
    config (:meth:`~shardline.job.family.Family.config_to_hf`)."""
    if getattr(model, "hf_config", None):
        hf = dict(model.hf_config)
        return hf["architectures"][0], hf
    return family_of_config(model.config).config_to_hf(model.config)


def architectures(module: nn.Module) -> list[tuple[str, str]]:
    """``(prefix, Hugging Face architecture)`` of every shardline decoder model inside ``module``: what a load
    compares with the checkpoint's :func:`models` (without building their configs)."""
    return [(prefix, hf_config_of(sub)[0]) for prefix, sub, _ in _decoders(module, tables=False)]


def models(module: nn.Module) -> list[dict]:
    """What a checkpoint records of each shardline decoder model inside ``module``: where it sits (``prefix``),
    its Hugging Face architecture and ``config.json``, and its shardline config (``shardline config``)."""
    import dataclasses

    out = []
    for prefix, sub, _ in _decoders(module):
        arch, hf_config = hf_config_of(sub)
        config = {k: v for k, v in dataclasses.asdict(sub.config).items() if k != "activation_checkpointing"}
        out.append({"prefix": prefix, "class": f"{type(sub).__module__}.{type(sub).__qualname__}",
                    "architecture": arch, "hf_config": hf_config, "config": config})
    return out


def entries(module: nn.Module, *, tp: int, tp_rank: int, shape_of=None) -> list[Entry]:
    """Every parameter and persistent buffer of ``module`` on this rank, in module order. ``shape_of(tensor)``
    is the rank's whole shape of a tensor (default its shape; ZeRO-3 keeps a partition and knows the whole)."""
    shape_of = shape_of or (lambda tensor: tuple(tensor.shape))
    # One walk of the modules for the decoders, the parameters and the persistent buffers, in the order (and with
    # the de-duplication by identity) of named_parameters() then named_buffers(); persistent as state_dict() has
    # them: not in the module's ``_non_persistent_buffers_set``.
    modules = list(module.named_modules())
    decoders = _decoders(module, modules)
    out, seen, known = [], set(), set()
    named = []
    for is_param in (True, False):
        for prefix, sub in modules:
            tensors = parameter_table(sub) if is_param else buffer_table(sub)
            for key, tensor in tensors.items():
                if tensor is None or id(tensor) in known:
                    continue
                known.add(id(tensor))  # as named_buffers(): a buffer's first path, persistent or not, is its path
                if not is_param and key in non_persistent_buffers(sub):
                    continue
                named.append((f"{prefix}.{key}" if prefix else key, tensor, is_param))
    for path, tensor, is_param in named:
        if tensor.device.type == "meta":
            continue  # never materialised on this rank
        name, kind, vocab, n_head = path, TensorKind.PLAIN, None, None
        for prefix, model, table in decoders:
            local = path[len(prefix):] if path.startswith(prefix) else None
            if local is not None and local in table:
                name, kind = table[local].name, table[local].kind
                vocab, n_head = model.config.vocab_size, getattr(model.config, "n_head", None)
                break
        if name in seen:
            continue  # the same weight under a second name (a tie within one rank)
        seen.add(name)
        placement = rank_placement(tensor, tuple(shape_of(tensor)), kind, tp=tp, tp_rank=tp_rank, is_param=is_param,
                                   vocab=vocab, n_head=n_head)
        sharded = placement.box != full(placement.dense)
        out.append(Entry(path=path, name=name, tensor=tensor, placement=placement,
                         writes=sharded or tp_rank == 0, is_param=is_param))
    return out


__all__ = ["STATE", "Entry", "architectures", "entries", "hf_config_of", "models", "rank_placement"]
