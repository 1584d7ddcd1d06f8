import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo.grpo.losses import (
    aggregation_count,
    aggregation_weights,
    gaussian_mean_kl,
    importance_ratio,
    kl_estimate,
    ppo_clip_loss,
    reinforce_loss,
)
from mmgrpo.registry import POLICY_LOSSES

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def from_ratios(ratios):
    """logp (1, U) with grad, old_logp = 0, so that exp(logp - old_logp) = ratios."""
    logp = torch.log(t([ratios])).requires_grad_()
    return logp, torch.zeros_like(logp), torch.ones_like(logp, dtype=torch.bool)


# ---- aggregation ------------------------------------------------------------------------------------------


MASK = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]], torch.bool)


def test_aggregation_token_mean():
    close(aggregation_weights(MASK, "token-mean"), [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0], [0, 0, 0]])


def test_aggregation_seq_mean_token_mean():
    # two rows have units: row 0 -> 1/2 per unit / 2 rows, row 1 -> 1 / 2 rows
    close(aggregation_weights(MASK, "seq-mean-token-mean"), [[0.25, 0.25, 0], [0.5, 0, 0], [0, 0, 0]])


def test_aggregation_seq_mean_token_sum_norm():
    close(aggregation_weights(MASK, "seq-mean-token-sum-norm"), [[1 / 6, 1 / 6, 0], [1 / 6, 0, 0], [0, 0, 0]])
    close(aggregation_weights(MASK, "seq-mean-token-sum-norm", max_units=4), [[1 / 8, 1 / 8, 0], [1 / 8, 0, 0], [0] * 3])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("rows", [
    [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]],
    [[0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]],  # mean count 0.5: not raised to 1
], ids=["lengths", "one_unit"])
def test_aggregation_over_processes_is_the_global_mean(mode, rows):
    """Two processes with different lengths: averaging their losses, each weighted with the mean count over the
    processes (``total``), equals the loss of the whole batch on one process."""
    loss = torch.rand(4, 5)
    mask = t(rows, torch.bool)
    halves = (mask[:2], mask[2:])
    total = sum(aggregation_count(m, mode) for m in halves) / 2
    per_process = [(aggregation_weights(m, mode, 5, total=total) * l).sum() for m, l in zip(halves, loss.split(2))]
    whole = (aggregation_weights(mask, mode, 5) * loss).sum()
    close(sum(per_process) / 2, whole)


def test_aggregation_empty_mask_and_unknown_mode():
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for mode in MODES:
        w = aggregation_weights(empty, mode)
        assert w.dtype == torch.float32 and torch.equal(w, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="'mean'.*token-mean, seq-mean-token-mean, seq-mean-token-sum-norm"):
        aggregation_weights(MASK, "mean")


masks = st.integers(1, 5).flatmap(
    lambda n: st.integers(1, 6).flatmap(
        lambda u: st.lists(st.booleans(), min_size=n * u, max_size=n * u).map(lambda b: t(b, torch.bool).view(n, u))
    )
)


@settings(max_examples=50, deadline=None)
@given(masks, st.sampled_from(["token-mean", "seq-mean-token-mean"]))
def test_aggregation_weights_sum_to_one(mask, mode):
    w = aggregation_weights(mask, mode)
    if mask.any():
        assert w.sum().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.all(w[~mask] == 0)


@settings(max_examples=50, deadline=None)
@given(masks, st.sampled_from(MODES), st.data())
def test_chunked_aggregation_equals_full(mask, mode, data):
    u = mask.shape[1]
    loss = torch.randn(mask.shape, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    w = aggregation_weights(mask, mode)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, u), max_size=3)) + [0, u]))
    chunked = sum((w[:, a:b] * loss[:, a:b]).sum() for a, b in itertools.pairwise(cuts))
    assert chunked.item() == pytest.approx((w * loss).sum().item(), abs=1e-6)


# ---- importance ratio -------------------------------------------------------------------------------------


def test_token_ratio_and_masked_units_are_one():
    logp = t([[-1.0, -2.0, float("-inf")]])
    old = t([[-1.5, -1.0, -3.0]])
    mask = t([[1, 1, 0]], torch.bool)
    close(importance_ratio(logp, old, mask, "token"), [[math.exp(0.5), math.exp(-1.0), 1.0]])


