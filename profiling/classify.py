"""Label every row of the events table with its ``category`` and, for communication, its parallel ``dim``.

Communication is recognised by evidence, strongest first:

1. the collective name and process-group args (``collective``, ``pg_*`` columns) on the row itself;
2. for a GPU kernel, the same args on its CPU op (``launching_op``, public: every analysis that needs a
   kernel's op asks it): the innermost communication op / ``nccl:*`` / ``gloo:*`` / ``sl:comm:*`` annotation
   that contains the kernel's launch (kernel.correlation == launch.correlation, launch inside the op on the
   same thread), else the ``record_param_comms`` op with the kernel's External id;
3. the kernel's own name (all three NCCL generations, RCCL ``Generic``) and the user-extensible ``CommRule`` list.

Only kernels that are communication by name or rule take a category from 2: a copy kernel launched inside an
all-to-all stays compute. A generic kernel (``SendRecv`` used for all-to-all, RCCL ``Generic``, a NCCL >= 2.19
``ncclDevKernel_*``) is named by what the op says, where HTA would go by the kernel name alone.

Everything else: memcpy by direction (h2d / d2h / d2d), memset, sync (host-side synchronize calls and the GPU
``cuda_sync`` markers), and compute otherwise. ``idle`` is never assigned here; attribution creates it.

``dim`` (communication rows only): from the process-group description (ours ``sl:tp``; torch DeviceMesh
``mesh_tp``; Megatron ``TENSOR_MODEL_PARALLEL_GROUP``, and ``MODEL_PARALLEL_GROUP`` = tp x pp = ``mp``;
``default_pg`` is the world), else from the group's ranks or size against a ``layout`` ``dict(tp=, cp=, dp=,
pp=)`` (rank order tp fastest, then cp, dp, pp; ranks spanning exactly the tp x pp ranks of one (cp, dp)
coordinate are ``mp``, cp x dp is ``dp_cp``), else ``unknown`` (e.g. Megatron's
``TENSOR_AND_DATA_PARALLEL_GROUP``, which no single dimension names). All matching runs on unique
names/descriptions and is broadcast back.
"""

from __future__ import annotations

import collections
import enum
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

import shardline.job.annotations as contract
from shardline.job import placement
from shardline.profiling.errors import ClassificationError
from shardline.profiling.schema import (
    COMM_CATEGORIES,
    P2P_CATEGORIES,
    category_texts,
    check_events,
    codes_or_end,
    empty_texts,
    per_category_table,
    sorted_categorical,
)


class Category(str, enum.Enum):
    """Our event categories (``schema.CATEGORIES``); the value is the string stored in the table."""

    COMPUTE = "compute"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    P2P_SEND = "p2p_send"
    P2P_RECV = "p2p_recv"
    BARRIER = "barrier"
    OTHER_COMM = "other_comm"
    MEMCPY_H2D = "memcpy_h2d"
    MEMCPY_D2H = "memcpy_d2h"
    MEMCPY_D2D = "memcpy_d2d"
    MEMSET = "memset"
    SYNC = "sync"
    IDLE = "idle"


class Lane(str, enum.Enum):
    """Lane kind of the events table (``lane`` column), and the kind a rank is attributed on."""

    GPU = "gpu"
    CPU = "cpu"


UNKNOWN_DIM = "unknown"


@dataclass(frozen=True)
class CommRule:
    """A communication kernel the NCCL name patterns do not know: ``pattern`` (regex, searched in the name).

    ``literals`` (optional): substrings of which every name the pattern matches contains at least one. The
    classifier then runs the regex only on names holding one of them (kernel names run to hundreds of
    characters, and an unanchored search through each is the slow part of classifying); empty: always run it.
    """

    pattern: str
    category: Category
    note: str = ""
    literals: tuple[str, ...] = ()

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ClassificationError(f"CommRule pattern {self.pattern!r} is not a valid regex: {exc}") from None
        if Category(self.category).value not in COMM_CATEGORIES:
            raise ClassificationError(f"CommRule {self.pattern!r}: category {self.category!r} is not a "
                                      f"communication category {COMM_CATEGORIES}")


#: Non-NCCL communication kernels. First match wins; extend with ``classify_events(..., rules=DEFAULT_RULES+...)``
#: (or ``shardline profile report --rules FILE``). Each rule's source, with real names, is in tests/profiling/
#: test_comm_coverage.py.
DEFAULT_RULES: tuple[CommRule, ...] = (
    # DeepEP (deepseek-ai/DeepEP csrc/kernels/{intranode,internode,internode_ll}.cu; DeepSeek's own profiles name
    # the same kernels dpsk::ep::...): expert-parallel all-to-all. The layout kernel (get_dispatch_layout) and
    # the buffer cleaner are local work and stay compute.
    CommRule(r"(deep_ep|dpsk::ep)::\w+::(cached_notify|notify_dispatch|notify_combine|dispatch|combine)",
             Category.ALL_TO_ALL, "DeepEP expert dispatch/combine", ("deep_ep::", "dpsk::ep::")),
    CommRule(r"userbuffers.*(_rs|reducescatter|reduce_scatter)", Category.REDUCE_SCATTER, "TE userbuffers RS",
             ("userbuffers",)),
    CommRule(r"userbuffers.*(_ag|allgather|all_gather)", Category.ALL_GATHER, "TE userbuffers AG",
             ("userbuffers",)),
    CommRule(r"userbuffers|kuserbuffers", Category.OTHER_COMM, "TE userbuffers p2p/other", ("userbuffers",)),
    CommRule(r"cross_device_reduce_[12]stage", Category.ALL_REDUCE, "vLLM custom all-reduce",
             ("cross_device_reduce_",)),
    CommRule(r"(one|two)ShotAllReduce|allReduce\w*Kernel|lamport\w*AllReduce", Category.ALL_REDUCE,
             "TensorRT-LLM custom all-reduce", ("llReduce",)),
    CommRule(r"(one|two)shotAllreduce\w*Kernel", Category.ALL_REDUCE, "TensorRT-LLM MNNVL all-reduce",
             ("shotAllreduce",)),
    CommRule(r"allreduce_fusion_kernel_(oneshot|twoshot|1stage|2stage)", Category.ALL_REDUCE,
             "FlashInfer / TensorRT-LLM / AITER fused all-reduce", ("allreduce_fusion_kernel_",)),
    CommRule(r"(one_shot|two_shot|multimem)_all_reduce", Category.ALL_REDUCE, "torch symmetric memory",
             ("_all_reduce",)),
    CommRule(r"multimem_all_gather", Category.ALL_GATHER, "torch symmetric memory", ("multimem_all_gather",)),
    CommRule(r"allreduce_(one_shot|two_shot|double_tree)", Category.ALL_REDUCE,
             "Triton-distributed symmetric-memory all-reduce", ("allreduce_",)),
    CommRule(r"rcclGenericKernel", Category.OTHER_COMM, "RCCL generic kernel (the op names the collective)",
             ("rcclGenericKernel",)),
    CommRule(r"mscclKernel_", Category.OTHER_COMM, "MSCCL / RCCL-MSCCL kernel (the op names the collective)",
             ("mscclKernel_",)),
    # NVSHMEM host-initiated (on-stream) collectives, rocSHMEM's too.
    CommRule(r"alltoall\w*_on_stream_kernel", Category.ALL_TO_ALL, "NVSHMEM alltoall", ("_on_stream_kernel",)),
    CommRule(r"fcollect\w*_on_stream_kernel", Category.ALL_GATHER, "NVSHMEM fcollect", ("_on_stream_kernel",)),
    CommRule(r"broadcast\w*_on_stream_kernel", Category.BROADCAST, "NVSHMEM broadcast", ("_on_stream_kernel",)),
    CommRule(r"reducescatter\w*_on_stream_kernel", Category.REDUCE_SCATTER, "NVSHMEM reducescatter",
             ("_on_stream_kernel",)),
    CommRule(r"(rdxn|reduce)\w*_on_stream_kernel", Category.ALL_REDUCE, "NVSHMEM / rocSHMEM reduction (every PE "
             "gets the result)", ("_on_stream_kernel",)),
    CommRule(r"(barrier|sync)\w*_on_stream_kernel", Category.BARRIER, "NVSHMEM barrier / sync",
             ("_on_stream_kernel",)),
)

