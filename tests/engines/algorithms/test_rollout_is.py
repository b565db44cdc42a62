"""Rollout-trainer mismatch correction: the IS weights and metrics against slow loops and hand-worked cases, and
on a tiny causal LM whose rollout copy has perturbed weights, the corrected policy gradient is closer to the exact
on-policy gradient than the uncorrected one. Every expectation is exact (all responses enumerated), so the
comparison has no sampling noise. CPU, in-process, seconds.
"""

import itertools
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlstages.engines.algorithms import (
    PolicyLossParams,
    logprobs_from_logits,
    mismatch_metrics,
    policy_loss,
    rollout_is_weights,
)

torch.set_num_threads(1)
B, T = 6, 5


def close(actual, expected, atol=1e-5, rtol=1e-4):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected, dtype=torch.float64),
                               atol=atol, rtol=rtol)  # fmt: skip


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[2] = 0.0
    rollout = -torch.rand(B, T, generator=g) * 3
    old = rollout + 0.5 * torch.randn(B, T, generator=g)
    return old, rollout, mask


def loop_weights(old, rollout, mask, level, mode, cap, lower):
    """Weights, ratio list and clipped list, from the definitions."""
    w = [[0.0] * T for _ in range(B)]
    ratios, clipped = [], []
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t]]
        if level == "token":
            units = [(math.exp(float(old[i, t] - rollout[i, t])), [t]) for t in valid]
        else:
            units = [(math.exp(sum(float(old[i, t] - rollout[i, t]) for t in valid)), valid)] if valid else []
        for rho, ts in units:
            ratios.append(rho)
            if mode == "truncate":
                value, cut = min(rho, cap), rho > cap
            else:
                inside = lower <= rho <= cap
                value, cut = (rho if inside else 0.0), not inside
            clipped.append(cut)
            for t in ts:
                w[i][t] = value
    return w, ratios, clipped


@pytest.mark.parametrize("seed", (0, 1, 2))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_weights_and_metrics_match_loop(seed, level, mode):
    old, rollout, mask = batch(seed)
    cap, lower = (1.5, 0.6) if level == "token" else (2.5, 0.6)  # a sequence ratio multiplies T token ratios
    weights, metrics = rollout_is_weights(old, rollout, mask, level, mode, cap, lower)
    w, ratios, clipped = loop_weights(old, rollout, mask, level, mode, cap, lower)
    close(weights, torch.tensor(w))
    close(metrics["ratio_mean"], sum(ratios) / len(ratios))
    close(metrics["ratio_max"], max(ratios))
    close(metrics["ratio_min"], min(ratios))
    close(metrics["clipped_fraction"], sum(clipped) / len(clipped))
    assert 0 < float(metrics["clipped_fraction"]) < 1  # the case has ratios on both sides of the bound
    assert not weights.requires_grad


def test_hand_worked_weights():
    """Token log-ratios (log 3, log 0.5, 0): truncate at 2 -> (2, 0.5, 1); mask [0.5, 2] -> (0, 0.5, 1);
    sequence: rho = 1.5 on every token for both modes."""
    old = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]])
    rollout, mask = torch.zeros(1, 3), torch.ones(1, 3)
    close(rollout_is_weights(old, rollout, mask, "token", "truncate", 2.0)[0], [[2.0, 0.5, 1.0]])
    close(rollout_is_weights(old, rollout, mask, "token", "mask", 2.0)[0], [[0.0, 0.5, 1.0]])
    close(rollout_is_weights(old, rollout, mask, "sequence", "truncate", 2.0)[0], [[1.5, 1.5, 1.5]])
    close(rollout_is_weights(old, rollout, mask, "sequence", "mask", 2.0)[0], [[1.5, 1.5, 1.5]])
    m = mismatch_metrics(old, rollout, mask)
    d = [math.log(3.0), math.log(0.5), 0.0]
    close(m["kl"], -sum(d) / 3)
    close(m["k3_kl"], sum(math.exp(x) - 1 - x for x in d) / 3)
    close(m["logprob_abs_diff"], sum(map(abs, d)) / 3)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_empty_mask_gives_zero_weights_and_finite_metrics(level, mode):
    old, rollout, _ = batch(0)
    weights, metrics = rollout_is_weights(old, rollout, torch.zeros(B, T), level, mode)
    assert torch.equal(weights, torch.zeros(B, T))
    assert all(math.isfinite(float(v)) for v in metrics.values())
    assert all(math.isfinite(float(v)) for v in mismatch_metrics(old, rollout, torch.zeros(B, T)).values())


def test_bad_settings_are_refused():
    old, rollout, mask = batch(0)
    with pytest.raises(ValueError, match="level 'tokens'"):
        rollout_is_weights(old, rollout, mask, "tokens")
    with pytest.raises(ValueError, match="mode 'clip'"):
        rollout_is_weights(old, rollout, mask, "token", "clip")
    with pytest.raises(ValueError, match="lower <= 1 <= cap"):
        rollout_is_weights(old, rollout, mask, "token", "mask", 2.0, 1.5)


# ---------- the correction reduces the gradient's bias on a tiny LM with perturbed rollout weights --------

VOCAB, PROMPT, LENGTH = 6, [1, 2], 3


def tiny_lm(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)  # fmt: skip
    return Qwen2ForCausalLM(config).float().eval()


def response_logprobs(model: Qwen2ForCausalLM, responses: torch.Tensor) -> torch.Tensor:
    """[N, LENGTH] log-probs of every response token given the fixed prompt."""
    ids = torch.cat([torch.tensor(PROMPT).expand(len(responses), -1), responses], dim=1)
    logits = model(input_ids=ids).logits[:, len(PROMPT) - 1 : -1].float()
    return logprobs_from_logits(logits, responses)


