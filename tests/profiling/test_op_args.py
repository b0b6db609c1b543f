"""``load(path, op_args=True)``: the op args the schema's columns drop, kept as extra columns of the events table.

Expected values come from the raw JSON read with plain ``json`` (the args as the file writes them), row by row,
and are compared with the columns decoded by ``schema.json_values``: on hand-written traces on every decode path
that reads them, and on real corpus traces. Without ``op_args`` the table is exactly the schema's.
"""

from __future__ import annotations

import gzip
import json
import warnings

import numpy as np
import pandas as pd
import pytest

from shardline.profiling.base.errors import TraceWarning
from shardline.profiling.base.schema import (
    COLUMNS,
    JSON_ARG_COLUMNS,
    OP_ARG_COLUMNS,
    check_events,
    conform,
    has_op_args,
    json_values,
)
from shardline.profiling.readers import _plan, kineto
from shardline.profiling.table.load import load, read_op_args

#: Each op-args column, by the Kineto arg it keeps.
ARG_OF = {"input_dims": "Input Dims", "input_types": "Input type", "concrete_inputs": "Concrete Inputs",
          "in_split_sizes": "In split size", "out_split_sizes": "Out split size", "dtype": "dtype",
          "in_nelems": "In msg nelems", "out_nelems": "Out msg nelems"}
_DROPPED = {"Trace", "ac2g", "fwdbwd", "async", "flow", "python_function", "python"}

# A GEMM with its shapes (written across lines, as torch does with indent), a collective op and its kernel with
# their comm args (split sizes as a text, as torch writes them), an event without args, a dropped Python frame,
# and a B/E range with shapes on its B (it becomes one complete event, after the X events).
EVENTS = [
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 5,
     "args": {"External id": 3, "Input Dims": [[8, 16], [16, 32]], "Input type": ["c10::BFloat16", "c10::BFloat16"],
              "Concrete Inputs": ["", ""]}},
    {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1, "ts": 20, "dur": 9,
     "args": {"External id": 4, "Collective name": "all_to_allv", "In msg nelems": 96, "Out msg nelems": 64,
              "dtype": "Float", "In split size": "[32, 64]", "Out split size": "[16, 48]", "Input Dims": [[96]],
              "Input type": ["float"]}},
    {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "pid": 0,
     "tid": 7, "ts": 30, "dur": 4, "args": {"device": 0, "stream": 7, "correlation": 9, "In msg nelems": 96,
                                            "Out msg nelems": 64, "dtype": "Float"}},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "pid": 1, "tid": 1, "ts": 40, "dur": 1},
    {"ph": "X", "cat": "python_function", "name": "train.py(12): step", "pid": 1, "tid": 1, "ts": 1, "dur": 60,
     "args": {"Input Dims": [[1]]}},
    {"ph": "B", "cat": "user_annotation", "name": "region", "pid": 1, "tid": 1, "ts": 50,
     "args": {"Input Dims": [[2, 2]], "Concrete Inputs": ["True"]}},
    {"ph": "E", "cat": "user_annotation", "name": "region", "pid": 1, "tid": 1, "ts": 55},
]


def _write(tmp_path, events=EVENTS, *, name="rank0.json"):
    doc = {"distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1}, "traceEvents": events,
           "baseTimeNanoseconds": 1_700_000_000_000_000_000}
    path = tmp_path / name
    path.write_text(json.dumps(doc, indent=2))  # JSON values across lines, as the profiler writes them
    return path


def _expected(events: list[dict]) -> dict[str, list]:
    """Each op-args column's values of the kept events, in the reader's row order (X events, then each B)."""
    kept = [e for e in events if e.get("ph") == "X" and e.get("cat") not in _DROPPED]
    kept += [e for e in events if e.get("ph") == "B" and e.get("cat") not in _DROPPED]
    out = {}
    for column, key in ARG_OF.items():
        default = -1 if OP_ARG_COLUMNS[column] == "int64" else None if column in JSON_ARG_COLUMNS else ""
        out[column] = [(e.get("args") or {}).get(key, default) for e in kept]
    return out


def _values(events: pd.DataFrame) -> dict[str, list]:
    return {column: (json_values(events[column]).tolist() if column in JSON_ARG_COLUMNS
                     else events[column].astype(object).tolist()) for column in OP_ARG_COLUMNS}