# Operation words (NCCL kernel op, torch collective names, annotation suffixes) -> category. Keys are the
# lower-cased word with "_" removed, so "AllReduce", "all_reduce" and "allreduce" meet.
_OP_WORDS = {
    "allreduce": Category.ALL_REDUCE, "allreducecoalesced": Category.ALL_REDUCE,
    "allgather": Category.ALL_GATHER, "allgatherbase": Category.ALL_GATHER,
    "allgatherintotensor": Category.ALL_GATHER, "allgatherintotensorcoalesced": Category.ALL_GATHER,
    "allgathercoalesced": Category.ALL_GATHER, "allgathertensorcoalesced": Category.ALL_GATHER,
    "reducescatter": Category.REDUCE_SCATTER, "reducescatterbase": Category.REDUCE_SCATTER,
    "reducescattertensor": Category.REDUCE_SCATTER, "reducescattertensorcoalesced": Category.REDUCE_SCATTER,
    "alltoall": Category.ALL_TO_ALL, "alltoallbase": Category.ALL_TO_ALL, "alltoallv": Category.ALL_TO_ALL,
    "alltoallsingle": Category.ALL_TO_ALL,
    "broadcast": Category.BROADCAST, "broadcastcoalesced": Category.BROADCAST,
    "send": Category.P2P_SEND, "isend": Category.P2P_SEND, "p2psend": Category.P2P_SEND,
    "recv": Category.P2P_RECV, "irecv": Category.P2P_RECV, "recvanysource": Category.P2P_RECV,
    "p2precv": Category.P2P_RECV,
    "barrier": Category.BARRIER, "monitoredbarrier": Category.BARRIER,
    "reduce": Category.OTHER_COMM, "gather": Category.OTHER_COMM, "scatter": Category.OTHER_COMM,
    "coalesced": Category.OTHER_COMM, "sendrecv": Category.OTHER_COMM, "generic": Category.OTHER_COMM,
    # Ascend HCCL task names (hcom_allReduce_, hcom_receive_, hcom_alltoallvc_)
    "receive": Category.P2P_RECV, "alltoallvc": Category.ALL_TO_ALL,
}

# NCCL kernels: ncclKernel_<Op>_..., ncclDevKernel_<Op>_... / ncclDevKernel_<Op>(...), the NCCL >= 2.27 symmetric
# kernels ncclSymkDevKernel_<Op>_<algo>..., in any case (nccldevkernel_*), plain RCCL/NCCL "ncclKernel_SendRecv".
# The op word decides; SendRecv/Generic are "other_comm" until an op says more. Ascend HCCL tasks: hcom_<op>_...
_NCCL_KERNEL_RE = re.compile(r"^(?:void\s+)?(?i:nccl(?:symk?)?(?:dev)?kernel_)([A-Za-z]+)")
_HCCL_RE = re.compile(r"^hcom_([A-Za-z]+)_")
_ANNOTATION_RE = re.compile(r"^(?:nccl|gloo|ucc|mpi):(\w+)")
_C10D_RE = re.compile(r"^c10d::(\w+?)_?$")
# CUDA/Kineto copies, ROCm SDMA copies (CopyHostToDevice...), rocprofiler-sdk's MEMORY_COPY_<direction> (ROCm 7)
# and the ROCclr blit kernels (__amd_rocclr_copyBuffer*, copies between device buffers).
_MEMCPY_RE = re.compile(r"^Memcpy\s*(HtoD|DtoH|DtoD|PtoP|HtoH)|^(CopyHostToDevice|CopyDeviceToHost|"
                        r"CopyDeviceToDevice)|^(?:ROCPROFILER_)?MEMORY_COPY_(HOST_TO_DEVICE|DEVICE_TO_HOST|"
                        r"DEVICE_TO_DEVICE|HOST_TO_HOST|PEER_TO_PEER)|^(?:void\s+)?(__amd_rocclr_copy)")
_MEMSET_RE = re.compile(r"^(Memset|FillBuffer|(?:void\s+)?__amd_rocclr_fillBuffer|MEMORY_SET)")
_SYNC_RE = re.compile(r"^(cuda|hip)(DeviceSynchronize|StreamSynchronize|EventSynchronize|StreamWaitEvent)$|"
                      r"^(Context Sync|Stream Sync|Event Sync|Stream Wait Event)$")
#: Every name-anchored pattern of ``name_category`` in one alternation: a name it does not match can only
#: be communication through a rule.
_ANCHORED = re.compile("|".join(f"(?:{p.pattern})" for p in (
    _NCCL_KERNEL_RE, _HCCL_RE, _ANNOTATION_RE, _C10D_RE, re.compile(r"^record_param_comms$"), contract.COMM_RE,
    _MEMCPY_RE, _MEMSET_RE, _SYNC_RE)))
#: A communication word in a kernel name: such a kernel launched inside a communication op takes the op's
#: collective (a library no rule knows yet, e.g. ``my_allgather_gemm_kernel`` under ``nccl:_all_gather_base``).
COMM_WORD_RE = re.compile(r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|send|recv|"
                          r"nccl|rccl|hccl|msccl|nvshmem|rocshmem|multimem|symm_?mem|p2p|dispatch|combine|"
                          r"barrier|lamport|fcollect")


def _spellings(alternative: str) -> list[str]:
    """The literal texts one alternative of ``COMM_WORD_RE`` matches: letters and digits, ``_?`` between them."""
    if not re.fullmatch(r"[a-z0-9]+(?:_\?[a-z0-9]+)*", alternative):
        raise ValueError(f"COMM_WORD_RE alternative {alternative!r} is not words joined by '_?'")
    words = alternative.split("_?")
    out = [words[0]]
    for word in words[1:]:
        out = [head + sep + word for head in out for sep in ("", "_")]
    return out


