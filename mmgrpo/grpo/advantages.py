"""Group-relative advantage estimators and reward combination.

Every estimator has the signature ``fn(rewards, group, eps) -> advantages``:

- ``rewards``: (N,) float, one scalar reward per sample. NaN means "does not apply": the sample is left out of every
  statistic and its advantage is 0.
- ``group``: (N,) int64 group ids (the G samples of one prompt share an id; ids need not be contiguous).
- returns (N,) float64.

Statistics are computed in float64 over the valid (non-NaN) members of each group; std is the population std.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmgrpo.registry import ADVANTAGES

ZERO_STD_TOL = 1e-12
"""A group whose valid rewards have std at or below this carries no learning signal."""


def group_stats(rewards: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-group statistics of the non-NaN rewards.

    Returns ``(index, count, mean, std)``: ``index`` (N,) int64 maps each sample to its group 0..K-1, and ``count``,
    ``mean`` and ``std`` (population) are (K,) float64. A group with no valid member has count 0, mean 0 and std 0.

    Sums run over the offsets from the group's largest valid reward, so a group of equal rewards has exactly their
    value as mean and std 0 (a plain sum / G is off by rounding, which a zero ``eps`` turns into advantages of +-1).
    """
    r = rewards.double()
    valid = ~torch.isnan(r)
    ids, index = torch.unique(group, return_inverse=True)
    zeros = torch.zeros(len(ids), dtype=torch.float64, device=r.device)
    count = zeros.index_add(0, index, valid.double())
    pivot = zeros.scatter_reduce(0, index, torch.where(valid, r, -torch.inf), "amax", include_self=False)
    pivot = torch.where(count > 0, pivot, 0.0)
    offset = torch.where(valid, r - pivot[index], 0.0)
    mean_offset = zeros.index_add(0, index, offset) / count.clamp(min=1)
    dev = torch.where(valid, offset - mean_offset[index], 0.0)
    std = (zeros.index_add(0, index, dev**2) / count.clamp(min=1)).sqrt()
    return index, count, pivot + mean_offset, std


def _normalise(rewards: torch.Tensor, center: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(r - center) / scale on valid samples, 0 on NaN rewards and where scale is 0. All (N,) float64."""
    r = rewards.double()
    keep = ~torch.isnan(r) & (scale > 0)
    return torch.where(keep, (r - center) / torch.where(keep, scale, 1.0), 0.0)


@ADVANTAGES.register("group_zscore")
def group_zscore(rewards: torch.Tensor, group: torch.Tensor, eps: float) -> torch.Tensor:
    """GRPO: (r - mean_g) / (std_g + eps)."""
    index, _, mean, std = group_stats(rewards, group)
    return _normalise(rewards, mean[index], std[index] + eps)


@ADVANTAGES.register("group_mean")
def group_mean(rewards: torch.Tensor, group: torch.Tensor, eps: float) -> torch.Tensor:
    """Dr. GRPO: r - mean_g, no std scaling (``eps`` is unused)."""
    index, _, mean, _ = group_stats(rewards, group)
    return _normalise(rewards, mean[index], torch.ones_like(mean[index]))


@ADVANTAGES.register("group_mean_batch_std")
def group_mean_batch_std(rewards: torch.Tensor, group: torch.Tensor, eps: float) -> torch.Tensor:
    """Flow-GRPO: (r - mean_g) / (std of all non-NaN rewards in the batch + eps)."""
    index, _, mean, _ = group_stats(rewards, group)
    batch_index, _, _, batch_std = group_stats(rewards, torch.zeros_like(group))
    return _normalise(rewards, mean[index], batch_std[batch_index] + eps)


@ADVANTAGES.register("rloo")
def rloo(rewards: torch.Tensor, group: torch.Tensor, eps: float) -> torch.Tensor:
    """Leave-one-out: r_i - mean of the other valid members of its group; 0 when it is alone (``eps`` is unused).

    Uses r_i - mean_{-i} = n / (n - 1) * (r_i - mean_g) for a group with n valid members."""
    index, count, mean, _ = group_stats(rewards, group)
    n = count[index]
    return _normalise(rewards, mean[index], torch.where(n > 1, (n - 1) / n, 0.0))


@ADVANTAGES.register("max_rl")
def max_rl(rewards: torch.Tensor, group: torch.Tensor, eps: float) -> torch.Tensor:
    """MaxRL (Tajwar, Zeng et al. 2026, arXiv:2602.02710): (r - mean_g) / mean_g, and 0 where mean_g <= eps.

    For 0/1 success rewards, the group's policy gradient is G x (mean score function of its successes - mean over
    all G samples): an unbiased estimate of the gradient of log pass@G, which tends to maximum likelihood
    (grad log p) as G grows. A prompt solved with probability p weighs about 1/p, against GRPO's 1/sqrt(p(1-p)),
    so hard prompts count most, as in supervised training. Rewards must be >= 0 (success indicators or scores
    with 0 as failure); a group without success carries no signal. Not invariant to a shift of the rewards."""
    r = rewards.double()
    negative = r[r < 0]  # NaN compares False
    if negative.numel():
        raise ValueError(f"advantage max_rl needs rewards >= 0 (0 = failure), got {negative.min().item():.4g}; "
                         "use grpo.advantage=group_zscore for signed rewards")
    index, _, mean, _ = group_stats(r, group)
    center = mean[index]
    return _normalise(r, center, torch.where(center > eps, center, 0.0))


def zero_std_groups(rewards: torch.Tensor, group: torch.Tensor, tol: float = ZERO_STD_TOL) -> torch.Tensor:
    """(N,) bool: the sample's group has valid-reward std <= tol (including groups with at most one valid member)."""
    index, count, _, std = group_stats(rewards, group)
    return ((std <= tol) | (count <= 1))[index]


