"""Tests of the flow-matching step kernels (pipelines/flow/kernels.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from mmgrpo.pipelines.flow.kernels import (
    StepOutput,
    cps_step,
    dance_grpo_sde_step,
    dpm_solver_2m_step,
    flow_grpo_sde_step,
    gaussian_log_prob,
    ode_euler_step,
)

SDE_STEPS = [flow_grpo_sde_step, dance_grpo_sde_step, cps_step]
SDE_IDS = ["flow_grpo", "dance", "cps"]


def _latents(*shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _velocity(x: torch.Tensor, sigma: float, direction: torch.Tensor) -> torch.Tensor:
    """A fixed, smooth, nonlinear stand-in for a transformer's velocity prediction."""
    return torch.sin(x) + sigma * direction


def _normal_log_prob(out: StepOutput) -> torch.Tensor:
    std = out.std.reshape(-1, *([1] * (out.mean.ndim - 1)))
    dist = torch.distributions.Normal(out.mean, std.expand_as(out.mean))
    return dist.log_prob(out.prev_sample).reshape(out.mean.shape[0], -1).mean(dim=1)


@pytest.mark.parametrize("step", SDE_STEPS, ids=SDE_IDS)
def test_log_prob_is_the_gaussian_density_averaged_over_non_batch_dims(step):
    x, v = _latents(3, 4, 5, 6)
    sigma, sigma_prev = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.4, 0.05])
    out = step(x, v, sigma, sigma_prev, generator=torch.Generator().manual_seed(1))
    assert out.log_prob.shape == (3,) and out.std.shape == (3,) and out.mean.shape == x.shape
    torch.testing.assert_close(out.log_prob, _normal_log_prob(out), rtol=1e-5, atol=1e-5)

    # A prev_sample far from the mean: the density must still match (and differ from the sampled one).
    far = out.mean + 3.0
    scored = step(x, v, sigma, sigma_prev, prev_sample=far)
    assert torch.equal(scored.prev_sample, far)
    torch.testing.assert_close(scored.log_prob, _normal_log_prob(scored), rtol=1e-5, atol=1e-5)
    assert (scored.log_prob < out.log_prob).all()


@pytest.mark.parametrize("step", SDE_STEPS, ids=SDE_IDS)
def test_empirical_moments_match_mean_and_std(step):
    n = 20000
    x, v = _latents(1, 8, seed=2)
    out = step(x.expand(n, 8), v.expand(n, 8), 0.6, 0.45, generator=torch.Generator().manual_seed(3))
    mean, std = out.mean[0], out.std[0]
    assert torch.equal(out.mean, mean.expand(n, 8)) and (out.std == std).all()
    # 5-sigma bounds for the sample mean and (approximately Gaussian) sample std.
    assert ((out.prev_sample.mean(dim=0) - mean).abs() < 5 * std / math.sqrt(n)).all()
    assert ((out.prev_sample.std(dim=0) / std - 1).abs() < 5 / math.sqrt(2 * n)).all()

    # The draw comes from the caller's generator: same seed, same noise as an explicit torch.randn.
    noise = torch.randn((n, 8), generator=torch.Generator().manual_seed(3))
    assert torch.equal(
        out.prev_sample, step(x.expand(n, 8), v.expand(n, 8), 0.6, 0.45, noise=noise).prev_sample
    )


# (step, kwargs, sigma, sigma_prev, mean, std) for x = 1, v = 0.5, worked out by hand:
#  flow_grpo: std_t = 0.7*sqrt(0.8/0.2) = 1.4, dt = -0.2:
#             mean = 1 - 1.96*0.2/1.6 + 0.5*(1 + 1.96*0.2/1.6)*(-0.2) = 0.755 - 0.1245; std = 1.4*sqrt(0.2)
#  at sigma 1: s = 0.75, std_t = 0.7*sqrt(1/0.25) = 1.4, dt = -0.25:
#             mean = 1 - 1.96*0.25/2 + 0.5*(1 + 0)*(-0.25) = 0.63; std = 1.4*sqrt(0.25) = 0.7
#  dance:     x0_hat = 0.6, score = -(1 - 0.6*0.2)/0.64 = -1.375,
#             mean = 1 - 0.1 - 0.5*0.09*(-1.375)*(-0.2) = 0.887625; std = 0.3*sqrt(0.2)
#  cps:       std = 0.6*sin(pi/4) = sqrt(0.18), x0_hat = 0.6, x1_hat = 1.1,
#             mean = 0.6*0.4 + 1.1*sqrt(0.36 - 0.18) = 0.24 + 1.1*sqrt(0.18)
#  kl_std (the std the KL divides by, as in Flow-GRPO's training code): the SDEs' noise scale per unit time, std_t
#             = 1.4 in both flow_grpo rows and eta = 0.3 for dance; the transition std for cps
CLOSED_FORM = [
    (flow_grpo_sde_step, {"noise_level": 0.7}, 0.8, 0.6, 0.6305, 1.4 * math.sqrt(0.2), 1.4),
    (flow_grpo_sde_step, {"noise_level": 0.7, "sigma_max_substitute": 0.75}, 1.0, 0.75, 0.63, 0.7, 1.4),
    (dance_grpo_sde_step, {"eta": 0.3}, 0.8, 0.6, 0.887625, 0.3 * math.sqrt(0.2), 0.3),
    (cps_step, {"eta": 0.5}, 0.8, 0.6, 0.24 + 1.1 * math.sqrt(0.18), math.sqrt(0.18), math.sqrt(0.18)),
]


