"""Bandwidth of every collective instance on every rank, against the limit of the link its group crosses.

One row per (collective call, rank): the GPU kernel on ranks attributed on GPUs, else the outermost CPU comm
op (the rows ``collectives.comm_calls`` uses), plus point-to-point sends and receives. nccl-tests' definitions
(``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests), with ``S`` bytes and ``n`` ranks in the group::

    S      all-reduce, broadcast, all-to-all, p2p: the (per-rank) input;  all-gather: the output;
           reduce-scatter: the input (both the full buffer, n x the per-rank shard)
    algbw = S / t                                   (GB/s = 1e9 B/s = bytes per ns)
    busbw = algbw x 2(n-1)/n    all-reduce
          = algbw x (n-1)/n     all-gather, reduce-scatter, all-to-all
          = algbw               broadcast, p2p send / recv
    efficiency = busbw / link_gbps                  (the limit on busbw over the link it crosses: links)

``t``, ``time_basis``: ``transfer`` is the matched transfer time (``collectives.match_collectives``: the call's
duration less the time it waited for the last member to arrive) when every member of the group was matched;
otherwise ``duration``, the kernel's (or op's) whole duration, which includes any waiting, so the bandwidth
is a lower bound. p2p calls are never matched here: their basis is always ``duration``.

``S`` (``size_source``), first that exists: the row's own ``In/Out msg nelems`` and ``dtype`` args (Kineto,
PyTorch >= 2.1 kernels and ``record_param_comms``), the events table's ``msg_bytes`` (NCCL logs, Nsight, a
kernel given its op's size by ``classify``), then the launching comm op's args: its nelems (``op_args``);
for an all-gather or a reduce-scatter the (output, input) tensors of the ``c10d::_allgather_base_`` /
``c10d::_reduce_scatter_base_`` op around it (``op_tensors``: the gathered output, the full input); its
``msg_bytes``; else its ``Input Dims`` x ``Input type`` (older PyTorch records only these, on ``nccl:*``
annotations; the input of an all-gather is one shard, so S = n x input there). The op of a kernel is its
``linking.launching_op`` among the comm ops holding size args (the innermost one that contains its launch: same
correlation id, same thread; else the one whose External id it shares); the op of a CPU row is the first one
with size args nested in it.

``group_size``: the pg args' (``links.group_sizes``), except for an anonymous group (no pg args: PyTorch before
2.1 records none, and ``group_sizes`` takes it for the world) whose all-gather or reduce-scatter op tells its
own: output / input (input / output), a whole number; its ranks are then unknown and taken as packed.
``imbalance`` (all-to-all-v): the larger of max/mean of ``In split size`` and ``Out split size`` (1.0
balanced, NaN without splits). The args are the op-args columns of the events table (``load(path,
op_args=True)``; for a trace set loaded without them ``load.read_op_args`` reads them).

The link a call's group crosses and its limit (``link``, ``link_gbps``, ``nodes``, ``device_name``, the node
size in ``df.attrs``): see :mod:`shardline.profiling.matching.links`, which holds the links table and its device rules.

``latency_bound``: S < ``LATENCY_BOUND_BYTES`` (1 MiB); the efficiency is still computed, but a summary says
"latency-bound" rather than a fraction of the peak there.

No bandwidth above the link's limit: where S / t x factor would be more than ``link_gbps``, one input is wrong.
A matched transfer time gives way to the whole duration (``check`` says so); where that is still too short the
row's ``algbw_gbps``, ``busbw_gbps`` and ``efficiency`` are NaN, ``inconsistent`` names the input that cannot
be right ("bytes" for a kernel, which holds the whole transfer; "duration" for a CPU op, or a kernel that is
one of several its comm op launched) and ``check`` gives the values (``_inconsistencies``). ``ranks_per_node``:
the fewest of the group's ranks on any node it spans (``links.ranks_per_node``).
"""

from __future__ import annotations

import enum
import json
import math
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from ..base.errors import AttributionError, TraceWarning
from ..base.schema import COMM_CATEGORIES, json_values
from ..readers._kineto_columns import DTYPE_BYTES
from ..table.dims import group_keys
from ..table.kinds import Lane
from ..table.linking import launching_op
from ..table.load import read_op_args
from ..table.rows import step_of
from .collectives import COLLECTIVE_CATEGORIES, ClockAlignment, _cpu_calls, match_collectives
from .links import (
    DEFAULT_LINKS,
    DEVICE_RULES,
    HOST_PCIE,
    P2P_CATEGORIES,
    Link,
    LinkTable,
    LinkTableError,
    check_gpus_per_node,
    crossed_links,
    device_names,
    group_sizes,
    link_table,
    node_size,
    nodes_spanned,
    ranks_per_node,
)
from .matched import matching_of

