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

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from ..base.errors import ClassificationError
from ..base.schema import (
    category_texts,
    check_events,
    codes_or_end,
    sorted_categorical,
)
from .dims import _dims, check_layout
from .kinds import CATEGORY_CODE, CATEGORY_NAMES, COMM_CODES, NO_CATEGORY, Category, Lane
from .linking import _fill_from_ops, _link_kernels_to_ops, _link_outer_ops, _link_worker_spans
from .names import (
    _CE_OP_RE,
    DEFAULT_RULES,
    CommRule,
    _per_category,
    comm_word_table,
    match_table,
    name_categories,
    op_category,
)


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
        to_ours = np.array([CATEGORY_CODE.get(c, NO_CATEGORY) for c in category_texts(out["category"].cat.categories)]
                           + [NO_CATEGORY], dtype=np.int8)
        out["dim"] = _dims(out, to_ours[category], layout)
    return out


def _check_input(events, layout) -> None:
    if not isinstance(events, pd.DataFrame):
        raise ClassificationError(f"classify_events expects an events DataFrame, got {type(events).__name__}")
    try:
        check_events(events)
    except ValueError as exc:
        raise ClassificationError(str(exc)) from None
    if layout is not None:
        check_layout(layout)


def _label(out: pd.DataFrame, *, rules: tuple, layout) -> None:
    """Fill ``category`` and ``dim`` of a non-empty, schema-checked table in place."""
    texts = [*category_texts(out["name"].cat.categories), ""]
    names = name_categories(texts, rules=rules)
    name_cat = np.array([CATEGORY_CODE[c] for c, _ in names], dtype=np.int8)
    name_kernel = np.array([k for _, k in names], dtype=bool)
    # Not communication by name, but may inherit a launching op's collective: a communication word in the
    # name, or a device-to-device copy (copy-engine collectives).
    name_codes = codes_or_end(out["name"])
    gpu = (out["lane"] == Lane.GPU.value).to_numpy()
    # Only a GPU row inherits: the words are looked for in the names GPU rows use (most names are CPU ops').
    gpu_names = np.flatnonzero(np.bincount(name_codes[gpu], minlength=len(texts)))
    name_word = np.zeros(len(texts), dtype=bool)
    name_word[gpu_names] = comm_word_table([texts[i] for i in gpu_names.tolist()])
    name_word &= ~COMM_CODES[name_cat]
    name_copy = name_cat == CATEGORY_CODE[Category.MEMCPY_D2D.value]
    category = name_cat[name_codes]
    is_comm_kernel = name_kernel[name_codes] & gpu
    inherits = (name_word | name_copy)[name_codes] & gpu

    # Evidence 1: the row's own collective arg.
    own_table = np.array([CATEGORY_CODE.get(c, NO_CATEGORY) for c in _per_category(out["collective"], op_category)],
                         dtype=np.int8)
    own = own_table[codes_or_end(out["collective"])]
    has_own = own != NO_CATEGORY
    category[has_own] = own[has_own]
    del own

    # Evidence 2: the CPU op of a communication kernel, or of a kernel that inherits its op's collective.
    linked, link_idx = _link_kernels_to_ops(out, category, (is_comm_kernel | inherits) & ~has_own)
    copies = np.flatnonzero(inherits & (link_idx >= 0) & name_copy[name_codes])
    if len(copies):  # a copy inherits only from the nccl:* op itself (not from a c10d op that also flattens)
        ce_op = match_table(out["name"], _CE_OP_RE)[name_codes[link_idx[copies]]]
        link_idx[copies[~ce_op]] = -1
        linked[copies[~ce_op]] = NO_CATEGORY
    del name_codes
    take = linked != NO_CATEGORY
    category[take] = linked[take]
    del linked, take, is_comm_kernel, has_own, inherits
    out["category"] = sorted_categorical(category, CATEGORY_NAMES)
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
        out["category"] = sorted_categorical(category, CATEGORY_NAMES)
    _fill_from_ops(out, posted)
    out["dim"] = _dims(out, category, layout)
