"""Boxes in a global tensor, and how one rank's slice of a shardline parameter sits in a canonical tensor.

A *box* is a tuple of ``(start, stop)`` per dimension: a rectangular block of a global tensor. A rank's slice
of a parameter is a box of the parameter's dense tensor (the full extent on every dim but the one its role
shards, where tensor-parallel rank ``r`` of ``tp`` holds ``[r * L, (r + 1) * L)``).

A checkpoint stores *canonical* tensors (Hugging Face names and orientation, see :mod:`.names`), so a box of
the dense shardline tensor maps to one or more boxes of a canonical tensor, by the parameter's ``kind`` (a
:class:`~shardline.job.family.TensorKind`, the kinds of the families' Hugging Face tables):

- ``plain``: the same box;
- ``vocab``: rows are the vocabulary, zero-padded in shardline to a multiple of tp; the canonical tensor has
  ``vocab`` rows, so the box is cut at ``vocab`` (and may be empty on the last TP rank);
- ``conv1d``: GPT-2's Conv1D weight is stored ``[in, out]``, shardline's ``[out, in]``: the box transposed;
- ``gpt2_qkv`` / ``gpt2_qkv_bias``: GPT-2's ``c_attn`` holds q, k and v as three column blocks ``[d, 3d]``
  (``q|k|v``, each ``(head, head_dim)``), shardline's fused weight ``[3d, d]`` interleaves them per head
  (rows ``(head, q|k|v, head_dim)``). A box of whole heads ``[h0, h1)`` is three canonical boxes, one per block.

:func:`to_canonical` cuts a rank's tensor into its canonical pieces; :func:`canonical_boxes` says which pieces a
rank needs, and :func:`from_canonical` assembles its tensor from them (the inverse). They are the one implementation of
the transforms: the checkpoint's save and load, ``shardline convert`` and the Hugging Face reader and writer
(:mod:`shardline.plugins.hf`: :func:`read_part` over a safetensors file, :func:`canonical_tensor` of a whole
tensor) all go through them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardline.job.family import TensorKind

Box = tuple[tuple[int, int], ...]


def volume(box: Box) -> int:
    return math.prod(max(0, b - a) for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None when they do not overlap."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Index of ``inner`` inside a tensor holding ``outer``."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer, strict=True))


def full(shape) -> Box:
    return tuple((0, int(n)) for n in shape)


def split_rows(box: Box, parts: int) -> list[Box]:
    """``box`` cut along dim 0 into ``parts`` consecutive boxes (as ``torch.tensor_split``; some may be empty)."""
    (a, b), rest = box[0], box[1:]
    n = b - a
    edges = [a + (n * i) // parts for i in range(parts + 1)]
    return [((edges[i], edges[i + 1]), *rest) for i in range(parts)]


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes, in order, whose row-major elements are exactly elements ``[start, stop)`` of the flattened tensor
    of ``shape`` (a ZeRO partition is such a range): a partial first row, whole rows, a partial last row, each
    partial row split the same way one dimension down. Each box is one contiguous run of the flat range."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start, stop),)]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(stop, inner)
    if r0 == r1:
        return [((r0, r0 + 1), *box) for box in flat_boxes(shape[1:], c0, c1)]
    out: list[Box] = []
    if c0:
        out += [((r0, r0 + 1), *box) for box in flat_boxes(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, r1), *full(shape[1:])))
    if c1:
        out += [((r1, r1 + 1), *box) for box in flat_boxes(shape[1:], 0, c1)]
    return out


def shift(box: Box, by: Box) -> Box:
    """``box`` (relative to the start of ``by``) in the coordinates ``by`` is given in."""
    return tuple((a + o, b + o) for (a, b), (o, _) in zip(box, by, strict=True))


@dataclass(frozen=True)
class Placement:
    """How one rank's tensor of a parameter sits in the canonical tensor.

    ``box``: the rank's box of the dense shardline tensor (shape ``dense``); ``kind``: a :class:`TensorKind`
    (or its value); ``vocab``: the canonical row count of a ``vocab`` tensor; ``n_head``: for the GPT-2 q/k/v
    kinds."""

    kind: TensorKind
    dense: tuple[int, ...]
    box: Box
    vocab: int | None = None
    n_head: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", TensorKind(self.kind))

    def canonical_shape(self) -> tuple[int, ...]:
        if self.kind is TensorKind.VOCAB:
            return (self.vocab, *self.dense[1:])
        if self.kind in (TensorKind.CONV1D, TensorKind.GPT2_QKV):
            return (self.dense[1], self.dense[0])
        return self.dense

    def _heads(self) -> tuple[int, int, int, int]:
        """``(h0, h1, head_dim, d_model)`` of a GPT-2 q/k/v box (whole heads along dim 0)."""
        d_model = self.dense[0] // 3
        head_dim = d_model // self.n_head
        a, b = self.box[0]
        return a // (3 * head_dim), b // (3 * head_dim), head_dim, d_model


def canonical_boxes(p: Placement) -> list[Box]:
    """The canonical boxes the rank's tensor covers, in the order :func:`to_canonical` yields them."""
    if p.kind is TensorKind.PLAIN:
        return [p.box]
    if p.kind is TensorKind.VOCAB:
        box = intersect(p.box, full(p.canonical_shape()))
        return [box] if box is not None else []
    if p.kind is TensorKind.CONV1D:
        return [(p.box[1], p.box[0])]
    h0, h1, hd, d = p._heads()
    cols = [(j * d + h0 * hd, j * d + h1 * hd) for j in range(3)]
    if p.kind is TensorKind.GPT2_QKV_BIAS:
        return [(c,) for c in cols]
    return [(p.box[1], c) for c in cols]


