"""Workload detection (``shardline.profiling.table.workload``) on public traces of each kind, the all-to-all's
use on real and generated traces, the findings' advice that follows from it, and the findings' time precision.

Public traces: the shared corpus (``$SHARDLINE_TRACES``) and the small ones in ``tests/data/public`` (see its
PROVENANCE.md: TraceLens's SGLang / vLLM decode traces, a ViT and a GPU-only MI210 CNN trace). No small public
LLM-training or MoE-training trace was found: those kinds are checked on generated traces.
"""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path

import pytest

from shardline.profiling.analyses.findings import DEFAULT_RULES, ms_figures
from shardline.profiling.base.errors import ProfilingError
from shardline.profiling.table.workload import AllToAllUse, Confidence, WorkloadKind, detect_workload

PUBLIC = Path(__file__).resolve().parents[1] / "data" / "public"
_RULE = tuple(r for r in DEFAULT_RULES if r.name == "exposed_collective")


def _load(path: Path):
    from shardline.profiling.table.load import load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return load(path)
        except ProfilingError:  # a single trace that records no rank
            return load(path, rank=0)


CORPUS_CASES = [
    ("param/dlrm_kineto", WorkloadKind.RECOMMENDER, ()),
    ("hta/trace_filter/sampled_rank-0.json.gz", WorkloadKind.RECOMMENDER, ()),
    ("hta/distributed_info_unavailable/distributed_info_not_found.json.gz", WorkloadKind.RECOMMENDER, ()),
    ("kineto_tb_plugin/resnet50_num_workers_4/worker0.1623213129365.pt.trace.json.gz", WorkloadKind.VISION, ()),
    ("hta/critical_path/alexnet/benchmark_result_2869224_1695835535_trace.json.gz", WorkloadKind.VISION, ()),
    ("hta/nccl_parser_config/nccl_data.json.gz", WorkloadKind.VISION, ()),
    ("tracelens/b200/eager_trace.json.gz", WorkloadKind.INFERENCE, (WorkloadKind.MOE,)),
    ("hta/critical_path/cuda_event_sync/event_sync_trace.json.gz", WorkloadKind.UNKNOWN, ()),
]
PUBLIC_CASES = [
    ("inference/tracelens_sglang_Qwen3-8B_decode.json.gz", WorkloadKind.INFERENCE, ()),
    ("inference/tracelens_vllm_decode_full_graph_execution.json.gz", WorkloadKind.INFERENCE, (WorkloadKind.MOE,)),
    ("vision/tracelens_h100_Falconsai_nsfw_image_detection.json.gz", WorkloadKind.VISION, ()),
    ("vision/tracelens_mi210_gpu_only_trace.json.gz", WorkloadKind.VISION, ()),
    # The 16-rank TorchRec trace (HTA), trimmed to its communication by another change: not read while
    # the rules were written.
    ("recommender/hta_torchrec_a100_rank0_comm.json.gz", WorkloadKind.RECOMMENDER, ()),
]


@pytest.mark.parametrize("path, kind, traits", CORPUS_CASES, ids=[c[0].split("/")[0] + ":" + c[1].name
                                                                  for c in CORPUS_CASES])
def test_the_corpus_traces_are_detected_as_their_kind(traces_dir, path, kind, traits):
    found = detect_workload(_load(traces_dir / path).events)
    assert (found.kind, found.traits) == (kind, traits), found.describe()
    if kind is not WorkloadKind.UNKNOWN:
        assert found.evidence and all(e.events > 0 and e.names for e in found.evidence)
        assert found.describe().startswith(f"workload: {kind.value}")


@pytest.mark.parametrize("path, kind, traits", PUBLIC_CASES, ids=[c[0] for c in PUBLIC_CASES])
def test_the_public_traces_are_detected_as_their_kind(path, kind, traits):
    if not (PUBLIC / path).is_file():
        pytest.skip(f"{path} is not in tests/data/public")
    found = detect_workload(_load(PUBLIC / path).events)
    assert (found.kind, found.traits) == (kind, traits), found.describe()
    assert found.confidence in (Confidence.HIGH, Confidence.MEDIUM)
    if kind is WorkloadKind.RECOMMENDER:  # every all-to-all of a TorchRec job is its embedding exchange
        assert found.all_to_all_calls and {use for use, _ in found.all_to_all_calls} == {AllToAllUse.EMBEDDING}


def _raw_names(path: Path) -> list[str]:
    with gzip.open(path, "rt") as f:
        return [e.get("name", "") for e in json.load(f)["traceEvents"]]


@pytest.fixture(scope="module")
def dlrm(traces_dir):
    return _load(traces_dir / "param" / "dlrm_kineto")


