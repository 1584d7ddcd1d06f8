import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mmgrpo.pipelines.flow.tree import (
    BranchPlan,
    backup_rewards,
    branch_sde_steps,
    depth_prune,
    depthwise_advantages,
    width_prune,
)

# bf=2, splits at steps 0 and 2 of T=4: the root splits at once, each child again at step 2 -> 4 leaves.
PLAN = BranchPlan(4, (0, 2), 2)
# Two prompts. Prompt 0 leaves 1, 3 | 5, 9; prompt 1 leaves 0, 0 | 2, 2.
LEAVES = torch.tensor([[1.0, 3.0, 5.0, 9.0], [0.0, 0.0, 2.0, 2.0]], dtype=torch.float64)


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def test_plan_structure_by_hand():
    assert PLAN.depth == 2 and PLAN.num_leaves == 4
    assert PLAN.nodes_per_depth() == [1, 2, 4]
    assert [PLAN.depth_at(s) for s in range(4)] == [1, 1, 2, 2]
    late = BranchPlan(5, [1, 3], 3)
    assert late.split_points == (1, 3) and late.num_leaves == 9
    assert [late.depth_at(s) for s in range(5)] == [0, 1, 1, 2, 2]
    # BranchGRPO's published tree: 20 steps, binary splits at 0, 3, 6, 9 -> 16 leaves
    assert BranchPlan(20, (0, 3, 6, 9)).num_leaves == 16


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((4, (2, 2), 2), "split_points"),
        ((4, (3, 1), 2), "split_points"),
        ((4, (), 2), "split_points"),
        ((4, (0, 4), 2), "split_points"),
        ((4, (-1, 2), 2), "split_points"),
        ((4, (0,), 1), "branch_factor"),
        ((0, (0,), 2), "num_steps"),
    ],
)
def test_plan_validation(args, name):
    with pytest.raises(ValueError, match=name):
        BranchPlan(*args)


def test_plan_rejects_out_of_range_queries():
    with pytest.raises(ValueError, match="step"):
        PLAN.depth_at(4)


def test_backup_mean_by_hand():
    root, mid, leaves = backup_rewards(LEAVES, PLAN)
    torch.testing.assert_close(mid, t([[2.0, 7.0], [0.0, 2.0]]))
    torch.testing.assert_close(root, t([[4.5], [1.0]]))
    torch.testing.assert_close(leaves, LEAVES)


