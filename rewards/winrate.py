"""Pairwise win rates within prompt groups (Pref-GRPO).

Every unordered pair of samples in a group is compared once; a sample's reward is its mean win probability over its
G - 1 comparisons. Group-normalising tiny pointwise score gaps inflates them into large advantages ("illusory
advantage"); win rates are bounded and rank-based, which damps that. Groups come from ``batch.group``, which holds
whole groups, never a per-device slice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from mmgrpo.registry import REWARDS

from .base import GROUPWISE, POINTWISE, Reward, RewardBatch, as_scores, main_score
from .zoo import build_reward


def pairwise_win_rate(group: torch.Tensor, compare: Callable[[int, int], float | None], *,
                      return_failures: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(B,) float64 win rates of the samples of ``group`` (B,) ids.

    ``compare(i, j)`` is called once per unordered pair of rows ``i < j`` of one group and returns P(i beats j) in
    [0, 1] (1 win, 0 loss, 0.5 tie), or None when the judgement failed (unparsable judge output): that pair counts
    0.5 for both. Anything else (NaN, out of range) raises ``ValueError``. A group of one sample gets NaN.
    With ``return_failures``, also returns the (B,) int64 number of failed comparisons of each sample."""
    group = torch.as_tensor(group).reshape(-1)
    n = group.numel()
    wins = torch.zeros(n, dtype=torch.float64)
    games = torch.zeros(n, dtype=torch.float64)
    failures = torch.zeros(n, dtype=torch.int64)
    for gid in torch.unique(group):
        rows = torch.nonzero(group == gid).flatten().tolist()
        for a, i in enumerate(rows):
            for j in rows[a + 1:]:
                p = compare(i, j)
                if p is None:
                    p = 0.5
                    failures[i] += 1
                    failures[j] += 1
                elif not 0.0 <= float(p) <= 1.0:
                    raise ValueError(f"compare({i}, {j}) returned {p!r}; return P(i beats j) in [0, 1], "
                                     "or None for a failed judgement")
                wins[i] += float(p)
                wins[j] += 1.0 - float(p)
        games[rows] = len(rows) - 1
    rates = torch.where(games > 0, wins / games.clamp(min=1), math.nan)
    return (rates, failures) if return_failures else rates


@REWARDS.register("win_rate", kind=GROUPWISE, modality="any",
                  description="Pref-GRPO win rate in the group, comparing samples by a pointwise base reward")
class WinRate(Reward):
    """Win rate within each group, where i beats j when ``base(i) - base(j) > margin`` (a tie within the margin).

    A cheap, deterministic stand-in for a pairwise judge. A NaN base score (does not apply) makes its comparisons
    failures (0.5 each). Returns ``score`` (the win rate) and ``failures`` (failed comparisons per sample).

    Args:
        base: name (or ``module:attr``) of the pointwise reward that scores each sample.
        base_args: constructor arguments of the base reward.
        margin: score difference within which two samples tie (>= 0).
    """

    kind = GROUPWISE

    @classmethod
    def components(cls, args: dict[str, Any]) -> list[tuple[str | None, str, Callable[[], Any]]]:
        """The base reward (see :meth:`Reward.components`)."""
        return [("base", "base_args", lambda: REWARDS.entry(args["base"]).obj)]

    def __init__(self, base: str, base_args: dict | None = None, margin: float = 0.0):
        if margin < 0:
            raise ValueError(f"win_rate: margin must be >= 0; got {margin}")
        self.base_name, self.margin = base, float(margin)
        self.base = build_reward(base, base_args)
        if self.base.kind != POINTWISE:
            raise ValueError(f"win_rate: base reward '{base}' is {self.base.kind}; it must be pointwise")
        self.modality = self.base.modality

    def to(self, device: torch.device | str) -> WinRate:
        """Move the base reward."""
        self.base.to(device)
        return self

    def _base_scores(self, batch: RewardBatch) -> torch.Tensor:
        return main_score(as_scores(self.base(batch), len(batch), self.base_name), self.base_name)

    def __call__(self, batch: RewardBatch) -> dict[str, torch.Tensor]:
        s = self._base_scores(batch).tolist()

        def compare(i: int, j: int) -> float | None:
            if math.isnan(s[i]) or math.isnan(s[j]):
                return None
            d = s[i] - s[j]
            return 1.0 if d > self.margin else 0.0 if d < -self.margin else 0.5

        rates, failures = pairwise_win_rate(batch.group, compare, return_failures=True)
        return {"score": rates, "failures": failures.to(torch.float64)}