def test_sequence_ratio_hand_computed():
    old = torch.zeros(2, 3)
    logp = t([[0.1, 0.3, 5.0], [-0.2, 9.0, 9.0]])  # masked units carry junk
    mask = t([[1, 1, 0], [1, 0, 0]], torch.bool)
    s0, s1 = math.exp(0.2), math.exp(-0.2)
    close(importance_ratio(logp, old, mask, "sequence"), [[s0, s0, 1.0], [s1, 1.0, 1.0]])
    with pytest.raises(ValueError, match="'seq'"):
        importance_ratio(logp, old, mask, "seq")


def test_sequence_ratio_gradient_matches_sequence_objective():
    gen = torch.Generator().manual_seed(0)
    n, u = 6, 5
    old = -torch.rand(n, u, generator=gen) * 3
    base = old + 0.3 * torch.randn(n, u, generator=gen)
    mask = torch.rand(n, u, generator=gen) < 0.7
    mask[0] = False  # a row with no units
    adv = torch.randn(n, generator=gen)
    w = aggregation_weights(mask, "seq-mean-token-mean")
    for clip, any_clipped in ((0.05, True), (10.0, False)):
        logp = base.clone().requires_grad_()
        loss, ratio, clipped = ppo_clip_loss(logp, old, adv, mask, clip_low=clip, level="sequence")
        (w * loss).sum().backward()

        direct = base.clone().requires_grad_()
        count = mask.sum(1)
        s = torch.exp(((direct - old) * mask).sum(1) / count.clamp(min=1))
        seq = -torch.minimum(s * adv, s.clamp(1 - clip, 1 + clip) * adv)
        objective = seq[count > 0].mean()
        objective.backward()

        assert (w * loss).sum().item() == pytest.approx(objective.item(), abs=1e-6)
        torch.testing.assert_close(logp.grad, direct.grad, atol=1e-6, rtol=1e-5)
        close(ratio[mask], s[:, None].expand(n, u)[mask].detach())
        assert bool(clipped.any()) == any_clipped


# ---- policy losses ----------------------------------------------------------------------------------------


def test_ppo_clip_symmetric_branches():
    logp, old, mask = from_ratios([1.5, 1.5, 0.5, 0.5, 1.1, 0.9])
    adv = t([[1.0, -1.0, 1.0, -1.0, 1.0, -1.0]])
    loss, ratio, clipped = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2)
    # -min(r A, clamp(r, 0.8, 1.2) A)
    close(loss, [[-1.2, 1.5, -0.5, 0.8, -1.1, 0.9]])
    close(ratio, [[1.5, 1.5, 0.5, 0.5, 1.1, 0.9]])
    assert clipped.tolist() == [[True, False, False, True, False, False]]
    loss.sum().backward()
    close(logp.grad, [[0.0, 1.5, -0.5, 0.0, -1.1, 0.9]])  # d(-r A)/dlogp = -r A where unclipped


def test_ppo_clip_asymmetric_clip_higher():
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    logp, old, mask = from_ratios([1.25, 1.3, 0.75, 0.85])
    loss, _, clipped = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.25, -1.28, 0.8, 0.85]])
    assert clipped.tolist() == [[False, True, True, False]]
    loss, _, clipped = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2)
    close(loss, [[-1.2, -1.2, 0.8, 0.85]])
    assert clipped.tolist() == [[True, True, True, False]]