__all__ = ["COLUMNS", "DEFAULT_LINKS", "DEVICE_RULES", "HOST_PCIE", "LATENCY_BOUND_BYTES", "Link", "LinkTable",
           "LinkTableError", "TimeBasis", "bandwidth_summary", "busbw_factor", "collective_bandwidth", "link_table"]


class TimeBasis(str, enum.Enum):
    TRANSFER = "transfer"
    DURATION = "duration"


#: Messages below this many bytes are dominated by latency, not bandwidth (NCCL's LL/LL128 range).
LATENCY_BOUND_BYTES = 1 << 20
CATEGORIES = tuple(c for c in COLLECTIVE_CATEGORIES if c not in ("barrier", "other_comm")) + P2P_CATEGORIES


#: The columns of ``collective_bandwidth``, in order.
COLUMNS = ("rank", "step", "category", "pg", "pg_desc", "dim", "group_size", "dtype", "bytes", "time_ns",
           "time_basis", "algbw_gbps", "busbw_gbps", "link", "link_gbps", "efficiency", "latency_bound",
           "nodes", "imbalance", "size_source", "device_name", "name", "start_ns", "dur_ns", "wait_ns", "peer",
           "ranks_per_node", "inconsistent", "check")


def busbw_factor(category, n) -> np.ndarray:
    """nccl-tests' bus-bandwidth factor of each (category, group size n); NaN where n is unknown (< 1)."""
    category = np.asarray(category, dtype=object)
    n = np.asarray(n, dtype=np.float64)
    safe = np.where(n >= 1, n, np.nan)
    ring = (safe - 1) / safe
    out = np.full(len(category), np.nan)
    out = np.where(category == "all_reduce", 2 * ring, out)
    out = np.where(np.isin(category, ("all_gather", "reduce_scatter", "all_to_all")), ring, out)
    return np.where(np.isin(category, ("broadcast", *P2P_CATEGORIES)), 1.0, out)


# --- the rows -------------------------------------------------------------------------------------------------

def collective_bandwidth(source, *, links: str | Path | Mapping | None = None, gpus_per_node: int | None = None,
                         clock: ClockAlignment = ClockAlignment.ENDS) -> pd.DataFrame:
    """One row per collective call (and p2p send/recv) per rank, with ``COLUMNS`` (see the module docstring).

    ``source``: a ``TraceSet`` (the op-args columns give dtype, split sizes, ``Input Dims``: loaded with
    ``op_args=True``, else its Kineto files are read once more for them, ``load.read_op_args``), an events
    table or an ``Attribution`` (the op args where the table has them, else sizes from ``msg_bytes`` only,
    dtype ""). ``links``: overrides of the links table (``link_table``); ``gpus_per_node`` wins over
    every other source of the node size. ``df.attrs`` holds ``gpus_per_node`` and ``gpus_per_node_source``.
    """
    table = link_table(links)
    if gpus_per_node is not None:
        check_gpus_per_node(gpus_per_node, "collective_bandwidth")
    attribution, matching = matching_of(source, caller="collective_bandwidth")
    traceset = source if hasattr(source, "files") and hasattr(source, "metadata") else None
    metadata = getattr(traceset, "metadata", None) or getattr(attribution, "metadata", None) or {}
    rows = _call_rows(attribution)
    gpn, gpn_source = node_size(gpus_per_node, table, traceset, attribution.events)
    if rows.empty:
        out = pd.DataFrame({c: pd.Series(dtype=object) for c in COLUMNS})
        out.attrs.update(gpus_per_node=gpn, gpus_per_node_source=gpn_source)
        return out
    rows = _with_matching(rows, attribution, clock)
    if matching.op_args is None:
        matching.op_args = read_op_args(traceset if traceset is not None else attribution.events)
    args = matching.op_args
    rows["group_size"] = group_sizes(rows, metadata)
    rows = _with_sizes(rows, args, attribution.events)
    unknown = ~rows["group_known"].to_numpy(dtype=bool)
    rows["nodes"] = nodes_spanned(rows, metadata, gpn, unknown=unknown)
    rows["ranks_per_node"] = ranks_per_node(rows, metadata, gpn, unknown=unknown)
    rows["device_name"] = device_names(rows, metadata)
    return _finish(rows, table, gpn, gpn_source)


_ROW_COLUMNS = ("rank", "lane", "device", "stream", "name", "category", "dim", "start_ns", "dur_ns", "correlation",
                "external_id", "pg_name", "pg_desc", "pg_ranks", "pg_size", "msg_bytes", "peer")


