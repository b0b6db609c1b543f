"""Shared figures: PNGs that show what they are given, an empty state instead of an error, no pyplot leaks."""

from __future__ import annotations

import io

import matplotlib.image as mpimg
import numpy as np

from shardline.profiling.attribution.core import breakdown, comm_by_dim
from shardline.profiling.present.plots import (
    COLOURS,
    breakdown_figure,
    comm_by_dim_figure,
    pipeline_timeline_figure,
    timeline_spans,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _pixels(png: bytes) -> np.ndarray:
    assert png.startswith(PNG_MAGIC)
    return (mpimg.imread(io.BytesIO(png), format="png")[..., :3] * 255).round().astype(int)


def _has_colour(pixels: np.ndarray, hex_colour: str) -> bool:
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
    return bool((np.abs(pixels - rgb).max(axis=-1) <= 1).any())


def test_breakdown_figure_draws_exactly_the_nonzero_columns(synth):
    rows, _ = synth.zero_tp_offload()
    bd = breakdown(synth.to_frame(rows))
    pixels = _pixels(breakdown_figure(bd, title="zero"))
    for present in ("compute", "all_gather", "all_reduce", "memcpy_h2d", "reduce_scatter", "memcpy_d2h"):
        assert _has_colour(pixels, COLOURS[present]), present
    for absent in ("bubble", "p2p_recv", "broadcast"):  # zero on every row: not drawn
        assert not _has_colour(pixels, COLOURS[absent]), absent


def test_timeline_spans_recover_the_1f1b_truth(synth):
    p, m, f, b = 3, 4, 100, 200
    rows, truth = synth.one_f_one_b(p, m, f=f, b=b)
    spans = timeline_spans(synth.to_frame(rows))
    length = (spans["end_ns"] - spans["start_ns"]).groupby([spans["rank"], spans["kind"]]).sum()
    for rank in range(p):
        assert length[(rank, "forward")] == m * f
        assert length[(rank, "backward")] == m * b
        assert length[(rank, "bubble")] == truth["bubble_ns"]
    # The recv kernels spin only on stages > 0, before their activations arrive.
    assert (0, "communication") not in length.index and length[(2, "communication")] > 0


def test_pipeline_timeline_figure_colours_and_empty_state(synth):
    rows, _ = synth.one_f_one_b(2, 3)
    pixels = _pixels(pipeline_timeline_figure(synth.to_frame(rows)))
    for kind in ("forward", "backward", "bubble"):
        assert _has_colour(pixels, COLOURS[kind]), kind
    plain, _ = synth.zero_tp_offload()
    empty = _pixels(pipeline_timeline_figure(synth.to_frame(plain)))
    assert not any(_has_colour(empty, COLOURS[k]) for k in ("forward", "backward", "bubble"))
    assert empty.shape[0] < pixels.shape[0] + 200  # a small message figure, not an empty axes grid


def test_empty_inputs_give_a_figure_not_an_error(synth):
    import warnings

    from shardline.profiling.attribution.core import empty_breakdown

    rows, _ = synth.zero_tp_offload()
    zero = breakdown(synth.to_frame(rows)).head(1)
    zero[list(zero.columns[zero.dtypes == "int64"])] = 0  # a step of 0 ns: nothing to stack
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even a matplotlib "no artists" warning
        for png in (breakdown_figure(empty_breakdown()), comm_by_dim_figure(None), breakdown_figure(zero)):
            pixels = _pixels(png)
            assert not _has_colour(pixels, COLOURS["compute"])


def test_comm_by_dim_figure_on_a_real_trace(traces_dir):
    from shardline.profiling.table.load import load

    ts = load(traces_dir / "param" / "dlrm_kineto")
    cbd = comm_by_dim(ts)
    assert len(cbd)
    pixels = _pixels(comm_by_dim_figure(cbd))
    assert _has_colour(pixels, "#c44e52")  # the exposed colour: DLRM's all-reduces are partly exposed


def test_figures_leave_no_pyplot_state_and_are_deterministic(synth):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    rows, _ = synth.one_f_one_b(2, 2)
    events = synth.to_frame(rows)
    first = pipeline_timeline_figure(events)
    assert pipeline_timeline_figure(events) == first
    assert breakdown_figure(breakdown(events)) == breakdown_figure(breakdown(events))
    assert plt.get_fignums() == before