def to_canonical(p: Placement, local: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
    """``local`` (the rank's tensor, shaped like ``p.box``) as ``(canonical box, tensor)`` pieces."""
    boxes = canonical_boxes(p)
    if p.kind is TensorKind.PLAIN:
        return [(boxes[0], local)]
    if p.kind is TensorKind.VOCAB:
        if not boxes:
            return []
        rows = boxes[0][0][1] - boxes[0][0][0]
        return [(boxes[0], local[:rows])]
    if p.kind is TensorKind.CONV1D:
        return [(boxes[0], local.t())]
    h0, h1, hd, d = p._heads()
    grouped = local.reshape(h1 - h0, 3, hd, *local.shape[1:])
    parts = [grouped[:, j].reshape((h1 - h0) * hd, *local.shape[1:]) for j in range(3)]
    if p.kind is TensorKind.GPT2_QKV:
        parts = [part.t() for part in parts]
    return list(zip(boxes, parts, strict=True))


def from_canonical(p: Placement, pieces: list[torch.Tensor], *, dtype: torch.dtype) -> torch.Tensor:
    """The rank's tensor (shaped like ``p.box``) from its canonical pieces (in :func:`canonical_boxes` order);
    a vocabulary's padding rows are zeros of ``dtype``."""
    shape = tuple(b - a for a, b in p.box)
    if p.kind is TensorKind.PLAIN:
        return pieces[0]
    if p.kind is TensorKind.VOCAB:
        rows = pieces[0].shape[0] if pieces else 0
        if rows == shape[0]:
            return pieces[0]
        out = torch.zeros(shape, dtype=dtype)
        if rows:
            out[:rows] = pieces[0]
        return out
    if p.kind is TensorKind.CONV1D:
        return pieces[0].t()
    h0, h1, hd, d = p._heads()
    if p.kind is TensorKind.GPT2_QKV:
        pieces = [piece.t() for piece in pieces]
    blocks = [piece.reshape(h1 - h0, hd, *piece.shape[1:]) for piece in pieces]
    return torch.stack(blocks, dim=1).reshape(shape)


def read_part(p: Placement, read: Callable[[Box], torch.Tensor], *, dtype: torch.dtype) -> torch.Tensor:
    """The rank's tensor of ``p`` read from a canonical tensor: ``read(box)`` gives one canonical box (a
    checkpoint's or a Hugging Face safetensors file's); its pieces, read in :func:`canonical_boxes` order, are
    assembled by :func:`from_canonical` (padding rows of ``dtype`` where nothing is read)."""
    pieces = [read(box) for box in canonical_boxes(p)]
    return from_canonical(p, pieces, dtype=pieces[0].dtype if pieces else dtype)


def canonical_tensor(p: Placement, local: torch.Tensor) -> torch.Tensor:
    """The whole canonical tensor of ``local``, a rank's tensor whose box is all of the dense tensor (tp = 1):
    its :func:`to_canonical` pieces put in place (a single piece as it is, a view where it can be)."""
    shape = tuple(p.canonical_shape())
    pieces = to_canonical(p, local)
    if len(pieces) == 1 and pieces[0][0] == full(shape):
        return pieces[0][1]
    out = local.new_empty(shape)
    for box, piece in pieces:
        out[relative(box, full(shape))] = piece
    return out


__all__ = ["Box", "Placement", "TensorKind", "canonical_boxes", "canonical_tensor", "flat_boxes",
           "from_canonical", "full", "intersect", "read_part", "relative", "shift", "split_rows", "to_canonical",
           "volume"]