def test_every_path_that_reads_them_keeps_the_op_args(tmp_path):
    path = _write(tmp_path)
    plain = kineto.read_kineto(path).events
    assert list(plain.columns) == list(COLUMNS) and not has_op_args(plain)
    read = 0
    for way in _plan.DecodePath:
        if way is _plan.DecodePath.NATIVE:
            with pytest.raises(_plan.PathRefused, match="op args"):
                kineto.read_kineto(path, force=way, op_args=True)
            continue
        events = kineto.read_kineto(path, force=way, op_args=True).events
        assert list(events.columns) == [*COLUMNS, *OP_ARG_COLUMNS], way
        check_events(events)
        pd.testing.assert_frame_equal(events[list(COLUMNS)], plain, obj=way.value)  # the schema's part: the same
        assert _values(events) == _expected(EVENTS), way
        read += 1
    assert read == len(_plan.DecodePath) - 1
    # split sizes are texts holding a list: their JSON value is that text
    assert _values(kineto.read_kineto(path, op_args=True).events)["in_split_sizes"][1] == "[32, 64]"


def test_the_plan_leaves_the_native_scanner_out_only_when_asked(tmp_path):
    path = _write(tmp_path)
    if _plan.native_on():
        assert _plan.plan(path).paths[0] is _plan.DecodePath.NATIVE
    asked = _plan.plan(path, op_args=True)
    assert _plan.DecodePath.NATIVE not in asked.paths and asked.op_args
    assert "op args" in asked.reason


@pytest.mark.parametrize("corpus_path", ["tracelens/b200/eager_trace.json.gz",
                                         "hta/nccl_parser_config/nccl_data.json.gz",
                                         "param/dlrm_kineto/worker0_step_12.1694128201545.pt.trace.json.gz"])
def test_real_traces_keep_the_args_of_the_raw_json(traces_dir, corpus_path):
    path = traces_dir / corpus_path
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        ts = load(path, op_args=True, rank=0)
        plain = load(path, rank=0)
    assert _values(ts.events) == _expected(events)
    pd.testing.assert_frame_equal(ts.events[list(COLUMNS)], plain.events)
    assert not has_op_args(plain.events)


def test_a_folder_read_by_workers_keeps_them_and_other_formats_hold_none(traces_dir, tmp_path):
    folder = traces_dir / "param" / "dlrm_kineto"
    one, many = load(folder, op_args=True, workers=1), load(folder, op_args=True, workers=2)
    pd.testing.assert_frame_equal(one.events, many.events)
    log = load(traces_dir / "nccl_debug_logs" / "nvidia_nccl_issue584_sendrecv_2ranks.log", op_args=True)
    assert list(log.events.columns) == [*COLUMNS, *OP_ARG_COLUMNS]
    assert (log.events[["in_nelems", "out_nelems"]] == -1).all().all()
    assert all((log.events[c] == "").all() for c in OP_ARG_COLUMNS if OP_ARG_COLUMNS[c] == "category")


def test_read_op_args_reads_a_plain_trace_set_again(traces_dir, tmp_path):
    folder = traces_dir / "param" / "dlrm_kineto"
    wanted = load(folder, op_args=True).events
    again = read_op_args(load(folder))
    assert _values(again) == _values(wanted)
    assert read_op_args(wanted) is not None and _values(read_op_args(wanted)) == _values(wanted)
    # a bare table names no file: nothing to read, every row empty
    bare = read_op_args(load(folder).events)
    assert (bare["in_nelems"] == -1).all() and (bare["input_dims"] == "").all()
    # a file that changed since it was loaded: said, and its rows stay empty
    path = _write(tmp_path)
    ts = load(path)
    _write(tmp_path, EVENTS[:2])
    with pytest.warns(TraceWarning, match="op args not read again"):
        stale = read_op_args(ts)
    assert (stale["input_dims"] == "").all()


def test_schema_check_and_conform_know_the_op_args_columns(tmp_path):
    events = load(_write(tmp_path), op_args=True).events
    check_events(events)
    assert list(conform(events).columns) == list(COLUMNS)
    assert conform(events, op_args=True) is events
    filled = conform(load(_write(tmp_path)).events, op_args=True)
    assert list(filled.columns) == [*COLUMNS, *OP_ARG_COLUMNS] and (filled["in_nelems"] == -1).all()
    broken = events.assign(in_nelems=events["in_nelems"].astype(np.float64))
    with pytest.raises(ValueError, match="'in_nelems' has dtype float64, expected int64"):
        check_events(broken)