def _call_rows(attribution) -> pd.DataFrame:
    """The calls of every working rank (as ``collectives.comm_calls`` picks them, p2p included), with
    their step and their position in the events table (``row``)."""
    frames = []
    for rank in attribution.working:
        calls = rank.work(list(_ROW_COLUMNS), categories=CATEGORIES)
        if rank.lanes == Lane.CPU.value:
            calls = _cpu_calls(calls)
        if calls.empty:
            continue
        frame = pd.DataFrame({c: (calls[c].astype(str).to_numpy() if isinstance(calls[c].dtype, pd.CategoricalDtype)
                                  else calls[c].to_numpy()) for c in _ROW_COLUMNS})
        frame["row"] = calls.index.to_numpy()
        frame["step"] = step_of(frame["start_ns"].to_numpy(), rank.windows)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _with_matching(rows: pd.DataFrame, attribution, clock) -> pd.DataFrame:
    """``wait_ns``, ``transfer_ns`` and ``members`` of each matched collective call (NaN / 0 elsewhere)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceWarning)  # uneven counts: the unmatched rows fall back below
            matched = match_collectives(attribution, clock=clock)
    except AttributionError:
        matched = pd.DataFrame(columns=["rank", "category", "start_ns", "offset_ns", "dur_ns", "wait_ns",
                                        "transfer_ns", "members"])
    key = pd.DataFrame({"rank": matched["rank"].to_numpy(dtype=np.int64),
                        "category": matched["category"].astype(str).to_numpy(),
                        "start_ns": (matched["start_ns"] + matched["offset_ns"]).to_numpy(dtype=np.int64),
                        "dur_ns": matched["dur_ns"].to_numpy(dtype=np.int64),
                        "wait_ns": matched["wait_ns"].to_numpy(dtype=np.float64),
                        "transfer_ns": matched["transfer_ns"].to_numpy(dtype=np.float64),
                        "members": matched["members"].to_numpy(dtype=np.int64)})
    key = key.drop_duplicates(["rank", "category", "start_ns", "dur_ns"])
    rows = rows.astype({"rank": np.int64, "start_ns": np.int64, "dur_ns": np.int64})
    out = rows.merge(key, on=["rank", "category", "start_ns", "dur_ns"], how="left")
    out["members"] = out["members"].fillna(0).astype(np.int64)
    return out


# --- sizes ----------------------------------------------------------------------------------------------------

#: ``Input type`` texts of the profiler (C++ type names) -> torch ScalarType names (the ``dtype`` arg's).
_INPUT_TYPES = {
    "float": "Float", "double": "Double", "c10::Half": "Half", "c10::BFloat16": "BFloat16", "int": "Int",
    "long": "Long", "long int": "Long", "int64_t": "Long", "short": "Short", "short int": "Short",
    "signed char": "Char", "int8_t": "Char", "unsigned char": "Byte", "uint8_t": "Byte", "bool": "Bool",
    "c10::complex<float>": "ComplexFloat", "c10::complex<double>": "ComplexDouble",
    "c10::complex<c10::Half>": "ComplexHalf", "c10::Float8_e4m3fn": "Float8_e4m3fn",
    "c10::Float8_e5m2": "Float8_e5m2", "c10::Float8_e4m3fnuz": "Float8_e4m3fnuz",
    "c10::Float8_e5m2fnuz": "Float8_e5m2fnuz", "unsigned short": "UInt16", "unsigned int": "UInt32",
}
#: What a row (or its comm op) says about the call's size: ``_size_args``.
_SIZE_ARGS = ("in_nelems", "out_nelems", "dtype", "msg_bytes", "input_bytes", "input_dtype", "imbalance")
#: c10d ops whose first two arguments are the (output, input) tensors of an all-gather or reduce-scatter: their
#: ``Input Dims`` give the gathered output, the full input, and the group size (their ratio).
_OUTPUT_INPUT_OPS = ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_")


def _size_args(events: pd.DataFrame, args: pd.DataFrame, positions: np.ndarray) -> pd.DataFrame:
    """The ``_SIZE_ARGS`` of the events rows at ``positions`` (-1: no row), from ``msg_bytes`` and the op-args
    columns ``args`` (``load.read_op_args``, row for row): the nelems and dtype args as recorded, the bytes and
    dtype of the tensor inputs (``Input Dims`` x ``Input type``), the all-to-all-v imbalance; -1 / "" / NaN
    where the row says nothing."""
    none = positions < 0
    at = np.where(none, 0, positions)
    rows, back = np.unique(at, return_inverse=True)  # each events row decoded once (several calls share an op)
    decoded = {c: json_values(args[c].iloc[rows]) for c in ("input_dims", "input_types", "in_split_sizes",
                                                            "out_split_sizes")}
    inputs = [_input_bytes(_listed(d), _listed(t)) for d, t in zip(decoded["input_dims"], decoded["input_types"])]
    imbalance = [max(_imbalance(_listed(i)), _imbalance(_listed(o)), key=_nan_low)
                 for i, o in zip(decoded["in_split_sizes"], decoded["out_split_sizes"])]
    out = pd.DataFrame({
        "in_nelems": args["in_nelems"].to_numpy()[at], "out_nelems": args["out_nelems"].to_numpy()[at],
        "dtype": args["dtype"].to_numpy(dtype=object)[at], "msg_bytes": events["msg_bytes"].to_numpy()[at],
        "input_bytes": np.array([b for b, _ in inputs], dtype=np.int64)[back],
        "input_dtype": np.array([d for _, d in inputs] or [""], dtype=object)[back],
        "imbalance": np.array(imbalance, dtype=np.float64)[back]})
    if none.any():
        out.loc[none, ["in_nelems", "out_nelems", "msg_bytes", "input_bytes"]] = -1
        out.loc[none, ["dtype", "input_dtype"]] = ""
        out.loc[none, "imbalance"] = np.nan
    return out


def _listed(value):
    """A decoded arg, with a list written as text (``"[1, 2]"``: torch writes split sizes so) read as the list."""
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def _nan_low(x: float) -> float:
    return -math.inf if math.isnan(x) else x


def _imbalance(splits) -> float:
    """max/mean of the per-peer split sizes (all-to-all-v); NaN without splits."""
    if not isinstance(splits, list) or not splits or not all(isinstance(s, (int, float)) for s in splits):
        return math.nan
    mean = sum(splits) / len(splits)
    return max(splits) / mean if mean > 0 else math.nan


def _input_bytes(dims, types) -> tuple[int, str]:
    """Bytes and dtype of an op's tensor inputs from ``Input Dims`` / ``Input type`` (-1, "" when none)."""
    if not isinstance(dims, list) or not isinstance(types, list):
        return -1, ""
    total, dtype = 0, ""
    for shape, kind in zip(dims, types):
        name = _INPUT_TYPES.get(kind) if isinstance(kind, str) else None
        if name is None or not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            continue
        total += math.prod(shape) * DTYPE_BYTES[name]
        dtype = dtype or name
    return (total, dtype) if dtype else (-1, "")


