"""Synthetic multi-rank traces with exact ground truth (a test helper; loaded by path from conftest.py).

Every builder returns ``(events, truth)``: ``events`` is a list of row dicts in the events-table vocabulary
(``rank, lane, stream, name, cat, start_ns, dur_ns`` plus Kineto-style args mapped to columns), ``truth`` the
numbers the analysis must recover, derived from how the timeline was laid out -- never from the code under
test. ``to_frame`` conforms rows to the schema; ``write_kineto`` writes one Kineto JSON file per rank so the
full load -> classify -> breakdown path can run.

``raster_partition`` is the brute-force reference for attribution: it paints every ns of a window with the
first label (by priority) whose events cover it -- O(window length), fine for windows of a few thousand ns.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd

from shardline.profiling.base.schema import conform

PRIORITY = ("compute", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier",
            "other_comm", "memcpy_h2d", "memcpy_d2h", "memcpy_d2d", "memset", "bubble", "p2p_send", "p2p_recv",
            "sync")

# GPU event names per category, as real traces spell them; the generic SendRecv kernel carries the op in args.
KERNEL_NAMES = {
    "compute": "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>()",
    "all_reduce": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "all_gather": "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "reduce_scatter": "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "all_to_all": "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
    "broadcast": "ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
    "p2p_send": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
    "p2p_recv": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
    "memcpy_h2d": "Memcpy HtoD (Pinned -> Device)",
    "memcpy_d2h": "Memcpy DtoH (Device -> Pinned)",
    "memcpy_d2d": "Memcpy DtoD (Device -> Device)",
    "memset": "Memset (Device)",
    "sync": "Stream Wait Event",
}
COLLECTIVE_ARG = {"all_to_all": "all_to_allv", "p2p_send": "send", "p2p_recv": "recv"}
CAT_OF = {"memcpy_h2d": "gpu_memcpy", "memcpy_d2h": "gpu_memcpy", "memcpy_d2d": "gpu_memcpy",
          "memset": "gpu_memset", "sync": "cuda_sync"}
STREAM_OF = {"compute": 7, "memcpy_h2d": 9, "memcpy_d2h": 9, "memcpy_d2d": 7, "memset": 7, "sync": 7}


def gpu_event(rank: int, category: str, start: int, dur: int, **extra) -> dict:
    """One GPU-lane work row of ``category``; NCCL rows carry a collective arg only for generic kernels."""
    row = {"rank": rank, "lane": "gpu", "device": rank % 8, "stream": STREAM_OF.get(category, 20),
           "name": KERNEL_NAMES[category], "cat": CAT_OF.get(category, "kernel"), "start_ns": start,
           "dur_ns": dur, "source": "kineto"}
    if category in COLLECTIVE_ARG:
        row["collective"] = COLLECTIVE_ARG[category]
    row.update(extra)
    return row


def annotation(rank: int, name: str, start: int, dur: int, *, lane: str = "gpu") -> dict:
    cat = "gpu_user_annotation" if lane == "gpu" else "user_annotation"
    return {"rank": rank, "lane": lane, "device": rank % 8 if lane == "gpu" else -1,
            "stream": 7 if lane == "gpu" else 100 + rank, "name": name, "cat": cat, "start_ns": start,
            "dur_ns": dur, "source": "kineto"}


def to_frame(rows: list[dict]) -> pd.DataFrame:
    return conform(pd.DataFrame(rows))


def raster_partition(rows: list[dict], *, rank: int, window: tuple[int, int],
                     bubble: list[tuple[int, int]] = ()) -> dict[str, int]:
    """Reference partition of one rank's window: paint each ns with its highest-priority label."""
    lo, hi = window
    painted = np.full(hi - lo, len(PRIORITY), dtype=np.int64)  # len(PRIORITY) stands for idle
    spans = [(r["category"], r["start_ns"], r["start_ns"] + r["dur_ns"]) for r in rows
             if r["rank"] == rank and r.get("category")]
    spans += [("bubble", s, e) for s, e in bubble]
    for label, s, e in spans:
        a, b = max(s, lo) - lo, min(e, hi) - lo
        if b > a:
            painted[a:b] = np.minimum(painted[a:b], PRIORITY.index(label))
    counts = np.bincount(painted, minlength=len(PRIORITY) + 1)
    out = {label: int(counts[i]) for i, label in enumerate(PRIORITY)}
    out["idle"] = int(counts[-1])
    return out


