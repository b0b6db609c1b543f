"""Third-party pipelines traced with nothing but NCCL send/recv kernels, with every time known by construction
(a test helper; loaded by path like ``synthetic_traces``).

``p2p_pipeline`` lays out 1F1B (``v = 1``) or Megatron's interleaved 1F1B (``v > 1``) on ``p`` GPU ranks with
its own event loop: the order of each rank's forwards and backwards is the schedule's (``shardline.job.pipeline``
generators, the pipeline package's data), the times are this module's. Stage ``c p + r`` runs on rank ``r``; a
chunk's forward costs ``f / v`` and its backward ``b / v`` (so every rank computes ``m (f + b)`` per step). A
rank posts the receive of an action's input as soon as it is free (its NCCL ``SendRecv`` kernel spins from then,
stream 20); the producer's send kernel (stream 21) starts when the producing action ends; the data lands
``transfer`` ns after the later of the two, and the action computes from then. Nothing else runs: after its
last message a rank idles until its step ends (the stages upstream still drain), the step ends ``tail`` ns after
the last activity of any rank, and the next step starts there (one GPU ``ProfilerStep#k`` per step, the same on
every rank).

``launched_early``: every kernel also gets its ``cudaLaunchKernel`` row (same correlation id), all of them
before the first step starts (a host far ahead of its GPU: every idle gap is then *queued*, no host cause).

``truth``: per (step, rank) ``compute``, and the step bounds; ``last_end[step][rank]`` is the end of the rank's
last pipeline message in the step (its drain starts there), ``first_start[step][rank]`` the start of its first.
"""

from __future__ import annotations

import numpy as np

from shardline.job.pipeline.schedule import interleaved_one_f_one_b, one_f_one_b


def _orders(p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, its compute actions in the schedule's order: (kind "F" | "B", stage, micro-batch)."""
    schedule = one_f_one_b(p, m) if v == 1 else interleaved_one_f_one_b(p, m, v)
    return [[(a.kind.value, a.stage, a.microbatch) for a in program if a.kind.is_compute]
            for program in schedule.actions]


def _kernel(rank: int, category: str, start: int, dur: int, **extra) -> dict:
    name = ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)" if category.startswith("p2p")
            else "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>()")
    row = {"rank": rank, "lane": "gpu", "device": rank % 8, "stream": 7, "name": name, "cat": "kernel",
           "start_ns": int(start), "dur_ns": int(dur), "source": "kineto", "category": category}
    row.update(extra)
    return row


def p2p_pipeline(p: int, m: int, *, v: int = 1, f: int = 3000, b: int = 6000, transfer: int = 20, steps: int = 2,
                 tail: int = 0, nbytes: int = 1 << 20, launched_early: bool = False) -> tuple[list[dict], dict]:
    """``(rows, truth)`` of the pipeline described in the module docstring."""
    assert f % v == 0 and b % v == 0, "chunk costs must be whole ns"
    orders = _orders(p, m, v)
    stages = p * v
    nelems = nbytes // 2
    rows: list[dict] = []
    truth = {"compute": np.zeros((steps, p), np.int64), "step_start": [], "step_end": [],
             "first_start": [], "last_end": []}

    def comm(rank, category, start, dur, peer, stream):
        key = "Src Rank" if category == "p2p_recv" else "Dst Rank"
        rows.append(_kernel(rank, category, start, dur, stream=stream, collective=category[4:],
                            peer_arg=(key, peer), peer=peer, in_nelems=nelems, out_nelems=nelems, dtype="BFloat16",
                            pg_size=p, msg_bytes=nbytes, pg_ranks=str(list(range(p))), pg_name="pp",
                            pg_desc="PIPELINE_MODEL_PARALLEL_GROUP"))

    t0 = 0
    for step in range(steps):
        done: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> end of that compute
        free = [t0] * p
        last = [t0] * p
        first = [None] * p
        pos = [0] * p
        pending = sum(len(o) for o in orders)
        while pending:
            progressed = False
            for r in range(p):
                while pos[r] < len(orders[r]):
                    kind, s, i = orders[r][pos[r]]
                    src = s - 1 if kind == "F" else s + 1  # the stage whose output this action reads
                    if kind == "B" and s == stages - 1:
                        src = None  # the last stage's backward reads its own forward
                        if ("F", s, i) not in done:
                            break
                    elif 0 <= src < stages and (kind, src, i) not in done:
                        break  # the producer has not run yet
                    start = free[r]
                    if src is not None and 0 <= src < stages:
                        peer = src % p
                        send_start = done[(kind, src, i)]
                        landed = max(start, send_start) + transfer
                        comm(r, "p2p_recv", start, landed - start, peer, 20)
                        comm(peer, "p2p_send", send_start, landed - send_start, r, 21)
                        for who, lo in ((r, start), (peer, send_start)):
                            first[who] = lo if first[who] is None else min(first[who], lo)
                            last[who] = max(last[who], landed)
                        start = landed
                    cost = (f if kind == "F" else b) // v
                    rows.append(_kernel(r, "compute", start, cost))
                    truth["compute"][step, r] += cost
                    free[r] = start + cost
                    done[(kind, s, i)] = free[r]
                    pos[r] += 1
                    pending -= 1
                    progressed = True
            assert progressed, "pipeline generator deadlocked"  # a bug in the generator itself
        end = max(max(free), max(last)) + tail
        for r in range(p):
            rows.append({"rank": r, "lane": "gpu", "device": r % 8, "stream": 7, "name": f"ProfilerStep#{step}",
                         "cat": "gpu_user_annotation", "start_ns": t0, "dur_ns": end - t0, "source": "kineto"})
        truth["step_start"].append(t0)
        truth["step_end"].append(end)
        truth["first_start"].append(list(first))
        truth["last_end"].append(list(last))
        t0 = end
    if launched_early:
        kernels = [row for row in rows if row["cat"] == "kernel"]
        for k, row in enumerate(kernels):
            row["correlation"] = k + 1
            rows.append({"rank": row["rank"], "lane": "cpu", "device": -1, "stream": 100 + row["rank"],
                         "name": "cudaLaunchKernel", "cat": "cuda_runtime", "start_ns": -10 * (len(kernels) - k),
                         "dur_ns": 5, "correlation": k + 1, "source": "kineto"})
    return rows, truth


def host_stall(rank: int, start: int, dur: int, *, name: str = "cudaStreamSynchronize") -> dict:
    """A host call of ``rank`` that blocks it over ``[start, start + dur)`` (its host thread, ``100 + rank``)."""
    return {"rank": rank, "lane": "cpu", "device": -1, "stream": 100 + rank, "name": name, "cat": "cuda_runtime",
            "start_ns": int(start), "dur_ns": int(dur), "correlation": 9_000_000 + rank, "source": "kineto"}