def _pair_bytes(events: pd.DataFrame, args: pd.DataFrame, positions: np.ndarray) -> pd.DataFrame:
    """``out_tensor_bytes`` and ``in_tensor_bytes`` of the events rows at ``positions`` that are
    ``_OUTPUT_INPUT_OPS`` ops (``_tensor_pair``); -1 elsewhere (-1: no row)."""
    out = np.full((len(positions), 2), -1, dtype=np.int64)
    named = np.flatnonzero(positions >= 0)
    named = named[np.isin(events["name"].to_numpy(dtype=object)[positions[named]], _OUTPUT_INPUT_OPS)]
    if len(named):
        rows, back = np.unique(positions[named], return_inverse=True)
        dims, types = (json_values(args[c].iloc[rows]) for c in ("input_dims", "input_types"))
        found = np.array([_tensor_pair(_listed(d), _listed(t)) for d, t in zip(dims, types)], dtype=np.int64)
        out[named] = found.reshape(-1, 2)[back]
    return pd.DataFrame({"out_tensor_bytes": out[:, 0], "in_tensor_bytes": out[:, 1]})


def _tensor_pair(dims, types) -> tuple[int, int]:
    """Bytes of the (output, input) tensors an ``_OUTPUT_INPUT_OPS`` op lists first; (-1, -1) unless both have
    a known shape and the same known type."""
    if not isinstance(dims, list) or not isinstance(types, list) or len(dims) < 2 or len(types) < 2:
        return -1, -1
    name = _INPUT_TYPES.get(types[0]) if isinstance(types[0], str) else None
    shapes = dims[:2]
    if name is None or types[1] != types[0] or not all(
            isinstance(shape, list) and shape and all(isinstance(d, int) and d > 0 for d in shape) for shape in shapes):
        return -1, -1
    return tuple(math.prod(shape) * DTYPE_BYTES[name] for shape in shapes)


