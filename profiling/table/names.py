"""Categories from names: the kernel / op name rules (NCCL, RCCL, HCCL, gloo/UCC/MPI annotations, memcpy,
memset, synchronize), the user-extensible ``CommRule`` list, and the per-category name matching every module
shares (``match_names``, ``match_table``: on the categories, broadcast through the codes)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

import shardline.job.annotations as contract

from ..base.errors import ClassificationError
from ..base.schema import (
    COMM_CATEGORIES,
    category_texts,
    codes_or_end,
    per_category_table,
)
from .kinds import Category


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
_C10D_RE = re.compile(r"^c10d::(\w+?)_?$")
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
