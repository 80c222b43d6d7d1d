"""The loss's pieces on tiny tensors computed by hand: on-policy GRPO is minus the mean
advantage, PPO's clip at both sides (and clip-higher), the decoupled weight and its cap,
the k3 KL, and the group-normalised advantage."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from pearl.trainer.loss import (  # noqa: E402
    behaviour_weights,
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    k3_kl,
)

T = torch.tensor


def _close(a: object, b: object, tol: float = 1e-6) -> bool:
    return bool(torch.allclose(torch.as_tensor(a).float(), torch.as_tensor(b).float(), atol=tol))


# -- advantages --------------------------------------------------------------------------


def test_group_advantages_centre_and_scale_within_each_group() -> None:
    rewards = T([1.0, 0.0, 1.0, 0.0, 3.0, 3.0])
    groups = T([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, torch.ones(6, dtype=torch.bool))
    std = math.sqrt(4 * 0.25 / 3)  # the unbiased std of [1, 0, 1, 0]
    expected = [0.5 / (std + 1e-5), -0.5 / (std + 1e-5)] * 2 + [0.0, 0.0]
    assert _close(adv, expected)


def test_an_invalid_member_is_left_out_of_its_group_and_gets_zero() -> None:
    rewards, groups = T([1.0, 0.0, 5.0]), T([0, 0, 0])
    valid = T([True, True, False])
    adv = group_advantages(rewards, groups, valid)
    half = 0.5 / (math.sqrt(0.5) + 1e-5)  # [1, 0]: mean 0.5, unbiased std sqrt(0.5)
    assert _close(adv, [half, -half, 0.0])
    assert _close(group_advantages(rewards, groups, valid, scale_by_std=False), [0.5, -0.5, 0.0])
    # one valid member: nothing to compare with
    assert _close(group_advantages(T([7.0, 2.0]), T([0, 0]), T([True, False])), [0.0, 0.0])


# -- the clipped surrogate ---------------------------------------------------------------


def test_on_policy_loss_is_minus_the_mean_advantage_over_the_loss_mask() -> None:
    lp = T([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])
    adv = T([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    mask = T([[False, True, True], [False, False, True]])
    for proximal in (None, lp.clone()):  # plain GRPO, and decoupled with prox = behaviour
        parts = grpo_loss(lp, lp, adv, mask, num_tokens=3, eps_clip=0.2, proximal_logprobs=proximal)
        assert _close(parts.loss, -(1.0 + 1.0 - 0.5) / 3)
        assert (parts.loss_tokens, parts.kept_tokens, parts.clipped_tokens) == (3, 3, 0)
        assert _close(parts.weight_sum, 3.0)


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "clipped"),
    [
        pytest.param(1.5, 1.0, -1.2, True, id="above-positive-adv-clipped"),
        pytest.param(1.5, -1.0, 1.5, False, id="above-negative-adv-not-clipped"),
        pytest.param(0.5, -1.0, 0.8, True, id="below-negative-adv-clipped"),
        pytest.param(0.5, 1.0, -0.5, False, id="below-positive-adv-not-clipped"),
        pytest.param(1.1, 1.0, -1.1, False, id="inside"),
    ],
)
def test_the_clip_at_both_sides(ratio: float, adv: float, loss: float, clipped: bool) -> None:
    lp = torch.tensor([math.log(ratio)], requires_grad=True)
    per_token, was_clipped = clipped_surrogate(lp, T([0.0]), T([adv]), eps_clip=0.2)
    assert _close(per_token, [loss], 1e-5) and bool(was_clipped[0]) is clipped
    per_token.sum().backward()
    assert lp.grad is not None
    assert (float(lp.grad[0]) == 0.0) is clipped  # a clipped token pushes nothing


def test_clip_higher_widens_only_the_upper_side() -> None:
    ratios = T([1.5, 0.5])
    per_token, clipped = clipped_surrogate(
        ratios.log(), T([0.0, 0.0]), T([1.0, -1.0]), eps_clip=0.2, eps_clip_high=0.28
    )
    assert _close(per_token, [-1.28, 0.8], 1e-5) and clipped.tolist() == [True, True]


# -- the decoupled loss ------------------------------------------------------------------


def test_the_behaviour_weight_and_its_cap() -> None:
    prox = T([[0.0, 0.0, 0.0, 0.0]])
    behav = T([[0.0, -math.log(2.0), -math.log(6.0), math.log(4.0)]])
    mask = T([[True, True, True, False]])
    weight, kept = behaviour_weights(prox, behav, mask, cap=5.0)
    assert _close(weight, [[1.0, 2.0, 0.0, 0.0]], 1e-5)  # 6 > cap: masked; outside the mask: 0
    assert kept.tolist() == [[True, True, False, False]]
    weight, kept = behaviour_weights(prox, behav, mask, cap=None)
    assert _close(weight, [[1.0, 2.0, 6.0, 0.0]], 1e-5)
    # in the loss: ratio 1 against the proximal policy, each term times its weight; the
    # denominator counts the capped token too (AReaL's)
    adv = T([[1.0, 1.0, 1.0, 1.0]])
    parts = grpo_loss(
        prox, behav, adv, mask, num_tokens=3, eps_clip=0.2, proximal_logprobs=prox,
        behav_imp_weight_cap=5.0,
    )  # fmt: skip
    assert _close(parts.loss, -(1.0 + 2.0) / 3, 1e-5)
    assert (parts.loss_tokens, parts.kept_tokens) == (3, 2) and _close(parts.weight_sum, 3.0, 1e-5)


def test_the_ratio_is_against_the_proximal_policy_when_decoupled() -> None:
    lp = T([[math.log(1.5)]])  # the current policy
    prox, behav = T([[0.0]]), T([[math.log(1.5)]])  # behaviour = current: plain ratio 1
    mask, adv = T([[True]]), T([[1.0]])
    plain = grpo_loss(lp, behav, adv, mask, num_tokens=1, eps_clip=0.2)
    assert _close(plain.loss, -1.0, 1e-5) and plain.clipped_tokens == 0
    decoupled = grpo_loss(lp, behav, adv, mask, num_tokens=1, eps_clip=0.2, proximal_logprobs=prox)
    # ratio 1.5 to the proximal policy, clipped at 1.2, times weight exp(0 - log 1.5)
    assert _close(decoupled.loss, -1.2 / 1.5, 1e-5) and decoupled.clipped_tokens == 1


# -- KL ----------------------------------------------------------------------------------


def test_k3_kl_is_zero_at_equal_policies_and_positive_elsewhere() -> None:
    lp = T([-1.0, -2.0, -0.1])
    assert _close(k3_kl(lp, lp), [0.0, 0.0, 0.0])
    assert _close(k3_kl(T([0.0]), T([math.log(2.0)])), [1.0 - math.log(2.0)], 1e-6)
    assert bool((k3_kl(lp, T([-0.5, -3.0, -2.0])) > 0).all())


def test_the_kl_term_is_added_with_its_coefficient() -> None:
    lp, ref = T([[0.0, 0.0]]), T([[math.log(2.0), 0.0]])
    mask, adv = T([[True, True]]), T([[0.0, 0.0]])
    parts = grpo_loss(lp, lp, adv, mask, num_tokens=2, eps_clip=0.2, ref_logprobs=ref, kl_coef=0.5)
    assert _close(parts.loss, 0.5 * (1.0 - math.log(2.0)) / 2, 1e-6)
    assert _close(parts.kl_sum, 1.0 - math.log(2.0), 1e-6)


def test_microbatches_add_up_to_the_minibatch_token_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    lp, behav = torch.randn(4, 5, generator=gen), torch.randn(4, 5, generator=gen)
    adv = torch.randn(4, 1, generator=gen).expand(4, 5)
    mask = torch.rand(4, 5, generator=gen) > 0.3
    n = int(mask.sum())
    whole = grpo_loss(lp, behav, adv, mask, num_tokens=n, eps_clip=0.2, proximal_logprobs=lp)
    halves = [
        grpo_loss(lp[s], behav[s], adv[s], mask[s], num_tokens=n, eps_clip=0.2,
                  proximal_logprobs=lp[s])
        for s in (slice(0, 2), slice(2, 4))
    ]  # fmt: skip
    assert _close(whole.loss, halves[0].loss + halves[1].loss, 1e-6)