# --- scenario: ZeRO + TP + offload on one GPU rank, laid out by hand ---------------------------------------

def zero_tp_offload(rank: int = 0, *, t0: int = 1_000_000) -> tuple[list[dict], dict[str, int]]:
    """One step of 650 ns (offset t0): the truth below is worked out on paper from these intervals.

    compute [0,100) [150,300) [400,500); all_gather [80,180) (ZeRO prefetch, 50 under compute);
    all_reduce [300,340) (TP, exposed); h2d [340,420) (offload, 20 under compute); reduce_scatter [480,560)
    (20 under compute); d2h [560,600); nothing in [600,650).
    """
    layout = [("compute", 0, 100), ("compute", 150, 150), ("compute", 400, 100), ("all_gather", 80, 100),
              ("all_reduce", 300, 40), ("memcpy_h2d", 340, 80), ("reduce_scatter", 480, 80),
              ("memcpy_d2h", 560, 40)]
    rows = [dict(gpu_event(rank, c, t0 + s, d), category=c) for c, s, d in layout]
    rows.append(annotation(rank, "ProfilerStep#3", t0, 650))
    truth = {"compute": 350, "all_gather": 50, "overlapped_all_gather": 50, "all_reduce": 40,
             "overlapped_all_reduce": 0, "memcpy_h2d": 60, "reduce_scatter": 60, "overlapped_reduce_scatter": 20,
             "memcpy_d2h": 40, "idle": 50, "step_ns": 650, "comm_ns": 100 + 40 + 80}
    truth["overlap_ratio_num"] = 50 + 20
    return rows, truth


# --- scenario: 1F1B pipeline --------------------------------------------------------------------------------

def one_f_one_b(p: int, m: int, *, f: int = 100, b: int = 200, t0: int = 0,
                recv_kernels: bool = True) -> tuple[list[dict], dict]:
    """1F1B on p stages (rank s = stage s), m micro-batches, every F costs f and every B costs b ns.

    Each action starts when its stage is free and its input is ready (F(s,i) after F(s-1,i); B(s,i) after
    B(s+1,i)); p2p is instantaneous. With equal costs the makespan is (m+p-1)(f+b), so every stage's bubble
    is (p-1)(f+b) and its fraction (p-1)/(m+p-1) -- the textbook result the truth states. Stage s>0 also
    runs a recv kernel over each wait for an activation (it spins there), which must count as bubble.
    """
    from shardline.job.annotations import pp_action_name, pp_batch_name

    done_f = np.zeros((p, m), dtype=np.int64)
    done_b = np.zeros((p, m), dtype=np.int64)
    order = {s: _one_f_one_b_order(p - s - 1, m) for s in range(p)}
    pos = {s: 0 for s in range(p)}
    free = {s: 0 for s in range(p)}
    rows: list[dict] = []
    pending = sum(len(v) for v in order.values())
    while pending:
        progressed = False
        for s in range(p):
            while pos[s] < len(order[s]):
                kind, i = order[s][pos[s]]
                dep = (done_f[s - 1, i] if s > 0 else 0) if kind == "F" else (done_b[s + 1, i] if s < p - 1
                                                                               else done_f[s, i])
                if (kind == "F" and s > 0 and done_f[s - 1, i] == 0) or (kind == "B" and (
                        (s < p - 1 and done_b[s + 1, i] == 0) or (s == p - 1 and done_f[s, i] == 0))):
                    break
                start = max(free[s], int(dep))
                if recv_kernels and kind == "F" and s > 0 and start > free[s]:
                    rows.append(dict(gpu_event(s, "p2p_recv", t0 + free[s], start - free[s]), category="p2p_recv"))
                cost = f if kind == "F" else b
                rows.append(dict(gpu_event(s, "compute", t0 + start, cost), category="compute"))
                rows.append(annotation(s, pp_action_name(kind, stage=s, microbatch=i), t0 + start, cost))
                free[s] = start + cost
                (done_f if kind == "F" else done_b)[s, i] = free[s]
                pos[s] += 1
                pending -= 1
                progressed = True
        assert progressed, "1F1B generator deadlocked"  # a bug in the generator itself
    makespan = max(free.values())
    for s in range(p):
        rows.append(annotation(s, pp_batch_name("1f1b", p=p, m=m), t0, makespan))
        rows.append(annotation(s, "ProfilerStep#0", t0, makespan))
    truth = {"makespan": makespan, "bubble_ns": (p - 1) * (f + b), "compute": m * (f + b),
             "fraction": (p - 1) / (m + p - 1)}
    assert makespan == (m + p - 1) * (f + b)  # the closed form the truth relies on
    return rows, truth