#: Every text ``COMM_WORD_RE`` matches, spelled out (it matches nothing else: words joined by optional ``_``).
_COMM_WORDS = tuple(text for alternative in COMM_WORD_RE.pattern.split("|") for text in _spellings(alternative))
#: The CPU ops whose copies are the collective itself: NCCL >= 2.28 runs some collectives on the copy engines,
#: and they appear as memcpy launched inside the ``nccl:*`` op.
_CE_OP_RE = r"^(nccl|rccl):"
_MEMCPY_KIND = {"HtoD": Category.MEMCPY_H2D, "CopyHostToDevice": Category.MEMCPY_H2D,
                "DtoH": Category.MEMCPY_D2H, "CopyDeviceToHost": Category.MEMCPY_D2H,
                "DtoD": Category.MEMCPY_D2D, "PtoP": Category.MEMCPY_D2D, "CopyDeviceToDevice": Category.MEMCPY_D2D,
                "HtoH": Category.MEMCPY_D2D, "HOST_TO_DEVICE": Category.MEMCPY_H2D,
                "DEVICE_TO_HOST": Category.MEMCPY_D2H, "DEVICE_TO_DEVICE": Category.MEMCPY_D2D,
                "HOST_TO_HOST": Category.MEMCPY_D2D, "PEER_TO_PEER": Category.MEMCPY_D2D,
                "__amd_rocclr_copy": Category.MEMCPY_D2D}

_COMM = frozenset(COMM_CATEGORIES)


def op_category(word: str) -> str:
    """Category of a collective's name in any spelling ("allreduce", "_allgather_base", "AllToAll"); "" if none."""
    key = word.lower().replace("_", "")
    hit = _OP_WORDS.get(key)
    return hit.value if hit is not None else ""


def name_category(name: str, *, rules: Sequence[CommRule] = DEFAULT_RULES) -> tuple[str, bool]:
    """(category, is_comm_kernel_name) of one event name, from the name alone."""
    if not _ANCHORED.match(name) and not any(
            any(text in name for text in literals) if (literals := getattr(rule, "literals", ())) else
            re.search(rule.pattern, name)
            for rule in rules):
        return Category.COMPUTE.value, False  # most names: no pattern below can match
    for pattern, source in ((_NCCL_KERNEL_RE, "kernel"), (_HCCL_RE, "kernel"), (_ANNOTATION_RE, "annotation"),
                            (_C10D_RE, "c10d")):
        hit = pattern.match(name)
        if hit:
            category = op_category(hit.group(1))
            if category or source == "kernel":  # an unknown NCCL kernel op is still communication
                return (category or Category.OTHER_COMM.value), source == "kernel"
    if name == "record_param_comms":  # torch's comm marker; its collective arg (evidence 1) is more precise
        return Category.OTHER_COMM.value, False
    hit = contract.COMM_RE.match(name)
    if hit:
        return (op_category(hit.group("op")) or _memcpy_op(hit.group("op")) or Category.OTHER_COMM.value), False
    for rule in rules:
        if re.search(rule.pattern, name):
            return Category(rule.category).value, True
    hit = _MEMCPY_RE.match(name)
    if hit:
        return _MEMCPY_KIND[next(g for g in hit.groups() if g)].value, False
    if _MEMSET_RE.match(name):
        return Category.MEMSET.value, False
    if _SYNC_RE.match(name):
        return Category.SYNC.value, False
    return Category.COMPUTE.value, False


def name_categories(names: list[str], *, rules: Sequence[CommRule] = DEFAULT_RULES) -> list[tuple[str, bool]]:
    """``name_category`` of every name, with the literal prefilter run over all names at once: each rule's
    literals are searched in one joined text (a C scan per literal, not a Python test per name and rule), so
    only names that may match anything reach ``name_category``."""
    possible = np.array([_ANCHORED.match(name) is not None for name in names], dtype=bool)
    starts = np.cumsum([0] + [len(name) + 1 for name in names])
    # A hit spanning two names (a literal holding a newline) only costs an exact check: false hits are harmless.
    joined = "\n".join(names)
    for rule in rules:
        literals = getattr(rule, "literals", ())
        if not literals:
            possible |= np.array([re.search(rule.pattern, name) is not None for name in names], dtype=bool)
            continue
        for text in literals:
            _mark_names_containing(possible, joined, starts, text)
    compute = (Category.COMPUTE.value, False)
    return [name_category(name, rules=rules) if maybe else compute for name, maybe in zip(names, possible.tolist())]


def _mark_names_containing(marks: np.ndarray, joined: str, starts: np.ndarray, text: str) -> None:
    """Set ``marks[i]`` for every name ``i`` of ``joined`` (the names joined by newlines, name ``i`` starting at
    ``starts[i]``) that contains ``text``: ``str.find`` scans (several times faster than a regular expression's
    search for a literal), resuming at the next name after each hit, so the loop runs once per matching name."""
    at = joined.find(text)
    while at >= 0:
        name = int(np.searchsorted(starts, at, side="right")) - 1
        marks[name] = True
        at = joined.find(text, int(starts[name + 1]) if name + 1 < len(starts) else len(joined))


def _memcpy_op(op: str) -> str:
    return op if op in (Category.MEMCPY_H2D.value, Category.MEMCPY_D2H.value) else ""


# --- parallel dimension -------------------------------------------------------------------------------------

# Lower-cased group descriptions of other frameworks -> our dims. torch DeviceMesh names groups
# "mesh_<dim name>" (torchtitan: pp, dp_replicate, dp_shard, cp, tp, ep, flattened dp / dp_cp / dp_shard_cp);
# Megatron-core passes group_desc="TENSOR_MODEL_PARALLEL_GROUP" and friends.
_DESC_DIMS = (
    (re.compile(r"^(mesh_)?(tp|tensor_parallel)$|^tensor_model_parallel_group$|^expert_tensor_parallel_group$"),
     "tp"),
    (re.compile(r"^(mesh_)?(pp|pipeline_parallel)$|^pipeline_model_parallel_group$"), "pp"),
    (re.compile(r"^(mesh_)?cp$|^context_parallel_group$"), "cp"),
    (re.compile(r"^(mesh_)?(ep|expert_parallel)$|^expert_model_parallel_group$"), "ep"),
    (re.compile(r"^(mesh_)?(dp_cp|dp_shard_cp)$|^data_parallel_group_with_cp$"), "dp_cp"),
    (re.compile(r"^(mesh_)?(dp|dp_shard|dp_replicate|fsdp|hsdp|ddp)$|^data_parallel_group$|"
                r"^expert_data_parallel_group$"), "dp"),
    (re.compile(r"^(mesh_)?mp$|^model_parallel_group$"), "mp"),  # Megatron's tp x pp group (grid.py's "mp")
    (re.compile(r"^(embedding_group|position_embedding_group)$"), "embed"),
    (re.compile(r"^default_pg$"), "world"),
)


