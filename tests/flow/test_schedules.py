import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo.pipelines.flow.schedules import (
    SlidingWindow,
    StepPlan,
    dance_grpo_steps,
    fast_plan,
    flash_plan,
    flow_grpo_plan,
    noise_aware_weights,
    tempflow_branch_steps,
    timestep_weights,
)


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- StepPlan


def test_step_plan_properties_and_validation():
    plan = StepPlan(sde=(False, True, True, False), train=(1, 2))
    assert plan.num_steps == 4 and plan.last_sde == 2
    assert StepPlan(sde=(False, False), train=()).last_sde == -1
    with pytest.raises(ValueError, match="train"):
        StepPlan(sde=(False, True), train=(0,))  # step 0 is ODE
    with pytest.raises(ValueError, match="train"):
        StepPlan(sde=(True, True), train=(1, 0))
    with pytest.raises(ValueError, match="solver_after"):
        StepPlan(sde=(True,), train=(0,), solver_after="heun")
    with pytest.raises(ValueError, match="ode_sigmas_after"):
        StepPlan(sde=(True, False, False), train=(0,), ode_sigmas_after=(1, 2))  # misses the final index 3
    with pytest.raises(ValueError, match="ode_sigmas_after"):
        StepPlan(sde=(True, False, False), train=(0,), ode_sigmas_after=(2, 3))  # must start at index 1
    with pytest.raises(ValueError, match="sde"):
        StepPlan(sde=(), train=())


# ---------------------------------------------------------------- Flow-GRPO / DanceGRPO


def test_flow_grpo_plan_floors_like_timestep_fraction():
    plan = flow_grpo_plan(10)
    assert plan.sde == (True,) * 10 and plan.train == tuple(range(9))
    assert flow_grpo_plan(10, 0.05).train == (0,)  # floor(0.5) = 0, at least one step
    assert flow_grpo_plan(16, 0.6).train == tuple(range(9))  # floor(9.6)
    assert len(flow_grpo_plan(100, 0.29).train) == 29  # 0.29 * 100 = 28.999999999999996 in floating point
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="train_fraction"):
            flow_grpo_plan(10, bad)
    with pytest.raises(ValueError, match="num_steps"):
        flow_grpo_plan(0)


def test_dance_grpo_steps_are_sorted_subsets_of_the_right_size():
    steps = dance_grpo_steps(16, 0.6, 32, gen(1))
    assert steps.shape == (32, 10) and steps.dtype == torch.int64  # round(9.6) = 10
    assert bool((steps[:, 1:] > steps[:, :-1]).all())  # sorted, no repeats
    assert int(steps.min()) >= 0 and int(steps.max()) < 16
    assert len({tuple(r) for r in steps.tolist()}) > 1  # independent per sample
    torch.testing.assert_close(steps, dance_grpo_steps(16, 0.6, 32, gen(1)))
    assert dance_grpo_steps(4, 0.1, 3, gen()).shape == (3, 1)  # round(0.4) = 0 -> at least 1
    assert dance_grpo_steps(5, 0.5, 1, gen()).shape == (1, 3)  # 2.5 rounds half up
    assert dance_grpo_steps(6, 1.0, 2, gen()).tolist() == [list(range(6))] * 2
    with pytest.raises(ValueError, match="train_fraction"):
        dance_grpo_steps(16, 0.0, 2)
    with pytest.raises(ValueError, match="num_samples"):
        dance_grpo_steps(16, 0.5, 0)


# ---------------------------------------------------------------- MixGRPO sliding window


def test_progressive_window_moves_every_interval_and_rolls_back():
    w = SlidingWindow(25)  # size 4, interval 25, stride 1: starts 0..21, then back to 0
    assert w.max_start == 21
    starts = {it: w.start(it) for it in (0, 24, 25, 49, 50, 524, 525, 549, 550, 575)}
    assert starts == {0: 0, 24: 0, 25: 1, 49: 1, 50: 2, 524: 20, 525: 21, 549: 21, 550: 0, 575: 1}
    strided = SlidingWindow(10, size=4, shift_interval=2, stride=2)  # starts 0, 2, 4, 6
    assert [strided.start(i) for i in range(10)] == [0, 0, 2, 2, 4, 4, 6, 6, 0, 0]
    bounded = SlidingWindow(10, size=4, shift_interval=1, stride=2, max_start=3)  # 4 would pass the bound
    assert [bounded.start(i) for i in range(5)] == [0, 2, 0, 2, 0]


