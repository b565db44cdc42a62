"""The decoupled PPO objective (engines/algorithms/decoupled.py): exactly PPO when the behaviour policy is the
proximal one, also when the trajectories' tokens come from several policy versions; otherwise PPO's per-token loss
times the truncated pi_prox / pi_behav weight, by hand, values and gradients. CPU, seconds."""

import pytest
import torch

from rlstages.engines.algorithms import PolicyLossParams, decoupled_policy_loss, policy_loss

torch.set_num_threads(1)
B, T = 6, 7


def mixed_version_batch(seed: int):
    """A batch whose rows switch policy version mid-sequence (partial rollouts across 0-2 weight updates): the
    behaviour log-prob of each token is that token's version's; proximal = behaviour token by token."""
    g = torch.Generator().manual_seed(seed)
    versions = torch.sort(torch.randint(0, 3, (B, T), generator=g), dim=1).values  # non-decreasing along a row
    per_version = -torch.rand(3, B, T, generator=g, dtype=torch.float64) * 3  # log pi_v(y_t) of each version
    behaviour = per_version.gather(0, versions.unsqueeze(0)).squeeze(0)
    mask = (torch.rand(B, T, generator=g) > 0.2).double()
    mask[3] = 0.0
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    logp = (behaviour + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    return versions, behaviour, mask, adv, logp


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_equals_the_loss_itself_when_behaviour_is_proximal(name: str, agg: str) -> None:
    versions, behaviour, mask, adv, logp = mixed_version_batch(1)
    assert len(versions.unique()) == 3 and any(len(row.unique()) > 1 for row in versions)  # mixed rows
    params = PolicyLossParams(name=name, loss_agg_mode=agg)
    proximal = behaviour.clone()
    loss, metrics = decoupled_policy_loss(proximal, behaviour, logp, adv, mask, params, cap=2.0)
    (grad,) = torch.autograd.grad(loss, logp)
    ref, ref_metrics = policy_loss(proximal, logp, adv, mask, params)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert torch.equal(loss, ref) and torch.equal(grad, ref_grad)  # bitwise: w == 1 exactly
    assert float(metrics["behav_weight_mean"]) == pytest.approx(1.0) and float(metrics["behav_clipped_fraction"]) == 0.0
    assert torch.equal(metrics["pg_clipfrac"], ref_metrics["pg_clipfrac"])


def test_weights_ppo_by_the_truncated_behaviour_ratio() -> None:
    """Behaviour from stale versions, proximal = the trainer's: PPO-clip on pi/pi_prox times
    min(pi_prox/pi_behav, c)."""
    _, behaviour, mask, adv, logp = mixed_version_batch(2)
    g = torch.Generator().manual_seed(3)
    proximal = behaviour + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)
    cap, params = 1.5, PolicyLossParams(clip_ratio_c=None)
    loss, metrics = decoupled_policy_loss(proximal, behaviour, logp, adv, mask, params, cap=cap)
    ratio = torch.exp(logp - proximal)
    ppo = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    w = torch.exp(proximal - behaviour).clamp(max=cap)
    expected = (ppo * w * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, logp)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(grad, expected_grad)
    assert 0 < float(metrics["behav_clipped_fraction"]) < 1  # some tokens truncated, not all


def test_the_weight_is_about_behaviour_not_the_ratio_centre() -> None:
    """Naive PPO on stale samples centres the clip on pi_behav; the decoupled loss centres it on pi_prox: with
    pi_theta == pi_prox every token sits inside the clip band, whatever the behaviour policy was."""
    _, behaviour, mask, adv, _ = mixed_version_batch(4)
    proximal = behaviour - 1.0  # the policy moved far from the one that sampled
    logp = proximal.clone().requires_grad_()
    params = PolicyLossParams()
    _, decoupled = decoupled_policy_loss(proximal, behaviour, logp, adv, mask, params, cap=5.0)
    _, naive = policy_loss(behaviour, logp, adv, mask, params)
    assert float(decoupled["pg_clipfrac"]) == 0.0 and float(naive["pg_clipfrac"]) > 0.2
