"""Count the bytes of tensor storage alive on this process: a per-rank activation-memory probe for CPU runs.

CPU tensors have no allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU twin), and RSS is blurred
by the allocator's caching, so :class:`LiveTensorBytes` counts storages itself: every storage an op outputs is
counted once when created and uncounted by a ``weakref.finalize`` when it is freed. ``peak`` is the high-water
mark, ``largest`` the biggest single storage. It sees forward and backward temporaries alike, but not workspace a
fused kernel allocates internally without returning it. Used by the ring-attention memory test and benchmark.
"""

from __future__ import annotations

import weakref

import torch

from shardline.plugins.torch_compat import TorchDispatchMode, tree_flatten

__all__ = ["LiveTensorBytes", "saved_tensor_bytes"]


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes() as m: ...`` then ``m.peak``, ``m.largest``, ``m.live`` (bytes)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = 0
        self._keys: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._keys.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._keys:  # a view of a storage already counted
                continue
            self._keys.add(key)
            self.live += nbytes
            self.peak, self.largest = max(self.peak, self.live), max(self.largest, nbytes)
            weakref.finalize(storage, self._release, key, nbytes)
        return out


def saved_tensor_bytes(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)``; return ``(result, bytes of the distinct storages autograd saved)``."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, sum(seen.values())
