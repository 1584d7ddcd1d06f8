"""Pure tensor GRPO math: advantage estimators, policy losses, KL estimators, loss aggregation and diagnostics."""

from .advantages import (
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
from .diagnostics import advantage_stats, constant_columns, masked_mean, ratio_stats
from .losses import (
    aggregation_count,
    aggregation_weights,
    gaussian_mean_kl,
    importance_ratio,
    kl_estimate,
    ppo_clip_loss,
    reinforce_loss,
)

__all__ = [
    "advantage_stats",
    "aggregation_count",
    "aggregation_weights",
    "batch_normalize",
    "clip_advantages",
    "combine_rewards",
    "constant_columns",
    "gaussian_mean_kl",
    "group_mean",
    "group_mean_batch_std",
    "group_stats",
    "group_zscore",
    "importance_ratio",
    "kl_estimate",
    "masked_mean",
    "max_rl",
    "no_signal_groups",
    "ppo_clip_loss",
    "ratio_stats",
    "reinforce_loss",
    "rloo",
    "weighted_reward",
    "zero_std_groups",
]
