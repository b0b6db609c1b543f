"""Findings: what to change, each with its measurement and what it costs per step, ranked by that cost.

A finding is one row of :func:`findings`: the ``rule`` that found it, ``saves_ns`` (what fixing it would save
per step, the mean over the trace's steps; NaN for a diagnostic), ``method`` (how: ``exact bound`` -- the
attribution's own exclusive time, which no fix can beat; ``critical-path replay`` / ``simulation`` -- from
``what_if``), ``measured`` (the numbers, as text), ``change`` (the concrete change) and ``text``, one line::

    micro_batches 8 -> 16: bubble 22.31% -> 12.50% (ideal), -14.1 ms/step

Rules are data (:class:`FindingRule`: a name, a threshold, the function that tests it); ``findings(source,
rules=...)`` takes any tuple of them, ``DEFAULT_RULES`` is the set the reports run. Every rule is tested on a
synthetic trace that triggers it and one that must not (tests/profiling/test_findings.py). The rules:

- ``pipeline_bubble``: a measured pipeline (``pipeline_bubbles``, any method but the p2p-receive
  restatement) whose worst stage's bubble exceeds the (p-1)/(v·m+p-1) ideal at twice the micro-batches by
  ``threshold``: "micro_batches m -> 2m" (the same global batch in micro-batches half the size). Saves: the
  ``what_if`` simulation ``pipeline:m=2m,keep=batch`` when it runs, else the closed form
  batch x (ideal(m) - ideal(2m)) (equal-cost stages).
- ``exposed_collective``: a collective category whose exposed time is at least ``threshold`` of the step on
  average over (rank, step): all-gather -> ZeRO-3 / FSDP prefetch is not overlapping; reduce-scatter and
  all-reduce -> gradient reduction is not overlapping backward; all-to-all -> what the trace says it
  exchanges (``table.workload``: the enclosing annotations, the group's dim, else the detected workload),
  with that domain's levers: a recommender's embedding exchange (TorchRec's pipelined sparse dist, quantized
  comms), MoE expert dispatch/combine (DeepEP, shared experts), Ulysses attention (overlap, or ring
  attention); an all-to-all of unknown use gets no domain advice. Saves: ``what_if`` ``overlap:category=c``
  on the path, else that exposed time (exact bound). The replay hides the calls' data movement, not their
  waits for the last rank to arrive: where most of the exposed time is such waiting (``wait_transfer``; the
  measurement says so), the saving is small and the straggler finding carries the wait.
- ``tp_across_nodes``: tensor-parallel collectives whose group spans more than one node
  (``collective_bandwidth``'s ``nodes``): "keep tp within a node", with the achieved bus bandwidth against the
  NIC's limit. Saves: ``what_if`` ``comm_faster:k=intra/NIC,dim=tp`` (the same collectives on the node's
  fabric), else the exposed tp communication (exact bound).
- ``straggler``: a rank last to arrive in most instances of a step's collectives (``stragglers``), whose
  caused wait is at least ``threshold`` of the step; why: its compute or its host-bound GPU idle, whichever is
  further above its peers' median (``collectives.stage_peers``; in a pipelined job its stage's ranks, since
  another stage does other work). Saves: ``what_if`` ``no_straggler:rank=R`` (critical-path replay), else
  the wait it caused others (the matched waits whose last arriver it is).
- ``host_bound``: GPU idle because the host launched late (``idle_host_bound``) at least ``threshold`` of the
  step: CUDA graphs / torch.compile / fewer, larger kernels, with the launch delays and short-kernel count and
  where the launching thread was busy (its largest culprit: annotation, op, ranks, steps).
  Saves: that idle (exact bound).
- ``pageable_copies``: H2D/D2H copies from or to pageable host memory: pin the host buffers (the input
  pipeline's, in a recommender; the offload buffers otherwise). A pageable copy's launch call blocks the host
  until the copy is done, so what it costs is the GPU idle while the host was blocked in those calls
  (``attribution.idle.pageable_idle``), not the copy's own transfer time. Saves: ``what_if``
  ``no_idle:cause=pageable`` on the path, else that idle (exact bound); the measurement gives that idle on
  the mean rank and names where the host was blocked (annotation -> op -> call,
  ``attribution.idle.idle_culprits``) with ranks and steps. A trace without the copies' launch calls does not
  say how long the host was blocked: then the copies' exposed run time (exact bound), and the text says so.
- ``host_blocked``: GPU idle while the host was blocked in a synchronise or ``.item()`` (``idle_sync``, less the
  pageable copies' part) or waiting for data (``idle_dataloader``), at least ``threshold`` of the step, each
  named by its largest culprit: take the synchronisation out of the step / load ahead. Saves: that idle
  (exact bound; ``what_if`` ``no_idle:cause=dataloader`` for data loading).
- ``comm_coverage``: a communication op with no communication kernel, or the reverse (``comm_coverage``):
  a diagnostic -- name the kernel with a ``CommRule``.

A finding whose saving is below the steps' own spread (``step_noise``: the standard deviation of the step
time over steps) is ``minor``: listed after the others (the report shows it in a short "minor" list).

Every number a finding prints is one of its own columns' numbers, and each finding's source numbers come from
the report's frames (the breakdown, the pipeline table, the bandwidth rows, the launch statistics). Times are
printed in ms to ``SIGNIFICANT`` (3) significant figures, rounded half up (:func:`ms_figures`): a saving is a
mean over steps of a bound or a replay, and steps of one run differ by more than 0.1%, so further digits are
noise; ``saves_ns`` keeps the exact value. Percentages have two decimals.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from decimal import ROUND_HALF_UP, Decimal

import numpy as np
import pandas as pd

from ..attribution.core import comm_by_dim
from ..attribution.idle import empty_culprits, idle_culprits, pageable_launches
from ..base.errors import ProfilingError
from ..base.schema import COMM_CATEGORIES, P2P_CATEGORIES
from ..matching.collectives import stage_peers, within_stage
from ..matching.links import link_table
from ..matching.pipelines import MEASURED_METHODS, ideal_fraction
from ..table.workload import AllToAllUse, Workload, detect_workload

FINDING_COLUMNS = ("rank", "rule", "saves_ns", "method", "measured", "change", "text", "minor")

_ADVICE = {
    "all_gather": "ZeRO-3 / FSDP parameter prefetch is not overlapping compute: prefetch further ahead "
                  "(DeepSpeed stage3_prefetch_bucket_size, FSDP forward_prefetch / backward_prefetch)",
    "reduce_scatter": "gradient reduce-scatter is not overlapping backward: overlap_comm, larger buckets "
                      "(reduce_bucket_size)",
    "all_reduce": "gradient all-reduce is not overlapping backward: bucket it under backward (DDP bucket_cap_mb, "
                  "DeepSpeed overlap_comm), or move TP all-reduces under compute (sequence parallelism)",
    "all_to_all": "all-to-all is exposed: the trace does not say what it exchanges (no embedding, expert or "
                  "sequence-parallel annotation around it); overlap it with independent compute",
    "broadcast": "broadcasts are exposed: broadcast once, outside the step",
    "barrier": "barriers are exposed: remove the synchronising barrier from the step",
    "other_comm": "communication of an unknown kind is exposed",
}


#: The exposed all-to-all's advice by what it exchanges (``table.workload.AllToAllUse``); UNKNOWN is
#: ``_ADVICE["all_to_all"]``, with no domain's levers.
ALL_TO_ALL_ADVICE = {
    AllToAllUse.EMBEDDING: "the embedding all-to-all (sparse features and pooled embeddings) is exposed: pipeline it "
                           "under the dense compute (TorchRec TrainPipelineSparseDist / prefetch pipeline: the next "
                           "batch's input dist under this batch's dense forward/backward), and send less "
                           "(quantized comms, fp16/bf16 via QCommsConfig; fewer, fused all-to-alls over tables)",
    AllToAllUse.EXPERT: "expert dispatch/combine all-to-all is exposed: overlap dispatch/combine with compute "
                        "(DeepEP's communication-computation overlap, shared experts computed during dispatch)",
    AllToAllUse.ULYSSES: "the Ulysses attention all-to-all is exposed: overlap it with the QKV and output "
                         "projections (per-head chunks), or switch this context-parallel dim to ring attention",
    AllToAllUse.UNKNOWN: _ADVICE["all_to_all"],
}
#: Significant figures of a printed time.
SIGNIFICANT = 3


@dataclasses.dataclass(frozen=True)
class Finding:
    rule: str
    saves_ns: float
    method: str
    measured: str
    change: str
    text: str


@dataclasses.dataclass(frozen=True)
class FindingRule:
    """One rule: ``name``, its ``threshold`` (a fraction of the step unless the rule says otherwise) and
    ``test(context, threshold) -> list[Finding]``."""

    name: str
    threshold: float
    test: Callable[[_Context, float], list[Finding]]
    description: str = ""


@dataclasses.dataclass
class _Context:
    """What the rules read: the attribution, the report's frames (computed once, see ``report_sections``) and
    the analyses of other modules they ask, given by the caller (``evaluate``)."""

    attribution: object
    sections: object
    what_if: Callable[[str], pd.DataFrame]
    bandwidth_rows: Callable[[], pd.DataFrame]

    @property
    def breakdown(self) -> pd.DataFrame:
        return self.sections.breakdown

    @property
    def workload(self) -> Workload:
        """The report's detected workload (``sections.workload``), else detected here from the events."""
        found = getattr(self.sections, "workload", None)
        return found if isinstance(found, Workload) else detect_workload(self.attribution.events)

    @functools.cached_property
    def culprits(self) -> pd.DataFrame:
        """The host calls behind the host-blocked idle (``attribution.idle.idle_culprits``), all ranks: the
        report's frame (``sections.idle_culprits``) where it has one."""
        found = getattr(self.sections, "extra", {}).get("idle_culprits") if self.sections is not None else None
        if isinstance(found, pd.DataFrame):
            return found
        frames = [idle_culprits(self.attribution, rank) for rank in self.attribution.working]
        return pd.concat(frames, ignore_index=True) if frames else empty_culprits()

    @property
    def step_ns(self) -> float:
        """The mean step over (rank, step) rows."""
        return float(self.breakdown["step_ns"].mean()) if len(self.breakdown) else math.nan

    def per_step(self, values: pd.Series) -> float:
        """The mean per step of a per-(rank, step) quantity: the mean over ranks of each step, averaged."""
        frame = self.breakdown.assign(value=values.to_numpy())
        return float(frame.groupby("step")["value"].mean().mean()) if len(frame) else math.nan