def _one_f_one_b_order(warmup: int, m: int) -> list[tuple[str, int]]:
    warmup = min(warmup, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    return order


# --- scenario: a pipeline traced with nothing but spinning NCCL send/recv kernels -------------------------------

def spinning_pipeline(p: int, m: int, *, schedule: str = "1f1b", f: int = 1000, b: int = 2000,
                      nbytes: int = 4_500_000, gbps: float = 450.0, steps: int = 2,
                      stage_rank: list[int] | None = None, offsets: list[int] | None = None,
                      group_ranks: bool = True, megatron_nvtx: bool = False) -> tuple[list[dict], dict]:
    """A Megatron-style pipeline with no annotations: compute kernels on stream 7, NCCL ``SendRecv`` kernels
    for every activation/gradient (receives on stream 20, sends on 21), an all-reduce over all ranks closing
    each step (stream 22) and a GPU ``ProfilerStep#k`` per step.

    A stage posts the receive for an action's input when it is free (the recv kernel starts spinning then);
    the producer's send kernel starts when the producing action ends; the data lands
    ``max(recv start, send start) + nbytes / gbps`` later (the send kernel spins until then too), and the
    action computes after that. Truth, per rank and step: ``wait`` = sum over its receives of
    ``max(0, send start - recv start)`` (the stage waits for data its upstream has not sent: bubble) and
    ``transfer`` = the rest of its receives. ``stage_rank[s]`` is the rank of stage s (default: s);
    ``offsets[r]`` is added to every time of rank r (clock skew); ``group_ranks`` records the pipeline group's
    ``Process Group Ranks`` in stage order (else only the peers say who is where).

    ``megatron_nvtx`` (1F1B only) adds what an Nsight export of Megatron-core holds on the host: a
    ``cudaLaunchKernel`` row 200 ns before each compute and receive kernel (same correlation id) and the
    schedule's NVTX ranges ``...schedules.forward_backward_pipelining_without_interleaving.{warmup,steady,
    cooldown}`` around the launches of each phase's actions; ``truth["phase_wait"][step, rank, k]`` is the
    wait of the receives of phase k (warm-up, steady, cool-down)."""
    stage_rank = list(range(p)) if stage_rank is None else list(stage_rank)
    offsets = [0] * p if offsets is None else list(offsets)
    transfer = int(round(nbytes / gbps))  # bytes / (GB/s) = ns
    nelems = nbytes // 2  # bf16
    order = {s: (_one_f_one_b_order(p - s - 1, m) if schedule == "1f1b"
                 else [("F", i) for i in range(m)] + [("B", i) for i in range(m)]) for s in range(p)}
    rows: list[dict] = []
    truth = {"wait": np.zeros((steps, p), np.int64), "transfer": np.zeros((steps, p), np.int64),
             "compute": np.zeros((steps, p), np.int64), "step_start": [], "step_end": [], "steps": steps,
             "phase_wait": np.zeros((steps, p, 3), np.int64)}
    launches: dict[tuple[int, int, int], list[int]] = {}  # (step, rank, phase) -> host launch times
    pg = str(stage_rank) if group_ranks else ""

    def phase_of(stage, position):
        warmup = min(p - stage - 1, m)
        return 0 if position < warmup else 1 if position < warmup + 2 * (m - warmup) else 2

    def launched(row, step, stage, position):
        if megatron_nvtx:
            row["correlation"] = len(rows) + 1
            host = row["start_ns"] - 200
            launches.setdefault((step, row["rank"], phase_of(stage, position)), []).append(host)
            rows.append({"rank": row["rank"], "lane": "cpu", "device": -1, "stream": 100 + row["rank"],
                         "name": "cudaLaunchKernel", "cat": "cuda_runtime", "start_ns": host, "dur_ns": 5,
                         "correlation": row["correlation"], "source": "kineto", "category": "compute"})
        return row

    def comm(stage, category, start, dur, peer_stage, stream):
        rank = stage_rank[stage]
        key = "Src Rank" if category == "p2p_recv" else "Dst Rank"
        extra = {"stream": stream, "peer_arg": (key, stage_rank[peer_stage]), "peer": stage_rank[peer_stage],
                 "in_nelems": nelems, "out_nelems": nelems, "dtype": "BFloat16", "pg_size": p,
                 "msg_bytes": nelems * 2}
        if pg:
            extra.update(pg_ranks=pg, pg_name="pp", pg_desc="PIPELINE_MODEL_PARALLEL_GROUP")
        rows.append(dict(gpu_event(rank, category, int(start + offsets[rank]), int(dur), **extra), category=category))

    t0 = 0
    for step in range(steps):
        done = {"F": np.zeros((p, m), np.int64), "B": np.zeros((p, m), np.int64)}
        sent = {"F": np.full((p, m), -1, np.int64), "B": np.full((p, m), -1, np.int64)}
        free = {s: t0 for s in range(p)}
        pos = {s: 0 for s in range(p)}
        pending = p * 2 * m
        while pending:
            progressed = False
            for s in range(p):
                while pos[s] < len(order[s]):
                    kind, i = order[s][pos[s]]
                    peer = s - 1 if kind == "F" else s + 1
                    if 0 <= peer < p and sent[kind][peer, i] < 0:
                        break  # the producer has not run yet
                    if kind == "B" and s == p - 1 and done["F"][s, i] == 0:
                        break
                    start = free[s]
                    if 0 <= peer < p:  # receive the input: spin until the data lands
                        send_start = int(sent[kind][peer, i])
                        landed = max(start, send_start) + transfer
                        comm(s, "p2p_recv", start, landed - start, peer, 20)
                        launched(rows[-1], step, s, pos[s])
                        comm(peer, "p2p_send", send_start, landed - send_start, s, 21)
                        truth["wait"][step, stage_rank[s]] += max(0, send_start - start)
                        truth["phase_wait"][step, stage_rank[s], phase_of(s, pos[s])] += max(0, send_start - start)
                        truth["transfer"][step, stage_rank[s]] += landed - max(start, send_start)
                        start = landed
                    cost = f if kind == "F" else b
                    rows.append(dict(gpu_event(stage_rank[s], "compute", int(start + offsets[stage_rank[s]]), cost),
                                     category="compute"))
                    launched(rows[-1], step, s, pos[s])
                    truth["compute"][step, stage_rank[s]] += cost
                    free[s] = start + cost
                    done[kind][s, i] = free[s]
                    sent[kind][s, i] = free[s]  # the output leaves as soon as it exists
                    pos[s] += 1
                    pending -= 1
                    progressed = True
            assert progressed, "pipeline generator deadlocked"  # a bug in the generator itself
        arrive = max(free.values())
        for s in range(p):  # the closing all-reduce (gradient norm): ends together on every rank
            rank = stage_rank[s]
            rows.append(dict(gpu_event(rank, "all_reduce", int(free[s] + offsets[rank]), int(arrive + 50 - free[s]),
                                       stream=22, pg_name="0", pg_desc="default_pg", pg_ranks=str(list(range(p))),
                                       pg_size=p, seq=step), category="all_reduce"))
        end = arrive + 50
        for s in range(p):
            rank = stage_rank[s]
            rows.append(annotation(rank, f"ProfilerStep#{step}", int(t0 + offsets[rank]), int(end - t0)))
        truth["step_start"].append(t0)
        truth["step_end"].append(end)
        t0 = end
    if megatron_nvtx:
        assert schedule == "1f1b", "the generator lays out Megatron's phases for 1F1B only"
        name = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving."
        for (_step, rank, k), times in sorted(launches.items()):
            rows.append({"rank": rank, "lane": "cpu", "device": -1, "stream": 100 + rank,
                         "name": name + ("warmup", "steady", "cooldown")[k], "cat": "nvtx", "source": "nsys",
                         "start_ns": min(times) - 1, "dur_ns": max(times) - min(times) + 3, "category": "compute"})
    return rows, truth


# --- scenario: one collective on many ranks with known arrival, transfer and clock skew -------------------------

def skewed_collectives(arrivals: np.ndarray, *, transfer: np.ndarray, offsets: np.ndarray,
                       category: str = "all_reduce", pg: str = "0") -> tuple[list[dict], dict]:
    """Collective k on rank r: true start ``arrivals[k, r]``, true end ``max_r arrivals[k] + transfer[k]``,
    recorded on rank r's clock, which reads true time + ``offsets[r]``. Truth: wait = last arrival - own
    arrival, transfer, the straggler (argmax arrival), and offsets relative to rank 0."""
    n_coll, world = arrivals.shape
    rows = []
    last = arrivals.max(axis=1)
    ends = last + transfer
    for k in range(n_coll):
        for r in range(world):
            rows.append(dict(gpu_event(r, category, int(arrivals[k, r] + offsets[r]),
                                       int(ends[k] - arrivals[k, r])), category=category, pg_name=pg,
                             pg_desc="default_pg", pg_ranks=str(list(range(world))), pg_size=world, seq=k))
    truth = {"wait": last[:, None] - arrivals, "transfer": transfer, "straggler": arrivals.argmax(axis=1),
             "offset": offsets - offsets[0]}
    return rows, truth


# --- Kineto JSON writer ---------------------------------------------------------------------------------------

def write_kineto(rows: list[dict], folder: Path, *, world: int | None = None,
                 device_name: str | None = None) -> list[Path]:
    """One ``rank{r}.pt.trace.json.gz`` per rank; ts in µs relative to ``baseTimeNanoseconds`` with the ns
    fraction kept, GPU rows on pid=device/tid=stream, CPU rows on the rank's pid/thread; ``device_name``:
    the GPU's name in ``deviceProperties``."""
    folder.mkdir(parents=True, exist_ok=True)
    ranks = sorted({r["rank"] for r in rows})
    world = world or (max(ranks) + 1)
    paths = []
    for rank in ranks:
        mine = [r for r in rows if r["rank"] == rank]
        base = min(r["start_ns"] for r in mine)
        trace = [_kineto_event(r, base) for r in mine]
        doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
               "baseTimeNanoseconds": base, "traceEvents": trace}
        if device_name:
            doc["deviceProperties"] = [{"id": rank % 8, "name": device_name}]
        path = folder / f"rank{rank}.pt.trace.json.gz"
        with gzip.open(path, "wt") as fh:
            json.dump(doc, fh)
        paths.append(path)
    return paths


