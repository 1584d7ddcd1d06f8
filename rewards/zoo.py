"""RewardZoo: the configured rewards, loaded once, scored together on a batch.

The zoo returns raw per-reward scores. Combining them (weighted sum or GDPO) needs whole groups across processes,
so it happens in the trainer through :mod:`mmgrpo.grpo.advantages`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from mmgrpo.registry import REWARDS

from .base import FunctionReward, Reward, RewardBatch, as_scores, is_trl_signature, main_score, trl_reward


def build_reward(name: str, args: dict[str, Any] | None = None) -> Reward:
    """Instantiate a reward by registered name or ``module:attr``.

    A class or factory is called with ``args``; a plain function becomes a :class:`FunctionReward` (or a TRL-style
    wrapper when its first parameters are ``prompts, completions``)."""
    entry = REWARDS.entry(name)
    obj, args = entry.obj, dict(args or {})
    if isinstance(obj, type) and issubclass(obj, Reward):
        return obj(**args)
    if isinstance(obj, Reward):
        if args:
            raise ValueError(f"reward '{name}' is an instance and takes no args (got {sorted(args)})")
        return obj
    if callable(obj):
        if args:
            made = obj(**args)
            if isinstance(made, Reward):
                return made
            raise ValueError(f"reward '{name}' took args but did not return a Reward")
        if is_trl_signature(obj):
            return trl_reward(obj)
        return FunctionReward(obj, kind=entry.info.get("kind", "pointwise"),
                              modality=entry.info.get("modality", "any"))
    raise ValueError(f"reward '{name}' is not callable")


class RewardZoo:
    """The configured rewards. ``__call__`` returns ``(main (B, R) float64, logged {name: (B,)}, seconds {name})``.

    ``main[:, r]`` is reward r's score (its ``score`` sub-score, or the mean of its sub-scores when it returns
    several); ``logged`` holds every score and sub-score by name for metrics."""

    def __init__(self, specs: Sequence[Any]):
        if not specs:
            raise ValueError("no rewards configured: add at least one entry under 'rewards'")
        self.names = [s.name for s in specs]
        self.weights = torch.tensor([float(s.weight) for s in specs], dtype=torch.float64)
        self.rewards = [build_reward(s.name, s.args) for s in specs]

    def __call__(self, batch: RewardBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
        n = len(batch)
        main = torch.empty(n, len(self.rewards), dtype=torch.float64)
        logged: dict[str, torch.Tensor] = {}
        seconds: dict[str, float] = {}
        for r, (name, reward) in enumerate(zip(self.names, self.rewards)):
            start = time.perf_counter()
            scores = as_scores(reward(batch), n, name)
            seconds[name] = time.perf_counter() - start
            logged.update(scores)
            main[:, r] = main_score(scores, name)
        return main, logged, seconds