def ms_figures(ns: float, figures: int = SIGNIFICANT) -> str:
    """``ns`` in ms to ``figures`` significant figures, rounded half up (never fewer digits than the integer
    part has): 141857600 -> "142", 3172000 -> "3.17", 200 -> "0.000200"."""
    if not math.isfinite(ns):
        return str(ns)
    exact = Decimal(int(round(ns))) / Decimal(1_000_000)
    if exact == 0:
        return "0"
    decimals = max(0, figures - 1 - math.floor(math.log10(abs(exact))))
    rounded = exact.quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP)
    if decimals and rounded != 0 and math.floor(math.log10(abs(rounded))) > math.floor(math.log10(abs(exact))):
        rounded = exact.quantize(Decimal(1).scaleb(1 - decimals), rounding=ROUND_HALF_UP)  # 99.95 -> 100
    return f"{rounded:f}"


_ms = ms_figures


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


# --- the rules ---------------------------------------------------------------------------------------------------

def _pipeline_bubble(ctx: _Context, threshold: float) -> list[Finding]:

    bubbles = ctx.sections.bubbles
    if bubbles is None or bubbles.empty or "method" not in bubbles:
        return []
    measured = bubbles[bubbles["method"].isin(MEASURED_METHODS) & (bubbles["p"] > 1) & (bubbles["m"] > 0)]
    if measured.empty:
        return []
    worst = measured.sort_values(["bubble_fraction", "rank"], ascending=[False, True]).iloc[0]
    p, m, v = int(worst["p"]), int(worst["m"]), max(int(worst["v"]), 1)
    ideal_next = ideal_fraction(None, p=p, m=2 * m, v=v)
    if not worst["bubble_fraction"] - ideal_next >= threshold:
        return []
    # The same global batch in twice the micro-batches (each half the size): what more micro-batches buy.
    saved, method = _what_if_saving(ctx, f"pipeline:m={2 * m},keep=batch")
    if math.isnan(saved):
        ideal_now = ideal_fraction(None, p=p, m=m, v=v)
        saved = float(measured["batch_ns"].mean()) * (ideal_now - ideal_next)
        method = "exact bound"
    if not saved > 0:
        return []
    text = (f"micro_batches {m} → {2 * m}: bubble {_pct(worst['bubble_fraction'])} → {_pct(ideal_next)} (ideal), "
            f"−{_ms(saved)} ms/step")
    return [Finding("pipeline_bubble", saved, method,
                    f"rank {int(worst['rank'])} (stage {int(worst['stage'])}, {worst['schedule'] or 'pipeline'}, "
                    f"p={p}, m={m}, v={v}): bubble {_pct(worst['bubble_fraction'])} of its batch",
                    f"micro_batches {m} → {2 * m} (or more chunks per stage)", text)]