def _kineto_event(row: dict, base: int) -> dict:
    rel = row["start_ns"] - base
    gpu = row["lane"] == "gpu"
    args = {}
    if gpu:
        args.update({"device": row["device"], "stream": row["stream"]})
    for column, key in (("collective", "Collective name"), ("pg_name", "Process Group Name"),
                        ("pg_desc", "Process Group Description"), ("pg_ranks", "Process Group Ranks"),
                        ("pg_size", "Group size"), ("seq", "Seq"), ("in_nelems", "In msg nelems"),
                        ("out_nelems", "Out msg nelems"), ("dtype", "dtype")):
        if column in row:
            args[key] = row[column]
    if "peer_arg" in row:  # ("Src Rank" | "Dst Rank", global rank), as torch records a p2p call's peer
        args[row["peer_arg"][0]] = row["peer_arg"][1]
    return {"ph": "X", "cat": row["cat"], "name": row["name"],
            "pid": row["device"] if gpu else 1000 + row["rank"], "tid": row["stream"],
            "ts": rel / 1000, "dur": row["dur_ns"] / 1000,
            "args": args}


# --- scenarios: critical paths known by construction (``critical_path``) ----------------------------------------

def _collective(rank: int, category: str, start: int, end: int, *, world: int, seq: int, desc: str,
                offsets: list[int], stream: int = 20) -> dict:
    """A collective kernel of one group over all ``world`` ranks, on rank's clock (true time + offset)."""
    return dict(gpu_event(rank, category, int(start + offsets[rank]), int(end - start), stream=stream,
                          pg_name="0", pg_desc=desc, pg_ranks=str(list(range(world))), pg_size=world, seq=seq),
                category=category)