def _pair_sizes(category: np.ndarray, pair: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(S, n) from an ``_OUTPUT_INPUT_OPS`` op's tensors: an all-gather's gathered output and output/input, a
    reduce-scatter's full input and input/output; NaN and -1 elsewhere, and n -1 where the ratio is no whole
    number."""
    out_b = _positive_or_nan(pair["out_tensor_bytes"])
    in_b = _positive_or_nan(pair["in_tensor_bytes"])
    gather, scatter = category == "all_gather", category == "reduce_scatter"
    size = np.where(gather, out_b, np.where(scatter, in_b, np.nan))
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(gather, out_b / in_b, np.where(scatter, in_b / out_b, np.nan))
    whole = np.isfinite(ratio) & (ratio >= 1) & (np.abs(ratio - np.round(ratio)) < 1e-9)
    return size, np.where(whole, np.round(np.where(whole, ratio, 0)), -1).astype(np.int64)


def _anonymous(rows: pd.DataFrame) -> np.ndarray:
    """Rows whose group the trace does not name (no pg args: old PyTorch), taken as the world by ``group_sizes``."""
    return ((rows["pg_size"].to_numpy() <= 0) & (rows["pg_name"].astype(str).to_numpy() == "")
            & (rows["pg_ranks"].astype(str).to_numpy() == ""))


def _with_sizes(rows: pd.DataFrame, args: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """``bytes``, ``dtype``, ``imbalance`` and ``size_source`` of every row, and the ``group_size`` of an
    anonymous group whose call's own tensors tell it (``group_known``: False there; ``group_size`` already set
    from the pg args)."""
    own = _size_args(events, args, rows["row"].to_numpy())
    sized_op = _sized_ops(rows, events, args)
    pair_op = _sized_ops(rows, events, args, names=_OUTPUT_INPUT_OPS)
    op = _size_args(events, args, sized_op)
    pair = _pair_bytes(events, args, pair_op)
    category = rows["category"].to_numpy()
    pair_s, pair_n = _pair_sizes(category, pair)
    told = _anonymous(rows) & (pair_n > 0)
    rows["group_size"] = np.where(told, pair_n, rows["group_size"].to_numpy()).astype(np.int64)
    rows["group_known"] = ~told
    n = rows["group_size"].to_numpy()
    own_s = _nelems_bytes(category, own["in_nelems"], own["out_nelems"], own["dtype"])
    op_s = _nelems_bytes(category, op["in_nelems"], op["out_nelems"], op["dtype"])
    gather = np.where(category == "all_gather", np.where(n > 0, n, np.nan), 1.0)
    sources = (("args", own_s), ("msg_bytes", _positive_or_nan(rows["msg_bytes"])),
               ("op_args", op_s), ("op_tensors", pair_s), ("op_msg_bytes", _positive_or_nan(op["msg_bytes"])),
               ("input", _positive_or_nan(own["input_bytes"]) * gather),
               ("op_input", _positive_or_nan(op["input_bytes"]) * gather))
    size = np.full(len(rows), np.nan)
    source = np.full(len(rows), "", dtype=object)
    for label, values in sources:
        take = np.isnan(size) & ~np.isnan(values)
        size[take], source[take] = values[take], label
    rows["bytes"] = size
    rows["size_source"] = source
    rows["op_row"] = np.where(np.char.startswith(source.astype(str), "op_"),
                              np.where(source == "op_tensors", pair_op, sized_op), -1)
    dtype = np.full(len(rows), "", dtype=object)
    for values in (own["dtype"], op["dtype"], own["input_dtype"], op["input_dtype"], _name_dtypes(rows["name"])):
        values = pd.Series(values).fillna("").astype(str).to_numpy()
        dtype = np.where(dtype == "", values, dtype)
    rows["dtype"] = dtype
    imbalance = own["imbalance"].to_numpy(dtype=np.float64)
    rows["imbalance"] = np.where(np.isnan(imbalance), op["imbalance"].to_numpy(dtype=np.float64), imbalance)
    return rows


def _positive_or_nan(values) -> np.ndarray:
    values = pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(dtype=np.float64)
    return np.where(values > 0, values, np.nan)


def _element_bytes(dtype) -> np.ndarray:
    return pd.Series(dtype).map(DTYPE_BYTES).to_numpy(dtype=np.float64)


def _nelems_bytes(category: np.ndarray, in_nelems, out_nelems, dtype) -> np.ndarray:
    """nccl-tests' S from the nelems args: the output of an all-gather, the input of a reduce-scatter and of
    an all-to-all(-v), the larger of the two otherwise (they are equal there); x the dtype's size."""
    i = _positive_or_nan(in_nelems)
    o = _positive_or_nan(out_nelems)
    bigger = np.fmax(i, o)
    nelems = np.where(category == "all_gather", np.where(np.isnan(o), bigger, o),
                      np.where(np.isin(category, ("reduce_scatter", "all_to_all")),
                               np.where(np.isnan(i), bigger, i), bigger))
    return nelems * _element_bytes(dtype)


_KERNEL_DTYPE = re.compile(r"_(?P<t>bf16|f16|f32|f64|half|float|double|fp8_e4m3|fp8_e5m2)(?:[_(]|$)")
_KERNEL_DTYPES = {"bf16": "BFloat16", "f16": "Half", "half": "Half", "f32": "Float", "float": "Float",
                  "f64": "Double", "double": "Double", "fp8_e4m3": "Float8_e4m3fn", "fp8_e5m2": "Float8_e5m2"}


def _name_dtypes(names: pd.Series) -> np.ndarray:
    """The dtype an NCCL reduction kernel's name carries (``..._Sum_bf16_RING_LL``, ``..._Sum_float(``); ""
    for the byte-typed ones (SendRecv, Broadcast, AllGather: ``int8_t`` or none). On unique names."""
    unique = pd.unique(names.to_numpy())
    found = {}
    for name in unique:
        hit = _KERNEL_DTYPE.search(name) if name.startswith("nccl") else None
        found[name] = _KERNEL_DTYPES[hit["t"]] if hit else ""
    return names.map(found).to_numpy(dtype=object)


