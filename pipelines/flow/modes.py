"""Rollout modes: which denoising steps of a rollout are stochastic (SDE) and which are trained.

Each recipe is a small class registered in ``mmgrpo.registry.ROLLOUT_MODES`` and chosen by ``mode.name``. A
mode checks its ``mode.*`` settings once (a bad value is a :class:`~mmgrpo.config.ConfigError` naming the key)
and then turns the training iteration into a plan; the policy executes plans and never asks which recipe made
them:

- :class:`LinearPlan` for chains of N = groups x G independent samples (flow_grpo, dance_grpo, fast, mixgrpo,
  mixgrpo_flash, tempflow): per-sample SDE flags and per-sample trained steps.
- :class:`TreePlan` for BranchGRPO trees: the tree shape, the SDE steps and the trained steps.

The step math lives in :mod:`.schedules` and :mod:`.tree`; this module only wires config values into it. The
SDE kernel (``sampling.sde``) and the timestep weighting (``mode.timestep_weighting``) apply to every mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from mmgrpo.config import ConfigError
from mmgrpo.registry import ROLLOUT_MODES

from . import kernels, schedules, tree

SDE_KINDS = ("flow_grpo", "dance", "cps")
"""Values of ``sampling.sde``."""


def sde_kernel(sampling: Any, sigma_max_substitute: float) -> Callable[..., kernels.StepOutput]:
    """The stochastic step of ``sampling.sde`` with its noise setting bound: ``fn(x, v, sigma, sigma_prev, *,
    noise=None, prev_sample=None) -> StepOutput``. flow_grpo and cps take ``sampling.noise_level`` (Flow-GRPO
    shares it between its SDE types), dance ``sampling.eta``. ``sigma_max_substitute`` is the schedule's second
    sigma (the Flow-GRPO SDE's denominator at the schedule's first level, 1 or just below)."""
    if sampling.sde == "flow_grpo":
        return partial(kernels.flow_grpo_sde_step, noise_level=sampling.noise_level,
                       sigma_max_substitute=sigma_max_substitute)
    if sampling.sde == "dance":
        return partial(kernels.dance_grpo_sde_step, eta=sampling.eta)
    if sampling.sde == "cps":
        return partial(kernels.cps_step, eta=sampling.noise_level)
    raise ConfigError(f"bad value '{sampling.sde}' for 'sampling.sde': expected one of "
                      f"{', '.join(SDE_KINDS)}")


def check_noise(sampling: Any) -> None:
    """A ConfigError unless the noise setting of ``sampling.sde`` gives its SDE steps a positive std: ``eta`` (dance)
    or ``noise_level`` > 0, since 0 makes every step deterministic, with no log-prob to train; and for cps
    ``noise_level`` <= 1, as its std ``sigma_prev * sin(a * pi / 2)`` repeats that of ``2 - a`` above 1 and turns
    negative above 2."""
    key, value = ("sampling.eta", sampling.eta) if sampling.sde == "dance" else \
        ("sampling.noise_level", sampling.noise_level)
    high = 1.0 if sampling.sde == "cps" else math.inf
    if not 0 < value <= high:
        bound = "in (0, 1]" if sampling.sde == "cps" else "> 0 (0 leaves no noise, so no log-prob, to train)"
        raise ConfigError(f"bad value for '{key}': {value} must be {bound} with sampling.sde={sampling.sde}")


def check_window_size(size: int, num_steps: int) -> None:
    """A ConfigError unless an SDE window of ``size`` steps fits the schedule: 1 <= size <= num_steps."""
    if not 1 <= size <= num_steps:
        raise ConfigError(f"bad value for 'mode.window_size': {size} must be in [1, 'sampling.num_steps' = "
                          f"{num_steps}]")


def checked(keys: str | dict[str, str], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with a ValueError from the schedule math reported as a ConfigError naming the
    config key. ``keys`` is that key, or maps the parameter an error message starts with (``"size="``) to its
    key (the first key is the fallback)."""
    try:
        return fn(*args, **kwargs)
    except ValueError as err:
        if isinstance(keys, str):
            key = keys
        else:
            named = [k for p, k in keys.items() if str(err).startswith(f"{p}=")]
            key = named[0] if named else next(iter(keys.values()))
        raise ConfigError(f"bad value for '{key}': {err}") from err


