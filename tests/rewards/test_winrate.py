"""Pairwise win rates (Pref-GRPO) and the win_rate reward."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo.config import RewardSpec
from mmgrpo.rewards import RewardBatch, RewardZoo, build_reward, pairwise_win_rate


def by_score(scores):
    return lambda i, j: 1.0 if scores[i] > scores[j] else 0.0 if scores[i] < scores[j] else 0.5


def test_win_rate_closed_form():
    # scores 3 > 2 > 1: the best beats both (1), the middle wins one of two (0.5), the worst none (0)
    rates = pairwise_win_rate(torch.zeros(3, dtype=torch.long), by_score([3, 1, 2]))
    assert rates.dtype == torch.float64 and rates.tolist() == [1.0, 0.0, 0.5]
    assert pairwise_win_rate(torch.zeros(4, dtype=torch.long), lambda i, j: 0.5).tolist() == [0.5] * 4
    soft = pairwise_win_rate(torch.zeros(2, dtype=torch.long), lambda i, j: 0.8)
    assert soft.tolist() == pytest.approx([0.8, 0.2])


def test_only_pairs_within_a_group_are_compared():
    calls = []

    def compare(i, j):
        calls.append((i, j))
        return 1.0 if i < j else 0.0

    group = torch.tensor([7, 3, 7, 3, 7])  # interleaved groups, arbitrary ids
    rates = pairwise_win_rate(group, compare)
    assert sorted(calls) == [(0, 2), (0, 4), (1, 3), (2, 4)]  # C(3,2) + C(2,2), each once, i < j
    assert rates.tolist() == [1.0, 1.0, 0.5, 0.0, 0.0]


def test_failures_count_half_and_are_counted():
    def compare(i, j):
        return None if (i, j) == (0, 1) else 1.0 if i < j else 0.0

    rates, failures = pairwise_win_rate(torch.zeros(3, dtype=torch.long), compare, return_failures=True)
    # 0: 0.5 (failed) + 1 -> 0.75; 1: 0.5 (failed) + 1 -> 0.75; 2: 0 + 0 -> 0
    assert rates.tolist() == [0.75, 0.75, 0.0]
    assert failures.tolist() == [1, 1, 0]


def test_singleton_group_is_nan_and_bad_probabilities_raise():
    rates = pairwise_win_rate(torch.tensor([0, 1, 1]), lambda i, j: 1.0)
    assert math.isnan(rates[0]) and rates[1:].tolist() == [1.0, 0.0]
    for bad in (1.5, -0.1, math.nan):
        with pytest.raises(ValueError, match=r"compare\(0, 1\) returned .*in \[0, 1\]"):
            pairwise_win_rate(torch.zeros(2, dtype=torch.long), lambda i, j, p=bad: p)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=12),
       st.lists(st.floats(0, 1), min_size=12, max_size=12))
def test_rates_in_a_group_sum_to_half_its_size(group_ids, scores):
    # each of the C(G,2) pairs hands out exactly 1 win, and each sample plays G-1 games: sum = G/2
    group = torch.tensor(group_ids)
    rates = pairwise_win_rate(group, by_score(scores))
    for gid in set(group_ids):
        members = rates[group == gid]
        if len(members) > 1:
            assert members.sum().item() == pytest.approx(len(members) / 2)
            assert ((members >= 0) & (members <= 1)).all()


def text_batch(completions, group, meta=None):
    return RewardBatch(prompts=["q"] * len(completions), group=torch.tensor(group), completions=completions,
                       meta=meta or [])


def test_win_rate_reward_compares_base_scores_with_margin():
    # length scores (max_len 10, slack 10): 10 chars -> 1, 15 -> 0.5, 20 -> 0
    batch = text_batch(["x" * 10, "x" * 15, "x" * 20, "x" * 10, "x" * 10], [0, 0, 0, 1, 1])
    base = {"base": "length", "base_args": {"max_len": 10}}
    out = build_reward("win_rate", base)(batch)
    assert out["score"].tolist() == [1.0, 0.5, 0.0, 0.5, 0.5] and out["failures"].tolist() == [0.0] * 5
    # margin 0.6: gaps of 0.5 tie, the gap of 1.0 still wins
    out = build_reward("win_rate", {**base, "margin": 0.6})(batch)
    assert out["score"].tolist() == [0.75, 0.5, 0.25, 0.5, 0.5]


def test_win_rate_nan_base_scores_are_failures():
    meta = [{"problem_type": "OCR", "solution": "a b"}, {"problem_type": "essay", "solution": "a"},
            {"problem_type": "OCR", "solution": "a b"}]
    batch = text_batch(["<answer>a b</answer>", "<answer>a</answer>", "<answer>a</answer>"], [0, 0, 0], meta)
    reward = build_reward("win_rate", {"base": "accuracy", "base_args": {"unknown_type": "nan"}})
    assert reward.kind == "groupwise" and reward.modality == "text"
    out = reward(batch)
    # base scores 1, NaN, 0.5: 0 beats 2; every comparison with 1 fails (0.5)
    assert out["score"].tolist() == [0.75, 0.5, 0.25]
    assert out["failures"].tolist() == [1.0, 2.0, 1.0]


def test_win_rate_through_the_zoo_and_bad_args():
    zoo = RewardZoo([RewardSpec(name="win_rate", args={"base": "length", "base_args": {"max_len": 10}})])
    main, logged, _ = zoo(text_batch(["x" * 10, "x" * 20], [0, 0]))
    assert main[:, 0].tolist() == [1.0, 0.0]
    assert sorted(logged) == ["win_rate/failures", "win_rate/score"]
    with pytest.raises(ValueError, match="base reward 'win_rate' is groupwise; it must be pointwise"):
        build_reward("win_rate", {"base": "win_rate", "base_args": {"base": "length", "base_args": {"max_len": 1}}})
    with pytest.raises(ValueError, match="margin must be >= 0"):
        build_reward("win_rate", {"base": "length", "base_args": {"max_len": 1}, "margin": -1})