def straggler_all_reduce(world: int = 4, *, straggler: int = 2, compute: int = 1000, extra: int = 600,
                         transfer: int = 200, offsets: list[int] | None = None) -> tuple[list[dict], dict]:
    """One step: every rank computes ``[0, compute)`` (the straggler ``extra`` ns longer), then all-reduces
    over the world (``default_pg``: dim world) from its compute's end until ``last + transfer``, where
    ``last = compute + extra`` is the straggler's arrival; ``ProfilerStep#0`` spans ``[0, end)`` on every
    rank. ``offsets[r]`` is added to rank r's clock (the all-reduce ends together, so it aligns them).

    Truth ``path``: the rows (rank, label, start, end) on the true clock -- the straggler's compute up to its
    arrival, then the transfer. Every rank ends at once, so the path's end is on the lowest rank (the
    documented tie), whose wait leads to the straggler."""
    offsets = [0] * world if offsets is None else list(offsets)
    last = compute + extra
    end = last + transfer
    rows = []
    for r in range(world):
        arrive = last if r == straggler else compute
        rows.append(dict(gpu_event(r, "compute", offsets[r], arrive), category="compute"))
        rows.append(_collective(r, "all_reduce", arrive, end, world=world, seq=0, desc="default_pg", offsets=offsets))
        rows.append(annotation(r, "ProfilerStep#0", offsets[r], end))
    path = [(straggler, "compute", 0, last), (0, "all_reduce transfer", last, end)]
    if straggler == 0:
        path = [(0, "compute", 0, last), (0, "all_reduce transfer", last, end)]
    return rows, {"path": path, "end": end, "last": last}


