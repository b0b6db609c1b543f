"""Ring attention: the autograd Function behind :func:`shardline.plugins.layers.sequence_parallel.ring_attention`.

Math. For one query row ``i`` and a key block ``B``: ``s_ij = scale * q_i . k_j``, block log-sum-exp
``l_B = log sum_{j in B, visible} exp(s_ij)`` and block output ``o_B = sum_j exp(s_ij - l_B) v_j``. Blocks merge
exactly: ``l = logaddexp(l_1, l_2)``, ``o = exp(l_1 - l) o_1 + exp(l_2 - l) o_2``.

Forward (``n`` ranks, rank ``r``): at step ``t = 0..n-1`` the rank holds the K/V block of rank ``src = r - t``
(mod n), computes the visible part against its local queries and merges it. The K/V block for step ``t+1`` is
already travelling (isend to ``r+1`` / irecv from ``r-1``) while step ``t`` computes. Saved for backward: local
``q, k, v``, the output and ``l``; nothing of another rank's size.

Backward: with ``D_i = dO_i . O_i`` and ``p_ij = exp(s_ij - l_i)`` (the final ``l``), a block contributes
``dV_B += p^T dO``, ``dS = p * (dO V_B^T - D)``, ``dQ += scale * dS K_B`` and ``dK_B += scale * dS^T Q``. K/V
travel around the ring again; each block's dK/dV accumulator follows it one step behind (``r`` adds its part and
passes it on in the next step's exchange), and after ``n`` hops it arrives home. Per-rank memory: O(local_seq)
tensors plus one ``local x local`` score block at a time; no rank ever holds the full K/V or the full score matrix.

Which part of a visiting block is visible (``causal``): the diagonal block (``src == r``) uses the ordinary causal
mask (local positions increase with the local index in both layouts). Contiguous: blocks from ``src < r`` are fully
visible, from ``src > r`` invisible (skipped). Balanced (rank ``i`` holds chunks ``i`` and ``2n-1-i``): from
``src < r`` every query sees the block's first half; from ``src > r`` only the second half of the queries sees the
block, all of it. So each off-diagonal step costs every rank the same half block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardline.job.annotations import comm_name
from shardline.plugins.layers.tp_comm import group_rank, group_size

_KV_TAG, _GRAD_TAG = 11, 12  # distinct tags for the two streams (gloo matches by tag; NCCL by order)

_ALL = slice(None)
# Use aten's fused CPU flash-attention kernels per block where they apply (see _Blocks). Tests switch this off to
# exercise the plain-matmul path, the one CUDA runs.
_FUSED_CPU = True
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _visible(*, causal: bool, balanced: bool, rank: int, src: int, local: int):
    """(query slice, key slice, diagonal-causal) of the block of ``src`` that ``rank``'s queries see, or None."""
    if not causal:
        return _ALL, _ALL, False
    if src == rank:
        return _ALL, _ALL, True
    if not balanced:
        return (_ALL, _ALL, False) if src < rank else None
    half = local // 2
    return (_ALL, slice(0, half), False) if src < rank else (slice(half, None), _ALL, False)


def _scores(q, k, scale, diag):
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if diag:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1)
        s.masked_fill_(mask, float("-inf"))
    return s


class _Exchange:
    """One ring step's transfers, posted together: tensors to ``r+1``, the same number of buffers from ``r-1``.

    Every rank posts the same pattern at the same step, so each batch's sends meet the neighbours' receives of
    the same batch and nothing waits across steps: no deadlock even where a send blocks until it is received.
    Posting them as one ``batch_isend_irecv`` also keeps NCCL from serialising a send ahead of the matching
    receive on a shared stream (cp=2: next and previous rank are the same peer).
    """

    def __init__(self, group):
        n, r = group_size(group), group_rank(group)
        self.group = group
        # the p2p API addresses peers by global rank
        self.nxt = dist.get_global_rank(group, (r + 1) % n)
        self.prv = dist.get_global_rank(group, (r - 1) % n)

    def start(self, pairs):
        """``pairs``: ``(tensor to send, buffer to receive into, tag)``; returns the works to :meth:`wait` on."""
        ops = []
        for send, recv, tag in pairs:
            ops.append(dist.P2POp(dist.irecv, recv, self.prv, group=self.group, tag=tag))
            ops.append(dist.P2POp(dist.isend, send, self.nxt, group=self.group, tag=tag))
        if not ops:
            return []
        with record_function(comm_name("cp", "p2p_send")):
            return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works):
        # the exposed part of the transfer: what compute did not hide
        with record_function(comm_name("cp", "p2p_recv")):
            for w in works:
                w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, balanced):
        n, r = group_size(group), group_rank(group)
        ring = _Exchange(group)
        blocks = _Blocks(q, scale)
        cdt = blocks.cdt
        kv = torch.stack([k, v])  # travels in the input dtype (bf16 halves the bytes); merging is in cdt
        out = torch.zeros_like(q, dtype=cdt)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=cdt, device=q.device)
        local = q.shape[2]
        for t in range(n):
            incoming = torch.empty_like(kv) if t < n - 1 else None
            # the next block travels while this one computes
            works = ring.start([(kv, incoming, _KV_TAG)] if t < n - 1 else [])
            vis = _visible(causal=causal, balanced=balanced, rank=r, src=(r - t) % n, local=local)
            if vis is not None:
                qs, ks, diag = vis
                o_b, lse_b = blocks.forward(qs, kv[0][:, :, ks], kv[1][:, :, ks], diag)
                new = torch.logaddexp(lse[:, :, qs], lse_b)
                out[:, :, qs] = (out[:, :, qs] * torch.exp(lse[:, :, qs] - new).unsqueeze(-1)
                                 + o_b * torch.exp(lse_b - new).unsqueeze(-1))
                lse[:, :, qs] = new
            ring.wait(works)
            kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.balanced, ctx.fused = group, causal, scale, balanced, blocks.fused
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        n, r = group_size(group), group_rank(group)
        ring = _Exchange(group)
        blocks = _Blocks(q, scale, fused=ctx.fused).for_backward(dout, out, lse)
        cdt = blocks.cdt
        dq = torch.zeros_like(q, dtype=cdt)
        kv = torch.stack([k, v])
        local = q.shape[2]
        finished = None  # dK/dV of the block this rank worked on last step, to pass on
        for t in range(n):
            # One batch per step: last step's dK/dV accumulator goes to r+1 while r-1's arrives (it belongs to
            # this step's block), and the next K/V block travels; all of it overlaps this step's compute.
            pairs, acc, incoming = [], None, None
            if finished is not None:
                acc = torch.empty_like(finished)
                pairs.append((finished, acc, _GRAD_TAG))
            if t < n - 1:
                incoming = torch.empty_like(kv)
                pairs.append((kv, incoming, _KV_TAG))
            works = ring.start(pairs)
            dkv = torch.zeros_like(kv, dtype=cdt)  # dK/dV accumulate in the compute dtype
            vis = _visible(causal=ctx.causal, balanced=ctx.balanced, rank=r, src=(r - t) % n, local=local)
            if vis is not None:
                blocks.backward(vis, kv, dq, dkv)
            ring.wait(works)
            if acc is not None:
                dkv.add_(acc)
            finished, kv = dkv, incoming
        home = torch.empty_like(finished)  # after n hops every block's dK/dV is back with its owner
        ring.wait(ring.start([(finished, home, _GRAD_TAG)]))
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None, None, None, None


