"""Per-rank analysis on executors (``shardline.profiling.attribution.scale``): the same results as the
single-table path.

The reference is the single-table path on the same files: ``breakdown(load(path))``, ``match_collectives``,
``comm_calls`` and ``bubbles.rank_pipelines`` of the whole trace set. The scale path reads each file in a
worker and hands the driver only the communication rows, so every comparison below is exact (frame equality).
"""

from __future__ import annotations

import gzip
import json
import shutil
import warnings

import numpy as np
import pandas as pd
import pytest

from shardline.profiling.base.errors import TraceWarning

H100 = "NVIDIA H100 80GB HBM3"


def _reference(path):
    from shardline.profiling import breakdown, load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        ts = load(path)
        return ts, breakdown(ts)


def _analyze(path, **options):
    from shardline.profiling.attribution.scale import analyze

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        return analyze(path, **options)


def _same_cross_rank(ts, result) -> None:
    """match_collectives / comm_calls / the pipelines of the compact attribution equal the whole table's."""
    from shardline.profiling.attribution.core import attribute
    from shardline.profiling.base.errors import AttributionError
    from shardline.profiling.matching.collectives import comm_calls, match_collectives
    from shardline.profiling.matching.pipelines import rank_pipelines

    pd.testing.assert_frame_equal(comm_calls(ts), comm_calls(result.attribution))
    try:
        want = match_collectives(ts)
    except AttributionError:
        want = None
    if want is not None:
        pd.testing.assert_frame_equal(want, match_collectives(result.attribution))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        full, mine = rank_pipelines(attribute(ts))[0], rank_pipelines(result.attribution)[0]
    assert full.keys() == mine.keys()
    for rank, pipeline in full.items():
        assert pipeline.method is mine[rank].method, rank
        for a, b in zip(pipeline.bubble, mine[rank].bubble):
            np.testing.assert_array_equal(a, b)


def test_the_corpus_dlrm_set_gives_the_single_table_results(traces_dir):
    path = traces_dir / "param" / "dlrm_kineto"
    ts, want = _reference(path)
    result = _analyze(path, executor="local", workers=2)
    pd.testing.assert_frame_equal(want, result.breakdown)
    _same_cross_rank(ts, result)
    assert result.ranks == ts.ranks and result.events == len(ts.events)
    assert result.compact_events < len(ts.events) / 20  # the driver holds the communication rows only
    assert not result.failed


@pytest.mark.parametrize("variant", [
    {"p": 4, "m": 8},
    {"p": 4, "m": 4, "schedule": "gpipe", "stage_rank": [2, 0, 3, 1], "group_ranks": False,
     "offsets": [0, 5_000, -3_000, 12_000]},
])
def test_a_send_recv_pipeline_is_measured_across_ranks_then_each_rank_again(synth, tmp_path, variant):
    # The bubble of a pipeline traced with send/recv alone needs its peers: the driver matches the compact
    # rows, then the workers partition those ranks again with the bubble it measured.
    from shardline.profiling.matching.pipelines import BubbleMethod, rank_pipelines

    rows, _ = synth.spinning_pipeline(**variant)
    synth.write_kineto(rows, tmp_path, device_name=H100)
    ts, want = _reference(tmp_path)
    result = _analyze(tmp_path, executor="local", workers=2)
    pd.testing.assert_frame_equal(want, result.breakdown)
    assert (result.breakdown["bubble"] > 0).all()
    assert {p.method for p in rank_pipelines(result.attribution)[0].values()} == {BubbleMethod.P2P_MATCHED}
    _same_cross_rank(ts, result)


def test_a_generated_32_rank_job_gives_the_single_table_results(jobs, tmp_path):
    # tp2 x pp4 x dp4, Megatron order: TP all-reduces, 1F1B send/recv, DP reduce-scatter/all-gather, skewed
    # clocks, a straggler (tests/profiling/job_traces.py). Its pipeline bubbles need the second map.
    from shardline.profiling.matching.pipelines import BubbleMethod, rank_pipelines

    jobs.write_job(tmp_path, tp=2, pp=4, dp=4, steps=1, micro_batches=4)
    ts, want = _reference(tmp_path)
    result = _analyze(tmp_path, executor="local", workers=2)
    assert result.ranks == tuple(range(32))
    pd.testing.assert_frame_equal(want, result.breakdown)
    assert {p.method for p in rank_pipelines(result.attribution)[0].values()} == {BubbleMethod.P2P_MATCHED}
    _same_cross_rank(ts, result)


def test_the_second_map_reads_the_kept_table_not_the_trace(synth, tmp_path, monkeypatch):
    # On the driver's host the first map keeps each pipeline rank's loaded table; the second map, which needs
    # the driver's bubble, starts from it: every trace is decoded once (workers=1 runs the map in this process).
    import shardline.profiling.table.load as load_module

    rows, _ = synth.spinning_pipeline(p=4, m=4)
    synth.write_kineto(rows, tmp_path, device_name=H100)
    _, want = _reference(tmp_path)
    reads = []
    original = load_module.load
    monkeypatch.setattr(load_module, "load", lambda path, **kw: reads.append(path) or original(path, **kw))
    result = _analyze(tmp_path, executor="local", workers=1)
    pd.testing.assert_frame_equal(want, result.breakdown)
    assert sorted(reads) == sorted(str(f) for f in tmp_path.iterdir())  # once each