def _exposed_collective(ctx: _Context, threshold: float) -> list[Finding]:
    bd = ctx.breakdown
    out = []
    for category in COMM_CATEGORIES:
        if category in P2P_CATEGORIES or category not in bd:
            continue
        share = float((bd[category] / bd["step_ns"].where(bd["step_ns"] > 0)).mean())
        if not share >= threshold:
            continue
        bound = ctx.per_step(bd[category])
        saved, method = _what_if_saving(ctx, f"overlap:category={category}")
        if math.isnan(saved):
            saved, method = bound, "exact bound"
        name = category.replace("_", "-")
        advice, measured = _ADVICE[category], ""
        if category == "all_to_all":
            workload = ctx.workload
            advice = ALL_TO_ALL_ADVICE[workload.all_to_all]
            if workload.all_to_all is not AllToAllUse.UNKNOWN:
                name += f" ({workload.all_to_all.value})"
            measured = f"; {workload.all_to_all_text()}" if workload.all_to_all_calls else ""
        waiting, why = _wait_share(ctx, category), ""
        if waiting >= 0.5:  # overlap hides data movement, not a wait for the last rank to arrive
            measured += (f"; {_pct(waiting)} of its calls' time is waiting for the last rank to arrive, which "
                         "overlapping cannot hide (see the straggler finding)")
            why = f" ({_pct(waiting)} of it is waiting for the last rank: overlap recovers only the transfer)"
        out.append(Finding("exposed_collective", saved, method,
                           f"exposed {name} {_pct(share)} of the step (mean over ranks and steps; {_ms(bound)} "
                           f"ms/step on the mean rank){measured}", advice,
                           f"exposed {name} {_pct(share)} of step{why}: {advice}; −{_ms(saved)} ms/step"))
    return out


