"""What kind of job a trace records, from the trace itself, and what its all-to-all is for.

:func:`detect_workload` reads the events table only: the names of its ops, annotations and kernels (each
distinct name tested once, counts broadcast through the name codes), the parallel ``dim`` the classifier gave
its communication rows (from the process groups' descriptions) and, for the all-to-all, the host intervals
that enclose each call. The result is a :class:`Workload`: the kind, the signals that decided it (which names
matched, how many events), a confidence, and the use of the all-to-all with its own evidence.

Kinds (:class:`WorkloadKind`), decided in this order, each by its signals (``SIGNALS``):

- ``inference``: an inference server's own ops or kernels (vLLM ``vllm::`` / ``_C::`` ops, SGLang, paged
  KV-cache attention, ``reshape_and_cache``); an MoE model served there is a trait (``traits``), not the kind.
- ``recommender``: FBGEMM table-batched embedding lookups, FBGEMM's sparse/jagged feature ops or TorchRec's
  sparse-feature distribution (``fbgemm::split_embedding_codegen_lookup_*``, ``fbgemm::permute_2D_sparse_data``,
  ``## sparse_data_dist ##``, ``KJTAllToAll*``).
- ``moe``: expert parallelism (DeepEP ``deep_ep::`` kernels, expert routing / MoE layers, grouped GEMMs, the
  MoE all-to-all autograd function ``_AllToAll``).
- ``vision``: convolutions (``aten::conv2d``, cuDNN/CUTLASS implicit-GEMM and Winograd kernels, MIOpen's
  iGEMM) with no token embedding, so a vision transformer's patch embedding counts; with a token embedding
  (a text tower) transformer evidence decides first.
- ``llm_training``: transformer work (flash/SDPA attention, layer/RMS norm, rotary, Megatron or shardline
  annotations) with backward ops; the parallel dims the process groups name (tp, pp, dp, cp, ep) come with it.
  Transformer work without backward and without a server is ``inference`` at low confidence.
- ``unknown``: none of the above.

Confidence: ``high`` when two or more signals of the kind matched at least 5 events in all, ``medium`` for one
signal, ``low`` when the kind was reached by elimination (forward-only transformer work).

All-to-all use (:class:`AllToAllUse`): each host-side all-to-all call (the outermost on its thread) takes the use
of the innermost enclosing interval whose name says one -- TorchRec's ``## alltoall_fwd_single ##``,
``All2All_Pooled_*``, ``KJTAllToAll*`` (embedding exchange); ``_AllToAll``, MoE/expert names, DeepEP
(expert dispatch/combine); ``_SeqAllToAll``, ``DistributedAttention``, Ulysses names (Ulysses attention
exchange) -- or its own process group's dim (``ep``: expert; ``cp``: Ulysses, shardline's own Ulysses runs on
the cp group). Device kernels named by DeepEP count as expert calls. Calls with no such context take the
workload's (recommender: embedding, moe: expert), else the use is unknown.

Detection is per table: the evidence of several ranks' tables adds (``Workload.evidence`` counts events over
all ranks).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..base.errors import ProfilingError
from ..base.schema import category_texts, codes_or_end


class WorkloadKind(str, enum.Enum):
    """The kind of job a trace records; the value is the report's word for it."""

    LLM_TRAINING = "LLM training"
    MOE = "mixture-of-experts"
    RECOMMENDER = "recommender"
    VISION = "vision"
    INFERENCE = "inference"
    UNKNOWN = "unknown"


class AllToAllUse(str, enum.Enum):
    """What an all-to-all exchanges."""

    EMBEDDING = "embedding exchange"
    EXPERT = "expert dispatch/combine"
    ULYSSES = "Ulysses attention exchange"
    UNKNOWN = "unknown"


class Confidence(str, enum.Enum):
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"


