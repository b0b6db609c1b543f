"""Schedules as data: generators validate, unit-cost timing matches the closed forms, bad schedules are named."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.job.pipeline.schedule import (
    Action,
    ActionKind,
    Schedule,
    build_schedule,
    gpipe,
    interleaved_one_f_one_b,
    lower,
    one_f_one_b,
    parse_action,
    render,
    simulate,
    validate,
)
from shardline.plugins.errors import ScheduleError

# Exact arithmetic on small integers and halves: comparisons below are exact except where a ratio is formed,
# which gets a 1e-12 relative tolerance (one float division).
REL = 1e-12


@st.composite
def plain_case(draw):
    p = draw(st.integers(2, 16))
    return p, draw(st.integers(1, 8 * p))


@st.composite
def interleaved_case(draw):
    p = draw(st.integers(2, 16))
    return p, p * draw(st.integers(1, 8)), draw(st.integers(1, 4))


@settings(max_examples=40, deadline=None)
@given(plain_case(), st.sampled_from([gpipe, one_f_one_b]))
def test_plain_schedules_validate_and_meet_the_closed_forms(case, generator):
    p, m = case
    schedule = generator(p, m)
    validate(schedule)
    result = simulate(schedule, t_forward=1.0, t_backward=1.0, t_comm=0.0)
    assert result.makespan == 2 * (m + p - 1)  # exact: sums of unit costs
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=REL)
    assert result.busy == [2.0 * m] * p
    if generator is gpipe:
        assert result.peak_in_flight == [m] * p
    else:
        assert all(peak <= p - r for r, peak in enumerate(result.peak_in_flight))
        assert result.peak_in_flight[0] == min(p, m)  # the first rank does reach its bound


@settings(max_examples=30, deadline=None)
@given(interleaved_case())
def test_interleaved_validates_and_divides_the_bubble_by_v(case):
    p, m, v = case
    schedule = interleaved_one_f_one_b(p, m, v)
    assert (schedule.n_stages, schedule.n_chunks) == (p * v, v)
    validate(schedule)
    result = simulate(schedule, t_forward=1.0, t_backward=1.0)
    assert result.makespan == 2 * (v * m + p - 1)  # exact: sums of unit costs
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=REL)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6), st.integers(1, 12), st.integers(1, 3), st.sampled_from(["gpipe", "1f1b", "interleaved"]))
def test_text_form_round_trips(p, m, v, kind):
    if kind == "interleaved":
        m = p * m
    schedule = build_schedule(kind, n_ranks=p, n_microbatches=m, n_chunks=v if kind == "interleaved" else 1)
    text = schedule.to_text()
    assert Schedule.from_text(text) == schedule
    assert ("@" in text) == (schedule.n_chunks > 1)  # the stage suffix appears exactly when it is needed


def test_text_tokens_and_derived_peers():
    assert parse_action("SG3@5") == Action(ActionKind.SEND_GRAD, 5, 3)
    assert parse_action("F2", rank=1) == Action("F", 1, 2)
    assert Action("SA", 2, 0).peer_stage == 3 and Action("RG", 2, 0).peer_stage == 3
    assert Action("SG", 2, 0).partner() == Action("RG", 1, 0)
    for bad in ("X1", "F", "F1@", "SA-1", "FA1"):
        with pytest.raises(ScheduleError, match="cannot parse"):
            parse_action(bad, rank=0)
    with pytest.raises(ScheduleError, match="no @stage"):
        parse_action("F1")


def _hand(text: str) -> Schedule:
    return Schedule.from_text(text)


def test_hand_made_deadlock_is_rejected_naming_ranks_steps_and_actions():
    # Rank 0 waits for gradient 0 before sending activation 1; rank 1 needs activation 1 before its backward 0.
    schedule = _hand("""
        schedule hand ranks=2 stages=2 microbatches=2
        r0: F0 SA0 F1 RG0 B0 SA1 RG1 B1
        r1: RA0 F0 RA1 F1 B0 SG0 B1 SG1
    """)
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    message = str(info.value)
    assert "deadlock" in message
    assert "rank 0 blocked at step 3 on [RG0@0]" in message
    assert "rank 1 blocked at step 2 on [RA1@1]" in message


def test_head_on_sends_deadlock_under_rendezvous_but_megatron_batches_do_not():
    # The naive recv-before/send-after lowering of interleaved 1F1B makes two ranks send gradients to each
    # other in separate batches: fine if sends were buffered, a deadlock where a send waits for its receive.
    good = interleaved_one_f_one_b(2, 4, 2)
    compute = [[a for a in program if a.kind.is_compute] for program in good.actions]
    naive = lower(compute, n_stages=4, n_microbatches=4, name="naive")
    with pytest.raises(ScheduleError, match=r"deadlocks.*SG"):
        validate(naive)
    validate(good)


@pytest.mark.parametrize(("text", "expected"), [
    ("r0: F0 SA0 RG0 B0\nr1: RA0 F0 B0", r"rank 1, step 2: backward of stage 1 micro-batch 0 needs SG0@1 after"),
    ("r0: F0 SA0 RG0 B0 B0\nr1: RA0 F0 B0 SG0", r"rank 0, step 4: B0@0 repeats the action at step 3"),
    ("r0: RG0 B0 F0 SA0\nr1: RA0 F0 B0 SG0", r"rank 0, step 1: backward B0@0 comes before its forward at step 2"),
    ("r0: F0 SA0 RG0\nr1: RA0 F0 B0 SG0", r"rank 0: stage 0 micro-batch 0 lacks \['B0@0'\]"),
    ("r0: F0 SA0 F1 SA1 RG0 B0 RG1 B1\nr1: RA1 F0 B0 SG0 RA0 F1 B1 SG1",
     r"rank 1, step 4: RA0@1 must come before the forward at step 1"),
    ("r0: F0 SA0 SA0 RG0 B0\nr1: RA0 F0 B0 SG0", r"rank 0, step 2: SA0@0 repeats"),
    ("r0: F0 RG0 B0\nr1: F0 B0 SG0", r"rank 0, step 0: forward of stage 0 micro-batch 0 needs SA0@0 after it"),
])
def test_malformed_schedules_name_the_rank_step_and_action(text, expected):
    m = 2 if "F1" in text else 1
    with pytest.raises(ScheduleError, match=expected):
        validate(_hand(f"schedule bad ranks=2 stages=2 microbatches={m}\n{text}"))


def test_channel_order_mismatch_is_named():
    # Both micro-batches flow, but rank 1 receives them in the opposite order to the one rank 0 sends them.
    schedule = _hand("""
        schedule swapped ranks=2 stages=2 microbatches=2
        r0: F0 SA0 F1 SA1 RG1 B1 RG0 B0
        r1: RA1 RA0 F0 B0 F1 B1 SG1 SG0
    """)
    with pytest.raises(ScheduleError, match=r"order mismatch on channel rank 0 -> rank 1 at message 0: "
                                            r"rank 0 step 1 SA0@0 vs rank 1 step 0 RA1@1"):
        validate(schedule)


def test_construction_rejects_bad_metadata_and_placement():
    with pytest.raises(ScheduleError, match=r"n_stages=3 is not a multiple of n_ranks=2"):
        Schedule([[], []], n_stages=3, n_microbatches=1)
    with pytest.raises(ScheduleError, match=r"rank 0, step 0: F0@1 acts on stage 1, which lives on rank 1"):
        Schedule([[Action("F", 1, 0)], []], n_stages=2, n_microbatches=1)
    with pytest.raises(ScheduleError, match=r"n_microbatches=0"):
        gpipe(2, 0)
    with pytest.raises(ScheduleError, match=r"n_microbatches=6 to be a multiple of n_ranks=4"):
        interleaved_one_f_one_b(4, 6, 2)
    with pytest.raises(ScheduleError, match=r"unknown schedule kind 'zb'"):
        build_schedule("zb", n_ranks=2, n_microbatches=2)
    with pytest.raises(ScheduleError, match=r"t_comm"):
        simulate(gpipe(2, 2), t_comm=-1.0)


def test_simulate_with_communication_cost_matches_hand_timing():
    # GPipe p=2 m=1, F=1 B=2 comm=0.5: r0 F [0,1]; r1 F [1.5,2.5], B [2.5,4.5]; r0 B [5,7].
    result = simulate(gpipe(2, 1), t_forward=1.0, t_backward=2.0, t_comm=0.5)
    spans = [(t.rank, str(t.action), t.start, t.end) for t in result.timeline]
    assert sorted(spans) == [(0, "B0@0", 5.0, 7.0), (0, "F0@0", 0.0, 1.0),
                             (1, "B0@1", 2.5, 4.5), (1, "F0@1", 1.5, 2.5)]
    assert result.makespan == 7.0 and result.busy == [3.0, 3.0] and result.idle == [4.0, 4.0]
    assert result.bubble_fraction == pytest.approx(8.0 / 14.0, rel=REL)


def test_render_text_grid_and_png(tmp_path):
    schedule = one_f_one_b(4, 8)
    png = tmp_path / "sched.png"
    text = render(schedule, path=png, t_forward=1.0, t_backward=1.0)
    header, *rows = text.strip().splitlines()
    assert "bubble=0.273" in header  # (p-1)/(m+p-1) = 3/11
    assert len(rows) == 4
    for rank, row in enumerate(rows):
        cells = row.split("|")[1:-1]
        assert len(cells) == 2 * (8 + 4 - 1)
        assert sum(c.startswith("F") for c in cells) == 8 and sum(c.startswith("B") for c in cells) == 8
        assert cells[rank].startswith("F0")  # rank r starts its first forward at time r
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_split_backward_weight_actions_validate_and_are_timed():
    schedule = _hand("""
        schedule split ranks=2 stages=2 microbatches=1
        r0: F0 SA0 RG0 B0 W0
        r1: RA0 F0 B0 SG0 W0
    """)
    # r0 F [0,1]; r1 F [1,2], B [2,3], W [3,3.5]; r0 B [3,4], W [4,4.5].
    result = simulate(schedule, t_forward=1.0, t_backward=1.0, t_weight=0.5)
    assert result.makespan == 4.5 and result.busy == [2.5, 2.5]
    assert Schedule.from_text(schedule.to_text()) == schedule
    with pytest.raises(ScheduleError, match=r"rank 1, step 2: W0@1 comes before its backward at step 3"):
        validate(_hand("schedule s ranks=2 stages=2 microbatches=1\nr0: F0 SA0 RG0 B0 W0\nr1: RA0 F0 W0 B0 SG0"))
    with pytest.raises(ScheduleError, match=r"rank 0: stage 0 micro-batch 0 lacks \['W0@0'\]"):
        validate(_hand("schedule s ranks=2 stages=2 microbatches=1\nr0: F0 SA0 RG0 B0\nr1: RA0 F0 B0 SG0 W0"))