@dataclass(frozen=True)
class LinearPlan:
    """A rollout of N independent samples over T steps (N = groups x G, group-major).

    - ``sde``: (N, T) bool; step i of sample n is stochastic.
    - ``train_steps``: (N, U) int64, sorted per row; the trained (SDE) steps of each sample, U the same for
      all.
    - ``solver_after`` / ``ode_sigmas_after``: how the ODE steps after the last SDE step run (as in
      :class:`~.schedules.StepPlan`; the same for every sample).
    - ``shared_noise``: the G samples of a group start from one initial latent (TempFlow-GRPO always; the other
      modes with ``mode.shared_initial_noise``).
    - ``share_prefix``: with ``shared_noise``, a group's samples are identical until the first step any of them
      is SDE (:meth:`shared_steps`), so the policy runs those steps on one row per group and expands it to the
      G rows at that step, as a BranchGRPO tree splits. False runs every row on every step: the same samples
      up to float noise (a row's transformer output depends on the batch size), at G times the prefix's cost.
    """

    sde: Tensor
    train_steps: Tensor
    solver_after: str = "euler"
    ode_sigmas_after: tuple[int, ...] | None = None
    shared_noise: bool = False
    share_prefix: bool = True

    @classmethod
    def shared(cls, plan: schedules.StepPlan, num_samples: int, shared_noise: bool = False) -> LinearPlan:
        """The same :class:`~.schedules.StepPlan` for every sample."""
        sde = torch.tensor(plan.sde, dtype=torch.bool).expand(num_samples, -1).clone()
        steps = torch.tensor(plan.train, dtype=torch.int64).expand(num_samples, -1).clone()
        return cls(sde, steps, plan.solver_after, plan.ode_sigmas_after, shared_noise)

    @property
    def num_steps(self) -> int:
        return self.sde.shape[1]

    @property
    def main_steps(self) -> int:
        """Steps run one by one on the original sigmas: all T, or up to the last SDE step when a DPM solver
        takes over after it."""
        if self.solver_after == "euler":
            return self.num_steps
        return int(self.sde.any(dim=0).nonzero().max()) + 1

    def shared_steps(self, group_size: int) -> Tensor:
        """(N,) int64: how many leading steps each sample runs as its whole group of ``group_size`` (rows
        group-major): the steps before the first SDE step of any member with ``shared_noise`` and
        ``share_prefix`` (TempFlow: the branch step k), else 0."""
        n, t = self.sde.shape
        if not (self.shared_noise and self.share_prefix):
            return torch.zeros(n, dtype=torch.int64)
        first = torch.where(self.sde.any(dim=1), self.sde.int().argmax(dim=1), t)  # argmax: the first True
        return first.view(-1, group_size).min(dim=1).values.repeat_interleave(group_size)

    def unit_of(self) -> Tensor:
        """(N, T) int64: the unit (column of ``train_steps``) of each sample's step, -1 when it is not
        trained."""
        units = torch.full(self.sde.shape, -1, dtype=torch.int64)
        cols = torch.arange(self.train_steps.shape[1]).expand_as(self.train_steps)
        return units.scatter_(1, self.train_steps, cols)


@dataclass(frozen=True)
class TreePlan:
    """A BranchGRPO rollout: one tree per prompt, the leaves are the samples.

    - ``branch``: the tree shape (``split_points``, ``branch_factor``).
    - ``sde``: length T, which steps are stochastic (all for 'pure', a window plus the splits for 'mix').
    - ``train_steps``: sorted trained steps: SDE steps kept by depth pruning, owned by depth >= 1 (the root's
      advantage is always 0, so its transitions carry no policy gradient).
    - ``width_keep``: fraction of the leaves whose leaf-depth transitions are trained (width pruning).
    - ``backup``: internal-node reward, ``mean`` or ``prob``.
    """

    branch: tree.BranchPlan
    sde: tuple[bool, ...]
    train_steps: tuple[int, ...]
    width_keep: float = 1.0
    backup: str = "mean"

    def unit_depths(self) -> list[int]:
        """The owner depth of each unit (trained step)."""
        return [self.branch.depth_at(s) for s in self.train_steps]

    def ancestor(self, depth: int) -> Tensor:
        """(L,) int64: for each leaf of a tree, the index of its ancestor among the nodes at ``depth``."""
        p = self.branch
        return torch.arange(p.num_leaves) // p.branch_factor ** (p.depth - depth)

    def owners(self) -> Tensor:
        """(L, U) bool: leaf j owns unit u when it is the first leaf below the unit's node (one owner per
        node)."""
        p = self.branch
        leaves = torch.arange(p.num_leaves)[:, None]
        spans = torch.tensor([p.branch_factor ** (p.depth - d) for d in self.unit_depths()],
                             dtype=torch.int64)
        return (leaves % spans) == 0 if len(spans) else torch.zeros(p.num_leaves, 0, dtype=torch.bool)


