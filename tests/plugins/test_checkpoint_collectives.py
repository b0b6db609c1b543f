"""The checkpoint's few-word exchange (:func:`checkpointing._reduce_words`: a gather to the group's first rank
and its broadcast, instead of gloo's ring all-reduce) against the element-wise maximum and OR computed here from
every rank's words, on real gloo groups: the world and a subgroup whose first rank is not global rank 0."""

from __future__ import annotations

import functools
import operator

import torch.distributed as dist

from shardline.plugins.lightning.checkpointing import _reduce_words
from shardline.plugins.testing import run_ranks


def _words(rank: int, n: int) -> list[int]:
    """Rank ``rank``'s words: signed, some beyond 32 bits, different on every rank and in every place."""
    return [((rank + 3) * 7 ** (i + 5) % (1 << 60) ^ 1 << (40 + rank)) * (-1 if (rank + i) % 3 == 0 else 1)
            for i in range(n)]


def _body(rank, world, n):
    sub = dist.new_group([1, 2, 3])  # collective: every rank makes it
    out = {"max": _reduce_words(_words(rank, n), "max"), "or": _reduce_words(_words(rank, n), "or")}
    if rank in (1, 2, 3):
        out["sub_max"] = _reduce_words(_words(rank, n), "max", sub)
        out["sub_or"] = _reduce_words(_words(rank, n), "or", sub)
    return out


def test_words_reduce_to_the_elementwise_max_and_or_on_every_rank():
    for n in (1, 4, 35):  # one word is an all-reduce; more are the gather and the broadcast
        results = run_ranks(_body, 4, n, timeout=120)
        every = [_words(r, n) for r in range(4)]
        want_max = [max(column) for column in zip(*every)]
        want_or = [functools.reduce(operator.or_, column) for column in zip(*every)]
        sub = every[1:]
        for rank, got in enumerate(results):
            assert got["max"] == want_max and got["or"] == want_or, (n, rank)
            if rank:
                assert got["sub_max"] == [max(c) for c in zip(*sub)], (n, rank)
                assert got["sub_or"] == [functools.reduce(operator.or_, c) for c in zip(*sub)], (n, rank)
        assert want_max != every[0] and want_or != want_max  # the reduction is not any one rank's words