@pytest.mark.parametrize(
    ("step", "kwargs", "sigma", "sigma_prev", "mean", "std", "kl_std"),
    CLOSED_FORM,
    ids=["flow_grpo", "flow_grpo_at_sigma_1", "dance", "cps"],
)
def test_mean_and_std_match_hand_computed_scalar_example(step, kwargs, sigma, sigma_prev, mean, std, kl_std):
    out = step(
        torch.ones(1, 1), torch.full((1, 1), 0.5), sigma, sigma_prev, noise=torch.zeros(1, 1), **kwargs
    )
    assert out.mean.item() == pytest.approx(mean, rel=1e-6)
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    assert out.kl_std.item() == pytest.approx(kl_std, rel=1e-6)
    assert torch.equal(out.prev_sample, out.mean)


def test_flow_grpo_at_sigma_1_needs_a_substitute():
    x, v = _latents(2, 3)
    with pytest.raises(ValueError, match="sigma_max_substitute"):
        flow_grpo_sde_step(x, v, 1.0, 0.9)
    with pytest.raises(ValueError, match="sigma_max_substitute"):
        flow_grpo_sde_step(x, v, torch.tensor([0.5, 1.0]), torch.tensor([0.4, 0.9]))


def test_flow_grpo_first_level_just_below_1_takes_the_substitute():
    """Wan's UniPC flow sigmas start at 1 - 1e-6, not 1: the first step's std_t must still use sigmas[1]'s
    denominator (0.7 * sqrt(~1 / (1 - sigmas[1]))), not 0.7 * sqrt(1e6); later levels keep their own."""
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas.double()
    assert 0.999 < float(sigmas[0]) < 1.0
    x, v = _latents(2, 3)
    for k in (0, 1, 4):
        out = flow_grpo_sde_step(x.double(), v.double(), float(sigmas[k]), float(sigmas[k + 1]), noise_level=0.7,
                                 sigma_max_substitute=float(sigmas[1]), noise=torch.zeros_like(x))
        s = sigmas[1] if k == 0 else sigmas[k]
        std_t = 0.7 * math.sqrt(sigmas[k] / (1 - s))
        assert out.std.flatten()[0].item() == pytest.approx(std_t * math.sqrt(sigmas[k] - sigmas[k + 1]), rel=1e-5)