class RolloutMode:
    """Base of the modes. ``cfg`` is the whole :class:`~.config.FlowConfig`; constructors validate it."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.mode = cfg.mode
        self.num_steps = cfg.sampling.num_steps
        if self.num_steps < 1:
            raise ConfigError(f"bad value for 'sampling.num_steps': must be >= 1, got {self.num_steps}")
        self.trainable_steps = self.num_steps - 1 if cfg.sampling.sde == "cps" else self.num_steps
        """A CPS step into sigma = 0 is deterministic (std 0, no log-prob), so the last step is never
        trained."""
        if self.trainable_steps < 1:
            raise ConfigError("bad value for 'sampling.num_steps': cps needs at least 2 steps")

    def plan(self, iteration: int, num_groups: int, group_size: int, generator: torch.Generator) -> Any:
        """The plan of the rollout at training ``iteration`` (>= 0) for ``num_groups`` x ``group_size``
        samples."""
        raise NotImplementedError

    def max_units(self) -> int:
        """The most trained steps one sample (one loss row) has at any iteration: a constant of the config, the
        count Dr. GRPO's ``seq-mean-token-sum-norm`` divides by. No plan's row trains more, and some reaches it."""
        raise NotImplementedError

    def _trainable_count(self, steps: range | tuple[int, ...]) -> int:
        """How many of ``steps`` can be trained (not the deterministic last cps step)."""
        return sum(s < self.trainable_steps for s in steps)

    def _check_window_starts(self, starts: range, size: int) -> None:
        """A ConfigError when a window of ``size`` steps at one of ``starts`` trains nothing: it holds only the
        deterministic last cps step (the last start is the one that could)."""
        if starts and not self._trainable_count(range(starts[-1], starts[-1] + size)):
            raise ConfigError(f"bad value for 'mode.window_size': a {size}-step window at step {starts[-1]} "
                              f"trains nothing with sampling.sde=cps (its last step is deterministic); use at "
                              f"least 2")

    def _trainable(self, plan: schedules.StepPlan, num_samples: int) -> LinearPlan:
        """A shared plan without an untrainable last CPS step (one is always left: see
        :meth:`_check_window_starts`)."""
        kept = tuple(s for s in plan.train if s < self.trainable_steps)
        return LinearPlan.shared(schedules.StepPlan(plan.sde, kept, plan.solver_after, plan.ode_sigmas_after),
                                 num_samples, self.mode.shared_initial_noise)


@ROLLOUT_MODES.register("flow_grpo")
class FlowGRPOMode(RolloutMode):
    """Flow-GRPO: SDE on every step, the first ``mode.train_fraction`` of the steps trained."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.step_plan = checked("mode.train_fraction", schedules.flow_grpo_plan, self.num_steps,
                                 self.mode.train_fraction)

    def plan(self, iteration: int, num_groups: int, group_size: int,
             generator: torch.Generator) -> LinearPlan:
        return self._trainable(self.step_plan, num_groups * group_size)

    def max_units(self) -> int:
        return self._trainable_count(self.step_plan.train)


