"""Re-planning the end of an lr schedule (mmgrpo/schedule.py), against the transformers schedules' closed forms."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import get_scheduler

from mmgrpo.schedule import REPLAN_TOLERANCE, ScheduleWarp, projected_end, replanned_end, warp_schedule


def _schedule(name: str, horizon: int, warmup: int = 0):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    plain = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=horizon)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    warped = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=horizon)
    return plain, warped, warp_schedule(warped, horizon)


def _factor(schedule, step: int) -> float:
    return schedule.lr_lambdas[0](step)


def test_an_unplanned_warp_is_exactly_the_schedule_as_built():
    for name in ("cosine", "linear", "constant_with_warmup", "polynomial"):
        plain, warped, _ = _schedule(name, 97, warmup=7)
        assert [_factor(warped, s) for s in range(98)] == [_factor(plain, s) for s in range(98)], name


def test_a_cosine_squeezed_to_end_earlier_follows_the_closed_form():
    _, warped, warp = _schedule("cosine", 100)
    warp.replan(40, 70)  # steps 40..70 cover positions 40..100
    for step, position in ((40, 40.0), (55, 70.0), (70, 100.0), (90, 100.0)):
        expected = 0.5 * (1.0 + math.cos(math.pi * position / 100))
        assert math.isclose(_factor(warped, step), expected, abs_tol=1e-12), step
    assert _factor(warped, 70) < 1e-12 and _factor(warped, 90) < 1e-12  # holds 0, does not rise again


def test_a_linear_schedule_stretched_past_its_horizon_is_capped_at_it():
    _, warped, warp = _schedule("linear", 100)
    warp.replan(50, 150)  # asked to end after train.max_steps: the trainer caps it; the warp stretches
    assert math.isclose(_factor(warped, 100), 0.25, abs_tol=1e-12)  # position 75
    assert _factor(warped, 150) == 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(1, 600)), min_size=1, max_size=6))
def test_replanning_keeps_a_cosine_continuous_and_decaying(plans):
    """Whatever the re-planning steps and ends, the lr after warm-up never rises, and a re-plan does not move the
    lr of the step it is made at."""
    horizon, warmup = 500, 10
    _, warped, warp = _schedule("cosine", horizon, warmup)
    steps = sorted({max(s, warmup) for s, _ in plans})
    ends = dict(zip(steps, (e for _, e in plans)))
    previous = _factor(warped, warmup)
    for step in range(warmup, horizon + 1):
        if step in ends:
            before = _factor(warped, step)
            warp.replan(step, ends[step])
            assert math.isclose(_factor(warped, step), before, abs_tol=1e-12)
        now = _factor(warped, step)
        assert now <= previous + 1e-12 and now >= 0.0
        previous = now


def test_the_warp_state_round_trips():
    warp = ScheduleWarp(100.0)
    warp.replan(30, 80)
    restored = ScheduleWarp(100.0)
    restored.load_state_dict(warp.state_dict())
    assert [restored(s) for s in range(0, 120, 7)] == [warp(s) for s in range(0, 120, 7)]
    assert restored.planned_end() == 80.0


def test_projected_end_assumes_the_pace_so_far():
    assert projected_end(100, 60.0, 840.0) == 1400  # 0.6 s per step, 780 s left: 1,300 more steps
    assert projected_end(300, 290.0, 300.0) == 310
    assert projected_end(1, 0.5, 0.5) == 1


def test_replanned_end_moves_the_plan_only_when_far_off():
    assert replanned_end(40, 20.0, 40.0, planned_end=100, max_steps=100) == 80
    assert replanned_end(40, 16.4, 40.0, planned_end=100, max_steps=100) is None  # projected 97: within 5%
    assert replanned_end(40, 10.0, 40.0, planned_end=80, max_steps=100) == 100  # projected 160: capped
    assert replanned_end(40, 40.0, 40.0, planned_end=100, max_steps=100) is None  # the budget is spent


@given(step=st.integers(1, 10_000), elapsed_s=st.floats(1e-3, 1e4), budget_s=st.floats(1e-3, 1e4),
       planned_end=st.integers(1, 20_000), max_steps=st.integers(1, 20_000))
def test_a_replanned_end_is_ahead_within_the_horizon_and_off_the_plan(step, elapsed_s, budget_s, planned_end,
                                                                      max_steps):
    end = replanned_end(step, elapsed_s, budget_s, planned_end, max_steps)
    if end is not None:
        assert step < end <= max_steps and abs(end - planned_end) > REPLAN_TOLERANCE * planned_end