def _wait_share(ctx: _Context, category: str) -> float:
    """Of the matched calls of ``category`` (``sections.wait_transfer``), the share of their time spent waiting
    for the last rank; NaN where none was matched."""
    table = getattr(ctx.sections, "wait_transfer", None)
    if table is None or not len(table) or "category" not in table:
        return math.nan
    rows = table[table["category"].astype(str) == category]
    total = float(rows["dur_ns"].sum())
    return float(rows["wait_ns"].sum()) / total if total > 0 else math.nan


def _tp_across_nodes(ctx: _Context, threshold: float) -> list[Finding]:

    rows = ctx.bandwidth_rows()
    if rows.empty or "nodes" not in rows:
        return []
    tp = rows[(rows["dim"].astype(str) == "tp") & (rows["nodes"] > 1)]
    if tp.empty:
        return []
    busbw = float(tp["busbw_gbps"].median())
    limit = float(tp["link_gbps"].median())
    dims = comm_by_dim(ctx.attribution)
    exposed = dims[dims["dim"] == "tp"]
    bound = float(exposed.groupby("step")["exposed_ns"].mean().mean()) if len(exposed) else 0.0
    if not bound >= threshold * ctx.step_ns:
        return []
    nodes = int(tp["nodes"].max())
    category = str(tp["category"].mode().iloc[0]).replace("_", "-")
    link = str(tp["link"].mode().iloc[0])
    # Within a node the same collectives run on the intra-node fabric: k = its limit / the NIC's.

    table = link_table()
    intra = table.device_links(str(tp["device_name"].mode().iloc[0]))[0]
    faster = table.links[intra].gbps / limit if intra in table.links and limit > 0 else math.nan
    saved, method = (_what_if_saving(ctx, f"comm_faster:k={faster:.6g},dim=tp") if faster > 1
                     else (math.nan, ""))
    if math.isnan(saved):
        saved, method = bound, "exact bound"
    measured = f"tp group spans {nodes} nodes: {category} busbw {busbw:.2f} GB/s of the {link}'s {limit:.2f}"
    return [Finding("tp_across_nodes", saved, method, measured,
                    "keep tp within a node (tp <= GPUs per node; put pp or dp across nodes)",
                    f"{measured}; keep tp within a node, −{_ms(saved)} ms/step")]