def zero3_step(world: int = 3, *, slow: int = 1, compute: int = 1000, slow_compute: int = 1400, gather: int = 100,
               prefetch: int = 300, scatter: int = 150, offsets: list[int] | None = None) -> tuple[list[dict], dict]:
    """A ZeRO-3-like step over a data-parallel group (``mesh_dp``: dim dp) of ``world`` ranks, rank ``slow``
    computing ``slow_compute`` per layer where the others take ``compute`` (true clock; ``offsets`` as in
    ``straggler_all_reduce``):

        all-gather layer 1      [0, gather)                          every rank arrives at 0: no wait
        layer 1 forward         [gather, gather + c_r)
        all-gather layer 2      [gather + c_r, E1)                   E1 = 2 gather + c_slow: waits for ``slow``
        layer 2 forward         [E1, E1 + c_r), with the all-gather of layer 3 prefetched on another stream
                                [E1, E1 + prefetch) under it (every rank arrives at E1: no wait, hidden)
        layer 3 forward         [E1 + c_r, E1 + 2 c_r)
        reduce-scatter          [E1 + 2 c_r, end)                    end = E1 + 2 c_slow + scatter

    Truth ``path`` (rank, label, start, end): on ``slow``, the first all-gather's transfer, its layer-1
    compute, the second all-gather's transfer (it arrived last), its layers 2-3 compute (the hidden
    prefetch is under compute), then the reduce-scatter's transfer on the lowest rank (every rank ends at
    once: the documented tie)."""
    offsets = [0] * world if offsets is None else list(offsets)
    cost = [slow_compute if r == slow else compute for r in range(world)]
    e1 = 2 * gather + slow_compute
    end = e1 + 2 * slow_compute + scatter
    rows = []
    for r in range(world):
        c = cost[r]
        calls = [("all_gather", 0, gather, 20), ("all_gather", gather + c, e1, 20),
                 ("all_gather", e1, e1 + prefetch, 21), ("reduce_scatter", e1 + 2 * c, end, 20)]
        for seq, (category, start, stop, stream) in enumerate(calls):
            rows.append(_collective(r, category, start, stop, world=world, seq=seq, desc="mesh_dp", offsets=offsets,
                                    stream=stream))
        for start in (gather, e1, e1 + c):
            rows.append(dict(gpu_event(r, "compute", start + offsets[r], c), category="compute"))
        rows.append(annotation(r, "ProfilerStep#0", offsets[r], end))
    path = [(slow, "all_gather transfer", 0, gather), (slow, "compute", gather, gather + slow_compute),
            (slow, "all_gather transfer", gather + slow_compute, e1), (slow, "compute", e1, e1 + 2 * slow_compute),
            (0, "reduce_scatter transfer", e1 + 2 * slow_compute, end)]
    return rows, {"path": path, "end": end}


