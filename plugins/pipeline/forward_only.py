"""Forward-only pipeline pass (validation, prediction): the stages in order, one micro-batch, no backward.

Stage ``s`` lives on pipeline rank ``s % p`` (chunk ``s // p``). The activation walks the stages in order; when
consecutive stages sit on different ranks it travels with blocking send/recv on the pp group, preceded by a
small header (ndim, dtype code, dims) because the receiver cannot know the shape (the sequence length may
change). Every rank walks the same stage order, so each send meets its recv and nothing can deadlock. The last
stage applies ``loss_fn``; the loss is broadcast over the pp group and returned on every rank (float64).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from shardline.plugins.errors import ContractError

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)
_MAX_DIMS = 8


def _send(tensor: torch.Tensor, *, peer: int, group) -> None:
    if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
        raise ContractError(f"cannot send a {tensor.dtype} activation of {tensor.dim()} dims between stages")
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64, device=tensor.device)
    dist.send(header, group=group, group_dst=peer)
    dist.send(tensor.contiguous(), group=group, group_dst=peer)


def _recv(*, peer: int, group, device) -> torch.Tensor:
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=peer)
    ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
    out = torch.empty(tuple(int(d) for d in header[2:2 + ndim]), dtype=dtype, device=device)
    dist.recv(out, group=group, group_src=peer)
    return out


@torch.no_grad()
def forward_only(stages: Mapping[int, nn.Module], *, n_stages: int, pp_rank: int, group,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 inputs: torch.Tensor | None, targets: torch.Tensor | None,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Run ``inputs`` through every stage (``stages`` are this rank's) and return the loss on every rank."""
    p = dist.get_world_size(group)
    x, loss = None, None
    for stage in range(n_stages):
        owner = stage % p
        if owner != pp_rank:
            continue
        if stage == 0:
            x = inputs
        elif (stage - 1) % p != pp_rank:
            x = _recv(peer=(stage - 1) % p, group=group, device=device)
        x = stages[stage](x)
        if stage == n_stages - 1:
            loss = loss_fn(x, targets).detach().to(torch.float64)
        elif (stage + 1) % p != pp_rank:
            _send(x, peer=(stage + 1) % p, group=group)
    result = loss.to(device) if loss is not None else torch.zeros((), dtype=torch.float64, device=device)
    dist.broadcast(result, group=group, group_src=(n_stages - 1) % p)
    return result
