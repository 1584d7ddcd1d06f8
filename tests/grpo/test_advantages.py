import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mmgrpo.grpo.advantages import (
    batch_normalize,
    clip_advantages,
    combine_rewards,
    group_mean,
    group_mean_batch_std,
    group_stats,
    group_zscore,
    max_rl,
    no_signal_groups,
    rloo,
    weighted_reward,
    zero_std_groups,
)
from mmgrpo.registry import ADVANTAGES

NAN = float("nan")
ESTIMATORS = {"group_zscore": group_zscore, "group_mean": group_mean,
              "group_mean_batch_std": group_mean_batch_std, "rloo": rloo}
"""The shift-invariant estimators (max_rl, which is not, is tested on its own)."""


def t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, t(expected), atol=atol, rtol=0)


# Group 7 has a NaN member, 100 a single valid member, 42 none; ids are arbitrary and interleaved.
MIXED_R = t([1.0, NAN, 3.0, 5.0, 2.0, 2.0, NAN])
MIXED_G = t([7, 7, 7, -3, -3, 100, 42], torch.int64)


def test_registered_under_their_names():
    for name, fn in {**ESTIMATORS, "max_rl": max_rl}.items():
        assert ADVANTAGES.get(name) is fn


def test_group_zscore_hand_computed():
    r, g = t([1.0, 2.0, 3.0, 4.0]), t([0, 0, 1, 1], torch.int64)
    close(group_zscore(r, g, 0.0), [-1.0, 1.0, -1.0, 1.0])  # means 1.5, 3.5; std 0.5
    close(group_zscore(r, g, 0.5), [-0.5, 0.5, -0.5, 0.5])  # -0.5 / (0.5 + 0.5)
    assert group_zscore(r.float(), g, 0.0).dtype == torch.float64


def test_group_zscore_nan_and_noncontiguous_ids():
    # group 7: valid {1, 3}, mean 2 std 1; group -3: {5, 2}, mean 3.5 std 1.5; 100 alone; 42 all NaN.
    close(group_zscore(MIXED_R, MIXED_G, 0.0), [-1.0, 0.0, 1.0, 1.0, -1.0, 0.0, 0.0])


def test_group_mean_hand_computed():
    close(group_mean(MIXED_R, MIXED_G, 123.0), [-1.0, 0.0, 1.0, 1.5, -1.5, 0.0, 0.0])


def test_group_mean_batch_std_hand_computed():
    # valid rewards 1, 3, 5, 2, 2: mean 2.6, squared deviations 2.56 + 0.16 + 5.76 + 0.36 + 0.36 = 9.2, var 1.84
    std = math.sqrt(1.84)
    close(group_mean_batch_std(MIXED_R, MIXED_G, 0.0), [-1 / std, 0.0, 1 / std, 1.5 / std, -1.5 / std, 0.0, 0.0])
    close(group_mean_batch_std(MIXED_R, MIXED_G, 0.1)[:1], [-1 / (std + 0.1)])


def test_rloo_hand_computed():
    # group 7: 1 - 3, 3 - 1; group -3: 5 - 2, 2 - 5; a lone member gets 0.
    close(rloo(MIXED_R, MIXED_G, 0.0), [-2.0, 0.0, 2.0, 3.0, -3.0, 0.0, 0.0])
    close(rloo(t([1.0, 2.0, 6.0]), t([0, 0, 0], torch.int64), 0.0), [1 - 4.0, 2 - 3.5, 6 - 1.5])


