"""BranchGRPO tree rollouts: tree layout, reward backup, depth-wise advantages and pruning.

One tree per prompt. The root trajectory starts from pure noise; at each split step ``s`` in ``split_points``
every live node branches into ``branch_factor`` children, which take step ``s`` with distinct SDE noise draws
from the same mean (one transformer forward per parent; the children reuse it). Steps between splits continue
each node on its own. The depth of a node is the number of splits before it; depth ``D = len(split_points)``
holds the ``branch_factor ** D`` leaves, whose final images are scored.

Layout: every per-depth tensor is (P, n_d) with ``n_d = branch_factor ** d`` for P prompts, and the children
of node ``p`` at depth d-1 are nodes ``p * bf .. p * bf + bf - 1`` at depth d. All nodes of one depth
therefore form one contiguous batch ``(P * n_d, ...)`` for ONE batched transformer forward (the BranchGRPO
code forwards nodes one at a time).

Step ownership: the transition of a split step ``s`` (depth d-1 -> d) belongs to the children at depth d, each
with its own noise; a non-split step belongs to the node at the current depth. ``BranchPlan.depth_at(step)``
gives that owner depth.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import Tensor

BACKUP_MODES = ("mean", "prob")
SDE_VARIANTS = ("pure", "mix")
MIX_WINDOW = 4
"""Default SDE window length of the Mix variant: steps [0, 4) (BranchGRPO's ``mix_sde_window_size``)."""


@dataclass(frozen=True)
class BranchPlan:
    """The shape of a BranchGRPO tree.

    - num_steps: T >= 1 denoising steps, indexed 0..T-1.
    - split_points: strictly increasing split steps in [0, T), at least one (BranchGRPO: 0, 3, 6, 9 of 20).
    - branch_factor: children per split, >= 2 (BranchGRPO: 2).
    """

    num_steps: int
    split_points: tuple[int, ...]
    branch_factor: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "split_points", tuple(int(s) for s in self.split_points))
        if self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps} must be >= 1")
        if self.branch_factor < 2:
            raise ValueError(f"branch_factor={self.branch_factor} must be >= 2")
        points = self.split_points
        if not points or any(b <= a for a, b in pairwise(points)):
            raise ValueError(f"split_points={points} must be non-empty and strictly increasing")
        if points[0] < 0 or points[-1] >= self.num_steps:
            raise ValueError(f"split_points={points} must lie in [0, num_steps={self.num_steps})")

    @property
    def depth(self) -> int:
        """D, the number of splits: the depth of the leaves."""
        return len(self.split_points)

    @property
    def num_leaves(self) -> int:
        """Leaves per prompt, ``branch_factor ** D``."""
        return self.branch_factor ** self.depth

    def depth_at(self, step: int) -> int:
        """Depth of the nodes that own the transition at ``step`` (number of split points <= step).

        ``branch_factor ** depth_at(step)`` transitions (and log-probs) per prompt happen at that step. The
        transformer input at a split step is the parents' batch, one depth less.
        """
        if not 0 <= step < self.num_steps:
            raise ValueError(f"step={step} must be in [0, num_steps={self.num_steps})")
        return bisect_right(self.split_points, step)

    def nodes_per_depth(self) -> list[int]:
        """Nodes per prompt at each depth 0..D: ``[1, bf, bf**2, ..., bf**D]``."""
        return [self.branch_factor**d for d in range(self.depth + 1)]


def _check_depth_tensors(name: str, tensors: Sequence[Tensor], plan: BranchPlan, first: int) -> None:
    """tensors[i] must be (P, bf**(first + i)) with the same P for all."""
    expected = plan.nodes_per_depth()[first:]
    if len(tensors) != len(expected):
        raise ValueError(f"{name} must hold {len(expected)} tensors (depths {first}..{plan.depth}), "
                         f"got {len(tensors)}")
    rows = tensors[0].shape[0] if tensors[0].ndim == 2 else -1
    for d, (x, n) in enumerate(zip(tensors, expected), start=first):
        if x.ndim != 2 or x.shape != (rows, n):
            raise ValueError(f"{name}[{d - first}] (depth {d}) must have shape (P, {n}) with one P for all "
                             f"depths, got {tuple(x.shape)}")