@ROLLOUT_MODES.register("dance_grpo")
class DanceGRPOMode(RolloutMode):
    """DanceGRPO: SDE on every step; each sample trains its own random ``mode.train_fraction`` of the
    steps."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        checked("mode.train_fraction", schedules.dance_grpo_steps, self.trainable_steps,
                self.mode.train_fraction, 1)

    def plan(self, iteration: int, num_groups: int, group_size: int,
             generator: torch.Generator) -> LinearPlan:
        n = num_groups * group_size
        steps = schedules.dance_grpo_steps(self.trainable_steps, self.mode.train_fraction, n, generator)
        return LinearPlan(torch.ones(n, self.num_steps, dtype=torch.bool), steps,
                          shared_noise=self.mode.shared_initial_noise)

    def max_units(self) -> int:
        return schedules.dance_grpo_count(self.trainable_steps, self.mode.train_fraction)


@ROLLOUT_MODES.register("fast")
class FastMode(RolloutMode):
    """Flow-GRPO-Fast: a window of ``mode.window_size`` SDE (and trained) steps placed at random inside the
    first ``mode.fast_within`` of the schedule, ODE elsewhere."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        keys = {"window": "mode.window_size", "within": "mode.fast_within"}
        starts = checked(keys, schedules.fast_starts, self.num_steps, self.mode.window_size, self.mode.fast_within)
        self._check_window_starts(starts, self.mode.window_size)

    def plan(self, iteration: int, num_groups: int, group_size: int,
             generator: torch.Generator) -> LinearPlan:
        step_plan = schedules.fast_plan(self.num_steps, self.mode.window_size, self.mode.fast_within,
                                        iteration=iteration, seed=max(self.cfg.seed, 0))
        return self._trainable(step_plan, num_groups * group_size)

    def max_units(self) -> int:
        """The window placed at step 0 (a possible start) keeps the most trainable steps."""
        return self._trainable_count(range(self.mode.window_size))


@ROLLOUT_MODES.register("mixgrpo")
class MixGRPOMode(RolloutMode):
    """MixGRPO: SDE and training only inside a sliding window (``mode.window_*``, ``mode.shift_interval``),
    ODE elsewhere. The window position is a function of the iteration (the policy's rollout count)."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        m = self.mode
        check_window_size(m.window_size, self.num_steps)
        keys = {"shift_interval": "mode.shift_interval", "stride": "mode.window_stride",
                "strategy": "mode.window_strategy", "num_steps": "sampling.num_steps"}
        self.window = checked(keys, schedules.SlidingWindow, self.num_steps, m.window_size, m.shift_interval,
                              m.window_stride, m.window_strategy, seed=max(cfg.seed, 0))
        self._check_window_starts(self.window.starts(), m.window_size)

    def step_plan(self, iteration: int) -> schedules.StepPlan:
        return self.window.plan(iteration)

    def plan(self, iteration: int, num_groups: int, group_size: int,
             generator: torch.Generator) -> LinearPlan:
        return self._trainable(self.step_plan(iteration), num_groups * group_size)

    def max_units(self) -> int:
        """Every strategy may start the window at step 0, where it keeps the most trainable steps."""
        return self._trainable_count(range(self.window.size))


@ROLLOUT_MODES.register("mixgrpo_flash")
class MixGRPOFlashMode(MixGRPOMode):
    """MixGRPO-Flash: the MixGRPO window, then DPM-Solver++(2M) for the ODE steps after it, on
    ``mode.flash_compression`` of them (None keeps all)."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        checked("mode.flash_compression", schedules.flash_plan, self.window, 0, self.mode.flash_compression)

    def step_plan(self, iteration: int) -> schedules.StepPlan:
        return schedules.flash_plan(self.window, iteration, self.mode.flash_compression)