def test_sl_pp_annotations_are_measured_in_the_worker(synth, tmp_path):
    rows, _ = synth.one_f_one_b(4, 6)
    synth.write_kineto(rows, tmp_path)
    ts, want = _reference(tmp_path)
    assert (want["bubble"] > 0).any()
    result = _analyze(tmp_path, executor="local", workers=2)
    pd.testing.assert_frame_equal(want, result.breakdown)


def _rank_file(src, dst, *, rank=None, world=None):
    doc = json.loads(gzip.decompress(src.read_bytes()))
    if rank is not None:
        doc["distributedInfo"]["rank"] = rank
    if world is not None:
        doc["distributedInfo"]["world_size"] = world
    dst.write_bytes(gzip.compress(json.dumps(doc).encode()))


def test_bad_files_are_named_and_the_others_analysed(traces_dir, tmp_path):
    from shardline.profiling.base.errors import MixedJobsError

    source = sorted((traces_dir / "param" / "dlrm_kineto").iterdir())
    folder = tmp_path / "run"
    folder.mkdir()
    for file in source[:3]:
        shutil.copy(file, folder / file.name)
    (folder / "rank7.pt.trace.json").write_bytes(b"\x00\x01 not json at all")  # unreadable
    from shardline.profiling.attribution.scale import analyze

    with pytest.warns(TraceWarning) as caught:
        result = analyze(folder, executor="local", workers=2)
    texts = [str(w.message) for w in caught]
    assert list(result.failed) == [str(folder / "rank7.pt.trace.json")]
    assert any("rank7.pt.trace.json" in t and "not analysed" in t for t in texts)
    assert any("no file holds rank(s) 3, 4, 5, 6, 7" in t for t in texts)  # world_size 8, ranks 0-2 here
    assert sorted(result.breakdown["rank"].unique()) == [0, 1, 2]
    # A rank two files claim is refused, naming both.
    _rank_file(source[1], folder / "copy_of_rank1.pt.trace.json.gz", rank=0)
    with pytest.raises(MixedJobsError, match="rank 0 is in two files"):
        _analyze(folder, executor="local", workers=2)


def test_an_unknown_executor_and_a_missing_engine_are_our_errors(traces_dir, monkeypatch):
    import sys

    from shardline.profiling.attribution.scale import ExecutorError, analyze

    with pytest.raises(ExecutorError, match="executor='spark'"):
        analyze(traces_dir / "param" / "dlrm_kineto", executor="spark")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ExecutorError, match="needs Ray"):
        analyze(traces_dir / "param" / "dlrm_kineto", executor="ray")


def test_the_report_command_runs_the_scale_path(traces_dir, tmp_path, capsys):
    from shardline.profiling.present.cli import main

    path = traces_dir / "param" / "dlrm_kineto"
    _, want = _reference(path)
    assert main(["profile", "report", str(path), "--executor", "local", "--workers", "2",
                 "-o", str(tmp_path / "b.csv")]) == 0
    got = pd.read_csv(tmp_path / "b.csv")
    assert got["step_ns"].tolist() == want["step_ns"].tolist() and got["idle"].tolist() == want["idle"].tolist()
    assert main(["profile", "report", str(path), "--executor", "local", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "8 ranks" in out and "Per category" in out and "Per communication group" in out
    assert main(["profile", "report", str(path), "--executor", "local", "--address", "x:1"]) == 2
    assert "--address names a Ray or Dask cluster" in capsys.readouterr().err


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance for this module's tests (2 CPUs), shut down after them."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def _pipeline_set(synth, folder):
    rows, _ = synth.spinning_pipeline(p=4, m=4, stage_rank=[1, 3, 0, 2], offsets=[0, 7_000, -2_000, 4_000])
    synth.write_kineto(rows, folder, device_name=H100)
    return folder


def test_ray_gives_the_single_table_results(local_ray, traces_dir, synth, tmp_path):
    for path in (traces_dir / "param" / "dlrm_kineto", _pipeline_set(synth, tmp_path)):
        ts, want = _reference(path)
        result = _analyze(path, executor="ray")  # Ray is initialised: its instance is used as is
        pd.testing.assert_frame_equal(want, result.breakdown)
        _same_cross_rank(ts, result)
    assert local_ray.is_initialized()


def test_dask_gives_the_single_table_results(traces_dir, synth, tmp_path):
    pytest.importorskip("distributed")
    for path in (traces_dir / "param" / "dlrm_kineto", _pipeline_set(synth, tmp_path)):
        ts, want = _reference(path)
        result = _analyze(path, executor="dask", workers=2)  # a local cluster for the call
        pd.testing.assert_frame_equal(want, result.breakdown)
        _same_cross_rank(ts, result)


def test_an_unreachable_cluster_is_named(traces_dir, monkeypatch):
    pytest.importorskip("distributed")
    from shardline.profiling.attribution import scale
    from shardline.profiling.attribution.scale import ExecutorError, analyze

    monkeypatch.setattr(scale, "CONNECT_TIMEOUT_S", 2)

    with pytest.raises(ExecutorError, match="cannot reach the scheduler at address='tcp://127.0.0.1:9'"):
        analyze(traces_dir / "param" / "dlrm_kineto", executor="dask", address="tcp://127.0.0.1:9")