def desc_dim(desc: str) -> str:
    """Parallel dimension named by one process-group description, or "" when the name says nothing."""
    hit = contract.GROUP_DESC_RE.match(desc)
    if hit:
        return hit.group("axis")
    low = desc.lower()
    for pattern, dim in _DESC_DIMS:
        if pattern.match(low):
            return dim
    return ""


def layout_dim(ranks_text: str, *, size: int, layout: Mapping[str, int]) -> str:
    """Dimension of a group from its ranks (or only its size) in ``layout``, by :mod:`shardline.job.placement`'s
    rank order (tp fastest, then cp, dp, pp)."""
    axes = [a for a in placement.AXES if int(layout.get(a, 1)) > 1]
    degrees = {a: int(layout.get(a, 1)) for a in placement.AXES}
    world = int(np.prod(list(degrees.values())))
    ranks = [int(r) for r in re.findall(r"-?\d+", ranks_text)] if ranks_text else []
    if ranks:
        size = len(ranks)
        if size == world:
            return "world"
        varying = placement.varying_axes(ranks, degrees)  # the training side's own rank order
        if varying == ["cp", "dp"]:
            return "dp_cp"
        if varying == ["tp", "pp"] and size == degrees["tp"] * degrees["pp"]:
            return "mp"  # every tp and pp rank of one (cp, dp) coordinate: Megatron's MODEL_PARALLEL_GROUP
        return varying[0] if len(varying) == 1 else UNKNOWN_DIM
    if size == world and size > 1:
        return "world"
    matches = [a for a in axes if degrees[a] == size]
    return matches[0] if len(matches) == 1 else UNKNOWN_DIM


# --- the table-level pass -----------------------------------------------------------------------------------

_FILL_COLUMNS = ("collective", "pg_name", "pg_desc", "pg_ranks", "pg_size", "seq", "msg_bytes")


def classify_events(events: pd.DataFrame, *, rules: Sequence[CommRule] | None = None,
                    layout: Mapping[str, int] | None = None) -> pd.DataFrame:
    """Return a copy of ``events`` with ``category`` and ``dim`` filled (see the module docstring).

    A communication kernel linked to its CPU op also receives the op's ``collective`` / ``pg_*`` / ``seq`` /
    ``msg_bytes`` where its own are missing, so cross-rank matching can work on kernels.
    """
    _check_input(events, layout)
    out = events.copy()
    if out.empty:
        return out
    _label(out, rules=DEFAULT_RULES if rules is None else tuple(rules), layout=layout)
    return out


def classify_in_place(events: pd.DataFrame, *, rules: Sequence[CommRule] | None = None,
                      layout: Mapping[str, int] | None = None) -> pd.DataFrame:
    """``classify_events`` without the copy: fills ``category``/``dim`` (and the linked kernels' group
    columns) of ``events`` itself and returns it. For a table nobody else holds, e.g. inside ``load``."""
    _check_input(events, layout)
    if len(events):
        _label(events, rules=DEFAULT_RULES if rules is None else tuple(rules), layout=layout)
    return events


def assign_dims(events: pd.DataFrame, *, layout: Mapping[str, int] | None) -> pd.DataFrame:
    """A copy of a classified ``events`` table whose ``dim`` column is derived again for ``layout`` (the
    other columns are shared, not copied): what ``classify_events(events, layout=layout)`` would give, without
    classifying every row again (a layout changes only the dims of the groups that say none themselves)."""
    _check_input(events, layout)
    out = events.copy(deep=False)
    if len(out):
        category = codes_or_end(out["category"])
        to_ours = np.array([_CAT_CODE.get(c, _NO_CAT) for c in category_texts(out["category"].cat.categories)]
                           + [_NO_CAT], dtype=np.int8)
        out["dim"] = _dims(out, to_ours[category], layout)
    return out


def check_layout(layout: Mapping[str, int]) -> None:
    """Refuse a layout that is not a mapping of tp/cp/dp/pp to degrees >= 1, naming the bad entries."""
    if not isinstance(layout, Mapping):
        raise ClassificationError(f"layout={layout!r} must be a mapping such as dict(tp=2, dp=4)")
    bad = {k: v for k, v in layout.items() if k not in ("tp", "cp", "dp", "pp") or _degree(v) < 1}
    if bad:
        raise ClassificationError(f"layout entries {bad} are invalid: keys tp/cp/dp/pp, degrees >= 1")