def _straggler(ctx: _Context, threshold: float) -> list[Finding]:
    sg = ctx.sections.stragglers
    if sg is None or sg.empty:
        return []
    matched = ctx.sections.matched
    counts = sg["straggler_rank"].value_counts()
    rank = int(counts.index[0])
    mine = sg[sg["straggler_rank"] == rank]
    caused = float(mine["caused_wait_ns"].sum()) / max(len(sg), 1)  # per step, over all the steps
    if not caused >= threshold * ctx.step_ns:
        return []

    peers = stage_peers(matched, rank)  # the ranks doing its work: its stage's, where it has a pipeline stage
    piped = bool(len(matched)) and "cross_stage" in matched and bool(matched["cross_stage"].any())
    if len(matched):
        matched = within_stage(matched)  # the instances stragglers() counted
    instances = (matched.drop_duplicates(["step", "group", "category", "instance"]).groupby("step").size()
                 if len(matched) else pd.Series(dtype=int))
    last = int(mine["times_last"].sum())
    total = int(instances.loc[instances.index.isin(mine["step"])].sum()) if len(instances) else last
    # Why it is late: of its compute and its host-bound idle, the one furthest above its peers' median (every
    # rank's where it has none): another pipeline stage does other work.
    bd = ctx.breakdown
    whose = "the median of its pipeline stage's other ranks" if piped and peers else "the median"
    excess = {}  # words -> (how far above the peers' median, as a ratio; the phrase)
    for column, words in (("compute", "compute"), ("idle_host_bound", "host-bound GPU idle")):
        if column in bd:
            per_rank = bd.groupby("rank")[column].mean()
            pool = per_rank[per_rank.index.isin(peers)] if peers else per_rank
            median = float(pool.median())
            value = float(per_rank[rank]) if rank in per_rank.index else math.nan
            if median > 0 and not math.isnan(value):
                ratio = value / median - 1
                excess[words] = (ratio, f"{_pct(abs(ratio))} {'above' if ratio >= 0 else 'below'} {whose}")
            elif value > 0:  # the others have none (their work ran on other threads, or they only wait)
                excess[words] = (math.inf, f"{_ms(value)} ms per step where {whose} is 0")
    words, (_, how) = (max(excess.items(), key=lambda kv: kv[1][0]) if excess
                       else ("compute", (0.0, f"not measured against {whose} (no rank has any)")))
    measured = (f"rank {rank} is last in {last} of {total} collectives and costs the others {_ms(caused)} ms of "
                f"waiting per step: its {words} is {how}")
    saved, method = _what_if_saving(ctx, f"no_straggler:rank={rank}")
    if math.isnan(saved):
        saved, method = caused, "exact bound"
    text = f"{measured}; without it the step is {_ms(saved)} ms shorter"
    return [Finding("straggler", saved, method, measured,
                    f"find what rank {rank} does more (its data shard, a slower GPU or host, extra work on it)",
                    text)]