def expected_gradient(model, responses, reward, sample_logp, weights) -> torch.Tensor:
    """E_{y ~ sampler}[gradient of the on-policy loss with IS weights], summed exactly over all responses: the
    policy loss is linear in A at ratio 1, so A = p_sampler(y) * R(y) with token-sum aggregation is that sum."""
    model.zero_grad()
    logp = response_logprobs(model, responses)
    p = torch.exp(sample_logp.sum(-1)).unsqueeze(-1)
    params = PolicyLossParams(loss_agg_mode="token-sum", clip_ratio_c=None)
    loss, _ = policy_loss(logp.detach(), logp, p * reward, torch.ones_like(logp), params, rollout_is_weights=weights)
    loss.backward()
    return torch.cat([q.grad.flatten() for q in model.parameters() if q.grad is not None])


def test_is_correction_reduces_policy_gradient_bias_against_exact_on_policy():
    trainer = tiny_lm(0)
    rollout = tiny_lm(0)
    with torch.no_grad():  # the rollout engine's weights differ (other kernels, bf16, one update old)
        g = torch.Generator().manual_seed(1)
        for q in rollout.parameters():
            q.add_(0.15 * torch.randn(q.shape, generator=g))
    responses = torch.tensor(list(itertools.product(range(VOCAB), repeat=LENGTH)))
    reward = (responses == 3).float().sum(-1, keepdim=True) - 0.5  # a dense reward, nonzero mean
    with torch.no_grad():
        trainer_logp = response_logprobs(trainer, responses)
        rollout_logp = response_logprobs(rollout, responses)
    assert torch.allclose(torch.exp(rollout_logp.sum(-1)).sum(), torch.tensor(1.0), atol=1e-4)  # all enumerated
    mismatch = mismatch_metrics(trainer_logp, rollout_logp, torch.ones_like(trainer_logp))
    assert float(mismatch["k3_kl"]) > 0.01  # a real mismatch

    exact = expected_gradient(trainer, responses, reward, trainer_logp, None)
    biased = expected_gradient(trainer, responses, reward, rollout_logp, None)
    mask = torch.ones_like(trainer_logp)

    def error(level, mode, cap):
        w, _ = rollout_is_weights(trainer_logp, rollout_logp, mask, level, mode, cap)
        return float((expected_gradient(trainer, responses, reward, rollout_logp, w) - exact).norm())

    bias = float((biased - exact).norm())
    assert bias > 0.05 * float(exact.norm())  # the perturbation matters
    assert error("sequence", "truncate", 1e6) < 1e-3 * bias  # untruncated sequence IS is exact in expectation
    for level, mode, cap in [("token", "truncate", 2.0), ("sequence", "truncate", 2.0), ("token", "mask", 2.0)]:
        assert error(level, mode, cap) < 0.7 * bias, (level, mode)


def test_actor_loss_applies_the_micro_batchs_weights():
    """`ppo_step.actor_loss` (what every trainer calls) multiplies in `rollout_is_weights` when the batch has them."""
    from tensordict import TensorDict

    from rlstages.engines import types as TY
    from rlstages.engines.training.ppo_step import actor_loss, global_counts

    old, rollout, mask = batch(0)
    g = torch.Generator().manual_seed(3)
    logp, adv = old + 0.1 * torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    mb = TensorDict({TY.RESPONSE_MASK: mask, TY.OLD_LOGPROBS: old, TY.ADVANTAGES: adv}, batch_size=[B])
    params, norm = PolicyLossParams(), global_counts(mb)
    plain, _ = actor_loss(logp, torch.zeros(B, T), mb, params, norm, False)
    weights, _ = rollout_is_weights(old, rollout, mask)
    mb[TY.ROLLOUT_IS_WEIGHTS] = weights
    weighted, _ = actor_loss(logp, torch.zeros(B, T), mb, params, norm, False)
    close(weighted, policy_loss(old, logp, adv, mask, params, **norm, rollout_is_weights=weights)[0])
    assert not torch.allclose(weighted, plain)


def test_advantage_stage_writes_weights_and_mismatch_metrics():
    from tensordict import TensorDict

    from rlstages.configs.algorithm import RolloutISConfig
    from rlstages.engines import types as TY
    from rlstages.tasks.advantage import rollout_correction

    old, rollout, mask = batch(1)
    fields = {TY.RESPONSE_MASK: mask, TY.OLD_LOGPROBS: old, TY.ROLLOUT_LOGPROBS: rollout}
    off = TensorDict(dict(fields), batch_size=[B])
    metrics = rollout_correction(off, RolloutISConfig())
    assert TY.ROLLOUT_IS_WEIGHTS not in off.keys() and set(metrics) == {
        "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/logprob_abs_diff"}  # fmt: skip
    on = TensorDict(dict(fields), batch_size=[B])
    metrics = rollout_correction(on, RolloutISConfig(level="sequence", threshold=2.5))
    close(on[TY.ROLLOUT_IS_WEIGHTS], rollout_is_weights(old, rollout, mask, "sequence", "truncate", 2.5)[0])
    assert metrics["rollout_corr/is_ratio_max"] > 1 and 0 < metrics["rollout_corr/is_clipped_fraction"] < 1
    assert rollout_correction(TensorDict({TY.RESPONSE_MASK: mask}, batch_size=[B]), RolloutISConfig()) == {}