def _sized_ops(rows: pd.DataFrame, events: pd.DataFrame, args: pd.DataFrame, *, names=None) -> np.ndarray:
    """The events row of each call's comm op that tells a size (nelems and dtype args, ``Input Dims``, or
    ``msg_bytes``), -1 where none: a kernel's is its ``linking.launching_op`` among them (the innermost one
    holding its launch, else the one of its External id); a CPU call's the first of them nested in it (itself
    when it tells a size). ``names``: only CPU ops of these names whose (output, input) tensors are known
    (``_OUTPUT_INPUT_OPS``), comm-classified or not."""
    cpu = (events["lane"] == Lane.CPU.value).to_numpy()
    if names is None:
        candidates = np.flatnonzero(cpu & events["category"].isin(COMM_CATEGORIES).to_numpy())
        info = _size_args(events, args, candidates)
        tells = ((info["msg_bytes"] > 0) | (info["input_bytes"] > 0)
                 | ((info[["in_nelems", "out_nelems"]] > 0).any(axis=1) & (info["dtype"] != ""))).to_numpy()
    else:
        candidates = np.flatnonzero(cpu & events["name"].isin(list(names)).to_numpy())
        info = _pair_bytes(events, args, candidates)
        tells = ((info["out_tensor_bytes"] > 0) & (info["in_tensor_bytes"] > 0)).to_numpy()
    ops = candidates[tells]
    out = np.full(len(rows), -1, dtype=np.int64)
    row = rows["row"].to_numpy()
    gpu = rows["lane"].to_numpy() == Lane.GPU.value
    out[gpu] = launching_op(events, ops=ops, rows=row[gpu])
    calls = row[~gpu]
    if len(calls) and len(ops):
        owner = launching_op(events, ops=calls, rows=ops)  # the CPU call each sized op lies in
        held = owner >= 0
        start, dur = events["start_ns"].to_numpy(), events["dur_ns"].to_numpy()
        first = pd.DataFrame({"call": owner[held], "op": ops[held], "start": start[ops[held]],
                              "longer": -dur[ops[held]]}).sort_values(["call", "start", "longer"], kind="stable")
        first = first.drop_duplicates("call").set_index("call")["op"]
        out[~gpu] = first.reindex(calls).fillna(-1).to_numpy(dtype=np.int64)
    return out


def _finish(rows: pd.DataFrame, table: LinkTable, gpn: int, gpn_source: str) -> pd.DataFrame:
    n = rows["group_size"].to_numpy()
    category = rows["category"].to_numpy()
    link, gbps = crossed_links(rows, table, gpn)
    alone = (n == 1) & ~np.isin(category, P2P_CATEGORIES)
    rows["link"] = np.where(alone, "", link)
    limit = np.where(alone, np.nan, gbps)
    rows["link_gbps"] = limit
    size, dur = rows["bytes"].to_numpy(dtype=np.float64), rows["dur_ns"].to_numpy(dtype=np.float64)
    factor = busbw_factor(category, n)

    def busbw(time: np.ndarray) -> np.ndarray:
        return size / np.where(time > 0, time, np.nan) * factor  # bytes per ns = GB/s

    complete = (rows["members"].to_numpy() > 1) & ((n <= 0) | (rows["members"].to_numpy() >= n))
    transfer = rows["transfer_ns"].to_numpy(dtype=np.float64)
    use_transfer = complete & (transfer > 0)
    short = use_transfer & (busbw(transfer) > limit)  # the matched clocks made the transfer too short
    use_transfer &= ~short
    time = np.where(use_transfer, transfer, dur)
    bus = busbw(time)
    over = bus > limit
    rows["time_ns"] = time
    rows["time_basis"] = np.where(use_transfer, TimeBasis.TRANSFER.value, TimeBasis.DURATION.value)
    rows["inconsistent"], rows["check"] = _inconsistencies(rows, over, short, bus, transfer)
    rows["algbw_gbps"] = np.where(over, np.nan, size / np.where(time > 0, time, np.nan))
    rows["busbw_gbps"] = np.where(over, np.nan, bus)
    rows["wait_ns"] = np.where(use_transfer, rows["wait_ns"].to_numpy(dtype=np.float64), np.nan)
    rows["efficiency"] = rows["busbw_gbps"].to_numpy() / limit
    rows["latency_bound"] = size < LATENCY_BOUND_BYTES
    rows["pg"] = group_keys(rows["pg_name"], rows["pg_ranks"])
    out = rows[list(COLUMNS)].reset_index(drop=True)
    out = out.astype({"step": np.int64, "group_size": np.int64, "nodes": np.int64, "peer": np.int64,
                      "ranks_per_node": np.int64})
    out.attrs.update(gpus_per_node=gpn, gpus_per_node_source=gpn_source)
    return out


