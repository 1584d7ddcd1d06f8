"""consistency_bonus and temporal_bonus on batches that mix prompt groups with and without their rollout meta."""

import math

import torch

from mmgrpo.rewards import RewardBatch, build_reward

META = {"problem_type": "multiple choice", "solution": "<answer>B</answer>"}


def answer(letter: str) -> str:
    return f"<think>t</think><answer>{letter}</answer>"


def care_meta(likelihood: float | None) -> dict:
    return {**META} if likelihood is None else {**META, "care_answer_likelihood": likelihood}


def test_consistency_bonus_of_a_group_does_not_depend_on_another_group_in_the_batch():
    """Group 0 carries its likelihoods, group 1 (another prompt, no likelihoods) does not: group 0 scores as it
    does alone and group 1 is NaN (it made the whole batch NaN)."""
    reward = build_reward("consistency_bonus", {})
    letters, likes = ["B", "B", "A", "B"], [0.9, 0.3, 0.8, 0.88]
    alone = RewardBatch(prompts=["q"] * 4, group=torch.zeros(4, dtype=torch.long),
                        completions=[answer(x) for x in letters], meta=[care_meta(p) for p in likes])
    expected = reward(alone)
    assert expected.tolist() == [1.0, 0.0, 0.0, 1.0]
    mixed = RewardBatch(prompts=["q"] * 6, group=torch.tensor([0, 0, 0, 0, 1, 1]),
                        completions=[answer(x) for x in letters + ["B", "A"]],
                        meta=[care_meta(p) for p in likes] + [care_meta(None)] * 2)
    got = reward(mixed)
    assert got[:4].tolist() == expected.tolist() and all(math.isnan(v) for v in got[4:].tolist())
