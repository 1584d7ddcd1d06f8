"""Which denoising steps are stochastic (SDE) and which are trained, for each flow-GRPO recipe.

Conventions: a schedule has ``T = num_steps`` steps indexed ``0..T-1``; step ``i`` goes from ``sigmas[i]`` to
``sigmas[i + 1]`` (``T + 1`` sigma indices, ``sigmas[T]`` is the final, cleanest level). Steps that are not
SDE are deterministic ODE steps; they have no log-prob and are never trained.

Recipes (decisions follow the papers' public code, cited where they matter):

- Flow-GRPO: SDE everywhere, the first ``timestep_fraction`` of the steps trained (:func:`flow_grpo_plan`).
- DanceGRPO: SDE everywhere, a random subset of steps per sample trained (:func:`dance_grpo_steps`).
- MixGRPO: SDE and training only inside a sliding window, ODE elsewhere (:class:`SlidingWindow`);
  MixGRPO-Flash also runs the ODE steps after the window with DPM-Solver++(2M) on a compressed schedule
  (:func:`flash_plan`).
- Flow-GRPO-Fast: a short SDE window placed at random in the early steps (:func:`fast_plan`).
- TempFlow-GRPO: one SDE branching step per sample (:func:`tempflow_branch_steps`) and per-step loss weights
  proportional to the transition noise, normalised by the schedule's mean noise (:func:`noise_aware_weights`).

Every function raises ``ValueError`` naming the offending parameter for an invalid setting.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch
from torch import Tensor

SOLVERS = ("euler", "dpm2")
WINDOW_STRATEGIES = ("progressive", "random", "decay")
WEIGHT_KINDS = ("uniform", "noise_aware")

_FRACTION_TOL = 1e-9
"""Added before flooring ``fraction * T`` so that e.g. ``0.29 * 100 = 28.999999999999996`` counts as 29."""


def _check_num_steps(num_steps: int) -> None:
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1")


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name}={value} must be in (0, 1]")


def _seeded_rng(seed: int, iteration: int) -> np.random.Generator:
    """A generator that depends only on (seed, iteration), so draws do not depend on call order."""
    if seed < 0:
        raise ValueError(f"seed={seed} must be >= 0")
    if iteration < 0:
        raise ValueError(f"iteration={iteration} must be >= 0")
    return np.random.default_rng((seed, iteration))


@dataclass(frozen=True)
class StepPlan:
    """How one rollout runs its ``T`` steps, and which steps are trained.

    - ``sde``: length T; ``sde[i]`` is True when step i is stochastic (SDE with a log-prob), False for an ODE
      step.
    - ``train``: sorted step indices whose transitions are trained; a subset of the SDE steps. For DanceGRPO
      this is every step and the per-sample subset comes from :func:`dance_grpo_steps`.
    - ``solver_after``: ODE solver for the steps after the last SDE step: ``"euler"`` (the same first-order
      step as everywhere else) or ``"dpm2"`` (DPM-Solver++ 2M, MixGRPO-Flash). Steps before the last SDE step
      are Euler.
    - ``ode_sigmas_after``: None to run every step after the last SDE step on the original sigmas. Otherwise
      the increasing original sigma indices that the ``solver_after`` ODE visits after the last SDE step: it
      starts at ``last_sde + 1`` (where the last SDE step lands) and ends at ``T``; ``len - 1`` ODE steps are
      run.
    """

    sde: tuple[bool, ...]
    train: tuple[int, ...]
    solver_after: str = "euler"
    ode_sigmas_after: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.sde:
            raise ValueError("sde must have one entry per step (at least 1)")
        if list(self.train) != sorted(set(self.train)):
            raise ValueError(f"train={self.train} must be strictly increasing")
        if any(not (0 <= t < self.num_steps and self.sde[t]) for t in self.train):
            raise ValueError(f"train={self.train} must only hold SDE step indices in [0, {self.num_steps})")
        if self.solver_after not in SOLVERS:
            raise ValueError(f"solver_after={self.solver_after!r} must be one of {SOLVERS}")
        if self.ode_sigmas_after is not None:
            idx = self.ode_sigmas_after
            if list(idx) != sorted(set(idx)) or idx[0] != self.last_sde + 1 or idx[-1] != self.num_steps:
                raise ValueError(f"ode_sigmas_after={idx} must increase from {self.last_sde + 1} to "
                                 f"{self.num_steps}")

    @property
    def num_steps(self) -> int:
        """T, the number of steps of the original schedule."""
        return len(self.sde)

    @property
    def last_sde(self) -> int:
        """Index of the last SDE step, or -1 when every step is ODE."""
        return max((i for i, s in enumerate(self.sde) if s), default=-1)


def _window_plan(num_steps: int, start: int, size: int) -> StepPlan:
    """SDE and training on steps [start, start + size), Euler ODE elsewhere."""
    window = tuple(range(start, start + size))
    return StepPlan(sde=tuple(start <= i < start + size for i in range(num_steps)), train=window)


def flow_grpo_plan(num_steps: int, train_fraction: float = 0.9) -> StepPlan:
    """Flow-GRPO: SDE on all T steps; train the first ``max(1, floor(train_fraction * T))`` steps.

    Flow-GRPO computes ``num_train_timesteps = int(num_steps * timestep_fraction)`` (a floor) and trains steps
    ``0..num_train_timesteps-1`` in trajectory order; T=10 and 0.9 give steps 0..8.

    num_steps: T >= 1. train_fraction: in (0, 1].
    """
    _check_num_steps(num_steps)
    _check_fraction("train_fraction", train_fraction)
    k = max(1, math.floor(train_fraction * num_steps + _FRACTION_TOL))
    return StepPlan(sde=(True,) * num_steps, train=tuple(range(k)))


def dance_grpo_count(num_steps: int, train_fraction: float) -> int:
    """DanceGRPO's trained steps per sample, ``k = max(1, round(train_fraction * T))``, rounded half up."""
    _check_num_steps(num_steps)
    _check_fraction("train_fraction", train_fraction)
    return max(1, math.floor(train_fraction * num_steps + 0.5))


