"""Rotary position embeddings (RoPE), with the Llama-3 frequency scaling.

Frequencies: ``f_i = theta^(-2i/d)`` for ``i = 0 .. d/2-1`` (``d`` the head dim). A token at global position ``p``
rotates the pair ``(x_i, x_{i+d/2})`` of every query and key head by the angle ``p * f_i`` (the "half split"
pairing that Hugging Face checkpoints of the Llama family use):

    y_i       = x_i cos(p f_i) - x_{i+d/2} sin(p f_i)
    y_{i+d/2} = x_{i+d/2} cos(p f_i) + x_i sin(p f_i)

Because the rotation depends only on the token's own global position, it commutes with every way of sharding the
sequence: a context-parallel rank rotates its tokens by their global positions (in the BALANCED layout,
:func:`~shardline.plugins.layers.sequence_parallel.local_positions`) and then ring or Ulysses attention sees
exactly the dense model's rotated queries and keys.

Llama-3 scaling (:class:`RopeScaling`, ``rope_type="llama3"``): with ``L`` the original context length and the
wavelength ``w_i = 2 pi / f_i``, frequencies whose wavelength is shorter than ``L / high_freq_factor`` are kept,
those longer than ``L / low_freq_factor`` are divided by ``factor``, and those in between are blended linearly in
``L / w_i``: ``f' = (1 - t) f / factor + t f`` with ``t = (L / w - low_freq_factor) / (high_freq_factor -
low_freq_factor)``.

Angles are computed in float64 whatever the activation dtype, then ``cos``/``sin`` are cast to it.
"""

from __future__ import annotations

import math

import torch

from shardline.job.llama import RopeScaling  # the Llama family's config value, torch-free
from shardline.plugins.errors import ContractError

__all__ = ["RopeScaling", "rotary_frequencies", "Rotary", "apply_rotary"]


def rotary_frequencies(head_dim: int, *, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """``f_i`` (float64, ``[head_dim/2]``), scaled when ``scaling`` is given (see the module docstring)."""
    if head_dim % 2:
        raise ContractError(f"rotary embeddings need an even head_dim, got head_dim={head_dim}")
    freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freq
    length = scaling.original_max_position_embeddings
    ratio = length / (2 * math.pi / freq)  # L / wavelength
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    blend = ((ratio - low) / (high - low)).clamp(0.0, 1.0)  # 0: long wavelengths (scaled), 1: short ones (kept)
    return (1 - blend) * freq / scaling.factor + blend * freq


class Rotary:
    """The rotation tables of one model: ``tables(positions, dtype, device) -> (cos, sin)``, each
    ``[len(positions), head_dim]`` (the half-split angles repeated). The last tables are cached under ``key``
    (every block of a forward asks for the same ones): a caller passes a key that determines ``positions``
    (e.g. the sequence length, for a model whose layout is fixed); without one nothing is cached."""

    def __init__(self, head_dim: int, *, theta: float, scaling: RopeScaling | None = None):
        self.head_dim = head_dim
        self.freq = rotary_frequencies(head_dim, theta=theta, scaling=scaling)
        self._key, self._value = None, None

    def tables(self, positions: torch.Tensor, *, dtype, device, key=None) -> tuple[torch.Tensor, torch.Tensor]:
        key = None if key is None else (key, dtype, str(device))
        if key is None or key != self._key:
            angles = positions.to(torch.float64).cpu().unsqueeze(-1) * self.freq  # [s, d/2]
            angles = torch.cat([angles, angles], dim=-1)
            self._value = (angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device))
            self._key = key
        return self._value


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, s, head_dim]`` by the tables of its ``s`` tokens (``cos``, ``sin``: ``[s, head_dim]``)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin
