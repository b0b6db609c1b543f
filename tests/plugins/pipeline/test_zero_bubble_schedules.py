"""Zero-bubble schedules as data (ZB-H1, ZB-H2, ZB-V, DualPipeV): sound, and as idle and as light as published.

Notation, unless a test says otherwise: the ZB paper's (Qi et al., 2024). ``F``, ``B`` and ``W`` are the costs of
one action (one chunk of one micro-batch), ``B`` being the input-gradient half of the backward only; ``p`` ranks,
``m`` micro-batches. Every expected number is computed here from the published formula, never by calling the code
under test (``theory.py`` is checked against the same hand formulas, separately).

Two bubble counts appear. ``step`` = ``makespan - busy`` on a rank, the step with the optimizer's synchronisation
kept (what ``simulate`` models). ``span`` = a rank's last end minus its first start, less its busy time: the
paper's per-rank count for ZB-H2 and ZB-V, whose steps are parallelograms that only overlap the next step when
the optimizer step is post-validated.
"""

from __future__ import annotations

import pytest

from shardline.job import placement
from shardline.job.pipeline import theory
from shardline.job.pipeline.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleKind,
    build_schedule,
    dualpipev,
    lower,
    lower_ordered,
    one_f_one_b,
    parse_action,
    simulate,
    validate,
    zb_h1,
    zb_h2,
    zb_v,
)
from shardline.plugins.errors import ScheduleError

COSTS = [(1.0, 1.0, 1.0), (2.0, 2.0, 1.0)]  # F = B = W, and F = B = 2 W


def _run(schedule: Schedule, costs):
    f, b, w = costs
    return simulate(schedule, t_forward=f, t_backward=b, t_weight=w)


def _span_bubble(result, rank: int) -> float:
    mine = [t for t in result.timeline if t.rank == rank]
    return max(t.end for t in mine) - min(t.start for t in mine) - result.busy[rank]


def _grid():
    for p in (2, 3, 4, 5):
        for m in sorted({1, 2, p - 1 or 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 1}):
            yield p, m