def test_the_dlrm_evidence_counts_match_the_raw_files(traces_dir, dlrm):
    """The recommender's evidence counted from the JSON files themselves: every event whose name holds
    ``split_embedding`` / ``embedding_codegen`` / ``SplitLookupFunction`` / ``TableBatchedEmbedding`` /
    ``embedding_bag`` (the FBGEMM lookup signal), and 5 ``c10d::alltoall_base_`` per rank, each the outermost
    all-to-all of its thread."""
    folder = traces_dir / "param" / "dlrm_kineto"
    names = [n for p in sorted(folder.glob("*.json.gz")) for n in _raw_names(p)]
    lookups = sum(any(k in n for k in ("split_embedding", "embedding_codegen", "SplitLookupFunction",
                                       "embedding_bag", "TableBatchedEmbedding")) for n in names)
    calls = sum(n == "c10d::alltoall_base_" for n in names)
    assert calls == 40
    found = detect_workload(dlrm.events)
    (lookup,) = [e for e in found.evidence if e.label == "FBGEMM embedding lookup"]
    assert lookup.events == lookups
    assert found.all_to_all is AllToAllUse.EMBEDDING and found.all_to_all_calls == ((AllToAllUse.EMBEDDING, 40),)
    assert "## alltoall_fwd_single ##" in found.all_to_all_text()


def test_the_dlrm_all_to_all_finding_is_the_embedding_exchange_not_moe(dlrm):
    from shardline.profiling.present.report_md import render_markdown
    from shardline.profiling.present.report_sections import report_sections

    sections = report_sections(dlrm)
    (text,) = [t for t in sections.findings["text"] if "all-to-all" in t]
    assert text.startswith("exposed all-to-all (embedding exchange)") and "TorchRec" in text
    assert not any(word in text for word in ("DeepEP", "expert", "dispatch/combine", "MoE"))
    # The report leads with the workload: its first line after the title, and its own section first.
    md = render_markdown(sections).splitlines()
    assert md[2].startswith("**workload: recommender, high confidence, from FBGEMM embedding lookup")
    assert md.index("## Workload: what this trace records, detected from its names") < md.index(
        next(line for line in md if line.startswith("## Findings")))


# --- generated traces: MoE (DeepEP), Ulysses, and an all-to-all nobody names -------------------------------------

def _a2a_step(synth, *, host: list[tuple[str, int, int]], kernel: str | None = None, dim: str = ""):
    """One rank, step [0, 400): compute [0, 100) and [300, 400), an all-to-all kernel [100, 300) exposed (50%
    of the step, 200 ns); on the host, the call ``c10d::alltoall_base_`` [100, 110) inside the spans ``host``
    (name, start, dur)."""
    a2a = dict(synth.gpu_event(0, "all_to_all", 100, 200), category="all_to_all")
    if kernel:
        a2a["name"] = kernel
    rows = [dict(synth.gpu_event(0, "compute", 0, 100), category="compute"), a2a,
            dict(synth.gpu_event(0, "compute", 300, 100), category="compute"),
            synth.annotation(0, "ProfilerStep#0", 0, 400)]
    rows += [dict(synth.host_row(0, name, start, dur, cat="cpu_op"), category="compute") for name, start, dur in host]
    rows.append(dict(synth.host_row(0, "c10d::alltoall_base_", 100, 10, cat="cpu_op"), category="all_to_all",
                     dim=dim))
    return synth.to_frame(rows)


def _finding(frame):
    from shardline.profiling.present.report_sections import findings

    table = findings(frame, rules=_RULE)
    (text,) = table["text"]
    return table, text


def test_a_deepep_moe_all_to_all_gets_the_expert_advice(synth):
    frame = _a2a_step(synth, host=[("MoELayer.forward", 90, 40), ("deep_ep::Buffer::dispatch", 95, 20)],
                      kernel="void deep_ep::intranode::dispatch<8, 768>(void*)")
    found = detect_workload(frame)
    assert found.kind is WorkloadKind.MOE and found.all_to_all is AllToAllUse.EXPERT
    table, text = _finding(frame)
    # The step is the one rank's; a perfect overlap removes the 200 ns all-to-all: 0.000200 ms to 3 figures.
    assert table["saves_ns"].tolist() == [200.0]
    assert text.startswith("exposed all-to-all (expert dispatch/combine) 50.00% of step: expert dispatch/combine")
    assert "DeepEP" in text and "shared experts" in text and text.endswith("; −0.000200 ms/step")