def test_window_plan_is_sde_and_trained_only_inside_the_window():
    plan = SlidingWindow(6, size=2, shift_interval=1).plan(3)
    assert plan.sde == (False, False, False, True, True, False)
    assert plan.train == (3, 4) and plan.solver_after == "euler" and plan.ode_sigmas_after is None


def test_decay_shrinks_the_shift_interval_linearly_with_the_window_position():
    w = SlidingWindow(10, size=2, shift_interval=8, strategy="decay")  # min interval 8 // 4 = 2, max_start 8
    # int(8 * (1 - s/8) + 2 * s/8): 8, 7.25, 6.5, 5.75, 5, 4.25, 3.5, 2.75, 2
    assert [w.interval_at(s) for s in range(9)] == [8, 7, 6, 5, 5, 4, 3, 2, 2]
    # cumulative ends 8, 15, 21, 26, 31, 35, 38, 40, 42
    expected = {7: 0, 8: 1, 14: 1, 15: 2, 40: 8, 41: 8, 42: 0}
    assert {it: w.start(it) for it in expected} == expected
    explicit = SlidingWindow(10, size=2, shift_interval=10, strategy="decay", min_shift_interval=1)
    assert explicit.interval_at(0) == 10 and explicit.interval_at(8) == 1
    assert SlidingWindow(10, shift_interval=8).interval_at(5) == 8  # constant for progressive


def test_decay_divides_the_window_start_by_mixgrpos_start_bound():
    """MixGRPO's get_dynamic_iters_per_group: progress = window start / (sampling_steps - 2), whatever the window
    size; at 25 steps a 4-step window's starts end at 21, not 23."""
    w = SlidingWindow(25, size=4, shift_interval=10, strategy="decay", min_shift_interval=1)
    closed = [max(1, int(10 * (1 - s / 23) + s / 23)) for s in range(22)]
    assert [w.interval_at(s) for s in range(22)] == closed
    assert closed[10] == 6 and closed[21] == 1  # start / max_start would give int(110/21 + 10/21) = 5 at 10
    ends = [sum(closed[:s + 1]) for s in range(22)]
    assert [w.start(e - 1) for e in ends] == list(range(22)) and w.start(ends[-1]) == 0  # then rolls back


def test_random_window_is_reproducible_and_independent_of_call_order():
    w = SlidingWindow(12, size=3, strategy="random", seed=5)
    forward = [w.start(i) for i in range(60)]
    assert [w.start(i) for i in reversed(range(60))] == forward[::-1]
    assert set(forward) <= set(range(10)) and len(set(forward)) > 3
    assert forward != [SlidingWindow(12, size=3, strategy="random", seed=6).start(i) for i in range(60)]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"size": 11}, "size"),
        ({"size": 0}, "size"),
        ({"shift_interval": 0}, "shift_interval"),
        ({"stride": 0}, "stride"),
        ({"strategy": "exp_decay"}, "strategy"),
        ({"max_start": 7}, "max_start"),
        ({"max_start": -1}, "max_start"),
        ({"min_shift_interval": 26}, "min_shift_interval"),
        ({"seed": -1}, "seed"),
    ],
)
def test_sliding_window_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SlidingWindow(10, **kwargs)


def test_window_start_rejects_negative_iteration():
    with pytest.raises(ValueError, match="iteration"):
        SlidingWindow(10).start(-1)


@settings(max_examples=50, deadline=None)
@given(
    num_steps=st.integers(1, 40),
    data=st.data(),
    strategy=st.sampled_from(["progressive", "random", "decay"]),
    iteration=st.integers(0, 10_000),
)
def test_window_always_lies_inside_the_schedule(num_steps, data, strategy, iteration):
    size = data.draw(st.integers(1, num_steps))
    max_start = data.draw(st.none() | st.integers(0, num_steps - size))
    stride = data.draw(st.integers(1, 5))
    w = SlidingWindow(num_steps, size=size, shift_interval=data.draw(st.integers(1, 30)), stride=stride,
                      strategy=strategy, max_start=max_start)
    start = w.start(iteration)
    assert 0 <= start <= w.max_start and start + size <= num_steps
    if strategy != "random":
        assert start % stride == 0
    plan = w.plan(iteration)
    assert plan.train == tuple(range(start, start + size)) and sum(plan.sde) == size


