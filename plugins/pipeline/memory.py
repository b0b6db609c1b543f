"""Measuring activation memory: the bytes of tensors autograd holds for backward, as they live and die.

:class:`SavedTensorMeter` installs ``torch.autograd.graph.saved_tensors_hooks``. Each tensor saved for backward is
wrapped in a handle; the handle lives exactly as long as the graph node that saved it, so its ``__del__`` marks the
moment the activation is released (after that node's backward, or when the graph is dropped). Bytes are counted
once per storage (several saves of one tensor, or views of it, hold one buffer) and parameter storages are left out
(weights are resident anyway; they are not activations). ``peak_bytes`` is the high-water mark while the meter
was active: the activation memory a schedule really holds.

A split backward (:mod:`shardline.plugins.layers.split_backward`) keeps, from B until W, each split layer's input
and output gradient outside autograd's saved tensors; its store registers them with :meth:`SavedTensorMeter.hold`
(and reads them back with :meth:`SavedTensorMeter.unhold`), so they count until W has run, like a saved tensor
until its node has.
"""

from __future__ import annotations

from collections import Counter

import torch


class _Handle:
    __slots__ = ("meter", "key", "nbytes", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: int, nbytes: int, tensor: torch.Tensor):
        self.meter, self.key, self.nbytes, self.tensor = meter, key, nbytes, tensor

    def __del__(self):
        self.meter._release(self.key, self.nbytes)


class SavedTensorMeter:
    """Context manager counting live bytes saved for backward (see the module docstring)."""

    def __init__(self, exclude_storages: set[int] | None = None):
        self.exclude = set(exclude_storages or ())
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: Counter = Counter()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self.exclude or nbytes == 0:
            return tensor
        if self._refs[key] == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] += 1
        return _Handle(self, key, nbytes, tensor)

    def hold(self, tensor: torch.Tensor):
        """Count ``tensor`` as held (once per storage, parameters and excluded storages not at all) until the
        returned handle is dropped; :meth:`unhold` gives the tensor back."""
        return self._pack(tensor)

    @staticmethod
    def unhold(packed) -> torch.Tensor:
        """The tensor behind a :meth:`hold` handle."""
        return SavedTensorMeter._unpack(packed)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Handle) else packed

    def _release(self, key: int, nbytes: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live_bytes -= nbytes

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