@dataclass(frozen=True)
class Signal:
    """One rule: events whose name matches ``pattern`` (``re.search``) are evidence of ``kind`` (or of the
    training / Ulysses traits, ``kind=None``); ``label`` names it in the report."""

    label: str
    kind: WorkloadKind | None
    pattern: str


@dataclass(frozen=True)
class Evidence:
    """A signal that matched: its ``label``, up to three of the ``names`` it matched (shortened) and how many
    ``events`` carry them."""

    label: str
    names: tuple[str, ...]
    events: int

    def text(self, names: int = 2) -> str:
        shown = ", ".join(self.names[:names])
        return f"{self.label} ({self.events} events: {shown})" if self.names else self.label


@dataclass(frozen=True)
class Workload:
    """The detected ``kind`` with its ``evidence`` and ``confidence``; ``traits``: other kinds whose signals
    matched too (an MoE model served by vLLM: kind inference, trait moe); ``dims``: the parallel dims the
    process groups name; ``training``: backward ops were seen; ``all_to_all``: the use of the all-to-all (by
    calls), ``all_to_all_calls``: calls per use, ``all_to_all_evidence``: what named it."""

    kind: WorkloadKind
    confidence: Confidence
    evidence: tuple[Evidence, ...]
    traits: tuple[WorkloadKind, ...] = ()
    dims: tuple[str, ...] = ()
    training: bool = False
    all_to_all: AllToAllUse = AllToAllUse.UNKNOWN
    all_to_all_calls: tuple[tuple[AllToAllUse, int], ...] = ()
    all_to_all_evidence: tuple[tuple[AllToAllUse, str], ...] = ()

    def describe(self) -> str:
        """One line: the kind, its confidence and what it was detected from."""
        what = self.kind.value
        if self.kind is WorkloadKind.LLM_TRAINING and self.dims:
            what += f" ({', '.join(self.dims)})"
        if self.traits:
            what += " with " + ", ".join(t.value for t in self.traits)
        if self.kind is WorkloadKind.UNKNOWN:
            return "workload: unknown (no op, annotation or kernel name of a known kind of job)"
        return f"workload: {what}, {self.confidence.value} confidence, from " + "; ".join(
            e.text(names=1) for e in self.evidence)

    def all_to_all_text(self) -> str:
        """The all-to-all's use in words, with the calls per use and what named them ("" without calls)."""
        if not self.all_to_all_calls:
            return ""
        why = dict(self.all_to_all_evidence)
        parts = [f"{use.value}, {n} calls" + (f" ({why[use]})" if why.get(use) else "")
                 for use, n in self.all_to_all_calls]
        return "all-to-all: " + "; ".join(parts)


