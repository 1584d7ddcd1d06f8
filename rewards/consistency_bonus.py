"""GRPO-CARE consistency bonus (Chen et al. 2025, arXiv:2506.16141): reward correct answers that follow from their
reasoning, judged by a slowly moving reference model instead of a KL penalty.

For every training completion the vlm pipeline (``care.enabled``) stores in ``meta["care_answer_likelihood"]`` the
likelihood of its answer given the prompt and its own think text under an EMA of the policy: the geometric mean of
the reference's probabilities of the answer tokens, ``exp(mean log p_ref(answer token))``. Within each prompt
group, the high-accuracy rollouts (accuracy above ``threshold`` and at least the group's mean accuracy) whose
likelihood is at least their mean minus ``margin`` get their accuracy as the bonus; the reward's weight is the
bonus coefficient (GRPO-CARE: 0.5). The selection is made per prompt group; GRPO-CARE's public code pools the
whole local batch, which is one group there (one prompt per device).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mmgrpo.registry import REWARDS

from .base import GROUPWISE, RewardBatch
from .checks import completions_or_raise
from .text_rules import RolloutAccuracyBonus

LIKELIHOOD_KEY = "care_answer_likelihood"
"""Meta key of a training rollout's answer likelihood under the EMA reference, in [0, 1]; NaN when the completion
has no answer block. Absent outside training rollouts with ``care.enabled``."""


def consistency_bonus(accuracy: torch.Tensor, likelihood: torch.Tensor, group: torch.Tensor, margin: float = 0.01,
                      threshold: float = 0.1, likelihood_max: float = 0.95) -> torch.Tensor:
    """(B,) float64 bonus: ``accuracy`` on the rollouts picked below, 0 on the others of their group.

    - ``accuracy``: (B,) float accuracy scores; NaN counts as 0.
    - ``likelihood``: (B,) answer likelihood under the reference, clamped to at most ``likelihood_max`` (so that
      near-certain answers tie instead of ranking on noise); NaN (no answer) is never picked.
    - ``group``: (B,) group ids. In each group, the accurate rollouts are those with accuracy > ``threshold`` and
      >= the group's mean accuracy; the picked ones are the accurate rollouts whose likelihood is >= the mean
      likelihood of the accurate ones minus ``margin``. A group with no accurate rollout scores 0 everywhere.
    """
    acc = torch.nan_to_num(torch.as_tensor(accuracy, dtype=torch.float64).reshape(-1), nan=0.0)
    like = torch.as_tensor(likelihood, dtype=torch.float64).reshape(-1).clamp(max=likelihood_max)
    group = torch.as_tensor(group).reshape(-1)
    if not len(acc) == len(like) == len(group):
        raise ValueError(f"consistency_bonus: accuracy, likelihood and group have lengths {len(acc)}, {len(like)} "
                         f"and {len(group)}")
    bonus = torch.zeros_like(acc)
    for gid in torch.unique(group):
        rows = group == gid
        a, p = acc[rows], like[rows]
        at_least_mean = (a >= a.mean()) | torch.isclose(a, a.mean().expand_as(a), rtol=1e-12, atol=0.0)
        accurate = (a > threshold) & at_least_mean & ~torch.isnan(p)  # isclose: the mean of equal scores
        if not accurate.any():  # can round one ulp above them
            continue
        picked = accurate & (p >= p[accurate].mean() - margin)
        bonus[rows] = torch.where(picked, a, torch.zeros_like(a))
    return bonus


@REWARDS.register("consistency_bonus", kind=GROUPWISE, modality="text",
                  description="GRPO-CARE: accuracy bonus for correct answers that an EMA reference finds likely "
                              "given their reasoning")
class ConsistencyBonus(RolloutAccuracyBonus):
    """The GRPO-CARE bonus of :func:`consistency_bonus`, per prompt group. Needs ``care.enabled`` in the vlm
    pipeline, which fills ``meta["care_answer_likelihood"]``; rollouts without it (held-out evaluation) score NaN
    (does not apply), and so does the rest of their prompt group; other groups of the batch are scored as alone.
    Give it weight 0.5 (GRPO-CARE's bonus coefficient) and turn the KL off (``grpo.kl_beta: 0``): the bonus
    replaces it.

    Args:
        margin: rollouts this far below the accurate rollouts' mean likelihood still get the bonus (GRPO-CARE: 0.01).
        threshold: accuracy above which a rollout can count as accurate (GRPO-CARE: 0.1).
        likelihood_max: likelihoods are clamped to this before the comparison (GRPO-CARE: 0.95).
        accuracy_args: constructor arguments of the ``accuracy`` reward that decides the accurate rollouts.
    """

    def __init__(self, margin: float = 0.01, threshold: float = 0.1, likelihood_max: float = 0.95,
                 accuracy_args: dict[str, Any] | None = None):
        if margin < 0 or not 0 < likelihood_max <= 1:
            raise ValueError(f"consistency_bonus: margin must be >= 0 and likelihood_max in (0, 1]; got margin "
                             f"{margin} likelihood_max {likelihood_max}")
        self.margin, self.threshold, self.likelihood_max = float(margin), float(threshold), float(likelihood_max)
        super().__init__(accuracy_args)

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        completions_or_raise(batch, "consistency_bonus")
        out = torch.full((len(batch),), math.nan, dtype=torch.float64)
        rows = rows_of_complete_groups(batch)
        if not rows:
            return out
        scored = batch if len(rows) == len(batch) else batch.select(rows)
        likelihood = torch.tensor([float(m[LIKELIHOOD_KEY]) for m in scored.meta], dtype=torch.float64)
        accuracy = torch.as_tensor(self.accuracy(scored), dtype=torch.float64)
        out[rows] = consistency_bonus(accuracy, likelihood, scored.group, self.margin, self.threshold,
                                      self.likelihood_max)
        return out


def rows_of_complete_groups(batch: RewardBatch) -> list[int]:
    """The rows of ``batch`` whose whole prompt group carries ``meta[LIKELIHOOD_KEY]``; the other groups' rows
    score NaN, whatever else is in the batch."""
    missing = {gid for gid, meta in zip(batch.group.tolist(), batch.meta) if LIKELIHOOD_KEY not in meta}
    return [row for row, gid in enumerate(batch.group.tolist()) if gid not in missing]
