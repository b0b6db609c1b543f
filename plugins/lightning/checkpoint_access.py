"""Each rank's part of a parameter's weight and optimizer state, read for a save and set from a load, whatever
ZeRO stage holds it.

Two paths:

- **Fragments** (ZeRO-1/2/3 and the bf16 optimizer, for parameters of kind plain/vocab/conv1d): a ZeRO partition
  holds elements ``[start, stop)`` of each flattened parameter; the rank saves exactly those of the float32 master
  and of every moment, as the boxes of that range (:func:`~shardline.plugins.checkpoint.boxes.flat_boxes`), and
  loads exactly those back. No collective: the partitions of the ``dp x cp`` ranks are disjoint, so together
  they write each tensor once. The module's own weights need the whole tensor-parallel part under ZeRO-0/1/2
  (they are replicated over dp), and only the partition's range under ZeRO-3.
- **Whole values** (ZeRO-0 in float32, GPT-2's fused q/k/v whose canonical layout cuts heads, frozen parameters,
  buffers, ZeRO-3's inference engine): the rank's whole tensor-parallel part, through DeepSpeed's full accessors
  where they apply (a collective over the data-parallel group); the ``dp x cp`` replicas then split it by rows
  so each part is written once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from shardline.plugins.checkpoint.boxes import (
    Box,
    TensorKind,
    canonical_boxes,
    flat_boxes,
    shift,
    split_rows,
    to_canonical,
    volume,
)
from shardline.plugins.checkpoint.files import dtype_of
from shardline.plugins.checkpoint.names import STATE, Entry
from shardline.plugins.checkpoint.reader import CheckpointReader
from shardline.plugins.errors import CheckpointError
from shardline.plugins.layers.tp_comm import owned
from shardline.plugins.lightning import deepspeed_compat as compat

#: Kinds where a flat range of the rank's part is boxes of the canonical tensor.
_FRAGMENT_KINDS = (TensorKind.PLAIN, TensorKind.VOCAB, TensorKind.CONV1D)


class Access:
    """Reads and sets the values of :class:`~shardline.plugins.checkpoint.names.Entry` tensors (module docstring)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.base = compat.base_optimizer(optimizer)

    @staticmethod
    def _weight_fragment(entry: Entry) -> tuple[int, torch.Tensor] | None:
        """This rank's ZeRO fragment of ``entry``'s float32 master (:func:`compat.local_fragment`), or None where
        ``entry`` takes the whole-value path (module docstring)."""
        param = entry.tensor
        if not (entry.is_param and entry.placement.kind in _FRAGMENT_KINDS and param.dim() > 0
                and not compat.on_nvme(param)):
            return None
        return compat.local_fragment(param)

    # --- save -------------------------------------------------------------------------------------------------

    def pieces(self, entry: Entry, keys: list[str], *, replicas: int, replica: int, private: bool = False
               ) -> Iterator[tuple[str, Box, torch.Tensor]]:
        """``(canonical name, canonical box, values)`` this rank writes of ``entry``'s weight and its optimizer
        states ``keys``. Collective on the whole-value path: every rank holding ``entry`` must iterate it.
        ``private``: no piece shares memory with the model or the optimizer (an asynchronous save's, which the
        next step must not change), copying only what is not a copy already: a value moved off an accelerator,
        a ZeRO-3 gather, a replica's rows."""
        trainable = entry.is_param and entry.tensor.requires_grad
        named = [(None, entry.name)] + ([(k, STATE.format(key=k, name=entry.name)) for k in keys] if trainable
                                        else [])
        fragment = self._weight_fragment(entry)
        if fragment is not None:
            if not entry.writes:
                return
            for key, name in named:
                start, values = fragment if key is None else compat.local_fragment(entry.tensor, key)
                yield from self._range_pieces(entry, name, start, _on_cpu(values.detach(), private, False))
            return
        for key, name in named:
            value, copied = self.weight(entry) if key is None else (self.state(entry, key), False)
            if value is None:
                raise CheckpointError(f"{entry.path} has no optimizer state {key!r} on this rank")
            if not entry.writes:
                continue
            value = _on_cpu(value.detach(), private and replicas == 1, copied)
            for box, piece in to_canonical(entry.placement, value):
                if replicas == 1:
                    yield name, box, piece
                    continue
                part = split_rows(box, replicas)[replica]
                rows = slice(part[0][0] - box[0][0], part[0][1] - box[0][0])
                yield name, part, piece[rows].clone()  # a copy: the whole value can go now

    @staticmethod
    def _range_pieces(entry: Entry, name: str, start: int, values: torch.Tensor):
        offset = 0
        for sub in _range_placements(entry, start, start + values.numel()):
            n = volume(sub.box)
            data = values[offset:offset + n].reshape(tuple(b - a for a, b in sub.box))
            offset += n
            for canonical, piece in to_canonical(sub, data):
                yield name, canonical, piece

    def weight(self, entry: Entry) -> tuple[torch.Tensor, bool]:
        """The rank's whole value of ``entry``'s weight, and whether it is a copy made here (a ZeRO-3 gather's)."""
        from deepspeed.utils import safe_get_full_fp32_param

        param = entry.tensor
        if entry.is_param and param.requires_grad and compat.has_optimizer_view(param):
            value = safe_get_full_fp32_param(param)
            if value is not None:
                return value.reshape(entry.local_shape()), False
        if compat.zero3_partitioned(param):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                return param.data.detach().clone(), True
        return param.detach(), False

    def state(self, entry: Entry, key: str) -> torch.Tensor | None:
        from deepspeed.utils import safe_get_full_optimizer_state

        param = entry.tensor
        if compat.has_optimizer_view(param):
            value = safe_get_full_optimizer_state(param, key)
            return None if value is None else value.reshape(entry.local_shape())
        state = self.base.state.get(param) if self.base is not None else None
        return None if not state or key not in state else state[key].detach()

    # --- load -------------------------------------------------------------------------------------------------

    def stage(self, reader: CheckpointReader, entry: Entry, keys: list[str]) -> dict:
        """Everything :meth:`apply` sets for ``entry``, read and checked now (no value is set yet)."""
        trainable = entry.is_param and entry.tensor.requires_grad
        keys = keys if trainable else []
        fragment = self._weight_fragment(entry)
        if fragment is not None:
            param = entry.tensor
            start, values = fragment
            stop = start + values.numel()
            staged = {"fragment": (start, stop), "states": {}}
            if compat.zero3_partitioned(param):  # ZeRO-3: the module's weights are the partition too
                staged["weight"] = read_range(reader, entry, entry.name, start, stop)
            else:  # ZeRO-1/2: the module's weights are replicated over dp; the master is the fragment of them
                staged["weight"] = read(reader, entry, entry.name)
            for key in keys:
                staged["states"][key] = read_range(reader, entry, STATE.format(key=key, name=entry.name), start, stop)
            return staged
        staged = {"weight": read(reader, entry, entry.name), "states": {}}
        for key in keys:
            staged["states"][key] = read(reader, entry, STATE.format(key=key, name=entry.name))
        return staged

    def apply(self, entry: Entry, staged: dict, step: int | None) -> None:
        param = entry.tensor
        if "fragment" in staged:
            start, stop = staged["fragment"]
            if compat.zero3_partitioned(param):
                compat.set_zero3_weight_partition(param, staged["weight"])
                compat.set_local_fragment(param, staged["weight"])
            else:
                with torch.no_grad():
                    param.data.copy_(staged["weight"].to(param.dtype).reshape(param.data.shape))
                compat.set_local_fragment(param, staged["weight"].reshape(-1)[start:stop])
            for key, values in staged["states"].items():
                compat.set_local_fragment(param, values, key)
            return
        self.set_weight(entry, staged["weight"])
        for key, value in staged["states"].items():
            self.set_state(entry, key, value, step)

    def set_weight(self, entry: Entry, value: torch.Tensor) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        param = entry.tensor
        if compat.zero3_partitioned(param):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                param.data.copy_(value.to(param.dtype).reshape(param.data.shape))
        else:
            with torch.no_grad():
                param.data.copy_(value.to(param.dtype).reshape(param.data.shape))
        if entry.is_param and param.requires_grad and compat.has_optimizer_view(param):
            safe_set_full_fp32_param(param, value.to(torch.float32).to(param.device))

    def set_state(self, entry: Entry, key: str, value: torch.Tensor, step: int | None) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        param = entry.tensor
        if compat.has_optimizer_view(param):
            safe_set_full_optimizer_state(param, value.to(torch.float32), key)
            return
        state = self.base.state.setdefault(param, {})
        # A value the read made for this alone is adopted (as torch's Optimizer.load_state_dict adopts the loaded
        # tensors); one that shares its storage (a view of a larger read) is copied, so nothing else stays alive.
        state[key] = owned(value.reshape(param.shape), dtype=param.dtype, device=param.device)
        if step is not None and "step" not in state:
            state["step"] = torch.tensor(float(step))