_K = WorkloadKind
#: The signals, per kind; ``kind=None``: a trait (training: backward / optimizer ops).
SIGNALS: tuple[Signal, ...] = (
    Signal("vLLM ops", _K.INFERENCE, r"^vllm::|[^a-z]vllm::|^_C(_cache_ops)?::|unified_attention|unified_kv_cache"),
    Signal("SGLang ops", _K.INFERENCE, r"(?i)sglang|sgl_kernel|sgl::"),
    Signal("paged KV-cache attention", _K.INFERENCE,
           r"(?i)paged_?attention|reshape_and_cache|PagedKv|with_?paged_?kv|flashinfer"),
    Signal("FBGEMM embedding lookup", _K.RECOMMENDER,
           r"split_embedding|embedding_codegen|SplitLookupFunction|TableBatchedEmbedding|embedding_bag"),
    Signal("TorchRec sparse distribution", _K.RECOMMENDER,
           r"sparse_data_dist|KJT|KeyedJagged|All2All_(Pooled|Seq)|alltoall_(fwd|bwd)_single|all2all_data|"
           r"PooledEmbeddings|ShardedEmbedding|EmbeddingBagCollection|torchrec"),
    Signal("FBGEMM sparse ops", _K.RECOMMENDER,
           r"fbgemm(_gpu)?::\w*(jagged|sparse|permute|cumsum|bounds_check|pooled|keyed|segment)|jagged"),
    Signal("DeepEP dispatch/combine", _K.MOE, r"deep_ep::|dpsk::ep::"),
    Signal("expert routing / MoE layer", _K.MOE,
           r"(?i)(?<![a-z])moe(?![a-rt-z])|moe_|_moe|experts?(?![a-z])|expert_|token_(dispatch|permut|unpermut)|"
           r"TokenDispatcher|topk_softmax"),
    Signal("grouped GEMM", _K.MOE, r"(?i)grouped_?mm|grouped_?gemm|group_gemm"),
    Signal("MoE all-to-all function", _K.MOE, r"^_AllToAll(Backward)?$"),
    Signal("convolution", _K.VISION,
           r"^aten::(conv[123]d|cudnn_convolution|miopen_convolution|_convolution|convolution)$|"
           r"ConvolutionBackward|implicit_gemm|winograd|_fprop_|fprop_|scudnn|ImplicitGemmConvolution|"
           r"conv2d_|conv_fwd|conv_bwd|^igemm_(fwd|bwd|wrw)_|naive_conv|(?i:miopen\w*conv)"),
    Signal("pooling / batch norm", _K.VISION, r"(?i)max_?pool|avg_?pool|batch_?norm|bn_fw|bn_bw"),
    Signal("attention kernels", _K.LLM_TRAINING,
           r"(?i)flash_?attn|flash_fwd|flash_bwd|_flash_attention|scaled_dot_product|efficient_attention|fmha|"
           r"attn_fwd|attn_bwd|mha_fwd|mha_bwd|ring_attention"),
    Signal("transformer norms / rotary", _K.LLM_TRAINING, r"(?i)layer_?norm|rms_?norm|rotary"),
    Signal("Megatron / shardline annotations", _K.LLM_TRAINING,
           r"^sl:(pp|comm):|TransformerLayer|ColumnParallelLinear|RowParallelLinear|VocabParallel|megatron"),
    Signal("token embedding", _K.LLM_TRAINING, r"^aten::embedding$"),
    Signal("backward / optimizer", None,
           r"^autograd::engine|Backward\d*$|^Optimizer\.step|(?i:backward)|^sl:pp:[BW]:|_bwd_|_bwd$"),
)
#: Signals that only support a kind already evidenced by another of its signals (generic names).
_SUPPORTING = frozenset({"pooling / batch norm", "transformer norms / rotary",
                         "token embedding", "grouped GEMM"})

#: Names of enclosing intervals that say what an all-to-all is for (``re.search``).
_USE_PATTERNS: tuple[tuple[AllToAllUse, str], ...] = (
    (AllToAllUse.ULYSSES, r"(?i)_?SeqAllToAll|ulysses|DistributedAttention|all_to_all_[45]D|^sl:comm:cp:all_to_all$"),
    (AllToAllUse.EXPERT, r"(?i)deep_ep::|dpsk::ep::|^_AllToAll(Backward)?$|(?<![a-z])moe(?![a-rt-z])|moe_|_moe|"
                         r"experts?(?![a-z])|expert_|token_(dispatch|permut|unpermut)|TokenDispatcher|"
                         r"^sl:comm:ep:all_to_all$"),
    (AllToAllUse.EMBEDDING, r"alltoall_(fwd|bwd)_single|All2All_(Pooled|Seq)|KJT|all2all_data|sparse_data_dist|"
                            r"PooledEmbeddings|SequenceEmbeddings|EmbeddingsAllToAll|torchrec"),
)
_USES = (AllToAllUse.ULYSSES, AllToAllUse.EXPERT, AllToAllUse.EMBEDDING)
_DIM_USE = {"ep": AllToAllUse.EXPERT, "cp": AllToAllUse.ULYSSES}
_NAME_CHARS = 60
_SHOWN = 2
_WRAPPER = "autograd::engine::evaluate_function: "
_HIGH_EVENTS = 5