# ---------------------------------------------------------------- MixGRPO-Flash


def test_flash_compresses_the_ode_steps_after_the_window_keeping_the_final_sigma():
    w = SlidingWindow(25)  # iteration 0: window [0, 4), R = 21 ODE steps after it
    plan = flash_plan(w, 0)
    assert plan.solver_after == "dpm2" and plan.train == (0, 1, 2, 3)
    # n = round(0.4 * 21) = 8 steps on linspace(4, 25, 9) = 4, 6.625, 9.25, 11.875, 14.5, ... rounded half up
    assert plan.ode_sigmas_after == (4, 7, 9, 12, 15, 17, 20, 22, 25)
    assert flash_plan(w, 20 * 25).ode_sigmas_after == (24, 25)  # R = 1: one step, never zero
    assert flash_plan(w, 21 * 25).ode_sigmas_after == (25,)  # window ends at the last step: nothing after it
    assert flash_plan(w, 0, compression=1.0).ode_sigmas_after == tuple(range(4, 26))
    uncompressed = flash_plan(w, 0, compression=None)
    assert uncompressed.ode_sigmas_after is None and uncompressed.solver_after == "dpm2"
    for bad in (0.0, 1.2):
        with pytest.raises(ValueError, match="compression"):
            flash_plan(w, 0, compression=bad)


@settings(max_examples=50, deadline=None)
@given(num_steps=st.integers(1, 50), data=st.data(), compression=st.floats(0.01, 1.0))
def test_flash_sigma_indices_are_an_increasing_subset_ending_at_t(num_steps, data, compression):
    size = data.draw(st.integers(1, num_steps))
    w = SlidingWindow(num_steps, size=size, shift_interval=1)
    start = w.start(data.draw(st.integers(0, 100)))
    kept = flash_plan(w, start, compression).ode_sigmas_after  # shift_interval=1, stride=1: iteration = start
    end, remaining = start + size, num_steps - start - size
    assert kept[0] == end and kept[-1] == num_steps and list(kept) == sorted(set(kept))
    assert len(kept) - 1 == (max(1, int(compression * remaining + 0.5)) if remaining else 0)


# ---------------------------------------------------------------- Flow-GRPO-Fast


def test_fast_plan_places_the_window_inside_the_first_half():
    starts = set()
    for it in range(200):
        plan = fast_plan(10, iteration=it, seed=3)
        start = plan.train[0]
        assert plan.train == (start, start + 1, start + 2) and sum(plan.sde) == 3
        starts.add(start)
    assert starts == {0, 1, 2}  # H = 5: start in 0..5-3
    assert fast_plan(10, iteration=7, seed=3) == fast_plan(10, iteration=7, seed=3)
    assert fast_plan(10, window=5, iteration=0).train == (0, 1, 2, 3, 4)
    with pytest.raises(ValueError, match="window"):
        fast_plan(10, window=6, iteration=0)
    with pytest.raises(ValueError, match="window"):
        fast_plan(10, window=3, within=0.25, iteration=0)  # H = 2
    with pytest.raises(ValueError, match="within"):
        fast_plan(10, within=0.0, iteration=0)
    with pytest.raises(ValueError, match="seed"):
        fast_plan(10, iteration=0, seed=-1)


# ---------------------------------------------------------------- TempFlow-GRPO


def test_tempflow_branch_steps():
    k = tempflow_branch_steps(10, 400, generator=gen(2))
    assert k.shape == (400,) and k.dtype == torch.int64 and set(k.tolist()) == set(range(10))
    only = tempflow_branch_steps(10, 200, candidates=[2, 5], generator=gen(2))
    assert set(only.tolist()) == {2, 5}
    torch.testing.assert_close(only, tempflow_branch_steps(10, 200, candidates=[2, 5], generator=gen(2)))
    for bad in ([], [1, 1], [10], [-1]):
        with pytest.raises(ValueError, match="candidates"):
            tempflow_branch_steps(10, 4, candidates=bad)
    with pytest.raises(ValueError, match="num_samples"):
        tempflow_branch_steps(10, 0)


