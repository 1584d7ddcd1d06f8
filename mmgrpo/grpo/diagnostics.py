"""Scalar diagnostics for logging: importance ratios, clipping and advantages. Everything returns Python floats."""

from __future__ import annotations

import torch

from .advantages import ZERO_STD_TOL, group_stats


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``x`` over the True entries of the same-shaped bool ``mask``, in float64; 0.0 when none is True."""
    picked = x.detach().double()[mask]
    return picked.mean().item() if picked.numel() else 0.0


def ratio_stats(ratio: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor) -> dict[str, float]:
    """``ratio/mean``, ``ratio/max_dev`` (max |ratio - 1|) and ``clip_frac`` over the trained units; all (N, U).

    An empty mask gives mean 1.0, max_dev 0.0 and clip_frac 0.0."""
    picked = ratio.detach().double()[mask]
    if not picked.numel():
        return {"ratio/mean": 1.0, "ratio/max_dev": 0.0, "clip_frac": 0.0}
    return {
        "ratio/mean": picked.mean().item(),
        "ratio/max_dev": (picked - 1).abs().max().item(),
        "clip_frac": masked_mean(clipped.float(), mask),
    }


def advantage_stats(adv: torch.Tensor, rewards_combined: torch.Tensor, group: torch.Tensor) -> dict[str, float]:
    """Advantage spread and group health, for (N,) advantages, (N,) combined rewards (NaN = no reward) and group ids.

    - ``adv/mean``, ``adv/std`` (population), ``adv/abs_max`` over all N samples.
    - ``groups/zero_std_frac``: fraction of groups whose valid rewards have zero std (or at most one valid member).
    - ``reward/std_within_group``: mean over groups with a valid reward of the within-group std."""
    a = adv.detach().double()
    _, count, _, std = group_stats(rewards_combined, group)
    scored = count > 0
    return {
        "adv/mean": a.mean().item(),
        "adv/std": a.std(unbiased=False).item(),
        "adv/abs_max": a.abs().max().item(),
        "groups/zero_std_frac": ((std <= ZERO_STD_TOL) | (count <= 1)).double().mean().item(),
        "reward/std_within_group": std[scored].mean().item() if scored.any() else 0.0,
    }


def constant_columns(rewards: torch.Tensor, tol: float = ZERO_STD_TOL) -> torch.Tensor:
    """(R,) bool for (B, R) rewards (NaN = does not apply): whether each column takes one value, within ``tol``,
    over its non-NaN entries. A column with none counts as constant."""
    r = rewards.detach().double()
    valid = ~r.isnan()
    high = torch.where(valid, r, -torch.inf).amax(0)
    low = torch.where(valid, r, torch.inf).amin(0)
    return ~valid.any(0) | (high - low <= tol)
