"""Objectives against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rollart.training.algorithms import (
    PolicyLossConfig,
    group_advantages,
    informative_groups,
    masked_mean,
    old_logprobs,
    policy_loss,
    proximal_logprobs,
)


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0])
    groups = ["a", "a", "a", "a", "b", "b"]
    adv = group_advantages(rewards, groups, "group", eps=0.0 + 1e-12)
    # group a: mean 0.5, std 0.5 -> [1, -1, 1, -1]; group b: all equal -> 0
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, 0.0]), atol=1e-5)
    assert torch.allclose(group_advantages(rewards, groups, "group_mean"),
                          torch.tensor([0.5, -0.5, 0.5, -0.5, 0.0, 0.0]))
    batch = group_advantages(torch.tensor([1.0, 3.0]), ["x", "y"], "batch", eps=0.0)
    assert torch.allclose(batch, torch.tensor([-1.0, 1.0]))
    assert informative_groups(rewards.tolist(), groups) == {"a"}


def test_a_group_of_equal_rewards_has_advantage_exactly_zero_under_every_norm():
    """Eight rewards of 0.1: their float mean is an ulp off 0.1, so centring alone leaves ~1e-9, and
    over the std (0) + eps that was an advantage of ~1e-3 on every member."""
    rewards = torch.full((8,), 0.1)
    assert float((rewards - rewards.mean()).abs().max()) > 0, "the float rounding this guards against"
    for norm in ("group", "group_mean", "batch"):
        assert group_advantages(rewards, ["g"] * 8, norm).abs().max() == 0.0, norm


def test_clipped_objective_by_hand():
    cfg = PolicyLossConfig(algorithm="grpo", clip_low=0.2, clip_high=0.2)
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.5, 0.8, 0.2]]))  # ratios 1.0, 1.6, 0.4
    mask = torch.tensor([[1, 1, 1]])
    loss, metrics = policy_loss(new, old, torch.tensor([1.0]), mask, cfg)
    # A = +1: min(r, clip(r)) = 1.0, 1.2, 0.4 -> loss = -(1.0 + 1.2 + 0.4) / 3
    assert math.isclose(float(loss), -(1.0 + 1.2 + 0.4) / 3, rel_tol=1e-5)
    assert math.isclose(metrics["clip_fraction"], 1 / 3, rel_tol=1e-5)
    loss_neg, _ = policy_loss(new, old, torch.tensor([-1.0]), mask, cfg)
    # A = -1: -min(-r, -clip(r)) = max(r, clip(r)) = 1.0, 1.6, 0.8
    assert math.isclose(float(loss_neg), (1.0 + 1.6 + 0.8) / 3, rel_tol=1e-5)


def test_dual_clip_bounds_a_negative_advantage_past_ratio_c():
    """Ratios 1.6, 5 and 8 under A = -1: the first keeps its (unclipped) gradient, the two past c = 3 lose
    theirs and weigh c; a positive advantage is untouched; ``dual_clip=None`` leaves the plain objective."""
    old = torch.log(torch.tensor([[0.1, 0.1, 0.1]]))
    new = torch.log(torch.tensor([[0.16, 0.5, 0.8]])).requires_grad_()
    mask = torch.tensor([[1, 1, 1]])
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    loss, metrics = policy_loss(new, old, torch.tensor([-1.0]), mask, cfg)
    assert math.isclose(float(loss), (1.6 + 3.0 + 3.0) / 3, rel_tol=1e-5)
    assert math.isclose(metrics["dual_clip_fraction"], 2 / 3, rel_tol=1e-5)
    assert math.isclose(metrics["ratio_max"], 8.0, rel_tol=1e-5)
    loss.backward()
    assert new.grad[0, 0] > 0 and new.grad[0, 1:].tolist() == [0.0, 0.0]
    plain, _ = policy_loss(new, old, torch.tensor([-1.0]), mask, PolicyLossConfig(clip_low=0.2, clip_high=0.2,
                                                                                  dual_clip=None))
    assert math.isclose(float(plain), (1.6 + 5.0 + 8.0) / 3, rel_tol=1e-5)
    positive, metrics = policy_loss(new, old, torch.tensor([1.0]), mask, cfg)
    assert math.isclose(float(positive), -1.2, rel_tol=1e-5) and metrics["dual_clip_fraction"] == 0.0


def test_mask_excludes_prompt_and_env_tokens_and_gradients_flow_only_there():
    cfg = PolicyLossConfig(algorithm="reinforce")
    logprobs = torch.tensor([[-1.0, -2.0, -3.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 0, 1]])
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([2.0]), mask, cfg)
    assert math.isclose(float(loss), -2.0 * (-2.0 - 4.0) / 2)
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0, -1.0, 0.0, -1.0]]


def test_decoupled_importance_weight_and_kl():
    cfg = PolicyLossConfig(decoupled=True, clip_low=0.2, clip_high=0.2, kl_coef=0.5, importance_cap=10)
    behaviour = torch.log(torch.tensor([[0.25]]))
    proximal = torch.log(torch.tensor([[0.5]]))
    new = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    loss, metrics = policy_loss(new, proximal, torch.tensor([1.0]), torch.tensor([[1]]), cfg,
                                behaviour_logprobs=behaviour, ref_logprobs=ref)
    # ratio to proximal 1 -> -1 * A; weight exp(prox - behaviour) = 2 -> -2; k3 with diff = ln(0.5):
    k3 = 0.5 - math.log(0.5) - 1
    assert math.isclose(float(loss), -2.0 + 0.5 * k3, rel_tol=1e-5)
    assert math.isclose(metrics["importance_weight_mean"], 2.0, rel_tol=1e-5)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        policy_loss(new, proximal, torch.tensor([1.0]), torch.tensor([[1]]), cfg)


def test_the_proximal_policy_is_one_version_back_exact_at_staleness_zero_and_one():
    current = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-3.0, -3.0, -3.0, -5.0]])
    staleness = torch.tensor([[0, 1, 2, 4]])
    # s=0: only the current policy is known; s=1: the behaviour policy is the version before;
    # s=2: halfway in log space between behaviour and current; s=4: three quarters of the way
    assert proximal_logprobs(current, behaviour, staleness).tolist() == [[-1.0, -3.0, -2.0, -2.0]]
    assert old_logprobs(PolicyLossConfig(decoupled=False), current, behaviour, staleness) is behaviour


def test_decoupled_clip_binds_on_tokens_the_last_step_already_moved():
    """Staleness 1, one optimiser step per batch: a token whose probability the previous step raised past
    the clip (ratio 1.5 > 1.28) gets no more push from a positive advantage; on-policy it would."""
    cfg = PolicyLossConfig(decoupled=True)
    behaviour = torch.log(torch.tensor([[0.4, 0.4]]))
    current = torch.log(torch.tensor([[0.6, 0.42]])).requires_grad_()
    mask = torch.tensor([[1, 1]])
    old = old_logprobs(cfg, current, behaviour, torch.tensor([[1, 1]]))
    loss, metrics = policy_loss(current, old, torch.tensor([1.0]), mask, cfg, behaviour_logprobs=behaviour)
    loss.backward()
    assert current.grad[0, 0] == 0.0, "moved past 1 + clip_high by the last step: clipped"
    assert current.grad[0, 1] < 0.0, "ratio 1.05: still inside the trust region"
    assert metrics["clip_fraction"] == 0.5
    assert metrics["importance_weight_mean"] == 1.0, "the proximal policy is the behaviour at staleness 1"
    on_policy = current.detach().clone().requires_grad_()
    old = old_logprobs(cfg, on_policy, behaviour, torch.tensor([[0, 0]]))
    loss, _ = policy_loss(on_policy, old, torch.tensor([1.0]), mask, cfg, behaviour_logprobs=behaviour)
    loss.backward()
    assert bool((on_policy.grad < 0).all()), "staleness 0: ratio 1, nothing clipped"


def test_token_mean_versus_sequence_mean():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert math.isclose(float(masked_mean(values, mask, token_mean=True)), 7 / 5, rel_tol=1e-6)
    assert math.isclose(float(masked_mean(values, mask, token_mean=False)), (1 + 3) / 2)


@pytest.mark.parametrize("token_mean", [True, False])
def test_a_short_failure_moves_the_groups_shared_prefix_only_under_sequence_mean(token_mean):
    """The late collapse's mechanism (README, "Late collapse"): a near-deterministic policy succeeds in 7
    of 8 trajectories of 7 turns; the 8th takes a rare action at turn 3 and falls in a hole. The first two
    actions are the same in all 8 (one shared logprob here). Under the group-mean advantage (Dr. GRPO) the
    advantages sum to 0 over the group, so with every token weighed the same (token_mean) the shared
    actions get no gradient. Averaging per trajectory first (sequence_mean) weighs the short failure's
    tokens 7/3 as much as a success's: the step pushes the shared, correct actions down."""
    shared = torch.tensor(-0.01, requires_grad=True)  # log p of the shared first two actions
    lengths = [7] * 7 + [3]
    logprobs = torch.stack([torch.cat([shared.expand(2), torch.full((6,), -0.01)]) for _ in lengths])
    mask = torch.tensor([[1.0] * n + [0.0] * (8 - n) for n in lengths])
    rewards = torch.tensor([1.0] * 7 + [0.0])
    advantages = group_advantages(rewards, ["g"] * 8, "group_mean")
    cfg = PolicyLossConfig(algorithm="grpo", token_mean=token_mean, dual_clip=None)
    loss, _ = policy_loss(logprobs, logprobs.detach(), advantages, mask, cfg)
    loss.backward()
    # gradient descent moves `shared` by -grad: a positive gradient lowers the shared actions' probability
    expected = 0.0 if token_mean else (0.875 / 3 - 7 * 0.125 / 7) * 2 / 8  # two shared tokens, mean of 8 rows
    assert float(shared.grad) == pytest.approx(expected, abs=1e-6)