def backup_rewards(
    leaf_rewards: Tensor,
    plan: BranchPlan,
    mode: str = "mean",
    child_log_probs: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    """Rewards of every node, backed up from the leaves; returns one (P, bf**d) tensor per depth d = 0..D.

    - ``"mean"``: an internal node's reward is the mean of its children's, i.e. of all its leaves
      (BranchGRPO's default: every leaf below a node counts equally).
    - ``"prob"``: the children's rewards averaged with weights ``softmax`` over the bf siblings of their
      split-step log-probs (temperature 1), applied level by level from the leaves up. This is BranchGRPO's
      probability-weighted backup: a child whose noise draw was more likely under the policy speaks more for
      its parent.

    leaf_rewards: (P, L) finite float rewards of the leaves, L = ``plan.num_leaves``, prompt-major as in the
    module layout. plan: the tree shape. mode: one of ``BACKUP_MODES``. child_log_probs: "prob" only, D
    tensors; entry d-1 is (P, bf**d), the log-prob of the split-step transition that created each depth-d
    node. Use the per-element mean log-density the kernels return (a sum over the latent saturates the
    softmax), computed under the std that was actually sampled with.
    """
    if mode not in BACKUP_MODES:
        raise ValueError(f"mode={mode!r} must be one of {BACKUP_MODES}")
    if leaf_rewards.ndim != 2 or leaf_rewards.shape[1] != plan.num_leaves:
        raise ValueError(f"leaf_rewards must have shape (P, {plan.num_leaves}), "
                         f"got {tuple(leaf_rewards.shape)}")
    if not leaf_rewards.is_floating_point() or not bool(torch.isfinite(leaf_rewards).all()):
        raise ValueError("leaf_rewards must be a finite floating-point tensor")
    if mode == "mean" and child_log_probs is not None:
        raise ValueError("child_log_probs is only used by mode='prob'")
    if mode == "prob":
        if child_log_probs is None:
            raise ValueError("child_log_probs is required for mode='prob'")
        _check_depth_tensors("child_log_probs", child_log_probs, plan, first=1)
        if child_log_probs[0].shape[0] != leaf_rewards.shape[0]:
            raise ValueError("child_log_probs and leaf_rewards must have the same number of prompts P")
    bf, rows = plan.branch_factor, leaf_rewards.shape[0]
    levels = [leaf_rewards]
    for d in range(plan.depth, 0, -1):
        children = levels[0].reshape(rows, -1, bf)
        if mode == "mean":
            parent = children.mean(dim=-1)
        else:
            log_p = child_log_probs[d - 1].to(children.dtype).reshape(rows, -1, bf)
            parent = (torch.softmax(log_p, dim=-1) * children).sum(dim=-1)
        levels.insert(0, parent)
    return levels


def depthwise_advantages(node_rewards: Sequence[Tensor], eps: float = 1e-6) -> list[Tensor]:
    """Z-score each depth's node rewards within each prompt: ``(r - mean) / (std + eps)`` over its nodes.

    std is the population std, as in the rest of mmgrpo's estimators (BranchGRPO uses the unbiased one). A
    depth with a single node (the root) gets 0. node_rewards: per depth, (P, n_d) float. eps: > 0. Returns the
    same shapes and dtypes.
    """
    if eps <= 0:
        raise ValueError(f"eps={eps} must be > 0: backed-up node rewards that should tie differ by rounding, "
                         "which a zero eps turns into advantages of +-1")
    out = []
    for r in node_rewards:
        if r.ndim != 2:
            raise ValueError(f"each node_rewards entry must be (P, n), got shape {tuple(r.shape)}")
        if r.shape[1] == 1:
            out.append(torch.zeros_like(r))
            continue
        mean, std = r.mean(dim=1, keepdim=True), r.std(dim=1, correction=0, keepdim=True)
        out.append((r - mean) / (std + eps))
    return out


def branch_sde_steps(
    plan: BranchPlan, variant: str = "pure", window: tuple[int, int] | None = None
) -> tuple[bool, ...]:
    """Which steps of a tree rollout are SDE (stochastic, trainable); the others are ODE.

    - ``"pure"``: every step is SDE, so every transition of every node is trained (BranchGRPO's default).
    - ``"mix"``: SDE only on the steps of ``window`` and on the split steps, ODE elsewhere (BranchGRPO-Mix).
      The BranchGRPO code effectively uses the first ``MIX_WINDOW`` steps, the default here.

    plan: the tree shape. variant: one of ``SDE_VARIANTS``. window: "mix" only, ``(start, stop)`` half-open
    step range with 0 <= start < stop <= T; None means (0, min(4, T)). Returns a length-T tuple.
    """
    if variant not in SDE_VARIANTS:
        raise ValueError(f"variant={variant!r} must be one of {SDE_VARIANTS}")
    if variant == "pure":
        if window is not None:
            raise ValueError("window is only used by variant='mix'")
        return (True,) * plan.num_steps
    start, stop = (0, min(MIX_WINDOW, plan.num_steps)) if window is None else window
    if not 0 <= start < stop <= plan.num_steps:
        raise ValueError(f"window={window} must satisfy 0 <= start < stop <= num_steps={plan.num_steps}")
    splits = set(plan.split_points)
    return tuple(start <= t < stop or t in splits for t in range(plan.num_steps))


def width_prune(advantages: Tensor, keep: float, generator: torch.Generator | None = None) -> Tensor:
    """Width pruning: per prompt, train only the best and the worst nodes by advantage (BranchGRPO, mode 2).

    Keeps ``k = min(n, max(2, floor(keep * n)))`` nodes per row: the ``k // 2`` highest advantages and the
    ``k - k // 2`` lowest. BranchGRPO applies it to the leaf layer, i.e. to the transitions after the last
    split; apply this mask to the deepest depth's targets. (BranchGRPO ranks transitions across the whole
    local batch; here each prompt keeps its own extremes.)

    advantages: (P, n). keep: fraction in (0, 1] (BranchGRPO: 0.5). generator: when given, ties are broken at
    random with it; None breaks ties by node index. Returns a (P, n) bool mask, True = train.
    """
    if advantages.ndim != 2:
        raise ValueError(f"advantages must have shape (P, n), got {tuple(advantages.shape)}")
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep={keep} must be in (0, 1]")
    n = advantages.shape[1]
    k = min(n, max(2, math.floor(keep * n + 1e-9)))
    best, worst = k // 2, k - k // 2
    perm = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    order = perm[torch.argsort(advantages[:, perm], dim=1, descending=True, stable=True)]
    chosen = torch.cat([order[:, :best], order[:, n - worst:]], dim=1)
    return torch.zeros(advantages.shape, dtype=torch.bool).scatter_(1, chosen, True)


def depth_prune(
    plan: BranchPlan, iteration: int, window: int, interval: int, earliest: int | None = None
) -> frozenset[int]:
    """Depth pruning with a sliding window: the steps whose transitions are trained at ``iteration``.

    BranchGRPO gives a node one depth per step, so its depth window is a window of steps. ``window``
    consecutive steps are not trained; the window starts on the last steps [T - window, T) and moves one step
    earlier every ``interval`` iterations until its first step reaches ``earliest``, where it stays
    (BranchGRPO's ``depth_pruning_slide`` with ``depth_pruning_stop_depth``).

    plan: the tree shape. iteration: training iteration >= 0. window: pruned steps, 0..T-earliest (0: prune
    nothing). interval: iterations per one-step shift, >= 1. earliest: first step the window may cover, in
    [0, T]; None means the step after the last split, so split transitions are always trained. Returns the
    trained step indices.
    """
    steps = plan.num_steps
    earliest = plan.split_points[-1] + 1 if earliest is None else earliest
    if not 0 <= earliest <= steps:
        raise ValueError(f"earliest={earliest} must be in [0, num_steps={steps}]")
    if not 0 <= window <= steps - earliest:
        raise ValueError(f"window={window} must be in [0, num_steps - earliest = {steps - earliest}]")
    if interval < 1:
        raise ValueError(f"interval={interval} must be >= 1")
    if iteration < 0:
        raise ValueError(f"iteration={iteration} must be >= 0")
    shift = min(iteration // interval, steps - window - earliest)
    first = steps - window - shift
    return frozenset(t for t in range(steps) if not first <= t < first + window)
