"""T-GRPO temporal bonus (Video-R1): reward correct answers only when the ordered frames were needed to get them.

For each video prompt the vlm pipeline also samples answers on shuffled frames (not trained) and stores the group's
mean shuffled accuracy in every ordered sample's ``meta["tgrpo_shuffled_acc"]``. A group *passes* when its ordered
accuracy is at least ``mu`` times the shuffled one; each correct ordered rollout of a passing group then gets
``+alpha``. The test is made per prompt group. Video-R1's public code pools the whole local batch, which is only
right at one prompt per device.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mmgrpo.registry import REWARDS

from .base import GROUPWISE, RewardBatch
from .checks import completions_or_raise
from .text_rules import RolloutAccuracyBonus

SHUFFLED_ACC_KEY = "tgrpo_shuffled_acc"
"""Meta key holding the group's mean accuracy on shuffled frames; absent or NaN for non-video samples."""


def temporal_bonus(correct: torch.Tensor, group: torch.Tensor, shuffled_acc: torch.Tensor, alpha: float, mu: float,
                   accuracy: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) float64 bonus: ``alpha * correct`` in groups whose ordered accuracy >= ``mu`` * shuffled accuracy, else 0.

    - ``correct``: (B,) bool, the ordered rollouts that get the bonus when their group passes.
    - ``group``: (B,) group ids; each group is tested on its own members only.
    - ``shuffled_acc``: (B,) float, the group's shuffled-frame accuracy (equal within a group); NaN -> NaN bonus
      (the sample is not a video, the bonus does not apply).
    - ``accuracy``: (B,) float ordered accuracy scores whose group mean is the ordered accuracy (Video-R1 uses the
      mean accuracy reward); None uses the fraction of correct rollouts. NaN scores are left out of the mean.
    """
    correct = torch.as_tensor(correct, dtype=torch.bool).reshape(-1)
    group = torch.as_tensor(group).reshape(-1)
    shuffled = torch.as_tensor(shuffled_acc, dtype=torch.float64).reshape(-1)
    score = correct.double() if accuracy is None else torch.as_tensor(accuracy, dtype=torch.float64).reshape(-1)
    bonus = torch.full_like(shuffled, math.nan)
    for gid in torch.unique(group):
        rows = group == gid
        s = shuffled[rows]
        if torch.isnan(s).all():
            continue
        if not torch.allclose(s, s[0].expand_as(s)):
            raise ValueError(f"temporal_bonus: group {int(gid)} has differing shuffled accuracies {s.tolist()}")
        ordered = score[rows].nanmean()
        passed = bool(ordered >= mu * s[0]) if not torch.isnan(ordered) else False
        bonus[rows] = alpha * correct[rows].double() * float(passed)
    return bonus


@REWARDS.register("temporal_bonus", kind=GROUPWISE, modality="text",
                  description="T-GRPO: +alpha to correct answers of groups that beat mu x their shuffled-frame accuracy")
class TemporalBonus(RolloutAccuracyBonus):
    """The T-GRPO bonus of :func:`temporal_bonus`, per prompt group. Needs ``tgrpo.enabled`` in the vlm pipeline,
    which fills ``meta["tgrpo_shuffled_acc"]``; samples without it (images, text) score NaN (does not apply).

    The ordered accuracy of a group is the mean of the ``accuracy`` reward over its rollouts (as in Video-R1); a
    rollout is correct when its accuracy exceeds ``threshold`` (Video-R1: 0.1).

    Args:
        alpha: bonus for each correct rollout of a passing group (Video-R1: 0.3).
        mu: a group passes when ordered accuracy >= mu * shuffled accuracy (Video-R1 code: 0.8).
        threshold: accuracy above which a rollout counts as correct.
        accuracy_args: constructor arguments of the ``accuracy`` reward; the vlm pipeline scores the shuffled
            rollouts with the same arguments.
    """

    def __init__(self, alpha: float = 0.3, mu: float = 0.8, threshold: float = 0.1,
                 accuracy_args: dict[str, Any] | None = None):
        if alpha < 0 or mu < 0:
            raise ValueError(f"temporal_bonus: alpha and mu must be >= 0; got alpha {alpha} mu {mu}")
        self.alpha, self.mu, self.threshold = float(alpha), float(mu), float(threshold)
        super().__init__(accuracy_args)

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        completions_or_raise(batch, "temporal_bonus")
        shuffled = torch.tensor([float(m.get(SHUFFLED_ACC_KEY, math.nan)) for m in batch.meta], dtype=torch.float64)
        if torch.isnan(shuffled).all():
            return shuffled
        video = ~torch.isnan(shuffled)
        rows = torch.nonzero(video).flatten().tolist()
        accuracy = torch.full_like(shuffled, math.nan)
        accuracy[video] = self.accuracy(batch.select(rows))
        correct = torch.nan_to_num(accuracy, nan=0.0) > self.threshold
        return temporal_bonus(correct, batch.group, shuffled, self.alpha, self.mu, accuracy=accuracy)
