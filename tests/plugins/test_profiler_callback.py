"""StepProfiler on a real run: the reference GPT under HybridParallelStrategy (dp2 x ZeRO-2, real DeepSpeed,
real Lightning Trainer with a TensorBoardLogger) on two forked gloo ranks. The traces, the event files (read
back with TensorBoard's own EventAccumulator) and the printed summary are checked against the profiling core
run here, independently, on the traces the callback wrote."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.errors import ContractError
from shardline.plugins.lightning.profiler_callback import REPORT_NAME, TRACE_DIR, StepProfiler
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.profiling.analyses.bubbles import pipeline_bubbles
from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, breakdown
from shardline.profiling.matching.pipelines import BubbleMethod
from shardline.profiling.table.load import load
from shardline.recipes.lit_gpt import GPTModule

STEPS, BATCH, SEQ, VOCAB = 7, 4, 16, 64
MICRO_BATCHES = 2
MODEL = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=2, d_model=16, optimizer="sgd", lr=0.1)


def _count_calls(module, name: str, counts: dict) -> None:
    """Count calls of ``module.name`` (in this forked rank only) into ``counts[name]``."""
    original = getattr(module, name)
    counts[name] = 0

    def counting(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    setattr(module, name, counting)


def _fit(rank, world, save_dir, strategy_kwargs, model_overrides):
    import shardline.profiling.attribution.core as attribution

    adopt_process_group_in_lightning()
    computed: dict[str, int] = {}  # the breakdown computation and its per-rank partition, counted here
    for name in ("_compute_breakdown", "partition_columns"):
        _count_calls(attribution, name, computed)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH * world * STEPS, SEQ + 1), generator=g)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    profiler = StepProfiler(wait=1, warmup=1, active=2)
    logger = pl.loggers.TensorBoardLogger(save_dir=str(save_dir), name="run", version=0)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=HybridParallelStrategy(**strategy_kwargs),
                         max_steps=STEPS, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[profiler])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.fit(GPTModule(**{**MODEL, **model_overrides}), DataLoader(data, batch_size=BATCH))
    engines = getattr(trainer.strategy.pipeline_driver, "_engines", {})
    return {"stdout": out.getvalue(), "summary": profiler.summary, "trace_dirs": profiler.trace_dirs,
            "log_dir": logger.log_dir, "tables": profiler.tables, "computed": computed,
            "always_annotate": [engine._always_annotate for engine in engines.values()]}


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("profiled")
    return run_ranks(_fit, 2, save_dir, dict(zero_stage=2), {}, timeout=240)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("profiled_pp")
    # pipeline_annotations reaches the engine (here "always": e.g. for a Kineto on-demand trace, which does not
    # raise torch's profiler flag).
    return run_ranks(_fit, 2, save_dir, dict(pp=2, zero_stage=1, micro_batches=MICRO_BATCHES,
                                             pipeline_annotations="always"), {"n_layer": 2}, timeout=240)


def test_every_rank_wrote_its_gzipped_trace_with_distributed_info(profiled_run):
    rank0, rank1 = profiled_run
    assert rank0["trace_dirs"] == rank1["trace_dirs"]  # one window, one folder agreed by both ranks
    (folder,) = rank0["trace_dirs"]
    assert folder == Path(rank0["log_dir"]) / TRACE_DIR / "window0"
    for rank in (0, 1):
        with gzip.open(folder / f"rank{rank}.pt.trace.json.gz", "rt") as fh:
            doc = json.load(fh)
        assert doc["distributedInfo"]["rank"] == rank and doc["distributedInfo"]["world_size"] == 2
        steps = {e["name"] for e in doc["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # wait=1, warmup=1, active=2


def test_breakdown_reaches_tensorboard_event_files(profiled_run):
    rank0 = profiled_run[0]
    (folder,) = rank0["trace_dirs"]
    table = breakdown(load(folder), layout={"dp": 2})  # computed here, independently of the callback
    assert sorted(table["rank"].unique()) == [0, 1] and sorted(table["step"].unique()) == [2, 3]
    assert (table["all_reduce"] + table["reduce_scatter"] + table["all_gather"] > 0).all()  # ZeRO-2 comm
    logdir = Path(rank0["log_dir"]) / TRACE_DIR
    for rank in (0, 1):
        acc = EventAccumulator(str(logdir / f"rank{rank}"), size_guidance={"scalars": 0})
        acc.Reload()
        mine = table[table["rank"] == rank].set_index("step")
        shown = [c for c in EXCLUSIVE_COLUMNS if (table[c] != 0).any()]
        assert {f"step_time_ms/{c}" for c in shown} <= set(acc.Tags()["scalars"])
        for column in [*shown, "total"]:
            events = acc.Scalars(f"step_time_ms/{column}")
            assert [e.step for e in events] == [2, 3]
            expected = mine["step_ns" if column == "total" else column] / 1e6
            # float32 in the event file
            assert [e.value for e in events] == pytest.approx(expected.tolist(), rel=1e-6)
    root = EventAccumulator(str(logdir))
    root.Reload()
    assert "_hparams_/session_start_info" in root.PluginTagToContent("hparams")
    assert (logdir / "plugins" / "shardline" / "manifest.json").is_file()


def test_summary_is_printed_with_overhead_and_report_written(profiled_run):
    rank0, rank1 = profiled_run
    # rank 0 alone publishes (DeepSpeed prints its own lines on every rank)
    assert "shardline StepProfiler" not in rank1["stdout"] and rank1["summary"] == ""
    summary = rank0["summary"]
    assert summary and summary in rank0["stdout"]
    lines = summary.splitlines()
    (table,) = rank0["tables"]
    for rank in (0, 1):
        mean_ms = table[table["rank"] == rank]["step_ns"].mean() / 1e6
        assert any(line.split()[:3] == [str(rank), "2", f"{mean_ms:.3f}"] for line in lines)
    # Batch 0 waits (and is excluded as the first batch), 1 is the profiler's warm-up, 2 and 3 are recorded,
    # 4, 5 and 6 run with the profiler stopped.
    overhead = [line for line in lines if line.startswith("profiling overhead")]
    assert len(overhead) == 1 and "(n=2)" in overhead[0] and "(n=3)" in overhead[0]
    report = (Path(rank0["log_dir"]) / TRACE_DIR / REPORT_NAME).read_text()
    assert summary in report and "window0" in report
    html = (Path(rank0["log_dir"]) / TRACE_DIR / "report_window0.html").read_text()
    assert '<section id="breakdown">' in html and '<section id="findings">' in html
    # The summary carries the window's top findings, as the profiling core ranks them for those traces.
    from shardline.profiling.present.report_sections import findings
    from shardline.profiling.table.load import load

    (folder,) = rank0["trace_dirs"]
    want = [f"finding (window0) {int(r.rank)}: {r.text}" for r in findings(load(folder)).head(3).itertuples()]
    assert want and [line for line in lines if line.startswith("finding (")] == want


def test_one_window_computes_its_breakdown_once(profiled_run):
    """The HTML report, the markdown table, TensorBoard's scalars, text, plugin data and merged trace of one
    window all read one attribution: its breakdown is computed once, one partition per rank."""
    rank0, rank1 = profiled_run
    assert rank0["computed"] == {"_compute_breakdown": 1, "partition_columns": 2}
    assert rank1["computed"] == {"_compute_breakdown": 0, "partition_columns": 0}  # rank 0 alone analyses


def test_pipeline_run_publishes_bubbles_and_timeline(pipeline_run):
    rank0 = pipeline_run[0]
    assert all(run["always_annotate"] == [True] for run in pipeline_run)  # the strategy's option reached it
    (folder,) = rank0["trace_dirs"]
    traceset = load(folder)
    bubbles = pipeline_bubbles(traceset)  # the strategy's pipeline engine annotated every batch
    assert (bubbles["method"] == BubbleMethod.ANNOTATIONS.value).all() and sorted(bubbles["stage"]) == [0, 0, 1, 1]
    assert set(bubbles["p"]) == {2} and set(bubbles["m"]) == {MICRO_BATCHES}
    table = breakdown(traceset, layout={"pp": 2})
    assert (table["bubble"] > 0).all()
    logdir = Path(rank0["log_dir"]) / TRACE_DIR
    for rank in (0, 1):
        acc = EventAccumulator(str(logdir / f"rank{rank}"), size_guidance={"scalars": 0})
        acc.Reload()
        expected = table[table["rank"] == rank].sort_values("step")["bubble"] / 1e6
        assert [e.value for e in acc.Scalars("step_time_ms/bubble")] == pytest.approx(expected.tolist(), rel=1e-6)
    root = EventAccumulator(str(logdir), size_guidance={"images": 0})
    root.Reload()
    (image,) = root.Images("breakdown/pipeline_timeline")
    assert image.encoded_image_string[:4] == b"\x89PNG"
    content = root.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert start.hparams["pp"].number_value == 2 and start.hparams["micro_batches"].number_value == MICRO_BATCHES
    window = json.loads((logdir / "plugins" / "shardline" / "window_2.json").read_text())
    assert len(window["bubbles"]) == len(bubbles)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    (dict(active=0), "active=0"), (dict(wait=-1), "wait=-1"), (dict(repeat=1.5), "repeat=1.5"),
    (dict(warmup=True), "warmup=True")])
def test_bad_schedule_is_named(kwargs, fragment):
    with pytest.raises(ContractError, match=fragment):
        StepProfiler(**kwargs)


def test_exported_under_its_contract_name():
    import shardline.plugins

    assert shardline.plugins.StepProfiler is StepProfiler


def test_tensorboard_plugin_lists_the_window_with_the_traces_in_place(profiled_run):
    from tensorboard.plugins.base_plugin import TBContext

    from shardline.profiling.present.tb_plugin import ShardlinePlugin, TraceKind

    rank0 = profiled_run[0]
    (folder,) = rank0["trace_dirs"]
    log_dir = Path(rank0["log_dir"])  # <save_dir>/run/version_0; TensorBoard pointed at <save_dir>/run
    listing = ShardlinePlugin(TBContext(logdir=str(log_dir.parent))).listing()
    (window,) = listing[f"{log_dir.name}/{TRACE_DIR}"].values()
    raw = sorted(path for _, kind, path in window["traces"] if kind == TraceKind.RAW.value)
    # The callback's traces already lie inside the TensorBoard run: listed where they are, not copied.
    assert raw == sorted((folder / f"rank{r}.pt.trace.json.gz").resolve() for r in (0, 1))
    assert [kind for _, kind, _ in window["traces"]].count(TraceKind.MERGED.value) == 1