def test_noiseless_sdes_and_euler_follow_diffusers_flow_match_euler():
    """noise_level = eta = 0 gives exactly the Euler step, which is exactly diffusers' Euler scheduler."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas.tolist()
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    x, direction = _latents(2, 4, 8, 8, seed=4)
    reference = x.clone()
    zeros = torch.zeros_like(x)
    for i, timestep in enumerate(scheduler.timesteps):
        sigma, sigma_prev = sigmas[i], sigmas[i + 1]
        v = _velocity(x, sigma, direction)
        reference = scheduler.step(_velocity(reference, sigma, direction), timestep, reference).prev_sample
        euler = ode_euler_step(x, v, sigma, sigma_prev)
        assert euler.dtype == torch.float32 and torch.equal(euler, reference), f"step {i}"

        flow = flow_grpo_sde_step(
            x, v, sigma, sigma_prev, noise_level=0.0, sigma_max_substitute=sigmas[1], noise=zeros
        )
        dance = dance_grpo_sde_step(x, v, sigma, sigma_prev, eta=0.0, noise=zeros)
        cps = cps_step(x, v, sigma, sigma_prev, eta=0.0, noise=zeros)
        assert torch.equal(flow.prev_sample, euler) and torch.equal(flow.mean, euler)
        assert torch.equal(dance.prev_sample, euler) and torch.equal(dance.mean, euler)
        torch.testing.assert_close(cps.prev_sample, euler, rtol=1e-5, atol=1e-5)
        for out in (flow, dance, cps):
            assert (out.std == 0).all() and (out.log_prob == 0).all()
        x = euler


@pytest.mark.parametrize("step", SDE_STEPS, ids=SDE_IDS)
def test_recomputed_log_prob_is_bitwise_identical(step):
    x, v = _latents(4, 4, 16, 16, seed=5)
    sigma, sigma_prev = torch.tensor([0.9, 0.7, 0.3, 0.1]), torch.tensor([0.8, 0.5, 0.2, 0.0])
    sampled = step(x, v, sigma, sigma_prev, generator=torch.Generator().manual_seed(6))
    recomputed = step(
        x.clone(), v.clone(), sigma.clone(), sigma_prev.clone(), prev_sample=sampled.prev_sample
    )
    assert torch.equal(recomputed.log_prob, sampled.log_prob)
    assert torch.equal(recomputed.mean, sampled.mean) and torch.equal(recomputed.std, sampled.std)


STEPS_WITH_FLOAT_OUTPUT = {
    "flow_grpo": lambda x, v, s, sp, n: flow_grpo_sde_step(x, v, s, sp, sigma_max_substitute=0.95, noise=n),
    "dance": lambda x, v, s, sp, n: dance_grpo_sde_step(x, v, s, sp, noise=n),
    "cps": lambda x, v, s, sp, n: cps_step(x, v, s, sp, noise=n),
    "euler": lambda x, v, s, sp, n: ode_euler_step(x, v, s, sp),
    "dpm_first": lambda x, v, s, sp, n: dpm_solver_2m_step(x, v, s, sp),
    "dpm_second": lambda x, v, s, sp, n: dpm_solver_2m_step(x, v, s, sp, prev_x0=n, prev_sigma=s + 0.05),
}


def _tensors(result) -> list[torch.Tensor]:
    if isinstance(result, StepOutput):
        return [result.prev_sample, result.log_prob, result.mean, result.std]
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize("name", list(STEPS_WITH_FLOAT_OUTPUT))
def test_per_sample_sigmas_match_per_sample_calls(name):
    step = STEPS_WITH_FLOAT_OUTPUT[name]
    x, v = _latents(4, 3, 4, 4, seed=7)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    sigma = [0.95, 0.6, 0.3, 0.1] if name.startswith("dpm") else [1.0, 0.6, 0.3, 0.1]
    sigma_prev = [0.9, 0.4, 0.2, 0.0]
    batched = _tensors(step(x, v, torch.tensor(sigma), torch.tensor(sigma_prev), noise))
    for i in range(4):
        single = _tensors(step(x[i : i + 1], v[i : i + 1], sigma[i], sigma_prev[i], noise[i : i + 1]))
        for b, s in zip(batched, single):
            torch.testing.assert_close(b[i : i + 1], s, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(STEPS_WITH_FLOAT_OUTPUT))
def test_bf16_inputs_are_computed_in_fp32(name):
    """bf16 latents (and float64 sigmas) are cast to fp32 first: same fp32 result as casting them beforehand."""
    step = STEPS_WITH_FLOAT_OUTPUT[name]
    x, v = (t.to(torch.bfloat16) for t in _latents(2, 3, 4, 4, seed=9))
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    sigma, sigma_prev = torch.tensor([0.7, 0.3]), torch.tensor([0.5, 0.1])
    low = _tensors(step(x, v, sigma.double(), sigma_prev.double(), noise))
    high = _tensors(step(x.float(), v.float(), sigma, sigma_prev, noise.float()))
    for a, b in zip(low, high):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_zero_std_gives_the_deterministic_sample_and_zero_log_prob():
    """CPS to sigma_prev = 0 has std 0: prev_sample = x0_hat, log_prob 0 with a finite (zero) gradient."""
    x, v = _latents(2, 3, 4, 4, seed=11)
    v.requires_grad_(True)
    out = cps_step(
        x, v, torch.tensor([0.4, 0.4]), torch.tensor([0.2, 0.0]), generator=torch.Generator().manual_seed(12)
    )
    assert out.std[0] > 0 and out.std[1] == 0
    torch.testing.assert_close(out.prev_sample[1], x[1] - 0.4 * v[1], rtol=0, atol=1e-6)
    assert out.log_prob[1] == 0
    first = StepOutput(out.prev_sample[:1], out.log_prob[:1], out.mean[:1], out.std[:1], out.kl_std[:1])
    torch.testing.assert_close(out.log_prob[:1], _normal_log_prob(first))

    replay = cps_step(
        x, v, torch.tensor([0.4, 0.4]), torch.tensor([0.2, 0.0]), prev_sample=out.prev_sample.detach()
    )
    replay.log_prob.sum().backward()
    assert torch.isfinite(v.grad).all() and (v.grad[1] == 0).all() and (v.grad[0] != 0).any()


def test_gaussian_log_prob_broadcasts_std_and_handles_2d_and_float_std():
    sample, mean = _latents(3, 7, seed=13)
    std = torch.tensor([0.5, 1.0, 2.0])
    expected = torch.distributions.Normal(mean, std[:, None].expand(3, 7)).log_prob(sample).mean(dim=1)
    torch.testing.assert_close(gaussian_log_prob(sample, mean, std), expected)
    torch.testing.assert_close(
        gaussian_log_prob(sample, mean, 0.5), gaussian_log_prob(sample, mean, torch.full((3,), 0.5))
    )


def test_dpm_solver_needs_prev_x0_and_prev_sigma_together():
    x, v = _latents(2, 3)
    with pytest.raises(ValueError, match="prev_x0 and prev_sigma"):
        dpm_solver_2m_step(x, v, 0.5, 0.4, prev_x0=x)


@pytest.mark.parametrize("num_steps", [10, 20])
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # inside diffusers, numpy 2
def test_dpm_solver_2m_follows_diffusers(num_steps):
    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        flow_shift=3.0,
        solver_order=2,
        algorithm_type="dpmsolver++",
    )
    scheduler.set_timesteps(num_steps)
    sigmas = scheduler.sigmas.tolist()
    assert len(sigmas) == num_steps + 1 and sigmas[-1] == 0.0
    x, direction = _latents(2, 4, 8, 8, seed=14)
    reference = x.clone()
    prev_x0 = prev_sigma = None
    for i, timestep in enumerate(scheduler.timesteps):
        v = _velocity(x, sigmas[i], direction)
        reference = scheduler.step(
            _velocity(reference, sigmas[i], direction), timestep, reference
        ).prev_sample
        x_next, x0_hat = dpm_solver_2m_step(
            x, v, sigmas[i], sigmas[i + 1], prev_x0=prev_x0, prev_sigma=prev_sigma
        )
        assert x_next.dtype == torch.float32
        torch.testing.assert_close(x_next, reference, rtol=1e-5, atol=1e-5, msg=f"step {i}")
        if i == 0:  # first-order DPM-Solver++ is the Euler step for flow matching
            torch.testing.assert_close(
                x_next, ode_euler_step(x, v, sigmas[0], sigmas[1]), rtol=1e-5, atol=1e-5
            )
        x, prev_x0, prev_sigma = x_next, x0_hat, sigmas[i]
    assert torch.equal(x, prev_x0)  # the final step to sigma 0 returns the denoised estimate


def test_dpm_solver_2m_beats_euler_on_a_gaussian_flow():
    """Data N(mu, s^2) -> noise N(0, 1): the velocity and the ODE's flow map are known in closed form.

    (A point target would not do: its ODE paths are straight lines, on which Euler is already exact.)
    """
    mu, s = 1.5, 1.0

    def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
        var = (1 - sigma) ** 2 * s**2 + sigma**2
        return -mu + (sigma - (1 - sigma) * s**2) / var * (x - (1 - sigma) * mu)

    x_start = torch.randn(1, 4096, generator=torch.Generator().manual_seed(15))
    euler_errors, dpm_errors = [], []
    for num_steps in (10, 20, 40):
        t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
        sigmas = (3 * t / (1 + 2 * t)).tolist()  # shift 3, starting at sigma = 1 like FlowMatchEuler
        exact = mu + s * x_start  # the flow map from N(0, 1) at sigma = 1 to N(mu, s^2) at sigma = 0
        x_euler, x_dpm, prev_x0, prev_sigma = x_start, x_start, None, None
        for i in range(num_steps):
            x_euler = ode_euler_step(x_euler, velocity(x_euler, sigmas[i]), sigmas[i], sigmas[i + 1])
            x_dpm, prev_x0 = dpm_solver_2m_step(
                x_dpm,
                velocity(x_dpm, sigmas[i]),
                sigmas[i],
                sigmas[i + 1],
                prev_x0=prev_x0,
                prev_sigma=prev_sigma,
            )
            prev_sigma = sigmas[i]
        euler_errors.append((x_euler - exact).abs().mean().item())
        dpm_errors.append((x_dpm - exact).abs().mean().item())
    # Euler converges at first order (so the harness is right), and 2M is far more accurate at every N.
    for coarse, fine in itertools.pairwise(euler_errors):
        assert 0.4 < fine / coarse < 0.6
    for euler, dpm in zip(euler_errors, dpm_errors):
        assert dpm < 0.3 * euler