def test_row_advantages_broadcast_and_masked_units():
    logp = t([[0.0, 0.0, float("-inf")], [0.0, 3.0, 0.0]]).requires_grad_()
    old = t([[0.0, 0.0, 0.0], [0.0, 0.0, float("nan")]])
    mask = t([[1, 1, 0], [1, 0, 0]], torch.bool)
    for fn in (ppo_clip_loss, reinforce_loss):
        loss, ratio, clipped = fn(logp, old, t([2.0, -1.0]), mask, clip_low=0.2)
        close(loss, [[-2.0, -2.0, 0.0], [1.0, 0.0, 0.0]])
        close(ratio, torch.ones(2, 3))
        assert not clipped.any()
        logp.grad = None
        loss.sum().backward()
        close(logp.grad, [[-2.0, -2.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_an_overflowed_ratio_gives_the_closed_form_not_nan(level):
    """A unit with a log-ratio of 200 nats has exp(200) = inf in fp32: with A = 0, inf * 0 made the loss NaN, and
    with A > 0 the clip's zero gradient times inf made the gradient NaN, so the whole update was skipped. The
    closed form: A = 0 gives 0 and no gradient; A > 0 above 1 + clip gives -(1 + clip) A and no gradient; the
    other units of the batch keep -r A and d/dlogp = -r A."""
    logp = t([[200.0, 200.0, math.log(1.1), math.log(0.5)], [0.0, 0.0, 0.0, 0.0]]).requires_grad_()
    old = torch.zeros(2, 4)
    mask = torch.ones(2, 4, dtype=torch.bool)
    adv = t([[0.0, 2.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]]) if level == "token" else t([0.0, -1.0])
    loss, ratio, clipped = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, level=level)
    (aggregation_weights(mask, "token-mean") * loss).sum().backward()
    if level == "token":
        close(loss, [[0.0, -2.4, -1.1, -0.5], [1.0, 1.0, 1.0, 1.0]])
        assert clipped.tolist() == [[False, True, False, False], [False] * 4] and torch.isinf(ratio[0, 0])
        close(logp.grad, t([[0.0, 0.0, -1.1, -0.5], [1.0, 1.0, 1.0, 1.0]]) / 8)
    else:  # row 0: s = exp(mean log-ratio) = exp(100 + (log 1.1 + log 0.5) / 4) = inf too, with A = 0
        close(loss, [[0.0] * 4, [1.0] * 4])
        close(logp.grad, t([[0.0] * 4, [1.0] * 4]) / 8)
    for fn in (ppo_clip_loss, reinforce_loss):  # A = 0 on the overflowed unit, unclipped on the others
        x = logp.detach().clone().requires_grad_()
        loss, _, _ = fn(x, old, t([[0.0, -1.0, 1.0, 1.0], [1.0] * 4]), mask, clip_low=1e6, level="token")
        loss.sum().backward()
        close(loss[:, [0, 2, 3]], [[0.0, -1.1, -0.5], [-1.0, -1.0, -1.0]])
        assert torch.isinf(loss[0, 1])  # A < 0 on an infinite ratio: the true loss is infinite
        close(x.grad[:, [0, 2, 3]], [[0.0, -1.1, -0.5], [-1.0, -1.0, -1.0]])


def test_reinforce_is_unclipped():
    logp, old, mask = from_ratios([3.0, 0.1])
    loss, ratio, clipped = reinforce_loss(logp, old, t([[1.0, -1.0]]), mask, clip_low=0.2, clip_high=0.2)
    close(loss, [[-3.0, 0.1]])
    close(ratio, [[3.0, 0.1]])
    assert clipped.dtype == torch.bool and not clipped.any()


def test_registered_and_called_by_keyword_in_fp32():
    logp = torch.zeros(2, 3, dtype=torch.bfloat16)
    mask = torch.ones(2, 3, dtype=torch.bool)
    for name in ("ppo_clip", "reinforce"):
        loss, ratio, clipped = POLICY_LOSSES.get(name)(
            logp=logp, old_logp=logp, advantages=torch.ones(2, dtype=torch.float64), mask=mask,
            clip_low=0.2, clip_high=None, level="sequence")
        assert loss.dtype == ratio.dtype == torch.float32 and clipped.dtype == torch.bool
    assert POLICY_LOSSES.get("ppo_clip") is ppo_clip_loss and POLICY_LOSSES.get("reinforce") is reinforce_loss


@st.composite
def policy_batch(draw, spread):
    """logp, old_logp, advantages ((N,) or (N, U)) and a mask, from a drawn seed."""
    n, u = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    old = -3 * torch.rand(n, u, generator=gen)
    logp = old + spread * torch.randn(n, u, generator=gen)
    shape = draw(st.sampled_from([(n,), (n, u)]))
    adv = torch.randn(shape, generator=gen)
    mask = torch.rand(n, u, generator=gen) < draw(st.floats(0.2, 1.0))
    return logp, old, adv, mask


@settings(max_examples=50, deadline=None)
@given(policy_batch(spread=0.0), st.sampled_from(["token", "sequence"]), st.sampled_from(MODES),
       st.floats(0.01, 0.5), st.one_of(st.none(), st.floats(0.01, 0.5)))
def test_ppo_gradient_equals_reinforce_on_policy(batch, level, mode, clip_low, clip_high):
    logp, old, adv, mask = batch
    w = aggregation_weights(mask, mode)
    grads = []
    for fn in (ppo_clip_loss, reinforce_loss):
        x = logp.clone().requires_grad_()
        loss, ratio, clipped = fn(x, old, adv, mask, clip_low=clip_low, clip_high=clip_high, level=level)
        (w * loss).sum().backward()
        grads.append(x.grad)
        assert torch.equal(ratio, torch.ones_like(ratio)) and not clipped.any()
    torch.testing.assert_close(grads[0], grads[1], atol=1e-7, rtol=1e-6)


@settings(max_examples=50, deadline=None)
@given(policy_batch(spread=0.5), st.sampled_from(["token", "sequence"]), st.floats(0.01, 0.5),
       st.one_of(st.none(), st.floats(0.01, 0.5)))
def test_clipped_units_have_zero_gradient(batch, level, clip_low, clip_high):
    logp, old, adv, mask = batch
    x = logp.clone().requires_grad_()
    loss, _, clipped = ppo_clip_loss(x, old, adv, mask, clip_low=clip_low, clip_high=clip_high, level=level)
    loss.sum().backward()
    assert torch.all(x.grad[clipped] == 0)
    assert torch.all(x.grad[~mask] == 0)


# ---- KL ---------------------------------------------------------------------------------------------------


def test_kl_estimators_hand_computed():
    logp, ref = t([[0.0, -1.0, -2.0]]), t([[-0.5, -1.0, -1.0]])  # d = ref - logp = -0.5, 0, 1
    close(kl_estimate(logp, ref, "k1"), [[0.5, 0.0, -1.0]])
    close(kl_estimate(logp, ref, "k2"), [[0.125, 0.0, 0.5]])
    close(kl_estimate(logp, ref, "k3"), [[math.exp(-0.5) - 0.5, 0.0, math.e - 2]])
    with pytest.raises(ValueError, match="'low_var'.*k1, k2, k3"):
        kl_estimate(logp, ref, "low_var")


def test_k1_and_k3_are_unbiased_for_a_categorical():
    p = t([0.5, 0.3, 0.2])
    q = t([0.2, 0.2, 0.6])
    exact = (p * (p / q).log()).sum()
    for kind in ("k1", "k3"):  # expectation over x ~ p
        expected = (p * kl_estimate(p.log()[None], q.log()[None], kind)[0]).sum()
        assert expected.item() == pytest.approx(exact.item(), abs=1e-6)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=1, max_size=8), st.integers(0, 999))
def test_k3_nonnegative_and_close_to_k2_for_small_differences(logp, seed):
    logp = t([logp])
    ref = logp + torch.empty_like(logp).uniform_(-15, 15, generator=torch.Generator().manual_seed(seed))
    assert torch.all(kl_estimate(logp, ref, "k3") >= 0)
    near = logp + 0.01 * torch.rand(logp.shape, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(kl_estimate(logp, near, "k3"), kl_estimate(logp, near, "k2"), rtol=0.02, atol=1e-6)


def test_gaussian_mean_kl():
    ref = torch.zeros(2, 2, 2)
    mean = t([[[1.0, 1.0], [1.0, 1.0]], [[0.0, 1.0], [2.0, 3.0]]])
    # per element d^2 / (2 std^2); row 0: 1 / 0.5 = 2; row 1 at std 1: (0 + 0.5 + 2 + 4.5) / 4 = 1.75
    close(gaussian_mean_kl(mean, ref, t([0.5, 1.0]).view(2, 1, 1)), [2.0, 1.75])
    close(gaussian_mean_kl(mean, ref, 1.0), [0.5, 1.75])
    close(gaussian_mean_kl(mean.double(), ref, torch.tensor(2.0)), [0.125, 1.75 / 4])