def no_signal_groups(rewards: torch.Tensor, weights: torch.Tensor | Sequence[float], group: torch.Tensor,
                     aggregation: str, tol: float = ZERO_STD_TOL) -> torch.Tensor:
    """(N,) bool: the sample's group gives no learning signal, for dynamic sampling. (N, R) raw rewards.

    With ``weighted_sum`` the advantages come from the weighted sum, so a group is empty of signal when that sum
    does not vary (:func:`zero_std_groups`); with ``gdpo`` each reward is normalised on its own, so only when no
    reward with a non-zero weight varies within the group."""
    if aggregation == "weighted_sum":
        return zero_std_groups(weighted_reward(rewards, weights, group), group, tol)
    if aggregation != "gdpo":
        raise ValueError(f"unknown reward aggregation '{aggregation}' (valid: weighted_sum, gdpo)")
    w = torch.as_tensor(weights, dtype=torch.float64).tolist()
    empty = torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    for r, weight in enumerate(w):
        if weight != 0:
            empty &= zero_std_groups(rewards[:, r].double(), group, tol)
    return empty


def weighted_reward(rewards: torch.Tensor, weights: torch.Tensor | Sequence[float],
                    group: torch.Tensor | None = None) -> torch.Tensor:
    """(N, R) rewards, (R,) weights -> (N,) float64 sum of w_r * rewards[:, r].

    A NaN reward does not apply to its sample. With ``group`` (N,) it is replaced by that reward's mean over the
    sample's group, so it moves the sum by the same amount as for the rest of the group and gives no signal; a
    reward that applies to no member of the group, and any NaN without ``group``, is left out of the sum. A sample
    whose R rewards are all NaN gets NaN (it then takes part in no statistic)."""
    r = rewards.double()
    if group is not None:
        columns = []
        for column in r.unbind(dim=1):
            index, count, mean, _ = group_stats(column, group)
            fill = torch.where(count > 0, mean, float("nan"))[index]
            columns.append(torch.where(torch.isnan(column), fill, column))
        filled = torch.stack(columns, dim=1) if columns else r
    else:
        filled = r
    w = torch.as_tensor(weights, dtype=torch.float64, device=r.device)
    total = (w * filled).nansum(dim=1)
    return torch.where(torch.isnan(r).all(dim=1), float("nan"), total)


def combine_rewards(
    rewards: torch.Tensor,
    weights: torch.Tensor | Sequence[float],
    group: torch.Tensor,
    aggregation: str,
    estimator: str,
    eps: float,
) -> torch.Tensor:
    """Advantages (N,) float64 from (N, R) rewards of R kinds with (R,) weights.

    - ``weighted_sum``: the estimator applied to :func:`weighted_reward` (a NaN reward takes its group's mean).
    - ``gdpo``: the estimator applied to each reward kind within groups, then the weighted sum of those advantages
      (a NaN reward already has advantage 0, so it contributes nothing).

    ``estimator`` is a name in ``ADVANTAGES`` or a ``module:attr`` path."""
    fn = ADVANTAGES.get(estimator)
    if aggregation == "weighted_sum":
        return fn(weighted_reward(rewards, weights, group), group, eps)
    if aggregation == "gdpo":
        per_kind = torch.stack([fn(column, group, eps) for column in rewards.unbind(dim=1)], dim=1)
        w = torch.as_tensor(weights, dtype=torch.float64, device=per_kind.device)
        return (per_kind * w).sum(dim=1)
    raise ValueError(f"unknown reward aggregation '{aggregation}' (valid: weighted_sum, gdpo)")


def batch_normalize(adv: torch.Tensor, valid: torch.Tensor, eps: float) -> torch.Tensor:
    """(N,) advantages z-scored over the ``valid`` (N,) bool samples of the whole batch, taken as one group
    (:func:`group_zscore`); invalid samples get advantage 0. Returns float64."""
    one_group = torch.zeros_like(adv, dtype=torch.int64)
    return group_zscore(torch.where(valid, adv.double(), float("nan")), one_group, eps)


def clip_advantages(adv: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamp advantages to [-limit, limit]; ``limit <= 0`` returns them unchanged."""
    return adv.clamp(-limit, limit) if limit > 0 else adv
