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
  on the path, else that exposed time (exact bound).
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
  step: CUDA graphs / torch.compile / fewer, larger kernels, with the launch delays and short-kernel count.
  Saves: that idle (exact bound).
- ``pageable_copies``: H2D/D2H copies from or to pageable host memory: "pin the offload buffers". Saves: the
  exposed time with a pageable copy running (exact bound).
- ``comm_coverage``: a communication op with no communication kernel, or the reverse (``comm_coverage``):
  a diagnostic -- name the kernel with a ``CommRule``.

Every number a finding prints is one of its own columns' numbers, and each finding's source numbers come from
the report's frames (the breakdown, the pipeline table, the bandwidth rows, the launch statistics). Times are
printed in ms to ``SIGNIFICANT`` (3) significant figures, rounded half up (:func:`ms_figures`): a saving is a
mean over steps of a bound or a replay, and steps of one run differ by more than 0.1%, so further digits are
noise; ``saves_ns`` keeps the exact value. Percentages have two decimals.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from decimal import ROUND_HALF_UP, Decimal

import numpy as np
import pandas as pd

from ..attribution.core import comm_by_dim
from ..base.errors import ProfilingError
from ..base.schema import COMM_CATEGORIES, P2P_CATEGORIES
from ..matching.collectives import stage_peers, within_stage
from ..matching.links import link_table
from ..matching.pipelines import MEASURED_METHODS
from ..table.workload import AllToAllUse, Workload, detect_workload

FINDING_COLUMNS = ("rank", "rule", "saves_ns", "method", "measured", "change", "text")

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
    ideal_next = (p - 1) / (v * 2 * m + p - 1)
    if not worst["bubble_fraction"] - ideal_next >= threshold:
        return []
    # The same global batch in twice the micro-batches (each half the size): what more micro-batches buy.
    saved, method = _what_if_saving(ctx, f"pipeline:m={2 * m},keep=batch")
    if math.isnan(saved):
        ideal_now = (p - 1) / (v * m + p - 1)
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
        out.append(Finding("exposed_collective", saved, method,
                           f"exposed {name} {_pct(share)} of the step (mean over ranks and steps; {_ms(bound)} "
                           f"ms/step on the mean rank){measured}", advice,
                           f"exposed {name} {_pct(share)} of step: {advice}; −{_ms(saved)} ms/step"))
    return out


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
    change = "launch ahead of the GPU: CUDA graphs or torch.compile, fewer and larger kernels, less Python per step"
    return [Finding("host_bound", saved, method, measured, change, f"{measured}: {change}; −{_ms(saved)} ms/step")]


def _pageable_copies(ctx: _Context, threshold: float) -> list[Finding]:
    offload = ctx.sections.offload
    if offload is None or offload.empty or not (offload["pageable_copies"] > 0).any():
        return []
    copies = int(offload["pageable_copies"].sum())
    bd = ctx.breakdown
    saved = ctx.per_step(bd["pageable_memcpy_ns"]) if "pageable_memcpy_ns" in bd else math.nan
    if not saved >= threshold * ctx.step_ns:
        return []
    measured = f"pageable host memory in {copies} copies"
    change = "pin the offload buffers (pin_memory=True, DeepSpeed offload pin_memory)"
    return [Finding("pageable_copies", saved, "exact bound", measured, change,
                    f"{measured}: {change}; up to −{_ms(saved)} ms/step")]


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


def evaluate(attribution, sections, *, what_if: Callable[[str], pd.DataFrame],
             bandwidth_rows: Callable[[], pd.DataFrame], rules: Sequence[FindingRule] = DEFAULT_RULES) -> pd.DataFrame:
    """The findings of ``attribution`` given its report's ``sections`` (``present.report_sections``, whose
    ``findings`` is the entry point for a trace set), one row each (``FINDING_COLUMNS``), the largest saving
    first and diagnostics last. The rules ask ``what_if(scenario text)`` (``what_if``'s table of the
    attribution) and ``bandwidth_rows()`` (``traffic.bandwidth_rows`` of the attribution): analyses of other
    modules, which the caller gives."""
    context = _Context(attribution, sections, what_if, bandwidth_rows)
    found: list[Finding] = []
    for rule in rules:
        if not isinstance(rule, FindingRule):
            raise ProfilingError(f"findings: rules must be FindingRule objects, got {type(rule).__name__}")
        found += rule.test(context, rule.threshold)
    frame = pd.DataFrame([dataclasses.asdict(f) for f in found],
                         columns=[c for c in FINDING_COLUMNS if c != "rank"])
    if frame.empty:
        return pd.DataFrame({c: pd.Series(dtype=float if c == "saves_ns" else (int if c == "rank" else object))
                             for c in FINDING_COLUMNS})
    frame["saves_ns"] = frame["saves_ns"].astype(float)
    order = np.lexsort((frame["rule"].to_numpy(), -frame["saves_ns"].fillna(-1).to_numpy()))
    frame = frame.iloc[order].reset_index(drop=True)
    frame.insert(0, "rank", np.arange(1, len(frame) + 1))
    return frame[list(FINDING_COLUMNS)]