def _on_cpu(value: torch.Tensor, private: bool, copied: bool) -> torch.Tensor:
    """``value`` on the CPU; with ``private``, sharing no memory with what it was read from: copied unless it is
    a copy already (``copied``, or moved here from another device)."""
    moved = value.device.type != "cpu"
    value = value.cpu()
    return value.clone() if private and not (copied or moved) else value


def _range_placements(entry: Entry, start: int, stop: int) -> list:
    """Elements ``[start, stop)`` of the flattened rank's part of ``entry`` (a ZeRO partition's range) as
    placements of boxes in the dense tensor, in order (each one contiguous run of the range)."""
    return [dataclasses.replace(entry.placement, box=shift(box, entry.placement.box))
            for box in flat_boxes(entry.local_shape(), start, stop)]


def _need(reader: CheckpointReader, entry: Entry, name: str) -> None:
    if name not in reader.tensors:
        raise CheckpointError(f"{reader.folder}: no tensor {name!r} in the checkpoint (this model's {entry.path})")


def read(reader: CheckpointReader, entry: Entry, name: str) -> torch.Tensor:
    """The rank's whole (tensor-parallel part) value of canonical tensor ``name``, in shardline's layout."""
    _need(reader, entry, name)
    return reader.read_part(name, entry.placement)