def test_backup_prob_weights_children_by_softmax_of_their_split_log_probs():
    log3 = math.log(3.0)
    child_log_probs = [
        t([[0.0, 0.0], [0.0, log3]]),  # depth 1
        t([[0.0, log3, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),  # depth 2
    ]
    root, mid, _ = backup_rewards(LEAVES, PLAN, mode="prob", child_log_probs=child_log_probs)
    # prompt 0: node 0 = (1 * 1 + 3 * 3) / 4 = 2.5, node 1 = 7; root = (2.5 + 7) / 2 = 4.75
    # prompt 1: nodes 0, 2; root = (1 * 0 + 3 * 2) / 4 = 1.5
    torch.testing.assert_close(mid, t([[2.5, 7.0], [0.0, 2.0]]))
    torch.testing.assert_close(root, t([[4.75], [1.5]]))
    # equal log-probs reduce to the plain mean
    flat = [torch.zeros(2, 2), torch.zeros(2, 4)]
    for a, b in zip(backup_rewards(LEAVES, PLAN, "prob", flat), backup_rewards(LEAVES, PLAN), strict=True):
        torch.testing.assert_close(a, b)


def test_backup_validation():
    with pytest.raises(ValueError, match="leaf_rewards"):
        backup_rewards(LEAVES[:, :3], PLAN)
    with pytest.raises(ValueError, match="leaf_rewards"):
        backup_rewards(torch.tensor([[1.0, float("nan"), 0.0, 0.0]]), PLAN)
    with pytest.raises(ValueError, match="mode"):
        backup_rewards(LEAVES, PLAN, mode="max")
    with pytest.raises(ValueError, match="child_log_probs"):
        backup_rewards(LEAVES, PLAN, mode="prob")
    with pytest.raises(ValueError, match="child_log_probs"):
        backup_rewards(LEAVES, PLAN, mode="mean", child_log_probs=[torch.zeros(2, 2), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="child_log_probs"):
        backup_rewards(LEAVES, PLAN, mode="prob", child_log_probs=[torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="child_log_probs"):
        backup_rewards(LEAVES, PLAN, mode="prob", child_log_probs=[torch.zeros(2, 2), torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="P"):
        backup_rewards(LEAVES, PLAN, mode="prob", child_log_probs=[torch.zeros(1, 2), torch.zeros(1, 4)])


def test_depthwise_advantages_by_hand():
    root, mid, leaves = depthwise_advantages(backup_rewards(LEAVES, PLAN), eps=1e-12)
    torch.testing.assert_close(root, t([[0.0], [0.0]]))  # one node: 0
    torch.testing.assert_close(mid, t([[-1.0, 1.0], [-1.0, 1.0]]))  # {2, 7}: mean 4.5, population std 2.5
    # prompt 0: mean 4.5, deviations -3.5, -1.5, 0.5, 4.5, variance 35 / 4; prompt 1: mean 1, std 1
    s = math.sqrt(35 / 4)
    torch.testing.assert_close(leaves, t([[-3.5 / s, -1.5 / s, 0.5 / s, 4.5 / s], [-1.0, -1.0, 1.0, 1.0]]))
    # equal rewards carry no signal; eps keeps it finite
    torch.testing.assert_close(depthwise_advantages([torch.full((1, 4), 3.0)])[0], torch.zeros(1, 4))
    with pytest.raises(ValueError, match="eps"):
        depthwise_advantages([LEAVES], eps=0.0)
    with pytest.raises(ValueError, match="node_rewards"):
        depthwise_advantages([torch.zeros(4)])


def test_branch_sde_steps():
    assert branch_sde_steps(PLAN) == (True,) * 4
    published = BranchPlan(20, (0, 3, 6, 9))
    mix = branch_sde_steps(published, "mix")  # default window: steps 0..3, plus the splits
    assert [s for s in range(20) if mix[s]] == [0, 1, 2, 3, 6, 9]
    moved = branch_sde_steps(published, "mix", (10, 14))
    assert [s for s in range(20) if moved[s]] == [0, 3, 6, 9, 10, 11, 12, 13]
    assert branch_sde_steps(BranchPlan(2, (1,)), "mix") == (True, True)  # window clipped to T
    with pytest.raises(ValueError, match="window"):
        branch_sde_steps(PLAN, "pure", (0, 2))
    for bad in ((0, 5), (2, 2), (-1, 2)):
        with pytest.raises(ValueError, match="window"):
            branch_sde_steps(PLAN, "mix", bad)
    with pytest.raises(ValueError, match="variant"):
        branch_sde_steps(PLAN, "ode")


def test_width_prune_keeps_the_best_and_the_worst():
    adv = torch.tensor([[0.0, 3.0, -1.0, 2.0, 5.0, -4.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    # n = 6, keep 0.5: k = 3 -> the best one and the two worst
    assert width_prune(adv, 0.5).tolist() == [
        [False, False, True, False, True, True],
        [True, True, False, False, False, True],
    ]
    assert width_prune(adv, 0.1).sum(dim=1).tolist() == [2, 2]  # never fewer than 2: one best, one worst
    assert bool(width_prune(adv, 1.0).all())
    assert width_prune(torch.tensor([[7.0]]), 0.5).tolist() == [[True]]
    ties = torch.zeros(1, 4)
    assert width_prune(ties, 0.5).tolist() == [[True, False, False, True]]  # ties broken by index
    masks = {tuple(width_prune(ties, 0.5, torch.Generator().manual_seed(s))[0].tolist()) for s in range(20)}
    assert len(masks) > 1 and all(sum(m) == 2 for m in masks)  # ties broken at random with a generator
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="keep"):
            width_prune(adv, bad)
    with pytest.raises(ValueError, match="advantages"):
        width_prune(torch.zeros(4), 0.5)


def test_depth_prune_slides_the_pruned_window_toward_earlier_steps():
    plan = BranchPlan(20, (0, 3, 6, 9))

    def pruned(iteration, **kw):
        return sorted(set(range(20)) - depth_prune(plan, iteration, window=4, interval=30, **kw))

    assert pruned(0) == [16, 17, 18, 19]
    assert pruned(29) == [16, 17, 18, 19]
    assert pruned(30) == [15, 16, 17, 18]
    assert pruned(180) == [10, 11, 12, 13]  # shift 6: the window reaches the step after the last split
    assert pruned(10_000) == [10, 11, 12, 13]  # and stays there
    assert pruned(10_000, earliest=8) == [8, 9, 10, 11]
    assert depth_prune(plan, 5, window=0, interval=1) == frozenset(range(20))
    with pytest.raises(ValueError, match="window"):
        depth_prune(plan, 0, window=11, interval=1)  # only steps 10..19 may be pruned
    with pytest.raises(ValueError, match="interval"):
        depth_prune(plan, 0, window=2, interval=0)
    with pytest.raises(ValueError, match="earliest"):
        depth_prune(plan, 0, window=2, interval=1, earliest=21)
    with pytest.raises(ValueError, match="iteration"):
        depth_prune(plan, -1, window=2, interval=1)


@st.composite
def trees(draw):
    bf = draw(st.integers(2, 3))
    depth = draw(st.integers(1, 3))
    steps = draw(st.integers(depth, 12))
    splits = sorted(draw(st.sets(st.integers(0, steps - 1), min_size=depth, max_size=depth)))
    prompts = draw(st.integers(1, 3))
    plan = BranchPlan(steps, tuple(splits), bf)
    values = draw(st.lists(st.floats(-100, 100), min_size=prompts * plan.num_leaves,
                           max_size=prompts * plan.num_leaves))
    return plan, torch.tensor(values, dtype=torch.float64).reshape(prompts, plan.num_leaves)


@settings(max_examples=50, deadline=None)
@given(trees())
def test_mean_backup_root_is_the_mean_of_all_leaves(tree):
    plan, leaves = tree
    levels = backup_rewards(leaves, plan)
    assert [x.shape[1] for x in levels] == plan.nodes_per_depth()
    torch.testing.assert_close(levels[0][:, 0], leaves.mean(dim=1))


@settings(max_examples=50, deadline=None)
@given(trees(), st.integers(0, 2**31 - 1))
def test_prob_backup_stays_within_the_leaf_range(tree, seed):
    plan, leaves = tree
    g = torch.Generator().manual_seed(seed)
    log_probs = [torch.randn(leaves.shape[0], n, generator=g, dtype=torch.float64) * 3
                 for n in plan.nodes_per_depth()[1:]]
    root = backup_rewards(leaves, plan, "prob", log_probs)[0][:, 0]
    assert bool((root >= leaves.min(dim=1).values - 1e-9).all())
    assert bool((root <= leaves.max(dim=1).values + 1e-9).all())


@settings(max_examples=50, deadline=None)
@given(trees())
@example((BranchPlan(2, (0, 1), 2), torch.tensor([[90.1, 90.3, 90.2, 90.2]], dtype=torch.float64)))
def test_depthwise_advantages_have_zero_mean_per_prompt_and_depth(tree):
    """A depth whose nodes tie up to rounding (in the example the depth-1 nodes are 90.19999999999999 and 90.2)
    divides that rounding by eps=1e-6, so the mean is zero to about 1e-8, not to float64 precision; a biased
    centring would be off by O(1)."""
    plan, leaves = tree
    for adv in depthwise_advantages(backup_rewards(leaves, plan)):
        torch.testing.assert_close(adv.mean(dim=1), torch.zeros(adv.shape[0], dtype=torch.float64),
                                   atol=1e-6, rtol=0)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 3), st.integers(1, 12), st.floats(0.01, 1.0), st.integers(0, 2**31 - 1))
def test_width_prune_kept_extremes_bracket_the_pruned(prompts, n, keep, seed):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randint(-3, 4, (prompts, n), generator=g).double()  # small range: many ties
    mask = width_prune(adv, keep, g)
    k = min(n, max(2, math.floor(keep * n + 1e-9)))
    assert mask.sum(dim=1).tolist() == [k] * prompts
    for row, m in zip(adv, mask, strict=True):
        kept = row[m].sort(descending=True).values
        top, bottom, dropped = kept[: k // 2], kept[k // 2:], row[~m]
        if dropped.numel():
            assert top.numel() == 0 or bool(dropped.max() <= top.min())
            assert bool(dropped.min() >= bottom.max())