def test_max_rl_hand_computed():
    # group 0: 1 success of 4 -> (1 - 1/4) / (1/4) = 3 and -1; group 1: 2 of 4 -> +-1; group 2: none -> 0
    r = t([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    g = t([0, 0, 0, 0, 1, 1, 1, 1, 2, 2], torch.int64)
    close(max_rl(r, g, 1e-6), [3.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 0.0, 0.0])
    # scores in [0, 1]; NaN left out: mean 0.5 -> (0.25 - 0.5) / 0.5
    close(max_rl(t([0.25, 0.75, NAN]), t([5, 5, 5], torch.int64), 1e-6), [-0.5, 0.5, 0.0])
    close(max_rl(t([0.0, 1e-9]), t([0, 0], torch.int64), 1e-6), [0.0, 0.0])  # mean <= eps: no signal


def test_max_rl_rejects_negative_rewards():
    with pytest.raises(ValueError, match="max_rl needs rewards >= 0.*-0.5"):
        max_rl(t([1.0, -0.5]), t([0, 0], torch.int64), 1e-6)


def test_all_nan_batch_gives_zeros():
    r, g = t([NAN, NAN]), t([0, 1], torch.int64)
    for fn in ESTIMATORS.values():
        close(fn(r, g, 1e-4), [0.0, 0.0])


def test_group_stats_hand_computed():
    index, count, mean, std = group_stats(MIXED_R, MIXED_G)
    # sorted ids: -3, 7, 42, 100
    assert index.tolist() == [1, 1, 1, 0, 0, 3, 2]
    close(count, [2.0, 2.0, 0.0, 1.0])
    close(mean, [3.5, 2.0, 0.0, 2.0])
    close(std, [1.5, 1.0, 0.0, 0.0])


def test_zero_std_groups():
    r = t([1.0, 1.0, NAN, 2.0, 3.0, 4.0, NAN, NAN])
    g = t([0, 0, 0, 1, 1, 2, 3, 3], torch.int64)
    assert zero_std_groups(r, g).tolist() == [True, True, True, False, False, True, True, True]
    assert zero_std_groups(r, g, tol=0.5).tolist() == [True] * 8  # group 1 has std 0.5


def test_no_signal_groups_follow_the_aggregation():
    # group 0: the rewards vary but their weighted sum (1*2 + 2*0 = 1*0 + 2*1) does not; group 1: nothing varies
    r = t([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    g = t([0, 0, 1, 1], torch.int64)
    assert no_signal_groups(r, [1.0, 2.0], g, "weighted_sum").tolist() == [True, True, True, True]
    assert no_signal_groups(r, [1.0, 2.0], g, "gdpo").tolist() == [False, False, True, True]
    assert no_signal_groups(r, [1.0, 0.0], t([0, 0, 0, 0], torch.int64), "gdpo").all() == torch.tensor(False)
    assert no_signal_groups(r[:2, 1:], [0.0], g[:2], "gdpo").all()  # a zero-weight reward never counts
    with pytest.raises(ValueError, match="reward aggregation"):
        no_signal_groups(r, [1.0, 2.0], g, "mean")


def test_weighted_reward():
    r = t([[1.0, 2.0], [NAN, 3.0], [NAN, NAN], [4.0, NAN]])
    out = weighted_reward(r, [0.5, 2.0])
    close(out[[0, 1, 3]], [4.5, 6.0, 2.0])
    assert math.isnan(out[2])
    # with groups a NaN takes its group's mean of that reward: group 0 = rows 0, 1 (reward 0's mean is 1), group
    # 1 = rows 2, 3 (reward 1 applies to neither, so it is left out of both sums)
    grouped = weighted_reward(r, [0.5, 2.0], t([0, 0, 1, 1], torch.int64))
    close(grouped[[0, 1, 3]], [4.5, 0.5 * 1.0 + 6.0, 2.0])
    assert math.isnan(grouped[2])


def test_a_reward_that_does_not_apply_gives_no_advantage_in_a_weighted_sum():
    # rows 1-3 are ranked by reward 1 alone; row 0's reward 1 does not apply. Scoring it 0 (nansum) would give it
    # the lowest advantage; taking the group's mean, it sits where reward 0 alone puts it (level with the mean).
    r = t([[1.0, NAN], [1.0, 0.9], [1.0, 0.8], [1.0, 0.7]])
    g = t([0, 0, 0, 0], torch.int64)
    adv = combine_rewards(r, [1.0, 1.0], g, "weighted_sum", "group_zscore", 0.0)
    # sums 1.8 (row 0: reward 1's mean), 1.9, 1.8, 1.7: mean 1.8, population std 0.1 / sqrt(2)
    close(adv, [0.0, math.sqrt(2), 0.0, -math.sqrt(2)], atol=1e-9)


def test_gdpo_separates_what_the_weighted_sum_collapses():
    # Reward A is common (2 of 4 succeed), reward B rare (1 of 4). Samples 0 and 1 have the same sum, 1.
    r = t([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    g = t([0, 0, 0, 0], torch.int64)
    s3 = math.sqrt(3)
    # weighted sum: sums 1, 1, 1, 0 -> mean 3/4, std sqrt(3)/4
    close(combine_rewards(r, [1.0, 1.0], g, "weighted_sum", "group_zscore", 0.0), [1 / s3, 1 / s3, 1 / s3, -s3])
    # gdpo: A -> +-1; B: mean 1/4, std sqrt(3)/4 -> -1/sqrt(3) for the zeros, sqrt(3) for the success
    gdpo = combine_rewards(r, [1.0, 1.0], g, "gdpo", "group_zscore", 0.0)
    close(gdpo, [1 - 1 / s3, -1 + s3, 1 - 1 / s3, -1 - 1 / s3])
    assert gdpo[1] > gdpo[0]


def test_gdpo_weights_and_nan_columns():
    r = t([[1.0, NAN], [3.0, 2.0], [5.0, 6.0], [NAN, NAN]])
    g = t([4, 4, 9, 9], torch.int64)
    # column 0, group_mean: [-1, 1, 0, 0]; column 1: [0, 0, 0, 0] (group 4 has one valid, group 9 one valid)
    close(combine_rewards(r, [2.0, 10.0], g, "gdpo", "group_mean", 0.0), [-2.0, 2.0, 0.0, 0.0])
    # weighted sum: row 0's NaN takes group 4's mean of column 1 (2) -> [22, 26, 70, NaN] -> group means 24, 70
    close(combine_rewards(r, [2.0, 10.0], g, "weighted_sum", "group_mean", 0.0), [-2.0, 2.0, 0.0, 0.0])


def test_combine_rewards_accepts_import_path_and_rejects_unknown_aggregation():
    r, g = t([[1.0], [3.0]]), t([0, 0], torch.int64)
    close(combine_rewards(r, [1.0], g, "weighted_sum", "mmgrpo.grpo.advantages:rloo", 0.0), [-2.0, 2.0])
    with pytest.raises(ValueError, match="'sum'.*weighted_sum, gdpo"):
        combine_rewards(r, [1.0], g, "sum", "rloo", 0.0)


def test_batch_normalize():
    adv = t([1.0, 3.0, 7.0, 5.0])
    valid = torch.tensor([True, True, False, True])
    # valid 1, 3, 5: mean 3, population std sqrt(8/3); the invalid sample stays 0
    std = math.sqrt(8 / 3)
    close(batch_normalize(adv, valid, 0.0), [-2 / std, 0.0, 0.0, 2 / std])
    close(batch_normalize(adv, valid, 1.0), [-2 / (std + 1), 0.0, 0.0, 2 / (std + 1)])
    close(batch_normalize(adv, torch.zeros(4, dtype=torch.bool), 0.0), [0.0] * 4)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-100, 100), min_size=2, max_size=12), st.floats(-50, 50), st.floats(0.1, 10))
def test_batch_normalize_is_invariant_to_shift_and_scale(values, shift, scale):
    adv = t(values)
    valid = torch.ones(len(values), dtype=torch.bool)
    assume(adv.std(unbiased=False) > 1e-3)
    base = batch_normalize(adv, valid, 0.0)
    close(batch_normalize(adv * scale + shift, valid, 0.0), base.tolist(), atol=1e-6)


def test_clip_advantages():
    adv = t([-7.0, -1.0, 0.5, 6.0])
    close(clip_advantages(adv, 5.0), [-5.0, -1.0, 0.5, 5.0])
    close(clip_advantages(adv, 0.0), adv.tolist())
    close(clip_advantages(adv, -1.0), adv.tolist())


# ---- straightforward loop references and properties ----------------------------------------------------------


def reference(name, rewards, group, eps):
    """Loop over samples and groups with Python floats."""
    r, g = rewards.tolist(), group.tolist()
    valid = [x for x in r if not math.isnan(x)]
    batch_mean = sum(valid) / max(len(valid), 1)
    batch_std = math.sqrt(sum((x - batch_mean) ** 2 for x in valid) / max(len(valid), 1))
    out = []
    for x, gid in zip(r, g):
        members = [y for y, h in zip(r, g) if h == gid and not math.isnan(y)]
        if math.isnan(x):
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((y - mean) ** 2 for y in members) / len(members))
        if name == "group_zscore":
            out.append((x - mean) / (std + eps) if std + eps > 0 else 0.0)
        elif name == "group_mean":
            out.append(x - mean)
        elif name == "group_mean_batch_std":
            out.append((x - mean) / (batch_std + eps) if batch_std + eps > 0 else 0.0)
        else:
            others = list(members)
            others.remove(x)
            out.append(x - sum(others) / len(others) if others else 0.0)
    return t(out)


@st.composite
def grouped_rewards(draw, distinct=False):
    """(rewards, group): 1-4 groups with arbitrary ids, rewards k/4 or NaN, samples shuffled.

    ``distinct``: each group has at least two different valid rewards (so its std is nonzero)."""
    ids = draw(st.lists(st.integers(-50, 50), min_size=1, max_size=4, unique=True))
    rewards, group = [], []
    for gid in ids:
        values = draw(st.lists(st.integers(-8, 8), min_size=2 if distinct else 0, max_size=5, unique=distinct))
        nans = draw(st.integers(0 if values else 1, 2))
        rewards += [v / 4 for v in values] + [NAN] * nans
        group += [gid] * (len(values) + nans)
    order = draw(st.permutations(range(len(rewards))))
    return t(rewards)[list(order)], t(group, torch.int64)[list(order)]


@settings(max_examples=50, deadline=None)
@given(grouped_rewards(), st.sampled_from(sorted(ESTIMATORS)), st.sampled_from([0.0, 1e-3, 0.5]))
def test_estimators_match_loop_reference(data, name, eps):
    rewards, group = data
    torch.testing.assert_close(ESTIMATORS[name](rewards, group, eps), reference(name, rewards, group, eps),
                               atol=1e-9, rtol=1e-9)


@settings(max_examples=50, deadline=None)
@given(grouped_rewards(), st.sampled_from(sorted(ESTIMATORS)), st.floats(-100, 100))
def test_shift_invariance(data, name, shift):
    rewards, group = data
    fn = ESTIMATORS[name]
    torch.testing.assert_close(fn(rewards + shift, group, 1e-3), fn(rewards, group, 1e-3), atol=1e-8, rtol=0)


@settings(max_examples=50, deadline=None)
@given(grouped_rewards(distinct=True), st.sampled_from(["group_zscore", "group_mean_batch_std"]),
       st.floats(0.01, 100))
def test_scale_invariance(data, name, scale):
    rewards, group = data
    fn = ESTIMATORS[name]
    torch.testing.assert_close(fn(rewards * scale, group, 0.0), fn(rewards, group, 0.0), atol=1e-9, rtol=1e-9)


@settings(max_examples=50, deadline=None)
@given(grouped_rewards())
def test_zero_std_groups_match_loop(data):
    rewards, group = data
    r, g = rewards.tolist(), group.tolist()
    expected = []
    for gid in g:
        members = [y for y, h in zip(r, g) if h == gid and not math.isnan(y)]
        expected.append(len(set(members)) <= 1)
    assert zero_std_groups(rewards, group).tolist() == expected


@st.composite
def success_groups(draw):
    """(rewards, group, scores): 1-4 groups of 2-6 samples with 0/1 rewards (at least one success each) and a
    per-sample score standing in for a score function."""
    rewards, group = [], []
    for gid in range(draw(st.integers(1, 4))):
        values = draw(st.lists(st.integers(0, 1), min_size=2, max_size=6).filter(any))
        rewards += values
        group += [gid] * len(values)
    scores = draw(st.lists(st.floats(-10, 10), min_size=len(rewards), max_size=len(rewards)))
    return t(rewards), t(group, torch.int64), t(scores)


@settings(max_examples=50, deadline=None)
@given(success_groups(), st.floats(0.01, 100))
def test_max_rl_is_the_success_mean_minus_the_group_mean(data, scale):
    """For 0/1 rewards sum_i A_i s_i = G (mean of s over the successes - mean of s over the group) in every group
    (MaxRL's estimator with its control variate), and rescaling the rewards changes nothing."""
    rewards, group, scores = data
    adv = max_rl(rewards, group, 1e-9)
    torch.testing.assert_close(max_rl(rewards * scale, group, 1e-9), adv, atol=1e-9, rtol=1e-9)
    for gid in group.unique():
        sel = group == gid
        r, s = rewards[sel], scores[sel]
        expected = len(r) * (s[r == 1].mean() - s.mean())
        torch.testing.assert_close((adv[sel] * s).sum(), expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("value", [0.1, 0.7, 0.9, 1 / 3])
@pytest.mark.parametrize("size", [3, 7, 24])
def test_a_group_of_equal_rewards_has_exactly_zero_std_and_advantage(value, size):
    """The mean of G equal float64 rewards is not always that value (0.1 * 3 / 3 != 0.1), so the deviations were
    about 1e-17, their std the same, and with adv_eps=0 every member got advantage +1 or -1: a full-size push on
    a group without signal."""
    r, g = t([value] * size + [0.0, 1.0]), t([5] * size + [6, 6], torch.int64)
    _, _, mean, std = group_stats(r, g)
    assert mean[0].item() == value and std[0].item() == 0.0
    for name, fn in {**ESTIMATORS, "max_rl": max_rl}.items():
        assert fn(r, g, 0.0)[:size].abs().max().item() == 0.0, name