# --- scenario: idle decomposed (host-bound launches, syncs, data loading, cross-stream waits) -------------------

def host_row(rank: int, name: str, start: int, dur: int, *, cat: str = "cuda_runtime", correlation: int = -1,
             stream: int | None = None) -> dict:
    """One CPU-lane row of the rank's host thread (``100 + rank``, the thread ``annotation`` uses): a runtime
    call (linked to its GPU work by ``correlation``), a ``cpu_op`` or a ``user_annotation`` span. ``stream``:
    another lane id, e.g. the GPU stream a Kineto ``cuda_sync`` row names."""
    return {"rank": rank, "lane": "cpu", "device": -1, "stream": 100 + rank if stream is None else stream,
            "name": name, "cat": cat, "start_ns": start, "dur_ns": dur, "correlation": correlation,
            "source": "kineto"}


def launched(rank: int, category: str, start: int, dur: int, *, launch: int, correlation: int,
             stream: int | None = None, call: str = "cudaLaunchKernel") -> list[dict]:
    """A GPU work row and the 10 ns runtime call that launched it at ``launch`` (same correlation id)."""
    extra = {} if stream is None else {"stream": stream}
    return [gpu_event(rank, category, start, dur, correlation=correlation, **extra),
            host_row(rank, call, launch, 10, correlation=correlation)]


