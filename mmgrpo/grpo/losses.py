"""Policy losses, importance ratios, KL estimators and loss aggregation.

Shapes: N rows (samples) by U units (tokens or denoising steps). ``mask`` (N, U) bool marks the trained units.
Log-probs are natural-log probabilities; all log-prob math runs in fp32 whatever the input dtype.

A policy loss returns ``(loss, ratio, clipped)``, all (N, U): the per-unit loss (0 on masked-out units), the importance
ratio (1 on masked-out units) and whether the clip zeroed the unit's gradient (False on masked-out units). The scalar
loss is ``(aggregation_weights(mask, mode) * loss).sum()``, which also splits into sums over unit chunks.
"""

from __future__ import annotations

import torch

from mmgrpo.registry import POLICY_LOSSES

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


def aggregation_weights(mask: torch.Tensor, mode: str, max_units: int | None = None,
                        total: float | None = None) -> torch.Tensor:
    """(N, U) fp32 weights w such that the aggregated loss is ``(w * per_unit_loss).sum()``.

    - ``token-mean``: every trained unit of the batch counts the same (DAPO).
    - ``seq-mean-token-mean``: mean over units within a row, then mean over rows that have units (GRPO).
    - ``seq-mean-token-sum-norm``: unit sum per row divided by the constant ``max_units`` (default U), then mean over
      rows that have units (Dr. GRPO).

    ``total`` replaces the count the mean divides by (trained units for token-mean, rows with units otherwise),
    which defaults to this mask's. Under data parallelism, pass the mean of that count over the processes: the
    processes' gradients are averaged, so the result is the mean over the whole batch, not a mean of per-process
    means. Rows without units get weight 0; an all-False mask gives all zeros."""
    m = mask.float()
    count = aggregation_count(mask, mode) if total is None else total
    count = count if count > 0 else 1.0  # nothing trained: all weights are 0 anyway (a mean count may be < 1)
    if mode == "token-mean":
        return m / count
    if mode == "seq-mean-token-mean":
        return m / m.sum(dim=1, keepdim=True).clamp(min=1) / count
    if mode == "seq-mean-token-sum-norm":
        return m / (count * max(max_units or mask.shape[1], 1))
    raise ValueError(f"unknown loss aggregation '{mode}' (valid: {', '.join(AGGREGATIONS)})")


def aggregation_count(mask: torch.Tensor, mode: str) -> float:
    """The count :func:`aggregation_weights` divides by for ``mask`` (N, U): trained units for token-mean, rows
    with units for the other modes."""
    return float(mask.sum()) if mode == "token-mean" else float((mask.sum(dim=1) > 0).sum())


def log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """(N, U) fp32 log of :func:`importance_ratio`, 0 on masked-out units, with the same gradient structure."""
    logp = torch.where(mask, logp.float(), 0.0)
    delta = logp - torch.where(mask, old_logp.float(), 0.0)
    if level == "token":
        return delta
    if level == "sequence":
        log_s = delta.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        return torch.where(mask, log_s.detach() + (logp - logp.detach()), 0.0)
    raise ValueError(f"unknown ratio level '{level}' (valid: token, sequence)")


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """(N, U) fp32 ratio pi / pi_old, 1 on masked-out units (their log-probs may be anything, even -inf).

    - ``token``: exp(logp - old_logp) per unit.
    - ``sequence`` (GSPO): s_i = exp(mean over the row's trained units of (logp - old_logp)), on every trained unit,
      written as exp(sg[log s_i] + logp_t - sg[logp_t]) so d ratio_t / d logp_t = s_i. Aggregated with
      ``seq-mean-token-mean`` its gradient equals that of the sequence objective mean_i(s_i * A_i)."""
    return log_ratio(logp, old_logp, mask, level).exp()


def _weighted_ratio(log_r: torch.Tensor, adv: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """(N, U) ratio * A on the ``live`` units, 0 elsewhere. The exp is taken of live log-ratios only, so a ratio
    that overflows fp32 (a log-ratio above ~88 nats) on a unit whose term is constant gives neither inf * 0 = NaN
    in the loss nor 0 * inf = NaN in the gradient."""
    return torch.where(live, torch.where(live, log_r, 0.0).exp() * adv, 0.0)


def _per_unit(advantages: torch.Tensor) -> torch.Tensor:
    """(N,) or (N, U) advantages -> fp32, shaped to broadcast against (N, U)."""
    adv = advantages.float()
    return adv[:, None] if adv.dim() == 1 else adv


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float | None = None,
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate: -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A) per unit.

    ``clip_high`` defaults to ``clip_low``. ``clipped`` marks units whose gradient the clip zeroes: ratio above
    1 + clip_high with A > 0, or below 1 - clip_low with A < 0."""
    clip_high = clip_low if clip_high is None else clip_high
    log_r = log_ratio(logp, old_logp, mask, level)
    ratio = log_r.exp()
    adv = _per_unit(advantages)
    clipped = mask & (((ratio > 1 + clip_high) & (adv > 0)) | ((ratio < 1 - clip_low) & (adv < 0)))
    bound = torch.where(adv > 0, 1 + clip_high, 1 - clip_low)
    surrogate = _weighted_ratio(log_r, adv, mask & ~clipped & (adv != 0)) + torch.where(clipped, bound * adv, 0.0)
    return -surrogate, ratio, clipped


@POLICY_LOSSES.register("reinforce")
def reinforce_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float | None = None,
    clip_high: float | None = None,
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unclipped importance-weighted policy gradient: -ratio * A per unit. The clip arguments are accepted so that
    every policy loss takes the same keywords, and are ignored; ``clipped`` is all False."""
    log_r = log_ratio(logp, old_logp, mask, level)
    adv = _per_unit(advantages)
    return -_weighted_ratio(log_r, adv, mask & (adv != 0)), log_r.exp(), torch.zeros_like(mask)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """(N, U) fp32 per-unit estimate of KL(pi || ref) from units sampled from pi (Schulman's k1, k2, k3).

    With d = ref_logp - logp: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 (unbiased, >= 0, low variance)."""
    d = ref_logp.float() - logp.float()
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        return d.exp() - d - 1
    raise ValueError(f"unknown KL estimator '{kind}' (valid: {', '.join(KL_ESTIMATORS)})")


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """(N,) fp32 KL between Gaussians of equal std: ||mean - ref_mean||^2 / (2 std^2), averaged over non-batch dims.

    ``mean`` and ``ref_mean`` are (N, ...); ``std`` is a float or broadcasts against them."""
    std = torch.as_tensor(std, device=mean.device).float()
    kl = (mean.float() - ref_mean.float()) ** 2 / (2 * std**2)
    return kl.reshape(kl.shape[0], -1).mean(dim=1)