def _host_bound(ctx: _Context, threshold: float) -> list[Finding]:
    bd = ctx.breakdown
    if "idle_host_bound" not in bd:
        return []
    share = float((bd["idle_host_bound"] / bd["step_ns"].where(bd["step_ns"] > 0)).mean())
    if not share >= threshold:
        return []
    saved, method = _what_if_saving(ctx, "no_host_bound")
    if math.isnan(saved):
        saved, method = ctx.per_step(bd["idle_host_bound"]), "exact bound"
    launch = ctx.sections.launch
    detail = ""
    if launch is not None and len(launch) and launch["launches"].sum() > 0:
        delay = float(launch["launch_delay_median_ns"].median())
        detail = f" (launch delay median {delay / 1e3:.1f} µs, {int(launch['short_kernels'].sum())} kernels < 10 µs)"
    measured = f"GPU idle waiting for the host {_pct(share)} of step{detail}"
    culprits = ctx.culprits
    rows = culprits[culprits["cause"] == "idle_host_bound"] if len(culprits) else culprits
    if len(rows):
        measured += f", the launching thread busy in {_evidence(rows)}"
    change = "launch ahead of the GPU: CUDA graphs or torch.compile, fewer and larger kernels, less Python per step"
    return [Finding("host_bound", saved, method, measured, change, f"{measured}: {change}; −{_ms(saved)} ms/step")]


def _per_step_of(ctx: _Context, rows: pd.DataFrame) -> float:
    """The mean per step (over the breakdown's (rank, step) rows, 0 where ``rows`` has none) of ``rows``'
    ``idle_ns``."""
    if not len(rows):
        return 0.0
    totals = rows.groupby(["rank", "step"])["idle_ns"].sum()
    keys = pd.MultiIndex.from_arrays([ctx.breakdown["rank"], ctx.breakdown["step"]])
    return ctx.per_step(pd.Series(totals.reindex(keys).fillna(0).to_numpy(dtype=float)))


def _evidence(rows: pd.DataFrame) -> str:
    """Where the idle of ``rows`` (culprit rows) is: its largest (annotation, op, call) with ranks and steps."""
    keys = ["annotation", "op", "call"]
    top = rows.groupby(keys, sort=False)["idle_ns"].sum().sort_values(ascending=False, kind="stable")
    annotation, op, call = top.index[0]
    mine = rows[(rows[keys] == [annotation, op, call]).all(axis=1)]
    where = " → ".join(x for x in (annotation, op, call) if x) or "no host op recorded"
    ranks, steps = sorted(set(mine["rank"].tolist())), sorted(set(mine["step"].tolist()))
    share = float(top.iloc[0]) / float(top.sum()) if top.sum() > 0 else math.nan
    return (f"{where} ({_pct(share)} of it; ranks {_span(ranks)}, steps {_span(steps)}, "
            f"{int(mine['gaps'].sum())} gaps)")


def _span(values: list[int]) -> str:
    if len(values) > 2 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ", ".join(str(v) for v in values[:8]) + (", ..." if len(values) > 8 else "")


def _bounded(ctx: _Context, scenario: str, bound: float) -> tuple[float, str]:
    """The ``what_if`` saving of ``scenario`` when it runs, else ``bound`` (the attribution's exact bound)."""
    saved, method = _what_if_saving(ctx, scenario)
    return (bound, "exact bound") if math.isnan(saved) else (saved, method)