def _degree(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _check_input(events, layout) -> None:
    if not isinstance(events, pd.DataFrame):
        raise ClassificationError(f"classify_events expects an events DataFrame, got {type(events).__name__}")
    try:
        check_events(events)
    except ValueError as exc:
        raise ClassificationError(str(exc)) from None
    if layout is not None:
        check_layout(layout)


#: Category strings by code; the per-row work runs on these small int codes, never on per-row strings.
_CAT_NAMES = tuple(c.value for c in Category)
_CAT_CODE = {name: i for i, name in enumerate(_CAT_NAMES)}
_NO_CAT = len(_CAT_NAMES)  # "": no category from this evidence
_COMM_CODES = np.array([name in COMM_CATEGORIES for name in _CAT_NAMES] + [False], dtype=bool)
_P2P_CODES = np.array([name in P2P_CATEGORIES for name in _CAT_NAMES] + [False], dtype=bool)


def _label(out: pd.DataFrame, *, rules: tuple, layout) -> None:
    """Fill ``category`` and ``dim`` of a non-empty, schema-checked table in place."""
    texts = [*category_texts(out["name"].cat.categories), ""]
    names = name_categories(texts, rules=rules)
    name_cat = np.array([_CAT_CODE[c] for c, _ in names], dtype=np.int8)
    name_kernel = np.array([k for _, k in names], dtype=bool)
    # Not communication by name, but may inherit a launching op's collective: a communication word in the
    # name, or a device-to-device copy (copy-engine collectives).
    name_codes = codes_or_end(out["name"])
    gpu = (out["lane"] == Lane.GPU.value).to_numpy()
    # Only a GPU row inherits: the words are looked for in the names GPU rows use (most names are CPU ops').
    gpu_names = np.flatnonzero(np.bincount(name_codes[gpu], minlength=len(texts)))
    name_word = np.zeros(len(texts), dtype=bool)
    name_word[gpu_names] = comm_word_table([texts[i] for i in gpu_names.tolist()])
    name_word &= ~_COMM_CODES[name_cat]
    name_copy = name_cat == _CAT_CODE[Category.MEMCPY_D2D.value]
    category = name_cat[name_codes]
    is_comm_kernel = name_kernel[name_codes] & gpu
    inherits = (name_word | name_copy)[name_codes] & gpu

    # Evidence 1: the row's own collective arg.
    own_table = np.array([_CAT_CODE.get(c, _NO_CAT) for c in _per_category(out["collective"], op_category)],
                         dtype=np.int8)
    own = own_table[codes_or_end(out["collective"])]
    has_own = own != _NO_CAT
    category[has_own] = own[has_own]
    del own

    # Evidence 2: the CPU op of a communication kernel, or of a kernel that inherits its op's collective.
    linked, link_idx = _link_kernels_to_ops(out, category, (is_comm_kernel | inherits) & ~has_own)
    copies = np.flatnonzero(inherits & (link_idx >= 0) & name_copy[name_codes])
    if len(copies):  # a copy inherits only from the nccl:* op itself (not from a c10d op that also flattens)
        ce_op = match_table(out["name"], _CE_OP_RE)[name_codes[link_idx[copies]]]
        link_idx[copies[~ce_op]] = -1
        linked[copies[~ce_op]] = _NO_CAT
    del name_codes
    take = linked != _NO_CAT
    category[take] = linked[take]
    del linked, take, is_comm_kernel, has_own, inherits
    out["category"] = sorted_categorical(category, _CAT_NAMES)
    _fill_from_ops(out, link_idx)
    launched = np.zeros(len(out), dtype=bool)  # the ops that launched a GPU communication kernel: NCCL's calls
    launched[link_idx[link_idx >= 0]] = True
    del link_idx
    for _ in range(3):  # c10d op > record_param_comms > nccl:* / gloo:*, filled from the inside out
        inner = _link_outer_ops(out, category)
        if not (inner >= 0).any():
            break
        _fill_from_ops(out, inner)
    posted, relabelled = _link_worker_spans(out, category, launched)  # a gloo:* run on a worker thread: its post
    if relabelled is not category:
        category = relabelled
        out["category"] = sorted_categorical(category, _CAT_NAMES)
    _fill_from_ops(out, posted)
    out["dim"] = _dims(out, category, layout)


def comm_word_table(texts: list[str]) -> np.ndarray:
    """Does each name carry a communication word (``COMM_WORD_RE``, any case)? One C scan of the joined,
    lower-cased names (a case-sensitive scan is several times faster than an ignore-case one)."""
    out = np.zeros(len(texts), dtype=bool)
    if not texts:
        return out
    starts = np.cumsum([0] + [len(t) + 1 for t in texts])
    joined = "\n".join(texts)
    lowered = joined.lower()
    if len(lowered) == len(joined):
        for word in _COMM_WORDS:  # the pattern's words, each found by a str.find scan
            _mark_names_containing(out, lowered, starts, word)
    else:  # a character whose lower case is longer (İ) would shift the offsets
        at = [hit.start() for hit in re.finditer(COMM_WORD_RE.pattern, joined, re.IGNORECASE)]
        if at:
            out[np.searchsorted(starts, at, side="right") - 1] = True
    return out


def _per_category(column: pd.Series, fn) -> list:
    """``fn`` of every category of a categorical column, then of "" (the slot a missing value maps to)."""
    return [fn(value) for value in [*category_texts(column.cat.categories), ""]]


def match_names(column: pd.Series, pattern: str) -> np.ndarray:
    """Boolean mask: does each value of a categorical column match ``pattern`` (``re.match``), computed on
    the unique values and broadcast."""
    return match_table(column, pattern)[codes_or_end(column)]


def match_table(column: pd.Series, pattern: str) -> np.ndarray:
    """``match_names`` per category (one extra trailing False for a missing value), to index with codes."""
    def build(texts):
        match = re.compile(pattern).match
        return np.array([match(t) is not None for t in texts] + [False], dtype=bool)

    return per_category_table(column, ("match", pattern), build)


def _link_kernels_to_ops(ev: pd.DataFrame, category: np.ndarray, want: np.ndarray):
    """For rows in ``want``: (category code of the linked CPU comm op or ``_NO_CAT``, index of that op row
    or -1). ``category`` holds the rows' category codes; the op is ``launching_op``'s among the CPU comm rows,
    one with a specific category (not other_comm) preferred."""
    result = np.full(len(ev), _NO_CAT, dtype=np.int8)
    link = np.full(len(ev), -1, dtype=np.int64)
    if not want.any():
        return result, link
    ops = np.flatnonzero((ev["lane"] == Lane.CPU.value).to_numpy() & _COMM_CODES[category])
    rows = np.flatnonzero(want)
    link[rows] = launching_op(ev, ops=ops, rows=rows, prefer=category != _CAT_CODE[Category.OTHER_COMM.value])
    linked = link >= 0
    result[linked] = category[link[linked]]
    return result, link


def launch_rows(events: pd.DataFrame, rows=None) -> np.ndarray:
    """For each of ``rows`` (positions in ``events`` or a boolean mask; default every row): the position of
    the row that launched it -- the first CPU row of its rank with its correlation id (the runtime call that
    Kineto's ``ac2g`` flow joins to a kernel, memcpy or memset) -- or -1 (no correlation id, no such row)."""
    rows = _positions(rows, len(events))
    out = np.full(len(rows), -1, dtype=np.int64)
    corr = events["correlation"].to_numpy()
    rows_with = np.flatnonzero(corr[rows] >= 0)
    if len(rows_with):
        launches = np.flatnonzero((events["lane"] == Lane.CPU.value).to_numpy() & (corr >= 0))
        out[rows_with] = _row_by_key(launches, events["rank"].to_numpy(), corr, queries=rows[rows_with],
                                     keep="first")
    return out


def launching_op(events: pd.DataFrame, *, ops, rows=None, prefer=None) -> np.ndarray:
    """For each of ``rows`` (positions in ``events`` or a boolean mask; default every row), the position of the
    op among ``ops`` (CPU rows: positions or a mask) that launched it -- the op it belongs to -- or -1. By
    evidence, strongest first:

    1. its launch: a GPU row's is ``launch_rows``'s, a CPU row is its own (so a CPU row among ``ops`` is its own
       op). The op is the innermost of ``ops`` holding the launch on its thread: same rank and stream,
       ``op.start <= launch.start`` and ``launch.end <= op.end``; of ops that start together the shorter is the
       inner one. ``prefer`` (a boolean per events row): the innermost preferred op holding the launch wins
       over inner ones that are not preferred; ops that are not are tried only where no preferred one holds it.
    2. where that finds none, its External id (recent Kineto gives a kernel its launching op's): the last op of
       its rank with that id, if it began no later than the row (old Kineto reuses a kernel's correlation id
       as its External id, which can equal a later op's).

    Every caller that needs "the op of this kernel" asks here: the classifier (a kernel's collective and group
    from its comm op), calibration (a GEMM's shapes), ``collective_bandwidth`` (a call's size args) and
    ``report_sections.comm_coverage``. Vectorised: a sorted search per (rank, thread) holding ops, then a walk
    back over the earlier ops only while one of them still reaches the launch."""
    rows = _positions(rows, len(events))
    ops = np.unique(_positions(ops, len(events)))
    out = np.full(len(rows), -1, dtype=np.int64)
    if not len(rows) or not len(ops):
        return out
    rank, stream = events["rank"].to_numpy(), events["stream"].to_numpy()
    start = events["start_ns"].to_numpy()
    dur = events["dur_ns"].to_numpy()
    cpu = (events["lane"] == Lane.CPU.value).to_numpy()
    point = np.where(cpu[rows], rows, launch_rows(events, rows))
    has = np.flatnonzero(point >= 0)
    for allowed in ((ops[np.asarray(prefer)[ops]],) if prefer is not None else ()) + (ops,):
        todo = has[out[has] < 0]
        if len(todo) and len(allowed):
            out[todo] = _innermost(allowed, point[todo], rank=rank, stream=stream, start=start, dur=dur)
    ext = events["external_id"].to_numpy()
    rest = np.flatnonzero((out < 0) & (ext[rows] >= 0))
    if len(rest):
        hit = _row_by_key(ops[ext[ops] >= 0], rank, ext, queries=rows[rest], keep="last")
        ok = hit >= 0
        ok[ok] = start[hit[ok]] <= start[rows[rest[ok]]]
        out[rest[ok]] = hit[ok]
    return out


def _positions(rows, n: int) -> np.ndarray:
    if rows is None:
        return np.arange(n, dtype=np.int64)
    rows = np.asarray(rows)
    return np.flatnonzero(rows) if rows.dtype == bool else rows.astype(np.int64, copy=False)


def _row_by_key(rows: np.ndarray, rank: np.ndarray, key: np.ndarray, *, queries: np.ndarray,
                keep: str) -> np.ndarray:
    """For each query row: the row among ``rows`` (ascending) with the same rank and key -- the first or the
    last of several -- or -1. Per rank, a sorted search (no hashing of (rank, key) pairs)."""
    out = np.full(len(queries), -1, dtype=np.int64)
    q_rank = rank[queries]
    for r in np.unique(q_rank):
        mine = rows[rank[rows] == r]
        if not len(mine):
            continue
        order = np.argsort(key[mine], kind="stable")  # equal keys stay in row order
        keys, owners = key[mine][order], mine[order]
        q = np.flatnonzero(q_rank == r)
        wanted = key[queries[q]]
        pos = np.searchsorted(keys, wanted, side="left" if keep == "first" else "right")
        if keep != "first":
            pos -= 1
        ok = (pos >= 0) & (pos < len(keys))
        ok[ok] = keys[pos[ok]] == wanted[ok]
        out[q[ok]] = owners[pos[ok]]
    return out


def _innermost(ops: np.ndarray, points: np.ndarray, *, rank, stream, start, dur) -> np.ndarray:
    """Position of the innermost op of ``ops`` holding each point row (same rank and thread), or -1.

    Per thread the ops are sorted by start (the longer first among equal starts, so a parent precedes its
    child); the innermost holder of a point is the last op at or before the point's start that ends no earlier
    than the point. Candidates are walked back one op at a time, only for points that some earlier op still
    reaches (the running maximum of the ends): one step where ops nest or follow each other, a few more past
    the earlier children of a parent."""
    out = np.full(len(points), -1, dtype=np.int64)
    end = start + dur
    order = ops[np.lexsort((-dur[ops], start[ops], stream[ops], rank[ops]))]
    r_sorted, s_sorted = rank[order], stream[order]
    change = np.flatnonzero((r_sorted[1:] != r_sorted[:-1]) | (s_sorted[1:] != s_sorted[:-1])) + 1
    for group in np.split(order, change):
        sel = np.flatnonzero((rank[points] == rank[group[0]]) & (stream[points] == stream[group[0]]))
        if not len(sel):
            continue
        g_start, g_end = start[group], end[group]
        reach = np.maximum.accumulate(g_end)
        p_start, p_end = start[points[sel]], end[points[sel]]
        cand = np.searchsorted(g_start, p_start, side="right") - 1
        todo = np.flatnonzero(cand >= 0)
        while len(todo):
            c = cand[todo]
            live = reach[c] >= p_end[todo]  # else no op at or before c holds the point
            todo, c = todo[live], c[live]
            hit = g_end[c] >= p_end[todo]
            out[sel[todo[hit]]] = group[c[hit]]
            todo = todo[~hit]
            cand[todo] -= 1
            todo = todo[cand[todo] >= 0]
    return out


#: How many comm ops after a c10d op (by start, on its thread) ``_link_outer_ops`` looks through for its record.
_NESTED_LOOKAHEAD = 4


def _link_outer_ops(out: pd.DataFrame, category: np.ndarray) -> np.ndarray:
    """Per row: for a CPU communication op without a process group (``c10d::allreduce_`` and friends: torch
    records the group, its seq and sizes on the ``record_param_comms`` op inside it), the communication op right
    inside it on its thread (the first of the next :data:`_NESTED_LOOKAHEAD` by start) that has a group and names
    the outer op's collective; -1 elsewhere. Without it the outermost op, the one a CPU-lane rank's calls are
    matched by, had no group: every group's calls fell into one anonymous group matched by order."""
    link = np.full(len(out), -1, dtype=np.int64)
    rows = np.flatnonzero(_COMM_CODES[category] & (out["lane"] != Lane.GPU.value).to_numpy())
    if len(rows) < 2:
        return link
    start = out["start_ns"].to_numpy()[rows].astype(np.int64)
    end = start + out["dur_ns"].to_numpy()[rows].astype(np.int64)
    rank, stream = out["rank"].to_numpy()[rows], out["stream"].to_numpy()[rows]
    order = np.lexsort((start - end, start, stream, rank))  # by thread, then start; an enclosing op first
    rows, start, end, rank, stream = rows[order], start[order], end[order], rank[order], stream[order]
    group = ((out["pg_name"].iloc[rows].astype(str).to_numpy() != "")
             | (out["pg_ranks"].iloc[rows].astype(str).to_numpy() != ""))
    # The inner op's own collective must be the outer op's category: a c10d op may hold another call's record
    # (a helper group's, one op of a batch of sends and receives), whose group and seq are not its own.
    said = np.array([_CAT_CODE.get(c, _NO_CAT) for c in _per_category(out["collective"], op_category)],
                    dtype=np.int8)[codes_or_end(out["collective"])[rows]]
    want = category[rows]
    for ahead in range(_NESTED_LOOKAHEAD, 0, -1):  # the nearest qualifying op inside wins: it is written last
        outer, inner = slice(0, -ahead), slice(ahead, None)
        hit = ((rank[outer] == rank[inner]) & (stream[outer] == stream[inner]) & (start[inner] >= start[outer])
               & (end[inner] <= end[outer]) & ~group[outer] & group[inner] & (said[inner] == want[outer]))
        link[rows[:-ahead][hit]] = rows[ahead:][hit]
    return link


#: The backend's own record of running a call (ProcessGroupGloo / MPI / UCC): on a worker thread of the backend
#: when the call was posted from another thread (a collective), inside the posting op when run inline (a send).
WORKER_SPAN_RE = r"^(gloo|mpi|ucc):"
#: Any backend's own span: a worker-capable one, or NCCL's/RCCL's ``nccl:*`` (always inside its op).
BACKEND_SPAN_RE = r"^(gloo|mpi|ucc|nccl|rccl):"
#: A run may carry out a post of another collective: gloo runs ``reduce_scatter_tensor`` as one all-reduce.
RUN_SERVES = {"all_reduce": ("all_reduce", "reduce_scatter")}
#: How many of the oldest unpaired posts a worker run may be paired with (the posts of other groups' queues that
#: ran later lie among them)
_POST_WINDOW = 64


def group_keys(pg_name, pg_ranks) -> np.ndarray:
    """The key a call's process group is matched by: its ``pg_name``, else its ``pg_ranks`` text, else "" (no
    group). Columns or arrays of the two, categorical or text."""
    name = np.asarray(pg_name.astype(str) if isinstance(pg_name, pd.Series) else pg_name, dtype=object)
    ranks = np.asarray(pg_ranks.astype(str) if isinstance(pg_ranks, pd.Series) else pg_ranks, dtype=object)
    return np.where(name != "", name, ranks)


def _on_thread(stream: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: (nested: inside an earlier row of its thread -- ``c10d op > record_param_comms > gloo:*``; of rows
    that start together the longer holds the other; begun: it starts inside an earlier row of its thread, as a
    nested row and a transport span that outlasts its op do; the outermost row holding that start, or -1)."""
    n = len(start)
    nested, begun, holder = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), np.full(n, -1, dtype=np.int64)
    if n < 2:
        return nested, begun, holder
    order = np.lexsort((start - end, start, stream))  # by thread, then start; an enclosing row first
    thread, first, finish = stream[order], start[order], end[order]
    reach = pd.Series(finish).groupby(thread).cummax().to_numpy()  # the furthest end so far on the thread
    same = np.concatenate([[False], thread[1:] == thread[:-1]])
    before = np.concatenate([[np.iinfo(np.int64).min], reach[:-1]])
    nested[order] = same & (finish <= before)
    inside = same & (first < before)  # starts while an earlier row of the thread is still running
    # the outermost rows (not inside any earlier one) in sorted order; each row's is the last one at or before it
    outer = np.flatnonzero(~inside)
    last_outer = outer[np.searchsorted(outer, np.arange(n), side="right") - 1]
    begun[order] = inside
    holder[order[inside]] = order[last_outer[inside]]
    return nested, begun, holder


def worker_span_pairs(rank: np.ndarray, stream: np.ndarray, start: np.ndarray, end: np.ndarray,
                      category: np.ndarray, names: np.ndarray, group: np.ndarray, *,
                      launched: np.ndarray | None = None) -> WorkerSpans:
    """A collective posted on one thread and run on a backend worker thread is two CPU rows: the posting op
    (``c10d::allreduce_``, microseconds) and the backend's span (``gloo:all_reduce`` on the process group's worker
    thread, the whole run). The arrays describe CPU communication rows (all of them, nested ones included);
    ``category`` holds category names, ``names`` per row 0 (an op), 1 (a worker-capable backend span,
    :data:`WORKER_SPAN_RE`) or 2 (another backend's span, ``nccl:*``); ``group`` is a group key ("" for none).

    - A backend span that starts inside an op on its own thread is that op's transport (a gloo send or receive,
      NCCL's ``nccl:*``), even where it outlasts the op (an ``irecv``'s lifetime): the op is the call.
    - A worker-capable span that starts inside no op of its thread is a run posted from another thread. Its post:
      the earliest unpaired outermost op of its rank, on another thread, started no later than the run, whose
      collective the run can carry out (the same, or one of :data:`RUN_SERVES`), and that holds no backend span of
      its own nor launched a GPU kernel (``launched``: the op, or one inside it on its thread, that a communication
      kernel was launched from; such an op, an NCCL call, is complete) -- taken in the runs' start order, as a
      process group's queue runs its posts in order. Where posts carry groups, a worker thread serves one
      process group, so once a thread's run is paired with a group's post its later runs take that group's
      posts first. A run that found no post, after a paired reduce-scatter, is one of its further runs (gloo's list
      ``reduce_scatter`` posts one all-reduce per rank: :func:`_extra_runs`). Limits: the first run of a thread
      takes the oldest ready post, which may be another group's whose own worker is busy; a run looks at the
      :data:`_POST_WINDOW` oldest unpaired posts only."""
    n = len(start)
    empty = np.zeros(0, dtype=np.int64)
    nested, begun, holder = _on_thread(np.asarray(stream), start, end)
    if not (names > 0).any():
        return WorkerSpans(nested, empty, empty, empty, empty, empty)
    backend = names > 0
    transports = np.flatnonzero(backend & begun)
    # ops holding a backend span on their thread ran it inline: complete calls, no worker's posts
    complete = np.zeros(n, dtype=bool)
    complete[holder[transports]] = True
    if launched is not None:
        complete |= launched
        inner = np.flatnonzero(launched & begun)
        complete[holder[inner]] = True
    runs = np.flatnonzero((names == 1) & ~begun)
    posts = np.flatnonzero(~backend & ~begun & ~complete)
    if not len(runs) or not len(posts):
        return WorkerSpans(nested, empty, empty, transports, empty, empty)
    waiting: dict[tuple, collections.deque[int]] = {}
    for p in posts[np.lexsort((start[posts], rank[posts]))].tolist():
        waiting.setdefault((rank[p], category[p]), collections.deque()).append(p)
    served: dict[tuple, str] = {}  # (rank, worker thread) -> the group its first paired post named
    out_runs, out_posts = [], []
    for x in runs[np.argsort(start[runs], kind="stable")].tolist():
        ready = []  # (post start, queue, index in it) of the posts this run may carry out
        for kind in RUN_SERVES.get(category[x], (category[x],)):
            queue = waiting.get((rank[x], kind))
            if queue:
                ready += [(start[p], queue, i) for i, p in enumerate(itertools.islice(queue, _POST_WINDOW))
                          if start[p] <= start[x] and stream[p] != stream[x]]
        if not ready:
            continue
        ready.sort(key=lambda item: item[0])
        want = served.get((rank[x], stream[x]))
        _, queue, i = next((r for r in ready if want is not None and group[r[1][r[2]]] == want), ready[0])
        p = queue[i]
        del queue[i]
        if group[p] != "":
            served.setdefault((rank[x], stream[x]), group[p])
        out_runs.append(x)
        out_posts.append(p)
    extra_runs, extra_posts = _extra_runs(rank, stream, start, category, runs, posts, out_runs, out_posts)
    return WorkerSpans(nested, np.array(out_runs, dtype=np.int64), np.array(out_posts, dtype=np.int64), transports,
                       extra_runs, extra_posts)


def _extra_runs(rank, stream, start, category, runs, posts, out_runs, out_posts) -> tuple[np.ndarray, np.ndarray]:
    """The unpaired runs that are a paired post's further runs: gloo's list ``reduce_scatter`` posts one all-reduce
    per rank, so an all-reduce run that found no post, and whose rank's latest post before it (on another thread)
    is a paired reduce-scatter, is that post's. Positions of the runs and of their posts."""
    paired = set(out_runs)
    lone = [x for x in runs.tolist() if x not in paired and category[x] in RUN_SERVES["all_reduce"]]
    multi = {p for p in out_posts if category[p] == "reduce_scatter"}
    if not lone or not multi:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    by_rank: dict = {}
    for p in posts[np.argsort(start[posts], kind="stable")].tolist():
        by_rank.setdefault(rank[p], []).append(p)
    extra_runs, extra_posts = [], []
    for x in lone:
        mine = [p for p in by_rank.get(rank[x], []) if start[p] <= start[x] and stream[p] != stream[x]]
        if mine and mine[-1] in multi:
            extra_runs.append(x)
            extra_posts.append(mine[-1])
    return np.array(extra_runs, dtype=np.int64), np.array(extra_posts, dtype=np.int64)


@dataclass(frozen=True)
class WorkerSpans:
    """:func:`worker_span_pairs`' answer: per row whether it is nested in an earlier row of its thread; and
    positions in its arrays of each paired run and its post, of the backend spans that are their op's transport,
    and of a post's further runs with their posts (:func:`_extra_runs`; neither is a call)."""

    nested: np.ndarray
    runs: np.ndarray
    posts: np.ndarray
    transports: np.ndarray
    extra_runs: np.ndarray
    extra_posts: np.ndarray


def span_kinds(names: pd.Series) -> np.ndarray:
    """Per row of a categorical name column: 0 (not a backend span), 1 (``gloo:*``/``mpi:*``/``ucc:*``), 2 (``nccl:*``,
    ``rccl:*``), for :func:`worker_span_pairs`."""
    return np.where(match_names(names, WORKER_SPAN_RE), 1, np.where(match_names(names, BACKEND_SPAN_RE), 2, 0))


def _link_worker_spans(out: pd.DataFrame, category: np.ndarray, launched: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: for a backend span run on a worker thread (:func:`worker_span_pairs`), the op that posted it, so
    that the run -- which the calls are matched by -- takes the post's group, seq and sizes; -1 elsewhere (and
    where the run has its own). Also ``category`` with each paired run given its post's collective (gloo's
    all-reduce that carries out a ``reduce_scatter_tensor`` is that reduce-scatter)."""
    link = np.full(len(out), -1, dtype=np.int64)
    rows = np.flatnonzero(_COMM_CODES[category] & ~_P2P_CODES[category] & (out["lane"] != Lane.GPU.value).to_numpy())
    if len(rows) < 2:
        return link, category
    kinds = span_kinds(out["name"])[rows]
    if not (kinds == 1).any():
        return link, category
    start = out["start_ns"].to_numpy()[rows].astype(np.int64)
    end = start + out["dur_ns"].to_numpy()[rows].astype(np.int64)
    group = group_keys(out["pg_name"].iloc[rows], out["pg_ranks"].iloc[rows])
    names = np.array(_CAT_NAMES + ("",), dtype=object)[category[rows]]
    found = worker_span_pairs(out["rank"].to_numpy()[rows], out["stream"].to_numpy()[rows], start, end, names, kinds,
                              group, launched=launched[rows])
    runs = rows[np.concatenate([found.runs, found.extra_runs])]
    posts = rows[np.concatenate([found.posts, found.extra_posts])]
    link[runs] = posts
    if (category[runs] != category[posts]).any():
        category = category.copy()
        category[runs] = category[posts]
    return link, category


def _fill_from_ops(out: pd.DataFrame, link: np.ndarray) -> None:
    """Copy the linked row's collective/process-group columns onto each linked row (a kernel: from its op; an
    outer op: from the op inside it) where that row lacks them."""
    rows = np.flatnonzero(link >= 0)
    if not len(rows):
        return
    src = link[rows]
    for column in _FILL_COLUMNS:
        values = out[column]
        if isinstance(values.dtype, pd.CategoricalDtype):
            # On the codes: "" is a category like any other; the result keeps the used values, sorted.
            vocabulary = [*category_texts(values.dtype.categories), ""]
            codes = codes_or_end(values).astype(np.int32)  # a copy: the column itself is replaced below
            _dedupe(vocabulary, codes)
            empty = vocabulary.index("")
            missing = (codes[rows] == empty) & (codes[src] != empty)
            if not missing.any():  # every linked kernel has its own (or its op has none): the column stays
                continue
            codes[rows[missing]] = codes[src[missing]]
            out[column] = sorted_categorical(codes, vocabulary)
        else:
            current = values.to_numpy()
            missing = (current[rows] < 0) & (current[src] >= 0)
            if not missing.any():
                continue
            current = current.copy()
            current[rows[missing]] = current[src[missing]]
            out[column] = current.astype(values.dtype)


def _dedupe(vocabulary: list, codes: np.ndarray) -> None:
    """Rewrite ``codes`` so repeated texts in ``vocabulary`` (a "" category and the missing slot; 0 and "0")
    use the first code: equal texts become one category."""
    first: dict = {}
    remap = np.array([first.setdefault(text, i) for i, text in enumerate(vocabulary)], dtype=np.int32)
    if (remap != np.arange(len(vocabulary))).any():
        codes[:] = remap[codes]


def _dims(out: pd.DataFrame, category: np.ndarray, layout: Mapping[str, int] | None) -> pd.Categorical:
    """Parallel dimension of every communication row ("" elsewhere), from the category codes."""
    comm = _COMM_CODES[category]
    idx = np.flatnonzero(comm)
    if not len(idx):
        return empty_texts(len(out))
    from_desc = np.array(_per_category(out["pg_desc"], desc_dim), dtype=object)[codes_or_end(out["pg_desc"])[idx]]
    dims = np.where(from_desc != "", from_desc, UNKNOWN_DIM)
    ann_table = np.array(_per_category(out["name"], lambda n: (m.group("dim") if (m := contract.COMM_RE.match(n))
                                                                else "")), dtype=object)
    ann = ann_table[codes_or_end(out["name"])[idx]]
    use_ann = (dims == UNKNOWN_DIM) & (ann != "")
    dims[use_ann] = ann[use_ann]
    if layout is not None:
        todo = dims == UNKNOWN_DIM
        if todo.any():
            keys = pd.DataFrame({"r": out["pg_ranks"].astype(str).to_numpy()[idx[todo]],
                                 "s": out["pg_size"].to_numpy()[idx[todo]]})
            uniq = keys.drop_duplicates()
            uniq_dim = [layout_dim(r, size=int(s), layout=layout) for r, s in zip(uniq["r"], uniq["s"])]
            lookup = pd.Series(uniq_dim, index=pd.MultiIndex.from_frame(uniq))
            dims[todo] = lookup.reindex(pd.MultiIndex.from_frame(keys)).to_numpy()
    row_codes, uniques = pd.factorize(dims)
    vocabulary = ["", *(d for d in uniques if d != "")]
    position = {d: i for i, d in enumerate(vocabulary)}
    codes = np.zeros(len(out), dtype=np.int32)
    codes[idx] = np.array([position[d] for d in uniques], dtype=np.int32)[row_codes]
    return sorted_categorical(codes, vocabulary)