@ROLLOUT_MODES.register("tempflow")
class TempFlowMode(RolloutMode):
    """TempFlow-GRPO: ODE everywhere except one SDE branching step k per group; only k is trained. A group
    shares its initial latent and k, so its members differ only by the noise drawn at k and their reward
    differences are credited to that step."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        candidates = self.mode.tempflow_candidates
        if candidates is None:
            candidates = list(range(max(1, self.num_steps - 1)))
        if any(c >= self.trainable_steps for c in candidates):
            raise ConfigError(f"bad value for 'mode.tempflow_candidates': {list(candidates)} must be "
                              f"trainable steps in [0, {self.trainable_steps})")
        self.candidates = [int(c) for c in candidates]
        checked("mode.tempflow_candidates", schedules.tempflow_branch_steps, self.num_steps, 1,
                self.candidates)

    def plan(self, iteration: int, num_groups: int, group_size: int,
             generator: torch.Generator) -> LinearPlan:
        k = schedules.tempflow_branch_steps(self.num_steps, num_groups, self.candidates, generator)
        steps = k.repeat_interleave(group_size)[:, None]
        sde = torch.zeros(len(steps), self.num_steps, dtype=torch.bool).scatter_(1, steps, True)
        return LinearPlan(sde, steps, shared_noise=True)

    def max_units(self) -> int:
        return 1


@ROLLOUT_MODES.register("branch")
class BranchMode(RolloutMode):
    """BranchGRPO: a tree per prompt (``mode.split_points``, ``mode.branch_factor``) whose leaves are the
    group; shared prefixes are sampled once, rewards are backed up to internal nodes, advantages normalised
    per depth; width pruning (``mode.width_keep``) and sliding depth pruning (``mode.depth_prune_*``)."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        m = self.mode
        self.branch = checked({"split_points": "mode.split_points", "branch_factor": "mode.branch_factor",
                               "num_steps": "sampling.num_steps"},
                              tree.BranchPlan, self.num_steps, tuple(m.split_points), m.branch_factor)
        window = None
        if m.branch_variant == "mix":
            check_window_size(m.window_size, self.num_steps)
            window = (0, m.window_size)
        self.sde = checked("mode.branch_variant", tree.branch_sde_steps, self.branch, m.branch_variant,
                           window)
        if m.reward_backup not in tree.BACKUP_MODES:
            raise ConfigError(f"bad value '{m.reward_backup}' for 'mode.reward_backup': expected one of "
                              f"{', '.join(tree.BACKUP_MODES)}")
        checked("mode.width_keep", tree.width_prune, torch.zeros(1, 2), m.width_keep)
        checked("grpo.adv_eps", tree.depthwise_advantages, [torch.zeros(1, 2)], cfg.grpo.adv_eps)
        checked({"window": "mode.depth_prune_window", "interval": "mode.depth_prune_interval"},
                tree.depth_prune, self.branch, 0, m.depth_prune_window, m.depth_prune_interval)
        if cfg.train.group_size != self.branch.num_leaves:
            raise ConfigError(f"bad value for 'train.group_size': branch mode samples branch_factor ** "
                              f"len(split_points) = {self.branch.num_leaves} leaves per prompt, got "
                              f"{cfg.train.group_size}")
        if cfg.sampling.sde == "cps" and self.branch.split_points[-1] == self.num_steps - 1:
            raise ConfigError("bad value for 'mode.split_points': with cps the last step is deterministic "
                              "and cannot split")

    def plan(self, iteration: int, num_groups: int, group_size: int, generator: torch.Generator) -> TreePlan:
        m = self.mode
        return TreePlan(self.branch, self.sde, self._train_steps(iteration), m.width_keep, m.reward_backup)

    def _train_steps(self, iteration: int) -> tuple[int, ...]:
        """The trained steps at ``iteration``: SDE, kept by depth pruning, owned by depth >= 1, trainable."""
        m = self.mode
        kept = tree.depth_prune(self.branch, iteration, m.depth_prune_window, m.depth_prune_interval)
        return tuple(s for s in range(self.trainable_steps)
                     if self.sde[s] and s in kept and self.branch.depth_at(s) >= 1)

    def max_units(self) -> int:
        """A tree's first leaf owns every trained transition of its ancestors; depth pruning's window stops
        moving after at most ``num_steps`` shifts, so those iterations hold every trained-step set."""
        interval = self.mode.depth_prune_interval
        return max(len(self._train_steps(shift * interval)) for shift in range(self.num_steps + 1))


def build_mode(cfg: Any) -> RolloutMode:
    """The rollout mode of ``cfg.mode.name``; unknown names and bad settings are ConfigErrors."""
    from mmgrpo.registry import RegistryError

    try:
        mode_class = ROLLOUT_MODES.get(cfg.mode.name)
    except RegistryError as err:
        raise ConfigError(f"bad value for 'mode.name': {err}") from err
    if cfg.sampling.sde not in SDE_KINDS:
        raise ConfigError(f"bad value '{cfg.sampling.sde}' for 'sampling.sde': expected one of "
                          f"{', '.join(SDE_KINDS)}")
    check_noise(cfg.sampling)
    if cfg.mode.timestep_weighting not in schedules.WEIGHT_KINDS:
        raise ConfigError(f"bad value '{cfg.mode.timestep_weighting}' for 'mode.timestep_weighting': "
                          f"expected one of {', '.join(schedules.WEIGHT_KINDS)}")
    return mode_class(cfg)