class _Blocks:
    """The attention math of one visiting block against this rank's queries ``q [b, h, s, d]``.

    On the CPU (float32/float64/bf16) it calls aten's fused flash-attention kernels
    (``_scaled_dot_product_flash_attention_for_cpu`` and its backward): they return the block's log-sum-exp, and
    their backward given the *final* output and log-sum-exp yields exactly this block's share of dQ, dK, dV, so
    they never materialise a score block. Elsewhere (CUDA, float16, a torch without those kernels) the same
    formulas run as plain matmuls over one ``local x local`` score block. Merging is done in ``cdt`` (float32
    for 16-bit inputs).
    """

    def __init__(self, q, scale: float, *, fused: bool | None = None):
        self.q, self.scale = q, scale
        self.cdt = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
        if fused is None:  # decided once in forward; backward reuses the decision
            fused = (_FUSED_CPU and q.device.type == "cpu" and q.dtype in _FUSED_DTYPES
                     and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"))
        self.fused = fused

    def forward(self, qs, k_b, v_b, diag):
        """``(o_b, lse_b)`` in ``cdt`` for the query rows ``qs``."""
        q_b = self.q[:, :, qs]
        if self.fused:
            o_b, lse_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q_b, k_b, v_b, 0.0, diag, scale=self.scale)
            return o_b.to(self.cdt), lse_b.to(self.cdt)
        s = _scores(q_b.to(self.cdt), k_b.to(self.cdt), self.scale, diag)
        lse_b = torch.logsumexp(s, dim=-1)
        return torch.matmul(torch.exp_(s.sub_(lse_b.unsqueeze(-1))), v_b.to(self.cdt)), lse_b

    def for_backward(self, dout, out, lse):
        self.lse = lse
        if self.fused:  # the kernel wants grad/output in the input dtype (its lse is float32 for bf16)
            self.do, self.out = dout.to(self.q.dtype), out.to(self.q.dtype)
        else:
            self.do = dout.to(self.cdt)
            self.delta = (self.do * out).sum(dim=-1)  # D_i = dO_i . O_i
        return self

    def backward(self, vis, kv, dq, dkv):
        """Add one visible block's share to ``dq`` and to its ``dkv = [dK, dV]`` accumulator (in place)."""
        qs, ks, diag = vis
        k_b, v_b = kv[0][:, :, ks], kv[1][:, :, ks]
        if self.fused:
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                self.do[:, :, qs], self.q[:, :, qs], k_b, v_b, self.out[:, :, qs], self.lse[:, :, qs], 0.0, diag,
                scale=self.scale)
            dq[:, :, qs] += gq
            dkv[0][:, :, ks] += gk
            dkv[1][:, :, ks] += gv
            return
        q_b, do_b, cdt = self.q[:, :, qs].to(self.cdt), self.do[:, :, qs], self.cdt
        k_b, v_b = k_b.to(cdt), v_b.to(cdt)
        p = torch.exp_(_scores(q_b, k_b, self.scale, diag).sub_(self.lse[:, :, qs].unsqueeze(-1)))
        dkv[1][:, :, ks] += torch.matmul(p.transpose(-1, -2), do_b)
        ds = p.mul_(torch.matmul(do_b, v_b.transpose(-1, -2)).sub_(self.delta[:, :, qs].unsqueeze(-1)))
        dq[:, :, qs] += torch.matmul(ds, k_b).mul_(self.scale)
        dkv[0][:, :, ks] += torch.matmul(ds.transpose(-1, -2), q_b).mul_(self.scale)


def ring_attention_impl(q, k, v, *, group, causal: bool, scale: float | None, balanced: bool):
    """Inputs already validated by the public wrapper; ``scale`` None means ``1/sqrt(head_dim)``."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, group, causal, scale, balanced)