def test_noise_aware_weights_favour_high_noise_steps():
    # std_t * sqrt(|dt|) of a 4-step schedule, decreasing over the steps, mean 2.5
    schedule = torch.tensor([4.0, 3.0, 2.0, 1.0])
    w = noise_aware_weights(schedule, schedule)
    torch.testing.assert_close(w, torch.tensor([1.6, 1.2, 0.8, 0.4]))
    assert w[0] > 1 > w[-1]
    torch.testing.assert_close(noise_aware_weights(torch.tensor([2, 2]), torch.tensor([2, 2])), torch.ones(2))
    for bad in (torch.tensor([1.0, -1.0]), torch.ones(2, 2), torch.tensor([]), torch.tensor([1.0, float("inf")])):
        with pytest.raises(ValueError, match="step_std"):
            noise_aware_weights(bad, schedule)
        with pytest.raises(ValueError, match="schedule_std"):
            noise_aware_weights(schedule, bad)
    with pytest.raises(ValueError, match="schedule_std must not be all zero"):
        noise_aware_weights(schedule, torch.zeros(3))


def test_noise_aware_weights_rise_toward_the_end_under_dance_on_a_shifted_schedule():
    """The kernels' transition stds on SD3's shift-3 schedule: flow_grpo and cps weigh the early steps most, dance
    (std eta * sqrt(|dt|), and the shift makes the early steps short) the late ones, as the docstrings say."""
    from mmgrpo.pipelines.flow import kernels

    t = torch.linspace(1, 0, 11)
    sigmas = 3 * t / (1 + 2 * t)
    zeros = torch.zeros(10, 1)
    steps = {"flow_grpo": lambda *a, **k: kernels.flow_grpo_sde_step(*a, sigma_max_substitute=float(sigmas[1]), **k),
             "cps": kernels.cps_step, "dance": kernels.dance_grpo_sde_step}
    weights = {name: noise_aware_weights(std, std) for name, step in steps.items()
               for std in [step(zeros, zeros, sigmas[:10], sigmas[1:], noise=zeros).std]}
    assert weights["flow_grpo"][0] > 1 > weights["flow_grpo"][-1] and weights["cps"][0] > 1 > weights["cps"][-1]
    assert weights["dance"][0] < 1 < weights["dance"][-1] and bool((weights["dance"].diff() > 0).all())


def test_noise_aware_weight_of_a_step_does_not_depend_on_the_other_steps_weighted():
    """The normaliser is the schedule's, not the batch's: a lone step (one TempFlow group) keeps its weight."""
    schedule = t([4.0, 3.0, 2.0, 1.0])
    alone = noise_aware_weights(t([2.0]), schedule)
    with_others = noise_aware_weights(t([4.0, 2.0, 2.0, 1.0]), schedule)
    torch.testing.assert_close(alone, t([0.8]))
    assert float(alone) == float(with_others[1]) == float(with_others[2]) != 1.0
    assert float(noise_aware_weights(t([4.0]), schedule)) > float(alone)


def test_timestep_weights_dispatch():
    std = t([3.0, 1.0])
    torch.testing.assert_close(timestep_weights("uniform", std, std), t([1.0, 1.0]))
    torch.testing.assert_close(timestep_weights("uniform", torch.tensor([3, 1]), std), torch.ones(2))
    torch.testing.assert_close(timestep_weights("noise_aware", std, std), t([1.5, 0.5]))
    torch.testing.assert_close(timestep_weights("noise_aware", t([1.0]), std), t([0.5]))
    with pytest.raises(ValueError, match="kind"):
        timestep_weights("snr", std, std)
    with pytest.raises(ValueError, match="step_std"):
        timestep_weights("uniform", torch.ones(2, 2), std)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=30).filter(lambda v: max(v) > 1e-3))
def test_noise_aware_weights_have_mean_one_over_the_schedule_and_keep_ratios(values):
    std = torch.tensor(values, dtype=torch.float64)
    w = noise_aware_weights(std, std)
    assert abs(float(w.mean()) - 1.0) < 1e-9
    torch.testing.assert_close(w * std.mean(), std)
    torch.testing.assert_close(noise_aware_weights(std[:1], std), w[:1], rtol=0, atol=0)