@pytest.mark.parametrize("generator", [zb_h1, zb_h2, zb_v, dualpipev])
def test_every_schedule_validates_over_a_grid(generator):
    checked = 0
    for p, m in _grid():
        if generator is dualpipev and m < 2 * p:
            continue
        schedule = validate(generator(p, m))  # every send meets its receive, nothing deadlocks (rendezvous)
        v = 2 if generator in (zb_v, dualpipev) else 1
        assert (schedule.n_ranks, schedule.n_stages, schedule.n_microbatches) == (p, p * v, m)
        assert schedule.placement == ("v" if v == 2 else "loop")
        kinds = [a.kind for program in schedule.actions for a in program]
        assert kinds.count(ActionKind.WEIGHT) == kinds.count(ActionKind.BACKWARD) == p * v * m
        checked += 1
    assert checked >= (12 if generator is dualpipev else 28)


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_zb_h1_bubble_is_the_papers_and_a_third_of_1f1b_at_equal_costs(p, costs):
    f, b, w = costs
    for m in (p, 2 * p, 3 * p + 1):
        result = _run(zb_h1(p, m, costs=costs), costs)
        expected = (p - 1) * (f + b - w)  # ZB paper, ZB-H1: (p-1)(T_F + T_B - T_W), B = input gradient
        assert result.busy == [m * (f + b + w)] * p
        assert result.makespan == m * (f + b + w) + expected  # exact: sums of small binary fractions
        assert result.bubble_fraction == pytest.approx(expected / (m * (f + b + w) + expected), rel=1e-12)
        # 1F1B on the same costs runs the whole backward (B + W) at once: (p-1)(T_F + T_B + T_W).
        base = simulate(one_f_one_b(p, m), t_forward=f, t_backward=b + w)
        assert base.makespan - base.busy[0] == (p - 1) * (f + b + w)
        # Memory: 1F1B's bound, p micro-batches held (from F until W) on rank r at most p - r there, p here.
        assert result.peak_in_flight == [min(p, m)] * p
        assert max(base.peak_in_flight) == min(p, m)


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zb_h2_is_the_papers_parallelogram_and_pays_the_fill_with_the_step_synchronised(p, costs):
    f, b, w = costs
    for m in (2 * p - 1, 3 * p):
        result = _run(zb_h2(p, m, costs=costs), costs)
        paper = max(0.0, (p - 1) * (f + b - 2 * w))  # ZB paper, ZB-H2: (p-1)(T_F + T_B - 2 T_W), per rank span
        spans = [_span_bubble(result, r) for r in range(p)]
        assert max(spans) == spans[0] == paper  # reached on rank 0, no rank idles more within its span
        # With the optimizer step's synchronisation kept every rank waits out the fill of p - 1 forwards.
        assert result.makespan == m * (f + b + w) + (p - 1) * f
        # Memory: the paper's (2p - 1) M_B, on every rank.
        assert result.peak_in_flight == [2 * p - 1] * p


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_v_is_zero_bubble_per_rank_at_equal_costs_with_1f1b_memory(p, costs):
    # Notation: F, B, W per chunk action (a chunk is half a rank's layers).
    f, b, w = costs
    for m in (2 * p - 1, 2 * p, 3 * p):
        schedule = zb_v(p, m, costs=costs)
        result = _run(schedule, costs)
        assert result.busy == [2 * m * (f + b + w)] * p
        # ZB paper section 6: zero bubble when T_F = T_B = T_W; at T_F = T_B = 2 T_W the ZB form (p-1)(F+B-2W).
        spans = [_span_bubble(result, r) for r in range(p)]
        assert max(spans) == spans[0] == max(0.0, (p - 1) * (f + b - 2 * w))
        assert result.makespan == 2 * m * (f + b + w) + (p - 1) * f  # the fill, with the step synchronised
        # Memory: 1F1B holds p micro-batches of a whole rank, i.e. 2 p chunk-micro-batches; ZB-V the same.
        assert result.peak_in_flight == [2 * p] * p


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_dualpipev_memory_is_the_readmes_and_its_bubble_stays_under_the_readme_form(p, costs):
    # Notation: the DualPipe README's, PP = 2 p stages, its B the *full* backward of a chunk (our B + W), F&B an
    # overlapped pair, here run back to back: F&B = F + B + W in the ZB notation of this file.
    f, b, w = costs
    full_b, f_and_b = b + w, f + b + w
    for m in (2 * p, 3 * p + 1):
        result = _run(dualpipev(p, m, costs=costs), costs)
        assert result.busy == [2 * m * (f + b + w)] * p
        readme = (2 * p / 2 - 1) * (f_and_b + full_b - 3 * w)  # (PP/2 - 1)(F&B + B - 3W)
        assert all(0 < result.makespan - busy <= readme for busy in result.busy)
        assert result.peak_in_flight == [2 * p + 1] * p  # README: PP + 1 chunk activations per device


def test_dualpipev_writes_each_f_and_b_as_the_forward_then_the_full_backward():
    # The steady state on rank 0 of p=2, m=6: F of the first chunk, B and W of the second, F of the second,
    # B and W of the first (DualPipe's two F&B cells, nothing overlapped).
    program = [a for a in dualpipev(2, 6)[0] if a.kind.is_compute]
    tokens = [a.token() for a in program]
    steady = ["F3@0", "B1@3", "W1@3", "F2@3", "B0@0", "W0@0"]
    assert any(tokens[i:i + 6] == steady for i in range(len(tokens)))