def dance_grpo_steps(
    num_steps: int, train_fraction: float, num_samples: int, generator: torch.Generator | None = None
) -> Tensor:
    """DanceGRPO: for each sample an independent uniform random subset of ``k`` steps.

    ``k = max(1, round(train_fraction * T))``, rounded half up (T=16, 0.6 -> 10; DanceGRPO's code floors: 9).

    num_steps: T >= 1. train_fraction: in (0, 1]. num_samples: >= 1 (one row per rollout sample).
    generator: torch RNG for the draw (None: the global one). Returns (num_samples, k) int64, each row sorted.
    """
    k = dance_grpo_count(num_steps, train_fraction)
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be >= 1")
    keys = torch.rand(num_samples, num_steps, generator=generator)
    return keys.argsort(dim=1)[:, :k].sort(dim=1).values


@dataclass(frozen=True)
class SlidingWindow:
    """MixGRPO sliding window: SDE and training on ``size`` consecutive steps, ODE elsewhere.

    The window start is a pure function of the training iteration (nothing is stateful, so a resumed run gets
    the same windows). Start positions are ``0, stride, 2*stride, ...`` up to ``max_start``; strategies:

    - ``"progressive"``: the start advances by ``stride`` every ``shift_interval`` iterations and, once it
      would pass ``max_start``, rolls back to 0 (MixGRPO's progressive strategy with ``--roll_back``).
    - ``"random"``: a start drawn uniformly from ``0..max_start`` (any integer, not only stride multiples) at
      every iteration, from ``(seed, iteration)`` alone.
    - ``"decay"``: progressive, but the shift interval shrinks as the window moves to later (less noisy)
      steps, linearly in the window position: ``max(min_shift_interval, int(shift_interval * (1 - p) +
      min_shift_interval * p))`` with ``p = start / max(T - 2, 1)``; it rolls back like progressive. This is
      the ``"decay"`` strategy of the MixGRPO code (``get_dynamic_iters_per_group``): its ``progress`` is the
      window's current start step (a denoising step, not the training iteration) over its start bound
      ``sampling_steps - 2``, whatever the window size and ``max_start`` are here. Its ``max_iters_per_group``
      is ``shift_interval`` here (its scripts pass 10 and ``min_iters_per_group`` 1).

    Fields:
    - num_steps: T >= 1.
    - size: window length in steps, 1..T (MixGRPO: 4).
    - shift_interval: iterations per window position, >= 1 (MixGRPO: 25); for "decay" the interval at start 0.
    - stride: steps the window moves per shift, >= 1 (MixGRPO: 1).
    - strategy: one of ``WINDOW_STRATEGIES``.
    - max_start: largest window start, 0..T-size; None means T - size, so the window may reach the last step
      (the MixGRPO code bounds the start by T - 2 and truncates windows there, so its last 2 steps stay
      ODE).
    - seed: >= 0, seeds the "random" strategy.
    - min_shift_interval: "decay" only, the smallest interval, 1..shift_interval: the interval at start T - 2,
      beyond ``max_start`` for windows of more than 2 steps (so the last start may keep a longer one); None
      means ``max(1, shift_interval // 4)`` as in MixGRPO (its scripts pass 10 and 1 explicitly).
    """

    num_steps: int
    size: int = 4
    shift_interval: int = 25
    stride: int = 1
    strategy: str = "progressive"
    max_start: int | None = None
    seed: int = 0
    min_shift_interval: int | None = None

    def __post_init__(self) -> None:
        _check_num_steps(self.num_steps)
        if not 1 <= self.size <= self.num_steps:
            raise ValueError(f"size={self.size} must be in [1, num_steps={self.num_steps}]")
        if self.shift_interval < 1:
            raise ValueError(f"shift_interval={self.shift_interval} must be >= 1")
        if self.stride < 1:
            raise ValueError(f"stride={self.stride} must be >= 1")
        if self.strategy not in WINDOW_STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} must be one of {WINDOW_STRATEGIES}")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        if self.max_start is None:
            object.__setattr__(self, "max_start", self.num_steps - self.size)
        elif not 0 <= self.max_start <= self.num_steps - self.size:
            raise ValueError(f"max_start={self.max_start} must be in [0, num_steps - size = "
                             f"{self.num_steps - self.size}]")
        if self.min_shift_interval is None:
            object.__setattr__(self, "min_shift_interval", max(1, self.shift_interval // 4))
        elif not 1 <= self.min_shift_interval <= self.shift_interval:
            raise ValueError(f"min_shift_interval={self.min_shift_interval} must be in "
                             f"[1, shift_interval={self.shift_interval}]")

    def interval_at(self, start: int) -> int:
        """Iterations the window stays at ``start``: ``shift_interval``, or less for "decay"."""
        if self.strategy != "decay":
            return self.shift_interval
        p = start / max(self.num_steps - 2, 1)
        return max(self.min_shift_interval,
                   int(self.shift_interval * (1 - p) + self.min_shift_interval * p))

    def starts(self) -> range:
        """Every start the window takes: each integer up to ``max_start`` ("random"), else the multiples of
        ``stride``."""
        return range(0, self.max_start + 1, 1 if self.strategy == "random" else self.stride)

    def start(self, iteration: int) -> int:
        """First step of the window at training ``iteration`` (>= 0); the window is [start, start + size)."""
        if iteration < 0:
            raise ValueError(f"iteration={iteration} must be >= 0")
        if self.strategy == "random":
            return int(_seeded_rng(self.seed, iteration).integers(0, self.max_start + 1))
        starts = self.starts()
        ends = list(accumulate(self.interval_at(s) for s in starts))
        return starts[bisect_right(ends, iteration % ends[-1])]

    def plan(self, iteration: int) -> StepPlan:
        """SDE and training on the window at ``iteration``, Euler ODE on every other step."""
        return _window_plan(self.num_steps, self.start(iteration), self.size)


def flash_plan(window: SlidingWindow, iteration: int, compression: float | None = 0.4) -> StepPlan:
    """MixGRPO-Flash: the window plan, with the ODE steps after the window run by DPM-Solver++(2M).

    Let ``e = start + size`` (the sigma index where the window ends) and ``R = T - e`` the ODE steps after it.
    With ``compression`` set, only ``n = max(1, round(compression * R))`` (half up) of them are run (none
    when ``R == 0``), on the original sigma indices ``linspace(e, T, n + 1)`` rounded half up: evenly spaced,
    always ``e`` first and ``T`` last. (MixGRPO rebuilds a uniform-in-time schedule of
    ``int(max((R + 1) * ratio, 1))`` points instead; on the shifted schedule evenly spaced indices are the
    same thing, up to rounding.)

    Caller: run steps ``0..e-1`` as usual (Euler ODE before the window, SDE inside), then integrate with
    DPM-Solver++(2M) through ``sigmas[list(plan.ode_sigmas_after)]`` (all of ``sigmas[e:]`` when it is None).

    window: the MixGRPO window schedule. iteration: training iteration >= 0. compression: in (0, 1], or None
    to keep every ODE step after the window.
    """
    if compression is not None:
        _check_fraction("compression", compression)
    start = window.start(iteration)
    base = _window_plan(window.num_steps, start, window.size)
    kept = None
    if compression is not None:
        end, remaining = start + window.size, window.num_steps - start - window.size
        n = max(1, math.floor(compression * remaining + 0.5)) if remaining else 0
        kept = tuple(int(i) for i in np.floor(np.linspace(end, window.num_steps, n + 1) + 0.5))
    return StepPlan(sde=base.sde, train=base.train, solver_after="dpm2", ode_sigmas_after=kept)


def fast_plan(
    num_steps: int, window: int = 3, within: float = 0.5, *, iteration: int, seed: int = 0
) -> StepPlan:
    """Flow-GRPO-Fast: SDE and training on ``window`` consecutive steps placed at random in the early steps.

    The window lies inside the first ``H = floor(within * T)`` steps: its start is uniform in ``0..H-window``
    (Flow-GRPO-Fast: ``sde_window_range = (0, num_steps // 2)``, ``randint(lo, hi - size)``). Euler ODE
    elsewhere. The draw depends only on ``(seed, iteration)``; give each process its own seed for per-process
    windows, as Flow-GRPO does.

    num_steps: T >= 1. window: SDE steps, 1..H. within: fraction of the steps the window may occupy, in
    (0, 1]. iteration: training iteration >= 0. seed: >= 0.
    """
    starts = fast_starts(num_steps, window, within)
    start = int(_seeded_rng(seed, iteration).integers(0, len(starts)))
    return _window_plan(num_steps, start, window)


def fast_starts(num_steps: int, window: int, within: float) -> range:
    """Every start :func:`fast_plan` may draw for its window: ``0..floor(within * T) - window``."""
    _check_num_steps(num_steps)
    _check_fraction("within", within)
    limit = math.floor(within * num_steps + _FRACTION_TOL)
    if not 1 <= window <= limit:
        raise ValueError(f"window={window} must be in [1, floor(within * num_steps) = {limit}]")
    return range(limit - window + 1)


def tempflow_branch_steps(
    num_steps: int,
    num_samples: int,
    candidates: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """TempFlow-GRPO trajectory branching: the one SDE step k of each sample, uniform over ``candidates``.

    The sample runs ODE on every other step and its final reward is credited to step k alone. To compare
    samples that differ only at k (TempFlow's credit assignment), draw one k per group (``num_samples`` =
    groups) and repeat it over the group's members, which then share the noise and ODE prefix up to k.

    num_steps: T >= 1. num_samples: >= 1. candidates: distinct step indices in [0, T); None = every step.
    generator: torch RNG (None: the global one). Returns (num_samples,) int64.
    """
    _check_num_steps(num_steps)
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be >= 1")
    pool = list(range(num_steps)) if candidates is None else [int(c) for c in candidates]
    if not pool or len(set(pool)) != len(pool) or not all(0 <= c < num_steps for c in pool):
        raise ValueError(f"candidates={candidates} must be distinct step indices in [0, {num_steps})")
    pick = torch.randint(len(pool), (num_samples,), generator=generator)
    return torch.tensor(pool, dtype=torch.int64)[pick]


def noise_aware_weights(step_std: Tensor, schedule_std: Tensor) -> Tensor:
    """TempFlow-GRPO noise-aware weights: each step's transition noise over the schedule's mean transition noise.

    step_std: (S,) transition std ``std_t * sqrt(|dt|)`` (latent units) of the steps to weight, finite and
    non-negative. schedule_std: (T,) the same quantity for every trainable step of the schedule, not all 0: a
    constant of the schedule, so a step's weight depends on the step alone, not on the other steps of its batch,
    rollout or process. Weights average 1 over the schedule's steps; the steps with the most transition noise get
    weights above 1: the early ones under the flow_grpo and cps kernels, but the late, long ones of a shifted
    schedule under dance, whose std ``eta * sqrt(|dt|)`` grows with the step size.
    Returns (S,) in float32 or the inputs' floating dtype.
    """
    for name, value in (("step_std", step_std), ("schedule_std", schedule_std)):
        if value.ndim != 1 or value.numel() == 0:
            raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(value.shape)}")
        if not bool(torch.isfinite(value).all()) or bool((value < 0).any()):
            raise ValueError(f"{name} must be finite and non-negative")
    if not bool((schedule_std > 0).any()):
        raise ValueError("schedule_std must not be all zero (noise_aware weights need a noisy schedule)")
    dtype = torch.promote_types(step_std.dtype, schedule_std.dtype)
    dtype = dtype if dtype.is_floating_point else torch.float32
    return step_std.to(dtype) / schedule_std.to(dtype).mean()


def timestep_weights(kind: str, step_std: Tensor, schedule_std: Tensor) -> Tensor:
    """Per-step loss weights for any recipe: ``"uniform"`` (all 1) or ``"noise_aware"``.

    kind: one of ``WEIGHT_KINDS``. step_std, schedule_std: as in :func:`noise_aware_weights`; for "uniform" only
    the shape and floating dtype (float32 otherwise) of ``step_std`` are used. Returns (S,).
    """
    if kind == "noise_aware":
        return noise_aware_weights(step_std, schedule_std)
    if kind != "uniform":
        raise ValueError(f"kind={kind!r} must be one of {WEIGHT_KINDS}")
    if step_std.ndim != 1:
        raise ValueError(f"step_std must be a 1-D tensor, got shape {tuple(step_std.shape)}")
    return torch.ones_like(step_std, dtype=step_std.dtype if step_std.is_floating_point() else torch.float32)