def _short(name: str) -> str:
    return name if len(name) <= _NAME_CHARS else name[:_NAME_CHARS - 1] + "…"


def _name_table(names: pd.Series, pattern: str) -> np.ndarray:
    """``re.search(pattern)`` of every category of ``names`` (a trailing False for a missing value)."""
    search = re.compile(pattern).search
    return np.array([search(t) is not None for t in category_texts(names.cat.categories)] + [False], dtype=bool)


def _is(events: pd.DataFrame, column: str, value: str) -> np.ndarray:
    """Boolean mask of the rows whose ``column`` is ``value`` (on the categories, not per row)."""
    return (events[column] == value).to_numpy(dtype=bool)


def _check(events) -> pd.DataFrame:
    if not isinstance(events, pd.DataFrame) or "name" not in events:
        raise ProfilingError(f"detect_workload: expected an events table, got {type(events).__name__}")
    names = events["name"]
    if not isinstance(names.dtype, pd.CategoricalDtype):
        events = events.assign(name=names.astype(str).astype("category"))
    return events


def _evidence(events: pd.DataFrame) -> dict[str, Evidence]:
    """Every signal that matched: its evidence (events over the whole table)."""
    names = events["name"]
    codes = codes_or_end(names)
    counts = np.bincount(codes, minlength=len(names.cat.categories) + 1)
    texts = [*category_texts(names.cat.categories), ""]
    found = {}
    for signal in SIGNALS:
        hit = _name_table(names, signal.pattern) & (counts > 0)
        if hit.any():
            # The names to show: the most frequent, the autograd engine's wrappers of a shown name left out.
            order = np.flatnonzero(hit)[np.lexsort(([len(texts[i]) for i in np.flatnonzero(hit)], -counts[hit]))]
            shown = [texts[i] for i in order if not texts[i].startswith(_WRAPPER)][:_SHOWN] or [texts[order[0]]]
            found[signal.label] = Evidence(signal.label, tuple(_short(t) for t in shown), int(counts[hit].sum()))
    return found


def _dims(events: pd.DataFrame) -> tuple[str, ...]:
    if "dim" not in events:
        return ()
    seen = {str(d) for d in events["dim"].unique()}
    return tuple(d for d in ("tp", "cp", "dp", "dp_cp", "pp", "ep") if d in seen)


def _decide(found: dict[str, Evidence]) -> tuple[WorkloadKind, Confidence, tuple[Evidence, ...],
                                                 tuple[WorkloadKind, ...]]:
    by_kind: dict[WorkloadKind, list[Evidence]] = {}
    for signal in SIGNALS:
        if signal.kind is not None and signal.label in found:
            by_kind.setdefault(signal.kind, []).append(found[signal.label])
    # A kind needs one of its decisive signals; the supporting ones (generic names) only add to it.
    decided = {k: v for k, v in by_kind.items() if any(e.label not in _SUPPORTING for e in v)}
    training = "backward / optimizer" in found
    kind = None
    for candidate in (_K.INFERENCE, _K.RECOMMENDER, _K.MOE):
        if candidate in decided:
            kind = candidate
            break
    if kind is None and _K.VISION in decided and "token embedding" not in found:
        kind = _K.VISION
    if kind is None and _K.LLM_TRAINING in decided:
        kind = _K.LLM_TRAINING if training else _K.INFERENCE
        if not training:  # forward-only transformer work: inference by elimination
            evidence = tuple(by_kind[_K.LLM_TRAINING]) + (Evidence("no backward ops", (), 0),)
            return kind, Confidence.LOW, evidence, _traits(decided, kind)
    if kind is None and _K.VISION in decided:
        kind = _K.VISION
    if kind is None:
        return _K.UNKNOWN, Confidence.LOW, (), ()
    evidence = tuple(by_kind[kind])
    strong = len(evidence) >= 2 and sum(e.events for e in evidence) >= _HIGH_EVENTS
    return kind, Confidence.HIGH if strong else Confidence.MEDIUM, evidence, _traits(decided, kind)