def _inconsistencies(rows: pd.DataFrame, over: np.ndarray, short: np.ndarray, bus: np.ndarray,
                     transfer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``inconsistent`` ("bytes", "duration" or "") and ``check`` (the values, in words) of every row.

    A row whose bytes over its time imply a bus bandwidth above its link's limit (``over``) cannot be: one input
    is wrong. A kernel's whole duration is measured on the GPU and holds the whole transfer, so there the bytes
    are (more than the call moved, or its group or link is not the one the trace tells), unless the kernel is
    one of several its comm op launched (a coalesced call) and the bytes are the whole call's: then its duration
    is a part of the call's. A CPU op's duration is not its transfer (an asynchronous op returns before the data
    moves): the duration. A matched transfer time that implies more than the limit (``short``: the clocks the
    matching aligned) gave way to the whole duration; ``check`` says so."""
    inconsistent = np.full(len(rows), "", dtype=object)
    check = np.full(len(rows), "", dtype=object)
    op_row = rows["op_row"].to_numpy()
    shares = rows.groupby(["rank", "op_row"], sort=False)["op_row"].transform("size").to_numpy()
    shares = np.where(op_row >= 0, shares, 1)
    cpu = rows["lane"].to_numpy() == Lane.CPU.value
    at = np.flatnonzero(over | short)
    columns = [rows[c].to_numpy()[at] for c in ("link_gbps", "link", "group_size", "nodes", "bytes", "size_source",
                                                 "dur_ns", "time_ns")]
    for i, gbps, link, n, nodes, size, source, dur, time in zip(at, *columns):
        limit = f"the {gbps:.4g} GB/s limit of {link} (a group of {n} on {nodes} node{'s' if nodes != 1 else ''})"
        size = f"{size:.0f} B ({source})"
        if short[i] and not over[i]:
            check[i] = (f"transfer time {transfer[i]:.0f} ns (the call's {dur} ns less the wait the matched clocks "
                        f"give) would be above {limit} for {size}: the whole duration is used, a lower bound")
            continue
        implied = f"{_gbps_text(bus[i])} GB/s of bus bandwidth, above {limit}"
        if cpu[i] or shares[i] > 1:
            inconsistent[i] = "duration"
            why = ("the CPU op's, which an asynchronous call leaves before its data moves" if cpu[i] else
                   f"one of the {shares[i]} kernels its comm op launched, which share these bytes")
            check[i] = f"duration inconsistent: {time:.0f} ns ({why}) for {size} would be {implied}"
        else:
            inconsistent[i] = "bytes"
            check[i] = (f"bytes inconsistent: {size} in the kernel's whole {time:.0f} ns would be {implied}: "
                        "more than the call moved, or its group or link is not the one the trace tells")
    return inconsistent, check


def _gbps_text(gbps: float) -> str:
    """Four significant digits, whole GB/s from 10,000 on (never an exponent)."""
    return f"{gbps:.4g}" if gbps < 1e4 else f"{gbps:,.0f}"


# --- the summary ----------------------------------------------------------------------------------------------

SUMMARY_COLUMNS = ("category", "dtype", "size_bucket", "group", "group_size", "link", "link_gbps", "calls",
                   "ranks", "bytes_median", "time_ns_median", "algbw_gbps_median", "busbw_gbps_median",
                   "busbw_gbps_max", "efficiency_median", "latency_bound", "time_basis", "verdict",
                   "bucket_bytes", "inconsistent_calls", "check")

#: A limit below this (GB/s) is no link's: a fraction of it is not printed as a percentage.
MIN_LIMIT_GBPS = 1e-3


def _bucket_label(lo: float) -> str:
    """``[lo, 4 lo)`` in binary units (1 KiB = 1024 B)."""
    def unit(x: float) -> str:
        for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if x >= size:
                return f"{x / size:g} {name}"
        return f"{x:g} B"
    return f"[{unit(lo)}, {unit(lo * 4)})"


def _verdict(latency_bound: bool, efficiency: float, limit: float, basis: str, calls: int, inconsistent: int,
             what: str) -> str:
    """A bucket's verdict (``bandwidth_summary``)."""
    if inconsistent == calls:
        return f"no verdict: {what} inconsistent"
    if latency_bound:
        return "latency-bound"
    if math.isnan(efficiency):
        return ""
    if not limit >= MIN_LIMIT_GBPS:
        return "no verdict: limit near zero"
    prefix = "" if basis == TimeBasis.TRANSFER.value else "≥ "
    percent = round(100 * efficiency, 1)
    text = f"{percent:g}" if percent >= 0.1 else f"{100 * efficiency:.2g}"  # two digits below 0.1 %, not "0"
    return f"{prefix}{text} % of peak"


def bandwidth_summary(df: pd.DataFrame) -> pd.DataFrame:
    """``collective_bandwidth`` rows grouped by (category, dtype, size bucket, group, link): medians of size,
    time and bandwidth, the efficiency, and ``verdict``, the text a report shows: "latency-bound" when every
    call of the bucket is under ``LATENCY_BOUND_BYTES``, else "x % of peak" (with "≥" when any time is a
    ``duration``, i.e. the bandwidth a lower bound; two significant digits below 0.1 %, never "0"), "" without a
    size or a limit. The bandwidths are those of the consistent calls: ``inconsistent_calls`` counts the others
    (bytes over time above the link's limit: ``collective_bandwidth``'s ``inconsistent``), and a bucket of nothing
    else has the verdict "no verdict: bytes (or duration) inconsistent"; ``check``: the first inconsistent call's
    message (else the first note); the medians of size and time are the consistent calls' too, where the bucket
    has any. A limit under ``MIN_LIMIT_GBPS`` gives no percentage. Buckets are powers of 4
    bytes (``bucket_bytes`` is the lower edge, for sorting) of one limit; ``group`` is the dim when known, else
    the pg ("(unnamed)" for a trace without process-group args)."""
    if df.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in SUMMARY_COLUMNS})
    sized = df["bytes"].to_numpy(dtype=np.float64)
    exponent = np.floor(np.log(np.where(sized > 0, sized, np.nan)) / np.log(4))
    lo = np.where(np.isnan(exponent), np.nan, 4.0 ** exponent)
    dim = df["dim"].astype(str).to_numpy()
    pg = df["pg"].astype(str).replace("", "(unnamed)")
    bad = df["inconsistent"].astype(str).to_numpy() != ""
    check = df["check"].astype(str).to_numpy()
    frame = df.assign(bucket_bytes=lo, group=np.where(np.isin(dim, ("", "unknown")), pg, dim),
                      bucket_key=np.nan_to_num(lo, nan=-1.0),
                      is_transfer=df["time_basis"].to_numpy() == TimeBasis.TRANSFER.value,
                      is_bad=bad, bad_check=np.where(bad, check, ""), note=np.where(bad, "", check))
    # the medians of size and time are the consistent calls' too, where a bucket has any (the bandwidths' are)
    some = frame.groupby(["category", "dtype", "bucket_key", "group", "link", "link_gbps"], dropna=False,
                         sort=False)["is_bad"].transform("min").to_numpy() == 0
    skip = bad & some
    frame["bytes"] = np.where(skip, np.nan, frame["bytes"].to_numpy(dtype=np.float64))
    frame["time_ns"] = np.where(skip, np.nan, frame["time_ns"].to_numpy(dtype=np.float64))
    keys = ["category", "dtype", "bucket_key", "group", "link", "link_gbps"]
    out = frame.groupby(keys, as_index=False, dropna=False, sort=True).agg(
        bucket_bytes=("bucket_bytes", "first"), group_size=("group_size", "max"),
        calls=("rank", "size"), ranks=("rank", "nunique"), bytes_median=("bytes", "median"),
        time_ns_median=("time_ns", "median"), algbw_gbps_median=("algbw_gbps", "median"),
        busbw_gbps_median=("busbw_gbps", "median"), busbw_gbps_max=("busbw_gbps", "max"),
        efficiency_median=("efficiency", "median"), latency_bound=("latency_bound", "all"),
        transfers=("is_transfer", "sum"), inconsistent_calls=("is_bad", "sum"),
        bad_check=("bad_check", _first_text), note=("note", _first_text))
    out["time_basis"] = np.where(out["transfers"] == out["calls"], TimeBasis.TRANSFER.value,
                                 np.where(out["transfers"] == 0, TimeBasis.DURATION.value, "mixed"))
    out["size_bucket"] = [_bucket_label(v) if v == v else "unknown" for v in out["bucket_bytes"]]
    out["check"] = np.where(out["bad_check"] != "", out["bad_check"], out["note"])
    what = [c.split(" ", 1)[0] if c else "" for c in out["bad_check"]]
    out["verdict"] = [_verdict(lb, e, lim, b, c, i, w) for lb, e, lim, b, c, i, w in zip(
        out["latency_bound"], out["efficiency_median"], out["link_gbps"], out["time_basis"], out["calls"],
        out["inconsistent_calls"], what)]
    out["inconsistent_calls"] = out["inconsistent_calls"].astype(np.int64)
    return out[list(SUMMARY_COLUMNS)].reset_index(drop=True)


def _first_text(values: pd.Series) -> str:
    """The first non-empty text of a bucket ("" when none)."""
    found = values[values != ""]
    return str(found.iloc[0]) if len(found) else ""