def _pageable_copies(ctx: _Context, threshold: float) -> list[Finding]:
    offload = ctx.sections.offload
    if offload is None or offload.empty or not (offload["pageable_copies"] > 0).any():
        return []
    copies = int(offload["pageable_copies"].sum())
    culprits = ctx.culprits
    blocked = culprits[culprits["pageable"].astype(bool)] if len(culprits) else culprits
    bd = ctx.breakdown
    if sum(pageable_launches(ctx.attribution, rank) for rank in ctx.attribution.working):
        # What pinning gives back is the GPU idle the blocking copies cause, not their own transfer time.
        idle = _per_step_of(ctx, blocked)
        saved, method = _bounded(ctx, "no_idle:cause=pageable", idle)
        measured = f"pageable host memory in {copies} copies: GPU idle {_ms(idle)} ms/step (mean rank) while the " \
                   f"host is blocked in them"
    else:  # no launch call of theirs in the trace: how long the host was blocked is not recorded
        saved = ctx.per_step(bd["pageable_memcpy_ns"]) if "pageable_memcpy_ns" in bd else math.nan
        method = "exact bound"
        measured = (f"pageable host memory in {copies} copies (no launch calls in the trace: priced by the time "
                    f"they run, not by the host's blocking)")
    if not saved >= threshold * ctx.step_ns:
        return []
    if len(blocked):
        measured += f", under {_evidence(blocked)}"
    change = _pageable_change(ctx)
    return [Finding("pageable_copies", saved, method, measured, change,
                    f"{measured}: {change}; −{_ms(saved)} ms/step")]


def _pageable_change(ctx: _Context) -> str:
    if ctx.workload.all_to_all is AllToAllUse.EMBEDDING:
        return ("pin the host tensors the input pipeline copies (DataLoader pin_memory=True, "
                "tensor.pin_memory() before .to(device, non_blocking=True); TorchRec: pinned KJT batches)")
    return ("pin the host buffers (DataLoader pin_memory=True, .to(device, non_blocking=True) from pinned "
            "tensors, DeepSpeed offload pin_memory)")


_BLOCKED_ADVICE = {
    "idle_sync": ("the host waits for the GPU in {where}: take the synchronisation out of the step (no .item() / "
                  ".cpu() / .tolist() on GPU tensors per step; log every N steps; non_blocking copies)"),
    "idle_dataloader": ("the GPU waits for data in {where}: load ahead of the step (more DataLoader workers, "
                        "pin_memory=True, prefetch_factor, persistent_workers)"),
}


def _host_blocked(ctx: _Context, threshold: float) -> list[Finding]:
    culprits = ctx.culprits
    if not len(culprits):
        return []
    out = []
    for cause, scenario in (("idle_sync", None), ("idle_dataloader", "no_idle:cause=dataloader")):
        rows = culprits[(culprits["cause"] == cause) & ~culprits["pageable"].astype(bool)]
        bound = _per_step_of(ctx, rows)
        if not len(rows) or not bound >= threshold * ctx.step_ns:
            continue
        # idle_sync also holds the pageable copies' idle (their own finding): its scenario would count it twice.
        saved, method = _bounded(ctx, scenario, bound) if scenario else (bound, "exact bound")
        evidence = _evidence(rows)
        measured = f"GPU idle {_ms(bound)} ms/step under {evidence}"
        change = _BLOCKED_ADVICE[cause].format(where=evidence.split(" (")[0])
        out.append(Finding("host_blocked", saved, method, measured, change,
                           f"{change}; −{_ms(saved)} ms/step"))
    return out


def _comm_coverage(ctx: _Context, threshold: float) -> list[Finding]:
    coverage = ctx.sections.comm_coverage
    if coverage is None or coverage.empty:
        return []
    out = []
    for finding, rows in coverage.groupby("finding", sort=True):
        names = ", ".join(rows["name"].astype(str).head(3))
        measured = f"{finding}: {int(rows['count'].sum())} × ({names})"
        out.append(Finding("comm_coverage", math.nan, "", measured,
                           "name the kernel with a CommRule (--rules FILE) so its time counts as communication",
                           measured))
    return out


