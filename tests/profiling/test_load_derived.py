"""A folder search skips what shardline itself derived from the traces (TensorBoard plugin files)."""

from __future__ import annotations

import shutil

from shardline.profiling import load


def test_plugin_outputs_are_not_read_as_more_ranks(traces_dir, tmp_path):
    source = traces_dir / "hta" / "trace_filter"
    run = tmp_path / "run"
    shutil.copytree(source, run)
    derived = run / "logs" / "plugins" / "shardline" / "window0"
    derived.mkdir(parents=True)
    for trace in source.iterdir():  # copies of the raw traces, as the plugin keeps them
        shutil.copy(trace, derived / trace.name)
    original, searched = load(source), load(run)
    assert searched.ranks == original.ranks
    assert len(searched.events) == len(original.events)
    assert all("plugins" not in str(path) for path in searched.files)