def read_range(reader: CheckpointReader, entry: Entry, name: str, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flattened rank's part of ``name`` (a ZeRO partition's range), read into
    one buffer: a view of the file's map where the range was saved as it is read (the saving layout:
    :meth:`~shardline.plugins.checkpoint.reader.CheckpointReader.read_flat`), else each of the range's boxes
    straight into its run of a fresh buffer (no concatenation)."""
    _need(reader, entry, name)
    whole = entry.placement
    if whole.kind is TensorKind.PLAIN and start == 0 and stop == volume(whole.box):  # the whole part: its own box
        flat = reader.read_flat(name, [whole.box])
        if flat is not None:
            return flat
    subs = _range_placements(entry, start, stop)
    # plain, or a vocabulary range short of its padding rows: the range's boxes are the canonical pieces' boxes
    if whole.kind in (TensorKind.PLAIN, TensorKind.VOCAB) and all(canonical_boxes(sub) == [sub.box] for sub in subs):
        flat = reader.read_flat(name, [sub.box for sub in subs])
        if flat is not None:
            return flat
    out = torch.empty(stop - start, dtype=dtype_of(reader.dtype_name(name)))
    offset = 0
    for sub in subs:
        n = volume(sub.box)
        reader.read_part(name, sub, out=out[offset:offset + n].view(tuple(b - a for a, b in sub.box)))
        offset += n
    return out


__all__ = ["Access", "read", "read_range"]
