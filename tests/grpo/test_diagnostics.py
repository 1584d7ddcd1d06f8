import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mmgrpo.grpo.advantages import ZERO_STD_TOL
from mmgrpo.grpo.diagnostics import advantage_stats, constant_columns, masked_mean, ratio_stats

NAN = float("nan")


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert masked_mean(x, torch.tensor([[True, False], [True, True]])) == pytest.approx(8 / 3)
    assert masked_mean(x, torch.zeros(2, 2, dtype=torch.bool)) == 0.0


def test_ratio_stats_hand_computed():
    ratio = torch.tensor([[1.0, 1.2, 5.0], [0.7, 1.0, 1.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    clipped = torch.tensor([[False, True, True], [False, False, False]])  # the masked-out clip does not count
    stats = ratio_stats(ratio, mask, clipped)
    assert stats == pytest.approx({"ratio/mean": 3.9 / 4, "ratio/max_dev": 0.3, "clip_frac": 0.25})
    assert all(isinstance(v, float) for v in stats.values())


def test_ratio_stats_empty_mask():
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert ratio_stats(torch.full((2, 3), 7.0), empty, ~empty) == {
        "ratio/mean": 1.0, "ratio/max_dev": 0.0, "clip_frac": 0.0}


def test_advantage_stats_hand_computed():
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    # group 5: mean 2, std sqrt(0.5); group 9: std 0; group 11: one valid member; group 13: none valid
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, 2.0, 4.0, NAN, NAN, NAN])
    group = torch.tensor([5, 5, 5, 5, 9, 9, 11, 11, 13, 13])
    mean = 3 / 10
    std = math.sqrt(11.5 / 10 - mean**2)  # sum of squares 1 + 1 + 0.25 + 0.25 + 9
    assert advantage_stats(adv, rewards, group) == pytest.approx({
        "adv/mean": mean, "adv/std": std, "adv/abs_max": 3.0,
        "groups/zero_std_frac": 3 / 4,  # groups, not samples (6 / 10)
        "reward/std_within_group": math.sqrt(0.5) / 3,  # over the 3 groups that have a valid reward
    })


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=12))
def test_zero_std_frac_counts_groups(pairs):
    group = torch.tensor([g for g, _ in pairs])
    rewards = torch.tensor([float(r) for _, r in pairs])
    ids = sorted(set(group.tolist()))
    zero = [len({r for g, r in pairs if g == gid}) == 1 for gid in ids]
    stats = advantage_stats(torch.zeros(len(pairs)), rewards, group)
    assert stats["groups/zero_std_frac"] == pytest.approx(sum(zero) / len(ids))


def test_constant_columns_ignore_nan_and_count_an_all_nan_column_as_constant():
    rewards = torch.tensor([[1.0, 0.0, NAN, 0.5], [1.0, 2.0, NAN, 0.5 + 1e-12], [NAN, 0.0, NAN, 0.5]])
    assert constant_columns(rewards).tolist() == [True, False, True, True]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=12), st.floats(-100, 100))
@example([0.0, 1e-9], 0.0)  # a spread between the tolerance and 1e-9, where this test once compared at 1e-9
@example([0.0, ZERO_STD_TOL], 0.0)
def test_constant_columns_agree_with_the_spread_and_ignore_a_shift(values, shift):
    rewards = torch.tensor(values, dtype=torch.float64)[:, None]
    expected = max(values) - min(values) <= ZERO_STD_TOL
    assert constant_columns(rewards).item() == expected
    assert constant_columns(torch.full_like(rewards, shift)).item()
