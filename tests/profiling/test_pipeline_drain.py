"""A third-party pipeline's fill and drain are bubble (issue 50 §4), up to the schedule's own share, after the
host-blocking idle causes; and the bubble theory those shares come from (``shardline.job.pipeline.theory``).

Traces: ``pipeline_traces.p2p_pipeline`` (1F1B and interleaved 1F1B laid out by its own event loop, NCCL
``SendRecv`` kernels only, no annotation), written as Kineto files and loaded. References: the closed forms
written out by hand here, and the simulator of the pipeline package (its own event loop) for the theory.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from shardline.job.errors import ScheduleError
from shardline.job.pipeline import theory

H100 = "NVIDIA H100 80GB HBM3"

_spec = importlib.util.spec_from_file_location("shardline_tests_pipeline_traces",
                                               Path(__file__).with_name("pipeline_traces.py"))
pipeline_traces = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pipeline_traces)


# --- the theory ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("schedule", "p", "m", "v", "want"), [
    ("1f1b", 4, 8, 1, 3 / 11),
    ("gpipe", 2, 4, 1, 1 / 5),
    ("1f1b", 8, 1, 1, 7 / 8),
    ("1f1b", 1, 5, 1, 0.0),
    ("interleaved", 4, 8, 2, 3 / 19),
    ("interleaved", 2, 4, 2, 1 / 9),
    ("looped_bfs", 4, 4, 3, 3 / 15),
    ("forward_only", 4, 8, 1, 3 / 11),
])
def test_bubble_fraction_closed_forms(schedule, p, m, v, want):
    assert theory.bubble_fraction(schedule, p=p, m=m, v=v) == want  # one division each side: the same float
    # The share does not depend on the costs for these schedules.
    assert theory.bubble_fraction(schedule, p=p, m=m, v=v, f=3.0, b=7.0) == pytest.approx(want, abs=1e-15)


def test_bubble_time_and_makespan_by_hand():
    # 1F1B, p=4, f=3, b=6 (+ w=1 split off): the fill and drain cross 3 stages of 3+6+1.
    assert theory.bubble_time("1f1b", p=4, m=8, f=3, b=6, w=1) == 30.0
    assert theory.makespan("1f1b", p=4, m=8, f=3, b=6, w=1) == 8 * 10 + 30
    # Interleaved, p=4, v=2, per-rank costs f=2, b=4: each of the 3 stages ahead costs one chunk, (2+4)/2.
    assert theory.bubble_time("interleaved", p=4, m=8, v=2, f=2, b=4) == 9.0
    assert theory.makespan("interleaved", p=4, m=8, v=2, f=2, b=4) == 48 + 9
    # Forward only: the fill alone, busy m f.
    assert theory.makespan("forward_only", p=3, m=5, f=2, b=9) == 10 + 4


@pytest.mark.parametrize(("kind", "p", "m", "v"), [("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1), ("interleaved", 4, 8, 2),
                                                   ("interleaved", 2, 4, 3)])
def test_theory_agrees_with_the_simulator(kind, p, m, v):
    from shardline.job.pipeline.schedule import build_schedule, simulate

    result = simulate(build_schedule(kind, n_ranks=p, n_microbatches=m, n_chunks=v))
    assert result.bubble_fraction == pytest.approx(theory.bubble_fraction(kind, p=p, m=m, v=v), abs=1e-12)
    # The simulator's unit chunk costs: F = 1, B = 2 per chunk, so a rank's per-micro-batch totals are v and 2v.
    assert result.makespan == pytest.approx(theory.makespan(kind, p=p, m=m, v=v, f=v, b=2 * v), abs=1e-9)


@pytest.mark.parametrize(("call", "named"), [
    (lambda: theory.bubble_fraction("zb_h1", p=4, m=8), "'zb_h1'"),
    (lambda: theory.bubble_fraction("1f1b", p=0, m=8), "p=0"),
    (lambda: theory.bubble_fraction("1f1b", p=4, m=2.5), "m=2.5"),
    (lambda: theory.bubble_fraction("1f1b", p=4, m=8, v=2), "v=2"),
    (lambda: theory.bubble_time("gpipe", p=4, m=8, f=-1.0), "f=-1.0"),
])
def test_bad_theory_input_raises_naming_the_value(call, named):
    with pytest.raises(ScheduleError, match=named.replace("(", r"\(").replace(".", r"\.")):
        call()


def test_closed_form_registry():
    assert {"gpipe", "1f1b", "interleaved", "looped_bfs"} <= set(theory.closed_form_schedules())
    assert not theory.has_closed_form("dualpipev")
    assert not theory.has_closed_form("1f1b", v=2) and theory.has_closed_form("interleaved", v=2)


# --- fill and drain on generated pipelines ---------------------------------------------------------------------

def _attributed(synth, tmp_path, rows, *, kineto: bool = True):
    """The attribution of ``rows`` written as Kineto files and loaded, or (``kineto=False``: the writer drops
    correlation ids) as an events table."""
    from shardline.profiling.attribution.core import attribute
    from shardline.profiling.table.load import load

    if not kineto:
        return attribute(synth.to_frame(rows))
    synth.write_kineto(rows, tmp_path, device_name=H100)
    return attribute(load(tmp_path))


@pytest.mark.parametrize(("v", "share", "launched_early"), [(1, 3 / (8 + 3), False), (2, 3 / (2 * 8 + 3), False),
                                                            (1, 3 / (8 + 3), True)])
def test_fill_and_drain_make_the_bubble_of_the_schedule(synth, tmp_path, v, share, launched_early):
    from shardline.profiling.analyses.bubbles import pipeline_bubbles
    from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS
    from shardline.profiling.matching.p2p import match_p2p

    p, m = 4, 8
    rows, truth = pipeline_traces.p2p_pipeline(p, m, v=v, steps=2, launched_early=launched_early)
    attribution = _attributed(synth, tmp_path, rows, kineto=not launched_early)
    if launched_early:  # every kernel's launch is read: the idle gaps are judged queued, not unknown
        from shardline.profiling.analyses.idle import launch_stats

        assert (launch_stats(attribution)["launches"] > 0).all()
    table = attribution.breakdown
    assert len(table) == 2 * p
    assert (table[list(EXCLUSIVE_COLUMNS)].sum(axis=1) == table["step_ns"]).all()
    for row in table.itertuples(index=False):
        assert row.compute == truth["compute"][row.step, row.rank] == m * (3000 + 6000)
        assert abs(row.bubble / row.step_ns - share) <= 0.03, (row.rank, row.step, row.bubble / row.step_ns)
        assert row.bubble <= math.floor(share * row.step_ns) or row.rank == 0  # stage 0's waits alone may pass it
        assert row.idle_host_bound == row.idle_sync == row.idle_dataloader == 0  # no host cause in the trace

    # The last stage's receive waits are only its fill (about (p - 1) f of the (p - 1)(f + b) it idles): the drain
    # after its last gradient leaves is what makes up the rest.
    waits = match_p2p(attribution).groupby(["rank", "step"])["wait_ns"].sum()
    last = table[table["rank"] == p - 1]
    for row in last.itertuples(index=False):
        assert waits[(p - 1, row.step)] < 0.5 * share * row.step_ns < row.bubble

    bubbles = pipeline_bubbles(attribution).sort_values(["step", "rank"])
    assert (bubbles["method"] == "p2p_matched").all()
    assert (bubbles["p"] == p).all() and (bubbles["m"] == m).all() and (bubbles["v"] == v).all()
    assert bubbles["ideal_fraction"].tolist() == [share] * len(bubbles)
    merged = bubbles.merge(table, on=["rank", "step"])
    assert (merged["bubble_ns"] == merged["bubble"]).all()  # one bubble set for the breakdown and the analysis


def test_idle_beyond_the_share_stays_idle(synth, tmp_path):
    p, m, tail = 4, 8, 20_000
    share = 3 / 11
    rows, truth = pipeline_traces.p2p_pipeline(p, m, steps=1, tail=tail)
    table = _attributed(synth, tmp_path, rows).breakdown
    for row in table.itertuples(index=False):
        assert row.step_ns == truth["step_end"][0] - truth["step_start"][0]
        # The tail makes fill + drain larger than the share: the bubble is the share exactly (floored to ns) ...
        assert row.bubble == math.floor(share * row.step_ns), row.rank
        # ... and the rest of the tail is idle, with no cause in the trace.
        assert row.idle > (1 - share) * tail - 0.03 * row.step_ns
        assert row.idle_other == row.idle


def test_a_host_stall_in_the_drain_is_charged_to_the_host_first(synth, tmp_path):
    p, m = 4, 8
    rows, truth = pipeline_traces.p2p_pipeline(p, m, steps=1)
    clean = _attributed(synth, tmp_path / "clean", rows).breakdown.set_index("rank")
    drain_start, step_end = truth["last_end"][0][p - 1], truth["step_end"][0]
    stall_start, stall = drain_start + 1_000, 4_000
    assert stall_start + stall <= step_end  # the stall lies inside the last stage's drain gap
    stalled = _attributed(synth, tmp_path / "stalled",
                          [*rows, pipeline_traces.host_stall(p - 1, stall_start, stall)]).breakdown.set_index("rank")

    assert clean.loc[p - 1, "bubble"] + clean.loc[p - 1, "idle"] >= stall  # the clean drain was bubble (and idle)
    assert stalled.loc[p - 1, "idle_sync"] == stall
    # The stall's ns moved from the bubble to the host's cause; nothing else changed.
    assert stalled.loc[p - 1, "bubble"] == clean.loc[p - 1, "bubble"] + clean.loc[p - 1, "idle"] - stall
    assert stalled.loc[p - 1, "idle"] == stall
    for column in ("compute", "p2p_recv", "p2p_send", "step_ns"):
        assert stalled.loc[p - 1, column] == clean.loc[p - 1, column]
    others = [r for r in range(p) if r != p - 1]
    assert np.array_equal(stalled.loc[others, "bubble"].to_numpy(), clean.loc[others, "bubble"].to_numpy())
