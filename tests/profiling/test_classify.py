"""classify_events: communication by evidence, memcpy/memset/sync, user rules, parallel dims."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.job.annotations import DIMS
from shardline.profiling.base.errors import ClassificationError
from shardline.profiling.base.schema import CATEGORIES, COMM_CATEGORIES, conform
from shardline.profiling.table.classify import classify_events
from shardline.profiling.table.dims import desc_dim, layout_dim
from shardline.profiling.table.kinds import Category
from shardline.profiling.table.linking import launch_rows, launching_op
from shardline.profiling.table.names import DEFAULT_RULES, CommRule, name_categories, name_category


def _classify(rows, **kw) -> pd.DataFrame:
    return classify_events(conform(pd.DataFrame(rows)), **kw)


@pytest.mark.parametrize("name, category", [
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "all_reduce"),
    ("ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "broadcast"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce_scatter"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "other_comm"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "other_comm"),
    ("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", "other_comm"),
    ("ncclKernel_Reduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "other_comm"),
    ("Memcpy HtoD (Pageable -> Device)", "memcpy_h2d"),
    ("Memcpy DtoH (Device -> Pinned)", "memcpy_d2h"),
    ("Memcpy DtoD (Device -> Device)", "memcpy_d2d"),
    ("Memcpy PtoP (Device -> Device)", "memcpy_d2d"),
    ("Memset (Device)", "memset"),
    ("cudaStreamSynchronize", "sync"), ("cudaDeviceSynchronize", "sync"), ("hipDeviceSynchronize", "sync"),
    ("Stream Wait Event", "sync"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 3, 128, 1>()", "compute"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>()", "compute"),
    ("nccl:all_to_all", "all_to_all"), ("nccl:_all_gather_base", "all_gather"), ("gloo:all_reduce", "all_reduce"),
    ("nccl:_reduce_scatter_base", "reduce_scatter"), ("nccl:send", "p2p_send"), ("nccl:recv", "p2p_recv"),
    ("c10d::allreduce_", "all_reduce"), ("c10d::alltoall_base_", "all_to_all"), ("c10d::barrier", "barrier"),
    ("sl:comm:tp:all_reduce", "all_reduce"), ("sl:comm:dp:memcpy_h2d", "memcpy_h2d"),
    ("void deep_ep::intranode::dispatch<8, 768>(void*)", "all_to_all"),
    ("cross_device_reduce_2stage<half, 8>", "all_reduce"),
    ("aten::mm", "compute"),
])
def test_name_only_categories(name, category):
    assert name_category(name)[0] == category
    assert category in CATEGORIES


def _kernel(name, *, corr=-1, ext=-1, start=1_000, **kw):
    return dict(rank=0, lane="gpu", stream=20, name=name, cat="kernel", start_ns=start, dur_ns=50,
                correlation=corr, external_id=ext, **kw)


def _cpu(name, start, dur, *, cat="cpu_op", stream=1, corr=-1, ext=-1, **kw):
    return dict(rank=0, lane="cpu", stream=stream, name=name, cat=cat, start_ns=start, dur_ns=dur,
                correlation=corr, external_id=ext, **kw)


SENDRECV = "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"


def test_generic_sendrecv_kernel_takes_the_op_of_the_annotation_around_its_launch():
    # DLRM's layout: record_param_comms (no args) > nccl:all_to_all > cudaLaunchKernel (correlation 7).
    # By name alone (HTA) this is a SendRecv/p2p kernel; it is an all-to-all.
    rows = [_cpu("record_param_comms", 100, 80), _cpu("nccl:all_to_all", 110, 60, cat="user_annotation"),
            _cpu("cudaLaunchKernel", 120, 5, cat="cuda_runtime", corr=7), _kernel(SENDRECV, corr=7),
            _cpu("cudaLaunchKernel", 200, 5, cat="cuda_runtime", corr=8), _kernel(SENDRECV, corr=8, start=2_000)]
    out = _classify(rows)
    assert out["category"].tolist()[3] == "all_to_all"
    assert out["category"].tolist()[5] == "other_comm"  # launched outside any comm op: no evidence


def test_external_id_links_kernel_to_record_param_comms_and_copies_group_args():
    rows = [_cpu("record_param_comms", 100, 80, ext=42, collective="all_to_allv", pg_name="3",
                 pg_desc="mesh_ep", pg_ranks="[0, 1, 2, 3]", pg_size=4, seq=11, msg_bytes=4096),
            _kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", ext=42, corr=99)]
    out = _classify(rows).iloc[1]
    assert (out["category"], out["dim"], out["pg_name"], out["seq"], out["pg_size"]) == ("all_to_all", "ep", "3",
                                                                                       11, 4)


def test_old_kineto_external_id_equal_to_correlation_does_not_link_to_a_later_op():
    rows = [_kernel(SENDRECV, ext=5, start=10),
            _cpu("record_param_comms", 100, 80, ext=5, collective="allreduce")]
    assert _classify(rows)["category"].tolist() == ["other_comm", "all_reduce"]


def _launch_table() -> pd.DataFrame:
    """Thread 1 of rank 0: an op P [100, 400) (row 0) holding five ops one after another (c0..c4, rows 1-5, 40 ns
    each, every 50 ns from 110) and a launch after them. Rows 0-6 ops, 7-9 launches, 10-14 the work."""
    ops = [_cpu("P", 100, 300, ext=50)] + [_cpu(f"c{i}", 110 + 50 * i, 40, ext=51 + i) for i in range(5)]
    ops.append(_cpu("twin", 160, 10, ext=60))  # starts with c1 ([160, 200)), ends first: the inner one (row 6)
    launches = [_cpu("cudaLaunchKernel", 165, 2, cat="cuda_runtime", corr=1),    # inside twin, in c1, in P
                _cpu("cudaLaunchKernel", 370, 2, cat="cuda_runtime", corr=2),    # in P only, past five children
                _cpu("cudaLaunchKernel", 500, 2, cat="cuda_runtime", corr=3)]    # in no op
    work = [_kernel("k1", corr=1, start=600), _kernel("k2", corr=2, start=700),
            _kernel("k3", corr=3, ext=52, start=800),  # no op holds its launch: its External id (c1, begun before)
            _kernel("k4", ext=54, start=120),          # no launch; its External id names c3, which began later
            _cpu("aten::add", 262, 5)]                 # a CPU row: its own launch, inside c3
    return conform(pd.DataFrame(ops + launches + work))


def test_launching_op_is_the_innermost_op_holding_the_launch_else_the_external_id():
    ev = _launch_table()
    ops = np.arange(7)
    assert launch_rows(ev, [10, 11, 12, 13, 14]).tolist() == [7, 8, 9, -1, -1]
    assert launching_op(ev, ops=ops, rows=[10, 11, 12, 13, 14]).tolist() == [6, 0, 2, -1, 4]
    # positions or a boolean mask, every row by default; a CPU op is its own op
    mask = np.zeros(len(ev), dtype=bool)
    mask[ops] = True
    every = launching_op(ev, ops=mask)
    assert every[:7].tolist() == list(range(7)) and every[10:].tolist() == [6, 0, 2, -1, 4]
    # preferred ops win over inner ones that are not; where none holds the launch, any op
    prefer = np.zeros(len(ev), dtype=bool)
    prefer[0] = True
    assert launching_op(ev, ops=ops, rows=[10, 12, 14], prefer=prefer).tolist() == [0, 2, 0]
    prefer[:] = False
    prefer[5] = True  # c4 holds neither
    assert launching_op(ev, ops=ops, rows=[10, 14], prefer=prefer).tolist() == [6, 4]


def test_own_collective_arg_beats_the_kernel_name_and_copy_kernels_stay_compute():
    copy = "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 3, 128, 1>()"
    rows = [_kernel("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", collective="_allgather_base"),
            _cpu("nccl:all_to_all", 100, 60, cat="user_annotation"),
            _cpu("cudaLaunchKernel", 110, 5, cat="cuda_runtime", corr=3), _kernel(copy, corr=3)]
    assert _classify(rows)["category"].tolist() == ["all_gather", "all_to_all", "compute", "compute"]


def test_user_rules_extend_and_bad_rules_are_our_error():
    rows = [_kernel("my_fused_allgather_gemm_kernel<bf16>")]
    assert _classify(rows)["category"].tolist() == ["compute"]
    rule = CommRule(r"fused_allgather_gemm", Category.ALL_GATHER, "async TP")
    assert _classify(rows, rules=[*DEFAULT_RULES, rule])["category"].tolist() == ["all_gather"]
    with pytest.raises(ClassificationError, match="not a valid regex"):
        CommRule("(unclosed", Category.ALL_GATHER)
    with pytest.raises(ClassificationError, match="not a communication category"):
        CommRule("x", Category.COMPUTE)


@pytest.mark.parametrize("rule", [r for r in DEFAULT_RULES if r.literals], ids=lambda r: r.pattern[:24])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_default_rule_literals_hold_for_every_match(rule, data):
    """A rule's ``literals`` let the classifier skip its regex; a wrong literal would silently call a
    communication kernel compute. Every name the pattern matches (generated from the regex, with text
    around it, as a search finds it) contains one of them."""
    text = data.draw(st.from_regex(rule.pattern, fullmatch=True))
    name = data.draw(st.text(max_size=8)) + text + data.draw(st.text(max_size=8))
    assert re.search(rule.pattern, name)
    assert any(literal in name for literal in rule.literals), (rule.pattern, name)


def test_names_without_a_rule_literal_still_run_literal_free_rules():
    rows = [_kernel("grouped_gemm_then_ag_kernel"), _kernel("userbuffers_rs_kernel")]
    plain = CommRule(r"then_ag", Category.ALL_GATHER)  # no literals: its regex runs on every name
    got = _classify(rows, rules=[*DEFAULT_RULES, plain])["category"].tolist()
    assert got == ["all_gather", "reduce_scatter"]
    # A literal that the name lacks skips the rule even though its regex would match: literals are a promise.
    promised = CommRule(r"then_ag", Category.ALL_GATHER, literals=("absent",))
    assert _classify(rows[:1], rules=[promised])["category"].tolist() == ["compute"]


_NAMES = st.one_of(st.text(max_size=30), st.sampled_from([
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "ncclKernel_AllReduce_RING_LL_Sum_float",
    "nccl:all_reduce", "record_param_comms", "Memcpy HtoD (Pageable -> Device)", "Memset (Device)",
    "cudaStreamSynchronize", "userbuffers_rs_kernel", "void at::native::gemm<float>", "gloo:all_gather", "",
    "a\nuserbuffers", "deep_ep::intranode::dispatch"]))


@settings(max_examples=200, deadline=None)
@given(st.lists(_NAMES, max_size=12), st.booleans())
def test_name_categories_equals_one_name_at_a_time(names, with_newline_rule):
    # The batched literal prefilter (one joined text) must never change a result, only skip work; a user rule
    # whose literal holds a newline can make a hit span two names: harmless, the exact check still runs.
    rules = [*DEFAULT_RULES, CommRule(r"a\nuser", Category.ALL_TO_ALL, literals=("a\nuser", "\nuser"))] \
        if with_newline_rule else DEFAULT_RULES
    assert name_categories(names, rules=rules) == [name_category(n, rules=rules) for n in names]


_WORDY = st.one_of(_NAMES, st.text(alphabet="alre_dcugths\nİNCL2p", max_size=40), st.sampled_from([
    "my_all_to_allv_kernel", "AllToAll", "all_toall", "symm_mem_x", "symmmem", "nvshmemx_barrier_all",
    "sendrecv", "p2p\nrecv", "reduce_scatter\nall_gather", "İstanbul_allreduce"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(_WORDY, max_size=12))
def test_comm_word_table_equals_the_pattern_searched_per_name(names):
    # The table is built by str.find scans of the joined names, one per spelling of the pattern's words
    # (classify._COMM_WORDS): it must say exactly what COMM_WORD_RE, searched in each name alone, says.
    from shardline.profiling.table.names import COMM_WORD_RE, comm_word_table

    want = [COMM_WORD_RE.search(name.lower()) is not None if len(name.lower()) == len(name)
            else re.search(COMM_WORD_RE.pattern, name, re.IGNORECASE) is not None for name in names]
    assert comm_word_table(names).tolist() == want


@pytest.mark.parametrize("desc, dim", [
    ("sl:tp", "tp"), ("sl:dp_cp", "dp_cp"), ("mesh_tp", "tp"), ("mesh_dp_shard", "dp"), ("mesh_pp", "pp"),
    ("mesh_cp", "cp"), ("mesh_dp_shard_cp", "dp_cp"), ("mesh_ep", "ep"), ("TENSOR_MODEL_PARALLEL_GROUP", "tp"),
    ("PIPELINE_MODEL_PARALLEL_GROUP", "pp"), ("DATA_PARALLEL_GROUP", "dp"), ("CONTEXT_PARALLEL_GROUP", "cp"),
    ("EXPERT_MODEL_PARALLEL_GROUP", "ep"), ("DATA_PARALLEL_GROUP_WITH_CP", "dp_cp"), ("default_pg", "world"),
    ("MODEL_PARALLEL_GROUP", "mp"), ("sl:mp", "mp"), ("TENSOR_AND_DATA_PARALLEL_GROUP", ""),
    ("undefined", ""), ("mesh_dim_0", ""),
])
def test_group_descriptions_name_dims(desc, dim):
    assert desc_dim(desc) == dim


def test_layout_fallback_from_ranks_and_size():
    layout = dict(tp=2, cp=1, dp=2, pp=2)  # rank = tp + 2*dp + 4*pp
    assert layout_dim("[4, 5]", size=2, layout=layout) == "tp"
    assert layout_dim("[1, 3]", size=2, layout=layout) == "dp"
    assert layout_dim("[2, 6]", size=2, layout=layout) == "pp"
    assert layout_dim("[0, 1, 2, 3]", size=4, layout=layout) == "unknown"  # tp x dp: no single dimension
    assert layout_dim("[2, 3, 6, 7]", size=4, layout=layout) == "mp"  # tp x pp at dp 1: Megatron's model parallel
    assert layout_dim("[0, 5]", size=2, layout=layout) == "unknown"  # varies along tp and pp, but not all of them
    assert layout_dim(str(list(range(8))), size=8, layout=layout) == "world"
    assert layout_dim("", size=2, layout=layout) == "unknown"  # three dims of size 2: size alone is ambiguous
    assert layout_dim("", size=4, layout=dict(tp=4, dp=2)) == "tp"


def test_dims_in_the_table_and_bad_layout():
    rows = [_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", collective="allreduce", pg_desc="undefined",
                    pg_ranks="[0, 1]", pg_size=2),
            _kernel("ncclDevKernel_AllGather_RING_LL(x)", pg_desc="sl:dp"), _kernel("aten_gemm_kernel")]
    assert _classify(rows)["dim"].tolist() == ["unknown", "dp", ""]
    assert _classify(rows, layout=dict(tp=2, dp=4))["dim"].tolist() == ["tp", "dp", ""]
    with pytest.raises(ClassificationError, match="invalid"):
        _classify(rows, layout=dict(tp=0))
    with pytest.raises(ClassificationError, match="invalid"):
        _classify(rows, layout=dict(sp=2))


def test_real_traces_generic_kernels_are_named_by_their_ops(traces_dir):
    from shardline.profiling.table.load import load

    dlrm = load(traces_dir / "param" / "dlrm_kineto").events
    gpu = dlrm[dlrm["lane"] == "gpu"]
    sendrecv = gpu[gpu["name"].astype(str).str.startswith("ncclKernel_SendRecv")]
    assert len(sendrecv) == 40 and (sendrecv["category"] == "all_to_all").all()
    assert (gpu[gpu["name"].astype(str).str.startswith("ncclKernel_AllReduce")]["category"] == "all_reduce").all()
    b200 = load(traces_dir / "tracelens" / "b200" / "eager_trace.json.gz").events
    (ag,) = b200[b200["name"].astype(str).str.startswith("ncclDevKernel_AllGather")].itertuples()
    assert (ag.category, ag.collective, ag.pg_name, ag.dim) == ("all_gather", "_allgather_base", "3", "unknown")
    with_layout = classify_events(b200, layout=dict(tp=8))
    assert with_layout.loc[ag.Index, "dim"] == "world"


def test_bad_tables_are_our_error():
    with pytest.raises(ClassificationError, match="expects an events DataFrame"):
        classify_events({"name": ["x"]})
    with pytest.raises(ClassificationError, match="missing column"):
        classify_events(pd.DataFrame({"name": ["x"]}))


def test_classification_does_not_depend_on_row_order(traces_dir):
    import numpy as np

    from shardline.profiling.table.load import load

    events = load(traces_dir / "param" / "dlrm_kineto", classify=False).events
    events = events[events["rank"].isin([0, 1])]
    first = classify_events(events)
    shuffled = classify_events(events.iloc[np.random.default_rng(0).permutation(len(events))])
    assert shuffled.loc[first.index, "category"].tolist() == first["category"].tolist()
    gpu = first[first["lane"] == "gpu"]
    assert (gpu["category"] == "all_to_all").sum() == 10  # 5 all-to-all kernels on each of the two ranks


_NAME_PARTS = st.sampled_from(["ncclKernel_", "ncclDevKernel_", "AllReduce", "SendRecv", "Generic", "nccl:",
                               "gloo:", "Memcpy ", "HtoD", "Memset", "sl:comm:", "tp:", "c10d::", "(", "*", "\\",
                               "record_param_comms", "deep_ep::", "_", " "])


@settings(max_examples=80, deadline=None)
@given(names=st.lists(st.one_of(st.text(max_size=30), st.lists(_NAME_PARTS, max_size=6).map("".join)),
                      min_size=1, max_size=12),
       descs=st.lists(st.text(max_size=20), min_size=1, max_size=12),
       lanes=st.lists(st.sampled_from(["cpu", "gpu"]), min_size=1, max_size=12))
def test_any_names_and_descriptions_get_a_valid_category_and_dim(names, descs, lanes):
    n = len(names)
    rows = [dict(rank=0, lane=lanes[i % len(lanes)], stream=1, name=names[i], cat="kernel", start_ns=10 * i,
                 dur_ns=5, correlation=i % 3, pg_desc=descs[i % len(descs)], pg_ranks="[0, 1]", pg_size=2)
            for i in range(n)]
    out = _classify(rows, layout=dict(tp=2))
    assert set(out["category"].astype(str)) <= set(CATEGORIES) - {"idle"}
    comm = out["category"].astype(str).isin(COMM_CATEGORIES)
    assert (out.loc[~comm, "dim"].astype(str) == "").all()
    assert set(out.loc[comm, "dim"].astype(str)) <= set(DIMS) | {"unknown"}


def test_a_rule_need_not_be_a_comm_rule_instance():
    """Rules are read by attribute (``pattern``, ``category``; ``literals`` when present)."""
    from types import SimpleNamespace

    rule = SimpleNamespace(pattern=r"fused_allgather_gemm", category=Category.ALL_GATHER)
    assert name_category("my_fused_allgather_gemm_kernel", rules=[rule]) == ("all_gather", True)