DEFAULT_RULES: tuple[FindingRule, ...] = (
    FindingRule("pipeline_bubble", 0.02, _pipeline_bubble, "bubble above the ideal at twice the micro-batches"),
    FindingRule("exposed_collective", 0.10, _exposed_collective, "a collective exposed >= 10% of the step"),
    FindingRule("tp_across_nodes", 0.0, _tp_across_nodes, "a tp group across nodes"),
    FindingRule("straggler", 0.05, _straggler, "one rank's late arrivals cost others >= 5% of the step"),
    FindingRule("host_bound", 0.10, _host_bound, "host-bound GPU idle >= 10% of the step"),
    FindingRule("pageable_copies", 0.0, _pageable_copies, "copies from/to pageable host memory"),
    FindingRule("host_blocked", 0.02, _host_blocked, "GPU idle under a host synchronise or data-loading wait "
                ">= 2% of the step"),
    FindingRule("comm_coverage", 0.0, _comm_coverage, "communication the rules do not know"),
)


def _what_if_saving(ctx: _Context, scenario: str) -> tuple[float, str]:
    """(mean saving per step, method) of a ``what_if`` scenario for the whole step; (NaN, "") when the
    scenario does not apply to this trace."""
    try:
        table = ctx.what_if(scenario)
    except ProfilingError:
        return math.nan, ""
    whole = table[table["rank"] == -1] if "rank" in table else table
    if whole.empty:
        return math.nan, ""
    return float(whole["saved_ns"].mean()), str(whole["method"].iloc[0])


def step_noise(breakdown: pd.DataFrame) -> float:
    """The step-to-step spread of a breakdown: the standard deviation (n - 1) over steps of the step time (each
    step's mean over ranks); 0 with fewer than two steps."""
    if not len(breakdown):
        return 0.0
    steps = breakdown.groupby("step")["step_ns"].mean()
    return float(steps.std(ddof=1)) if len(steps) > 1 else 0.0


def evaluate(attribution, sections, *, what_if: Callable[[str], pd.DataFrame],
             bandwidth_rows: Callable[[], pd.DataFrame], rules: Sequence[FindingRule] = DEFAULT_RULES) -> pd.DataFrame:
    """The findings of ``attribution`` given its report's ``sections`` (``present.report_sections``, whose ``findings``
    is the entry point for a trace set), one row each (``FINDING_COLUMNS``), the largest saving first, then the
    ``minor`` ones (a saving below ``step_noise``), diagnostics last. The rules ask ``what_if(scenario text)``
    (``what_if``'s table of the attribution) and ``bandwidth_rows()`` (``traffic.bandwidth_rows`` of the
    attribution): analyses of other modules, which the caller gives."""
    context = _Context(attribution, sections, what_if, bandwidth_rows)
    found: list[Finding] = []
    for rule in rules:
        if not isinstance(rule, FindingRule):
            raise ProfilingError(f"findings: rules must be FindingRule objects, got {type(rule).__name__}")
        found += rule.test(context, rule.threshold)
    frame = pd.DataFrame([dataclasses.asdict(f) for f in found],
                         columns=[c for c in FINDING_COLUMNS if c != "rank"])
    if frame.empty:
        types = {"saves_ns": float, "rank": int, "minor": bool}
        return pd.DataFrame({c: pd.Series(dtype=types.get(c, object)) for c in FINDING_COLUMNS})
    frame["saves_ns"] = frame["saves_ns"].astype(float)
    # Below the steps' own spread a saving cannot be told from noise: listed, but among the minor ones.
    frame["minor"] = (frame["saves_ns"] < step_noise(context.breakdown)).to_numpy()
    order = np.lexsort((frame["rule"].to_numpy(), -frame["saves_ns"].fillna(-1).to_numpy(),
                        frame["minor"].to_numpy(), frame["saves_ns"].isna().to_numpy()))
    frame = frame.iloc[order].reset_index(drop=True)
    frame.insert(0, "rank", np.arange(1, len(frame) + 1))
    return frame[list(FINDING_COLUMNS)]