def _traits(decided, kind: WorkloadKind) -> tuple[WorkloadKind, ...]:
    # Only MoE is worth naming beside another kind (a served MoE model, a recommender with experts).
    return (_K.MOE,) if kind is not _K.MOE and _K.MOE in decided else ()


def _outermost_a2a(events: pd.DataFrame) -> pd.DataFrame:
    """The host-side all-to-all calls, the outermost of each thread's nested ones (``c10d::alltoall_base_``
    holds ``nccl:all_to_all``)."""
    rows = events[_is(events, "category", "all_to_all") & _is(events, "lane", "cpu")]
    if rows.empty:
        return rows
    keep = np.ones(len(rows), dtype=bool)
    start_all = rows["start_ns"].to_numpy()
    end_all = start_all + rows["dur_ns"].to_numpy()
    for positions in rows.reset_index(drop=True).groupby(["rank", "stream"], sort=False).indices.values():
        # By start, the longer first: a call is enclosed when an earlier one in that order ends at or after it.
        order = positions[np.lexsort((-end_all[positions], start_all[positions]))]
        reach = np.maximum.accumulate(end_all[order])
        enclosed = np.zeros(len(order), dtype=bool)
        enclosed[1:] = reach[:-1] >= end_all[order][1:]
        keep[order[enclosed]] = False
    return rows[keep]


def _innermost_use(calls: pd.DataFrame, events: pd.DataFrame, use_of_name: np.ndarray) -> tuple[np.ndarray,
                                                                                                 np.ndarray]:
    """Per call, the use of the innermost host interval on its thread that encloses it and names one (index
    into ``_USES``, -1 where none does), and that interval's name code (-1)."""
    out = np.full(len(calls), -1, dtype=np.int64)
    name_out = np.full(len(calls), -1, dtype=np.int64)
    codes = codes_or_end(events["name"])
    marked = (use_of_name[codes] >= 0) & _is(events, "lane", "cpu")
    if not marked.any():
        return out, name_out
    markers = events[marked].assign(_use=use_of_name[codes[marked]], _code=codes[marked],
                                    _end=lambda f: f["start_ns"] + f["dur_ns"])
    # Outer first, inner last: by start, then the longer first; the last enclosing one is the innermost.
    markers = markers.sort_values(["start_ns", "_end"], ascending=[True, False], kind="stable")
    by_thread = markers.groupby(["rank", "stream"], sort=False).indices
    call_start = calls["start_ns"].to_numpy()
    call_end = call_start + calls["dur_ns"].to_numpy()
    for key, positions in calls.reset_index(drop=True).groupby(["rank", "stream"], sort=False).indices.items():
        rows = by_thread.get(key)
        if rows is None:
            continue
        m_start = markers["start_ns"].to_numpy()[rows]
        m_end = markers["_end"].to_numpy()[rows]
        uses = markers["_use"].to_numpy()[rows]
        marker_codes = markers["_code"].to_numpy()[rows]
        for chunk in range(0, len(positions), 1024):
            at = positions[chunk:chunk + 1024]
            inside = (m_start[None, :] <= call_start[at, None]) & (m_end[None, :] >= call_end[at, None])
            last = inside.shape[1] - 1 - np.argmax(inside[:, ::-1], axis=1)
            out[at] = np.where(inside.any(axis=1), uses[last], -1)
            name_out[at] = np.where(inside.any(axis=1), marker_codes[last], -1)
    return out, name_out