def test_memory_counts_what_w_still_holds_after_b():
    # One rank: F0 B0 F1 B1 W0 W1. Pairs held: F0 -> 1; B0 -> 0 full + 1 awaiting W; F1 -> 1 + 1; B1 -> 0 + 2.
    schedule = Schedule.from_text("schedule one ranks=1 stages=1 microbatches=2\nr0: F0 B0 F1 B1 W0 W1")
    assert simulate(schedule).peak_in_flight == [2]  # counted as held until W (dropped at B it would be 1)
    assert simulate(schedule, w_held_fraction=0.5).peak_held == [1.5]  # max(1, 0.5, 1.5, 1.0)
    assert simulate(schedule, w_held_fraction=0.0).peak_held == [1.0]
    unsplit = Schedule.from_text("schedule one ranks=1 stages=1 microbatches=2\nr0: F0 B0 F1 B1")
    assert simulate(unsplit).peak_in_flight == [1]
    with pytest.raises(ScheduleError, match="w_held_fraction"):
        simulate(schedule, w_held_fraction=1.5)


@pytest.mark.parametrize("kind", ["zb_h1", "zb_h2", "zbv", "dualpipev"])
def test_text_round_trip_keeps_the_v_placement(kind):
    schedule = build_schedule(kind, n_ranks=3, n_microbatches=7)
    text = schedule.to_text()
    header = text.splitlines()[0]
    assert header.endswith("placement=v") == (kind in ("zbv", "dualpipev"))
    back = Schedule.from_text(text)
    assert back == schedule and back.placement == schedule.placement
    assert back.stages_of_rank(1) == ([1, 4] if schedule.placement == "v" else [1])
    validate(back)