def test_deepep_kernels_of_a_gpu_only_trace_are_expert_calls(synth):
    """DeepEP launches its kernels from its own extension: no host collective op. Two dispatches and a combine
    are 3 expert calls; the NCCL kernel beside them, with no host call either, names nothing: in an MoE job it
    is taken as expert traffic too (the workload's), and the text says so."""
    rows = [dict(synth.gpu_event(0, "all_to_all", 100 * i, 50, name=name), category="all_to_all")
            for i, name in enumerate(["void deep_ep::intranode::dispatch<8, 768>(void*)",
                                      "void deep_ep::intranode::dispatch<8, 768>(void*)",
                                      "void deep_ep::intranode::combine<__nv_bfloat16, 8, 768>(void*)",
                                      synth.KERNEL_NAMES["all_to_all"]])]
    found = detect_workload(synth.to_frame(rows))
    assert found.kind is WorkloadKind.MOE and found.evidence[0].events == 3
    assert found.all_to_all_calls == ((AllToAllUse.EXPERT, 4),)
    assert found.all_to_all_text() == (
        "all-to-all: expert dispatch/combine, 4 calls (kernels void deep_ep::intranode::dispatch<8, 768>(void*), "
        "void deep_ep::intranode::combine<__nv_bfloat16, 8, 768>(voi…; 1 with no naming context, taken from "
        "the workload (mixture-of-experts))")  # names cut at 60 characters


def test_a_recommender_all_to_all_without_context_is_taken_as_the_embedding_exchange(synth):
    frame = _a2a_step(synth, host=[("fbgemm::split_embedding_codegen_lookup_adagrad_function", 0, 90)])
    found = detect_workload(frame)
    assert found.kind is WorkloadKind.RECOMMENDER and found.confidence is Confidence.MEDIUM
    assert found.all_to_all_calls == ((AllToAllUse.EMBEDDING, 1),)
    assert "1 with no naming context, taken from the workload (recommender)" in found.all_to_all_text()


@pytest.mark.parametrize("how", ["annotation", "group dim"])
def test_a_ulysses_all_to_all_gets_the_sequence_parallel_advice(synth, how):
    host = [("_SeqAllToAll", 98, 20)] if how == "annotation" else []
    frame = _a2a_step(synth, host=[("aten::scaled_dot_product_attention", 50, 200), *host],
                      dim="" if how == "annotation" else "cp")
    found = detect_workload(frame)
    assert found.all_to_all is AllToAllUse.ULYSSES and found.all_to_all_calls == ((AllToAllUse.ULYSSES, 1),)
    _, text = _finding(frame)
    assert text.startswith("exposed all-to-all (Ulysses attention exchange) 50.00% of step")
    assert "ring attention" in text and "DeepEP" not in text and "TorchRec" not in text


def test_the_innermost_naming_span_decides(synth):
    """An all-to-all inside Ulysses attention inside an MoE layer is the attention's exchange."""
    frame = _a2a_step(synth, host=[("MoELayer.forward", 0, 400), ("_SeqAllToAll", 98, 20)])
    assert detect_workload(frame).all_to_all is AllToAllUse.ULYSSES


def test_an_all_to_all_nobody_names_gets_neutral_advice(synth):
    frame = _a2a_step(synth, host=[("aten::mm", 0, 90)])
    found = detect_workload(frame)
    assert (found.kind, found.all_to_all) == (WorkloadKind.UNKNOWN, AllToAllUse.UNKNOWN)
    _, text = _finding(frame)
    assert text.startswith("exposed all-to-all 50.00% of step: all-to-all is exposed: the trace does not say")
    for lever in ("DeepEP", "shared experts", "TorchRec", "QCommsConfig", "ring attention", "dispatch/combine"):
        assert lever not in text, lever


def test_a_generated_megatron_job_is_llm_training_with_its_dims(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("shardline_tests_job_traces", Path(__file__).with_name(
        "job_traces.py"))
    job_traces = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job_traces)
    job_traces.write_job(tmp_path, tp=2, pp=2, dp=1, steps=1, micro_batches=2, layers_per_stage=1)
    found = detect_workload(_load(tmp_path).events)
    assert found.kind is WorkloadKind.LLM_TRAINING and found.training
    assert {"tp", "pp"} <= set(found.dims) and found.describe().startswith("workload: LLM training (tp")


def test_detection_refuses_what_is_not_an_events_table():
    with pytest.raises(ProfilingError, match="got list"):
        detect_workload([1, 2])


# --- precision ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ns, text", [(141_857_600, "142"), (3_172_000, "3.17"), (10_250_000, "10.3"),
                                      (200, "0.000200"), (99_950_000, "100"), (1_234_567_890, "1235"), (0, "0")])
def test_times_print_to_three_significant_figures(ns, text):
    # By hand: 141.8576 ms -> 142; 10.25 -> 10.3 (half up); 99.95 -> 100 (the carry adds a digit: 3 figures kept).
    assert ms_figures(ns) == text