def idle_causes_steps(rank: int = 0, *, t0: int = 1_000_000) -> tuple[list[dict], dict]:
    """Two GPU steps [0, 500) and [500, 1000) (offset t0) whose idle gaps each have one cause, laid out by hand.

    Kernels (stream 7 unless said; launch call start in brackets): [0,100) (-50), [200,300) (150),
    [400,450) (360), [600,650) (570), stream 20 [750,800) (496), [900,950) (610). Host: cudaStreamSynchronize
    [250,330); DataLoader ``__next__`` [420,520); ``aten::item`` [500,540); cudaStreamWaitEvent at 490;
    cudaDeviceSynchronize [700,720); Lightning's ``train_dataloader_next`` [960,980). Gaps and causes:

    - [100,200): next launched at 150 > 100: host-bound 100;
    - [300,400): launched at 360: sync [300,330) 30, host-bound 70;
    - [450,600): launched at 570: dataloader [450,500) 50 (step 1), sync (item inside the loader) [500,540) 40,
      host-bound [540,600) 60 (step 2);
    - [650,750): the stream-20 kernel was launched at 496 < 650 behind the wait at 490: dependency 100 (the
      device synchronize inside does not matter: the work was queued);
    - [800,900): launched at 610 < 800, no wait since the previous stream-7 launch (570): other 100;
    - [950,1000): no next work: dataloader [960,980) 20, other 30.
    """
    def t(x):
        return t0 + x

    rows = []
    for i, (start, dur, launch, stream) in enumerate(((0, 100, -50, 7), (200, 100, 150, 7), (400, 50, 360, 7),
                                                      (600, 50, 570, 7), (750, 50, 496, 20), (900, 50, 610, 7))):
        rows += launched(rank, "compute", t(start), dur, launch=t(launch), correlation=i + 1, stream=stream)
    rows += [host_row(rank, "cudaStreamSynchronize", t(250), 80, correlation=90),
             host_row(rank, "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", t(420), 100,
                      cat="user_annotation"),
             host_row(rank, "aten::item", t(500), 40, cat="cpu_op"),
             host_row(rank, "cudaStreamWaitEvent", t(490), 5, correlation=91),
             host_row(rank, "cudaDeviceSynchronize", t(700), 20, correlation=92),
             host_row(rank, "[_TrainingEpochLoop].train_dataloader_next", t(960), 20, cat="user_annotation"),
             annotation(rank, "ProfilerStep#1", t(0), 500), annotation(rank, "ProfilerStep#2", t(500), 500)]
    truth = {"step": [1, 2], "idle": [250, 350], "idle_host_bound": [170, 60], "idle_sync": [30, 40],
             "idle_dataloader": [50, 20], "idle_dependency": [0, 100], "idle_other": [0, 130]}
    return rows, truth


def gloo_all_reduce(arrivals: list[int], *, end: int, step: int | None = None) -> list[dict]:
    """CPU (gloo) ranks, one thread each: rank r runs ``aten::mm`` over ``[0, arrivals[r])``, then a
    ``c10d::allreduce_`` to ``end`` holding its ``record_param_comms`` and ``gloo:all_reduce`` (nested, as torch
    records them); a CPU ``ProfilerStep#step`` over ``[0, end)`` when ``step`` is given. Rows are already
    categorised by name (``conform`` them, the classifier runs in ``attribute``)."""
    rows = []
    for rank, arrive in enumerate(arrivals):
        spans = [("aten::mm", "cpu_op", 0, arrive, {}), ("c10d::allreduce_", "cpu_op", arrive, end, {}),
                 ("record_param_comms", "cpu_op", arrive + 1, end - 10, {"collective": "allreduce", "seq": 0}),
                 ("gloo:all_reduce", "user_annotation", arrive + 2, end - 20, {})]
        if step is not None:
            spans.append((f"ProfilerStep#{step}", "user_annotation", 0, end, {}))
        rows += [dict(rank=rank, lane="cpu", stream=1, name=name, cat=cat, start_ns=lo, dur_ns=hi - lo, **extra)
                 for name, cat, lo, hi, extra in spans]
    return rows