def test_v_placement_maps_stages_to_ranks():
    assert [placement.stage_rank(s, pp=3, style="v") for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [placement.stage_rank(s, pp=3) for s in range(6)] == [0, 1, 2, 0, 1, 2]  # the default is unchanged
    assert placement.stages_of_rank(0, n_stages=6, pp=3, style="v") == [0, 5]
    assert placement.stages_of_rank(1, n_stages=8, pp=2, style="v") == [1, 2, 5, 6]
    with pytest.raises(ScheduleError, match="style='zigzag'"):
        placement.stage_rank(0, pp=2, style="zigzag")
    with pytest.raises(ScheduleError, match="placement='zigzag'"):
        Schedule([[Action("F", 0, 0)]], n_stages=1, n_microbatches=1, placement="zigzag")
    # Under the V, stage 3 of 4 lives on rank 0: an action for it on rank 1 is refused, naming the rule.
    with pytest.raises(ScheduleError, match=r"rank 1, step 0: F0@3 acts on stage 3, which lives on rank 0 under "
                                            r"placement 'v'"):
        Schedule([[], [Action("F", 3, 0)]], n_stages=4, n_microbatches=1, placement="v")


def test_hand_written_deadlock_with_split_backward_names_rank_action_and_microbatch():
    # Rank 0 waits for gradient 0 before sending activation 1; rank 1 needs activation 1 before its backward 0.
    schedule = Schedule.from_text("""
        schedule hand ranks=2 stages=2 microbatches=2
        r0: F0 SA0 F1 RG0 B0 SA1 RG1 B1 W0 W1
        r1: RA0 F0 RA1 F1 B0 SG0 W0 B1 SG1 W1
    """)
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    message = str(info.value)
    assert "rank 0 blocked at step 3 on [RG0@0] (recv_grad of micro-batch 0 at stage 0, peer stage 1)" in message
    assert "rank 1 blocked at step 2 on [RA1@1] (recv_act of micro-batch 1 at stage 1, peer stage 0)" in message


def test_receives_posted_when_needed_deadlock_a_deep_warm_up_and_lower_ordered_posts_them_early():
    # A deep warm-up (rank 0 runs all three forwards first) lowered the 1F1B way, each receive right before its
    # consumer: rank 0 blocks sending activation 1, which rank 1 only receives after sending gradient 0 back,
    # which rank 0 only receives after that send. lower_ordered posts each receive when its data is ready.
    text = "F0 F1 F2 B0 W0 B1 W1 B2 W2 | F0 B0 W0 F1 B1 W1 F2 B2 W2"
    compute = [[parse_action(tok, rank=r) for tok in part.split()] for r, part in enumerate(text.split("|"))]
    naive = lower(compute, n_stages=2, n_microbatches=3, name="naive")
    with pytest.raises(ScheduleError, match=r"deadlocks.*rank 0 blocked at step 3 on \[SA1@0\].*"
                                            r"rank 1 blocked at step 3 on \[SG0@1\]"):
        validate(naive)
    early = validate(lower_ordered(compute, n_stages=2, n_microbatches=3, name="early"))
    assert [a for a in early[1] if a.kind.is_compute] == compute[1]  # same computes, transfers moved
    # Activation 1 is ready when rank 1 ends F0, so its receive is posted then, before B0 and its send.
    assert [a.token(with_stage=False) for a in early[1][:5]] == ["RA0", "F0", "RA1", "B0", "SG0"]


def test_layouts_a_schedule_cannot_run_are_refused_naming_the_numbers():
    with pytest.raises(ScheduleError, match="n_chunks=3"):
        zb_v(2, 4, 3)
    with pytest.raises(ScheduleError, match="n_chunks=1"):
        build_schedule("dualpipev", n_ranks=2, n_microbatches=4, n_chunks=1)
    with pytest.raises(ScheduleError, match=r"n_microbatches=5 with n_ranks=3 \(use m >= 6\)"):
        dualpipev(3, 5)
    with pytest.raises(ScheduleError, match="n_chunks=2"):
        build_schedule(ScheduleKind.ZB_H1, n_ranks=2, n_microbatches=4, n_chunks=2)
    with pytest.raises(ScheduleError, match="n_microbatches=0"):
        zb_h2(2, 0)
    with pytest.raises(ScheduleError, match=r"costs=\(1, 0, 1\)"):
        zb_h1(2, 2, costs=(1, 0, 1))


def test_theory_rows_match_the_published_forms_by_hand():
    # Per-rank costs f, b, w as theory.py states them (a rank's work per micro-batch, summed over its chunks).
    p, m = 4, 8
    assert theory.bubble_time("zb_h1", p=p, m=m, f=2, b=2, w=1) == 3 * (2 + 2 - 1)
    assert theory.bubble_time("zb_h2", p=p, m=m, f=2, b=2, w=1) == 3 * (2 + 2 - 2)
    assert theory.bubble_time("zb_h2", p=p, m=m, f=1, b=1, w=2) == 0.0  # the paper's max(0, ...)
    # ZB-V: chunk costs are half a rank's, so (p-1)(F + B - 2W) at F, B, W = f/2, b/2, w/2.
    assert theory.bubble_time("zbv", p=p, m=m, v=2, f=4, b=4, w=2) == 3 * (2 + 2 - 2)
    # DualPipeV: README (PP/2 - 1)(F&B + B - 3W), PP = 8, chunk F = 1, full B = (2 + 1) / 2, W = 0.5, F&B = F + B.
    assert theory.bubble_time("dualpipev", p=p, m=m, v=2, f=2, b=2, w=1) == 3 * ((1 + 1.5) + 1.5 - 1.5)
    total = m * (2 + 2 + 1) + 3 * (2 + 2 - 1)
    assert theory.bubble_fraction("zb_h1", p=p, m=m, f=2, b=2, w=1) == pytest.approx(9 / total, rel=1e-12)
    assert theory.has_closed_form("zbv", v=2, split=True) and not theory.has_closed_form("zbv", v=1, split=True)
    assert not theory.has_closed_form("zb_h1")  # a caller without the W cost sees none (the profiler's gate)
    with pytest.raises(ScheduleError, match=r"'zb_h2' splits the backward.*w=0\.0"):
        theory.bubble_time("zb_h2", p=2, m=4)
    with pytest.raises(ScheduleError, match="v=1"):
        theory.bubble_time("dualpipev", p=2, m=4, v=1)
    with pytest.raises(ScheduleError, match="v=2"):
        theory.bubble_time("zb_h1", p=2, m=4, v=2)