def _all_to_all(events: pd.DataFrame, kind: WorkloadKind) -> tuple[AllToAllUse, tuple, tuple]:
    """The all-to-all's use (by calls), calls per use and the names that said so."""
    names = events["name"]
    use_table = np.full(len(names.cat.categories) + 1, -1, dtype=np.int64)
    for use, pattern in reversed(_USE_PATTERNS):  # the first pattern wins where several match
        use_table[_name_table(names, pattern)] = _USES.index(use)
    calls = _outermost_a2a(events)
    per_call, per_call_name = (_innermost_use(calls, events, use_table) if len(calls)
                               else (np.array([], dtype=np.int64), np.array([], dtype=np.int64)))
    if len(calls) and "dim" in calls:  # the call's own group: ep or cp
        dim_use = np.array([_USES.index(_DIM_USE[d]) if d in _DIM_USE else -1
                            for d in calls["dim"].astype(str)], dtype=np.int64)
        from_dim = (per_call < 0) & (dim_use >= 0)
        per_call = np.where(per_call >= 0, per_call, dim_use)
    else:
        from_dim = np.zeros(len(calls), dtype=bool)
    # Device kernels that name their use (DeepEP's): calls of their own (DeepEP launches them from its C++
    # extension, with no host-side collective op). A kernel that names nothing (NCCL's) is the launch of a host
    # call above; only in a trace without host calls (GPU-only) is it counted, as a call of unknown use.
    gpu = _is(events, "category", "all_to_all") & _is(events, "lane", "gpu")
    kernel_codes = codes_or_end(names)[gpu]
    kernel_use = use_table[kernel_codes]
    texts = [*category_texts(names.cat.categories), ""]
    named: list[tuple[AllToAllUse, str]] = []
    counts = {use: 0 for use in AllToAllUse}
    for index, use in enumerate(_USES):
        on_host, on_device = per_call == index, kernel_use == index
        n = int(on_host.sum() + on_device.sum())
        if not n:
            continue
        counts[use] += n
        words = []
        inside = pd.Series(per_call_name[on_host & ~from_dim]).value_counts().index[:_SHOWN]
        if len(inside):
            words.append("inside " + ", ".join(_short(texts[c]) for c in inside))
        if (on_host & from_dim).any():
            dims = sorted(set(calls["dim"].astype(str).to_numpy()[on_host & from_dim]))
            words.append(f"on a {'/'.join(dims)} group")
        kernels = pd.Series(kernel_codes[on_device]).value_counts().index[:_SHOWN]
        if len(kernels):
            words.append("kernels " + ", ".join(_short(texts[c]) for c in kernels))
        named.append((use, "; ".join(words)))
    unnamed = int((per_call < 0).sum()) if len(calls) else int((kernel_use < 0).sum())
    fallback = {_K.RECOMMENDER: AllToAllUse.EMBEDDING, _K.MOE: AllToAllUse.EXPERT}.get(kind)
    if unnamed and fallback is not None:
        counts[fallback] += unnamed
        old = dict(named).get(fallback, "")
        note = f"{unnamed} with no naming context, taken from the workload ({kind.value})"
        named = [(u, w) for u, w in named if u is not fallback] + [(fallback, f"{old}; {note}" if old else note)]
    elif unnamed:
        counts[AllToAllUse.UNKNOWN] += unnamed
    calls_per_use = tuple((use, n) for use, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n)
    if not calls_per_use:
        return AllToAllUse.UNKNOWN, (), ()
    return calls_per_use[0][0], calls_per_use, tuple(named)


def detect_workload(events: pd.DataFrame) -> Workload:
    """The :class:`Workload` of a classified events table (``load(...).events``, ``Attribution.events``).

    Raises ``ProfilingError`` when ``events`` is not an events table."""
    events = _check(events)
    found = _evidence(events)
    kind, confidence, evidence, traits = _decide(found)
    use, calls, named = _all_to_all(events, kind) if "category" in events else (AllToAllUse.UNKNOWN, (), ())
    return Workload(kind=kind, confidence=confidence, evidence=evidence, traits=traits, dims=_dims(events),
                    training="backward / optimizer" in found, all_to_all=use, all_to_all_calls=calls,
                    all_to_all_evidence=named)
