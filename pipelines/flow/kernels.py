"""Flow-matching step kernels: stochastic steps with Gaussian log-probs, and deterministic ODE solvers.

Conventions (rectified flow, as in diffusers' flow-matching schedulers):

- ``x_sigma = (1 - sigma) * x0 + sigma * noise``; the model predicts the velocity ``v = noise - x0``.
- ``sigma`` is the current noise level in (0, 1], ``sigma_prev`` the next, smaller one, ``dt = sigma_prev - sigma < 0``.
- ``x0_hat = x - sigma * v`` (denoised estimate) and ``x1_hat = x + (1 - sigma) * v`` (noise estimate).
- ``sigma`` and ``sigma_prev`` are Python floats or (B,) tensors (one level per sample); they broadcast over the
  non-batch dimensions of ``x`` (B, ...).

All math runs in float32: inputs of any floating dtype are cast to float32 first, and every output is float32.

Stochastic steps draw ``prev_sample = mean + std * noise`` and score it with :func:`gaussian_log_prob`. Called again
with ``prev_sample=`` and the same ``(x, v, sigma, sigma_prev)``, they return bitwise the same ``log_prob``; training
recomputes the log-probs of stored rollouts this way.

A transition whose std is exactly 0 is deterministic and has no density. Such rows (CPS at ``sigma_prev == 0``, or
``noise_level`` / ``eta`` set to 0) get ``prev_sample == mean`` and ``log_prob == 0`` with a zero gradient: they add
nothing to a policy-gradient ratio, and trainers should not train those steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class StepOutput:
    """Result of one stochastic step. All tensors are float32.

    - ``prev_sample``: (B, ...) the latent at ``sigma_prev``.
    - ``log_prob``: (B,) Gaussian log-density of ``prev_sample``, averaged over the non-batch dimensions.
    - ``mean``: (B, ...) mean of the transition.
    - ``std``: (B,) std of the transition, the one actually used to sample.
    - ``kl_std``: (B,) the std the KL to a reference step divides by, ``||mean - mean_ref||^2 / (2 kl_std^2)``, as
      Flow-GRPO's training code has it: the SDE's noise scale per unit time, ``std / sqrt(|dt|)`` (Flow-GRPO's
      ``std_t``, DanceGRPO's ``eta``), and the transition std for CPS. The published KL betas are tuned to this
      scale; the exact KL of the transitions is ``1 / |dt|`` times larger for the SDEs.
    """

    prev_sample: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor
    kl_std: Tensor


def _batch_view(value: float | Tensor, x: Tensor) -> Tensor:
    """A float or a (B,) tensor as a float32 tensor of shape (B, 1, ..., 1) that broadcasts against x (B, ...)."""
    value = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    return value.expand(x.shape[0]).reshape(-1, *([1] * (x.ndim - 1)))


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: float | Tensor) -> Tensor:
    """log N(sample; mean, std^2), averaged over non-batch dims. sample, mean: (B, ...); std: (B,) or float.

    Returns (B,) float32. Rows with ``std == 0`` (deterministic transitions) return 0 with a zero gradient.
    """
    sample, mean = sample.float(), mean.float()
    std = _batch_view(std, mean)
    deterministic = std == 0
    safe_std = torch.where(deterministic, 1.0, std)
    log_density = (
        -((sample - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - 0.5 * math.log(2 * math.pi)
    )
    log_prob = log_density.reshape(mean.shape[0], -1).mean(dim=1)
    return torch.where(deterministic.reshape(-1), 0.0, log_prob)


def _sample_and_score(
    mean: Tensor,
    std: Tensor,
    noise: Tensor | None,
    prev_sample: Tensor | None,
    generator: torch.Generator | None,
    kl_std: Tensor | None = None,
) -> StepOutput:
    """Shared tail of the stochastic steps: draw (or take) prev_sample, then score it. std, kl_std: (B, 1, ..., 1);
    ``kl_std`` defaults to ``std``."""
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, dtype=torch.float32, device=mean.device)
        prev_sample = mean + std * noise.float()
    else:
        prev_sample = prev_sample.float()
    std = std.reshape(mean.shape[0])
    kl_std = std if kl_std is None else kl_std.reshape(mean.shape[0])
    log_prob = gaussian_log_prob(prev_sample.detach(), mean, std)
    return StepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std, kl_std=kl_std)


def flow_grpo_sde_step(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_prev: float | Tensor,
    *,
    noise_level: float = 0.7,
    sigma_max_substitute: float | Tensor | None = None,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> StepOutput:
    """Flow-GRPO SDE step (Euler-Maruyama of the marginal-preserving reverse SDE).

    ``std_t = noise_level * sqrt(sigma / (1 - s))`` with ``s = min(sigma, sigma_max_substitute)``: pass the
    schedule's second sigma, so that its first level, 1 (SD3, FLUX) or one that rounds just below it (Wan's
    UniPC flow sigmas start at 1 - 1e-6), takes the second level's denominator instead of a huge or infinite one.
    Without a substitute, ``sigma == 1`` is an error.
    The transition std is ``std_t * sqrt(-dt)``; it is nonzero even at ``sigma_prev == 0``.

    x, v: (B, ...); sigma, sigma_prev: float or (B,). Sampling: ``prev_sample`` if given, else ``noise`` if given
    (standard normal, shape of x), else ``torch.randn(generator=generator)``.
    """
    x, v = x.float(), v.float()
    sigma, sigma_prev = _batch_view(sigma, x), _batch_view(sigma_prev, x)
    dt = sigma_prev - sigma

    if sigma_max_substitute is not None:
        s = torch.minimum(sigma, _batch_view(sigma_max_substitute, x))
    elif bool((sigma >= 1).any()):
        raise ValueError(
            "flow_grpo_sde_step got sigma == 1, where sigma / (1 - sigma) is infinite; pass "
            "sigma_max_substitute (the scheduler's second sigma, sigmas[1])"
        )
    else:
        s = sigma
    std_t = noise_level * torch.sqrt(sigma / (1 - s))

    mean = x * (1 + std_t**2 * dt / (2 * sigma)) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return _sample_and_score(mean, std_t * torch.sqrt(-dt), noise, prev_sample, generator, kl_std=std_t)


def dance_grpo_sde_step(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_prev: float | Tensor,
    *,
    eta: float = 0.3,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> StepOutput:
    """DanceGRPO SDE step: constant diffusion ``eta``, drift corrected with the score of the flow.

    ``score = -(x - (1 - sigma) * x0_hat) / sigma^2``, ``mean = x + dt*v - 0.5 * eta^2 * score * dt``,
    transition std ``eta * sqrt(|dt|)``.

    x, v: (B, ...); sigma, sigma_prev: float or (B,). Sampling as in :func:`flow_grpo_sde_step`.
    """
    x, v = x.float(), v.float()
    sigma, sigma_prev = _batch_view(sigma, x), _batch_view(sigma_prev, x)
    dt = sigma_prev - sigma

    x0_hat = x - sigma * v
    score = -(x - x0_hat * (1 - sigma)) / sigma**2
    mean = x + dt * v - 0.5 * eta**2 * score * dt
    return _sample_and_score(mean, eta * torch.sqrt(dt.abs()), noise, prev_sample, generator,
                             kl_std=torch.full_like(dt, eta))


def cps_step(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_prev: float | Tensor,
    *,
    eta: float = 0.7,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> StepOutput:
    """Coefficients-preserving sampling (CPS) step.

    Splits the noise part of the next latent between the noise estimate ``x1_hat`` and fresh noise, so that
    ``prev_sample = (1 - sigma_prev) * x0_hat + sigma_prev * (unit-variance noise)`` keeps the flow's coefficients:
    std ``sigma_prev * sin(eta * pi / 2)`` and ``mean = (1 - sigma_prev) * x0_hat + sqrt(sigma_prev^2 - std^2) * x1_hat``.
    ``eta`` in [0, 1]; the default 0.7 is the ``noise_level`` Flow-GRPO shares between its SDE types, and configs
    set it with ``sampling.noise_level``.

    At ``sigma_prev == 0`` the std is 0: the step returns ``x0_hat`` with ``log_prob == 0`` (see the module notes).

    x, v: (B, ...); sigma, sigma_prev: float or (B,). Sampling as in :func:`flow_grpo_sde_step`.
    """
    x, v = x.float(), v.float()
    sigma, sigma_prev = _batch_view(sigma, x), _batch_view(sigma_prev, x)

    std = sigma_prev * math.sin(eta * math.pi / 2)
    x0_hat = x - sigma * v
    x1_hat = x + (1 - sigma) * v
    mean = x0_hat * (1 - sigma_prev) + x1_hat * torch.sqrt(sigma_prev**2 - std**2)
    return _sample_and_score(mean, std, noise, prev_sample, generator)


def ode_euler_step(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_prev: float | Tensor) -> Tensor:
    """Deterministic Euler step ``x + dt * v``; equals diffusers' ``FlowMatchEulerDiscreteScheduler.step``.

    x, v: (B, ...); sigma, sigma_prev: float or (B,). Returns (B, ...) float32.
    """
    x, v = x.float(), v.float()
    dt = _batch_view(sigma_prev, x) - _batch_view(sigma, x)
    return x + dt * v


def dpm_solver_2m_step(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_prev: float | Tensor,
    *,
    prev_x0: Tensor | None = None,
    prev_sigma: float | Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Second-order multistep DPM-Solver++ (2M, midpoint) step for flow matching.

    Data prediction ``x0_hat = x - sigma * v``, ``alpha = 1 - sigma``, ``lambda = log(alpha / sigma)``,
    ``h = lambda(sigma_prev) - lambda(sigma)``. With ``D = x0_hat + 0.5 * (h / h_last) * (x0_hat - prev_x0)``:

        ``x_next = (sigma_prev / sigma) * x - alpha_prev * (exp(-h) - 1) * D``

    where ``h_last = lambda(sigma) - lambda(prev_sigma)``. Without ``prev_x0`` (first step) ``D = x0_hat``: the
    first-order DPM-Solver++ (DDIM) step, which for flow matching is algebraically the Euler step ``x + dt * v``
    (equal up to fp32 rounding). A step to ``sigma_prev == 0`` is always first order and returns ``x0_hat``
    (diffusers' ``lower_order_final``). ``sigma == 1`` is allowed (lambda = -inf): a step from it is first order, and
    ``prev_sigma == 1`` makes the next step first order too.

    x, v, prev_x0: (B, ...); sigma, sigma_prev, prev_sigma: float or (B,). Pass the returned ``x0_hat`` and this
    ``sigma`` as ``prev_x0`` / ``prev_sigma`` of the next call. Returns (x_next, x0_hat), both (B, ...) float32.
    """
    if (prev_x0 is None) != (prev_sigma is None):
        raise ValueError(
            "dpm_solver_2m_step needs prev_x0 and prev_sigma together (or neither, for a first step)"
        )
    x, v = x.float(), v.float()
    sigma, sigma_prev = _batch_view(sigma, x), _batch_view(sigma_prev, x)

    x0_hat = x - sigma * v
    lambda_cur = torch.log(1 - sigma) - torch.log(sigma)
    h = torch.log(1 - sigma_prev) - torch.log(sigma_prev) - lambda_cur

    if prev_x0 is None:
        d = x0_hat
    else:
        prev_sigma = _batch_view(prev_sigma, x)
        h_last = lambda_cur - (torch.log(1 - prev_sigma) - torch.log(prev_sigma))
        d = x0_hat + 0.5 * (h / h_last) * (x0_hat - prev_x0.float())
    d = torch.where(sigma_prev == 0, x0_hat, d)

    x_next = (sigma_prev / sigma) * x - (1 - sigma_prev) * torch.expm1(-h) * d
    return x_next, x0_hat
