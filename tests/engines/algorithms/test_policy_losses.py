"""The policy losses selectable by name (GSPO, CISPO, Clip-Cov, KL-Cov), token-sum aggregation and the rollout IS
weights inside `policy_loss`: each against a slow Python loop written from the paper's formula, hand-worked
cases, gradients, and the empty-mask policy (finite, zero). CPU, one thread, seconds.
"""

import math

import pytest
import torch

from rlstages.engines.algorithms import LOSS_AGG_MODES, POLICY_LOSSES, PolicyLossParams, agg_loss, policy_loss
from rlstages.engines.algorithms import policy_losses as PL
from rlstages.engines.algorithms.policy_loss import per_token_loss

torch.set_num_threads(1)
SEEDS = (0, 1, 2)
B, T = 8, 6


def close(actual, expected, atol=1e-5, rtol=1e-4):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected, dtype=torch.float64),
                               atol=atol, rtol=rtol)  # fmt: skip


def random_batch(seed):
    """old, new log-probs (new = old + noise, so ratios straddle the clip band), advantages, mask with holes and
    one fully masked row."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[1] = 0.0
    old = -torch.rand(B, T, generator=g) * 3
    new = old + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    return old, new, adv, mask


def rows(mask):
    return [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]


def loop_agg(per_token, mask, mode):
    """Aggregate a list-of-lists per-token loss by mode (local counts), from the formulas."""
    r = rows(mask)
    vals = [[per_token[i][t] for t in r[i]] for i in range(len(r))]
    n = sum(len(v) for v in vals)
    if mode == "token-mean":
        return sum(map(sum, vals)) / n if n else 0.0
    if mode == "token-sum":
        return sum(map(sum, vals))
    nonempty = [v for v in vals if v]
    per_seq = [sum(v) / len(v) if mode == "seq-mean-token-mean" else sum(v) for v in nonempty]
    loss = sum(per_seq) / len(nonempty) if nonempty else 0.0
    return loss / mask.shape[1] if mode == "seq-mean-token-sum-norm" else loss


def grad_of(fn, new):
    new = new.clone().requires_grad_(True)
    loss = fn(new)
    loss.backward()
    return loss.detach(), new.grad


# ---------- GSPO ----------------------------------------------------------------------------------------


def loop_gspo(old, new, adv, mask, lo, hi):
    out = [[0.0] * T for _ in range(B)]
    for i, r in enumerate(rows(mask)):
        if not r:
            continue
        s = math.exp(min(sum(float(new[i, t] - old[i, t]) for t in r) / len(r), 10.0))
        for t in r:
            a = float(adv[i, t])
            out[i][t] = max(-a * s, -a * min(max(s, 1 - lo), 1 + hi))
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_gspo_matches_loop(seed, mode):
    old, new, adv, mask = random_batch(seed)
    params = PolicyLossParams(name="gspo", gspo_clip_ratio_low=0.05, gspo_clip_ratio_high=0.08, loss_agg_mode=mode)
    loss, metrics = policy_loss(old, new, adv, mask, params)
    close(loss, loop_agg(loop_gspo(old, new, adv, mask, 0.05, 0.08), mask, mode))
    assert 0.0 < float(metrics["pg_clipfrac"]) < 1.0  # some rows clipped, some not: both branches exercised


def test_gspo_gradient_is_the_sequence_objectives():
    """With a wide band, GSPO's token-level form has the gradient of the sequence objective
    mean_i(-A_i * exp(mean_t(logp - old))) (A constant per sequence, as GRPO gives it)."""
    old, new, _, mask = random_batch(0)
    adv = torch.randn(B, 1).expand(B, T).contiguous()
    params = PolicyLossParams(name="gspo", gspo_clip_ratio_low=10.0, gspo_clip_ratio_high=10.0,
                              loss_agg_mode="seq-mean-token-mean")  # fmt: skip
    _, g = grad_of(lambda lp: policy_loss(old, lp, adv, mask, params)[0], new)
    valid = mask.sum(-1) > 0

    def sequence_objective(lp):
        seq = ((lp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return (-adv[:, 0] * torch.exp(seq))[valid].mean()

    _, g_ref = grad_of(sequence_objective, new)
    close(g, g_ref, atol=1e-6)


def test_gspo_hand_worked():
    """One row, two tokens with log-ratios 0.1 and 0.3: s = exp(0.2); A = 1, band 3e-4/4e-4 clips at 1.0004."""
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.1, 0.3]])
    params = PolicyLossParams(name="gspo", loss_agg_mode="seq-mean-token-mean")
    loss, m = policy_loss(old, new, torch.ones(1, 2), torch.ones(1, 2), params)
    close(loss, -1.0004)  # max(-exp(0.2), -1.0004) = -1.0004: clipped
    assert float(m["pg_clipfrac"]) == 1.0
    wide = PolicyLossParams(name="gspo", gspo_clip_ratio_low=1.0, gspo_clip_ratio_high=1.0)
    close(policy_loss(old, new, torch.ones(1, 2), torch.ones(1, 2), wide)[0], -math.exp(0.2))


# ---------- CISPO ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_cispo_matches_loop_and_keeps_every_gradient(seed, mode):
    old, new, adv, mask = random_batch(seed)
    lo, hi = 0.1, 0.2
    params = PolicyLossParams(name="cispo", cispo_clip_ratio_low=lo, cispo_clip_ratio_high=hi, loss_agg_mode=mode)
    loss, g = grad_of(lambda lp: policy_loss(old, lp, adv, mask, params)[0], new)
    w = [[min(max(math.exp(float(new[i, t] - old[i, t])), 1 - lo), 1 + hi) for t in range(T)] for i in range(B)]
    per_token = [[-w[i][t] * float(adv[i, t]) * float(new[i, t]) for t in range(T)] for i in range(B)]
    close(loss, loop_agg(per_token, mask, mode))
    # d/dlogp of -sg(w)*A*logp is -w*A times the aggregation weight: never zero on a valid token (PPO's is
    # zero on clipped ones); the aggregation weight is the same loop with logp replaced by 1
    unit = [[-w[i][t] * float(adv[i, t]) for t in range(T)] for i in range(B)]
    expected = [[0.0] * T for _ in range(B)]
    for i, r in enumerate(rows(mask)):
        for t in r:
            one_hot = [[(unit[i][t] if (k, u) == (i, t) else 0.0) for u in range(T)] for k in range(B)]
            expected[i][t] = loop_agg(one_hot, mask, mode)
    close(g, torch.tensor(expected), atol=1e-6)


def test_cispo_hand_worked():
    """rho = 2, A = 1, high 0.28: weight 1.28, loss = -1.28 * log(2) at logp = log 2 (old = 0)."""
    new = torch.tensor([[math.log(2.0)]])
    loss, m = policy_loss(torch.zeros(1, 1), new, torch.ones(1, 1), torch.ones(1, 1), PolicyLossParams(name="cispo"))
    close(loss, -1.28 * math.log(2.0))
    assert float(m["pg_clipfrac"]) == 1.0


# ---------- Clip-Cov and KL-Cov -------------------------------------------------------------------------


def loop_cov(new, adv, mask):
    """Cov_t = (logp_t - mean logp)(A_t - mean A), means over valid tokens."""
    valid = [(i, t) for i, r in enumerate(rows(mask)) for t in r]
    mlp = sum(float(new[i, t]) for i, t in valid) / len(valid)
    ma = sum(float(adv[i, t]) for i, t in valid) / len(valid)
    return {(i, t): (float(new[i, t]) - mlp) * (float(adv[i, t]) - ma) for i, t in valid}


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_cov_matches_loop_when_every_candidate_is_chosen(seed):
    """With ratio 1 every candidate (lb < Cov < ub, not PPO-clipped) is detached: the choice is deterministic."""
    old, new, adv, mask = random_batch(seed)
    lo, hi, lb, ub = 0.2, 0.2, 0.05, 5.0
    cov = loop_cov(new, adv, mask)
    per_token = [[0.0] * T for _ in range(B)]
    detached = []
    for (i, t), c in cov.items():
        rho = math.exp(float(new[i, t] - old[i, t]))
        a = float(adv[i, t])
        l1, l2 = -a * rho, -a * min(max(rho, 1 - lo), 1 + hi)
        if l2 > l1 or not lb < c < ub:
            per_token[i][t] = max(l1, l2)
        else:
            detached.append((i, t))
    assert detached, "the case must detach some tokens"
    params = PolicyLossParams(name="clip_cov", clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub)
    loss, g = grad_of(lambda lp: policy_loss(old, lp, adv, mask, params)[0], new)
    close(loss, loop_agg(per_token, mask, "token-mean"))
    assert all(float(g[i, t]) == 0.0 for i, t in detached)


def test_clip_cov_detaches_ratio_of_tokens_at_random():
    old, new, adv, mask = random_batch(0)
    m = mask.float()
    n_valid = int(mask.sum())
    picks = set()
    for seed in range(5):
        _, metrics = PL.clip_cov(old, new, adv, m, 0.2, 0.2, 2.0 / n_valid, 0.0, 100.0,
                                 torch.Generator().manual_seed(seed))  # fmt: skip
        loss, _ = PL.clip_cov(old, new, adv, m, 0.2, 0.2, 2.0 / n_valid, 0.0, 100.0,
                              torch.Generator().manual_seed(seed))  # fmt: skip
        close(metrics["pg_clipfrac"], 2.0 / n_valid)  # exactly int(ratio * N) = 2 tokens
        picks.add(tuple(torch.nonzero((loss == 0) & (mask != 0)).flatten().tolist()))
    assert len(picks) > 1  # a random choice, not always the same tokens


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ratio", [0.1, 0.5])
def test_kl_cov_matches_loop(seed, ratio):
    old, new, adv, mask = random_batch(seed)
    coef = 0.7
    cov = loop_cov(new, adv, mask)
    k = max(int(ratio * len(cov)), 1)
    top = set(sorted(cov, key=cov.get, reverse=True)[:k])
    per_token = [[0.0] * T for _ in range(B)]
    for i, t in cov:
        d = float(new[i, t] - old[i, t])
        per_token[i][t] = -float(adv[i, t]) * math.exp(d) + (coef * abs(d) if (i, t) in top else 0.0)
    params = PolicyLossParams(name="kl_cov", kl_cov_ratio=ratio, kl_cov_coef=coef)
    loss, metrics = policy_loss(old, new, adv, mask, params)
    close(loss, loop_agg(per_token, mask, "token-mean"))
    close(metrics["pg_clipfrac"], k / len(cov))


def test_kl_cov_hand_worked():
    """Two tokens, A = (1, -1), logp = (0, -1), old = (0, -0.5): Cov = (0.5)(1) = 0.5 and (-0.5)(-1) = 0.5,
    a tie; with ratio 0.5 one token is penalised. Token 2: -(-1)*exp(-0.5) + 1*0.5."""
    old = torch.tensor([[0.0, -0.5]])
    new = torch.tensor([[0.0, -1.0]])
    adv = torch.tensor([[1.0, -1.0]])
    params = PolicyLossParams(name="kl_cov", kl_cov_ratio=1.0, kl_cov_coef=1.0, loss_agg_mode="token-sum")
    loss, _ = policy_loss(old, new, adv, torch.ones(1, 2), params)
    close(loss, -1.0 + math.exp(-0.5) + 0.5)


# ---------- every loss: edge cases, IS weights, token-sum ---------------------------------------------


@pytest.mark.parametrize("name", POLICY_LOSSES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_loss_is_zero_and_finite_on_an_empty_mask(name, mode):
    old, new, adv, _ = random_batch(0)
    params = PolicyLossParams(name=name, loss_agg_mode=mode)
    loss, g = grad_of(lambda lp: policy_loss(old, lp, adv, torch.zeros(B, T), params)[0], new)
    assert loss.item() == 0.0 and torch.equal(g, torch.zeros(B, T))
    _, metrics = policy_loss(old, new, adv, torch.zeros(B, T), params)
    assert all(torch.isfinite(v).all() for v in metrics.values())


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_rollout_is_weights_multiply_the_per_token_loss_before_aggregation(name):
    old, new, adv, mask = random_batch(1)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(9)) * 2
    for mode in ("token-mean", "seq-mean-token-mean"):
        params = PolicyLossParams(name=name, loss_agg_mode=mode, clip_cov_ratio=1.0)
        per_token, _ = per_token_loss(params, old, new, adv, mask)  # clip_cov: ratio 1, a deterministic choice
        loss, _ = policy_loss(old, new, adv, mask, params, rollout_is_weights=weights)
        close(loss, agg_loss(per_token * weights, mask, mode))
        assert not torch.allclose(loss, policy_loss(old, new, adv, mask, params)[0])


def test_token_sum_hand_worked_scaled_by_dp_and_summed_over_micro_batches():
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert agg_loss(L, m, "token-sum").item() == 7.0
    assert agg_loss(L, m, "token-sum", dp_size=4).item() == 28.0
    assert agg_loss(L[:1], m[:1], "token-sum").item() + agg_loss(L[1:], m[1:], "token-sum").item() == 7.0
    params = PolicyLossParams(loss_agg_mode="token-sum", dp_size=2, clip_ratio_c=None)
    zeros = torch.zeros(2, 3)
    loss, _ = policy_loss(zeros, zeros, -L, m, params)  # ratio 1: per-token loss = -A = L
    assert loss.item() == 14.0


def test_bad_params_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="policy loss 'ppo'"):
        PolicyLossParams(name="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        PolicyLossParams(clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="clip_cov_lb"):
        PolicyLossParams(clip_cov_lb=5.0, clip_cov_ub=1.0)
