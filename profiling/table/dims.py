"""The parallel ``dim`` of a communication row: from its process group's description, else from its ranks or
size against a layout ``dict(tp=, cp=, dp=, pp=)`` (rules in ``classify``'s docstring); and the group keys."""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import pandas as pd

import shardline.job.annotations as contract
from shardline.job import placement

from ..base.errors import ClassificationError
from ..base.schema import (
    codes_or_end,
    empty_texts,
    sorted_categorical,
)
from .kinds import COMM_CODES, UNKNOWN_DIM
from .names import _per_category

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


def group_keys(pg_name, pg_ranks) -> np.ndarray:
    """The key a call's process group is matched by: its ``pg_name``, else its ``pg_ranks`` text, else "" (no
    group). Columns or arrays of the two, categorical or text."""
    name = np.asarray(pg_name.astype(str) if isinstance(pg_name, pd.Series) else pg_name, dtype=object)
    ranks = np.asarray(pg_ranks.astype(str) if isinstance(pg_ranks, pd.Series) else pg_ranks, dtype=object)
    return np.where(name != "", name, ranks)


def _dims(out: pd.DataFrame, category: np.ndarray, layout: Mapping[str, int] | None) -> pd.Categorical:
    """Parallel dimension of every communication row ("" elsewhere), from the category codes."""
    comm = COMM_CODES[category]
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
