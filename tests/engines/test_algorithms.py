"""Tests for engines/algorithms.py: every function against a slow Python loop and the reference fixtures.

Run: `.venv/bin/pytest -q tests/engines/test_algorithms.py` (CPU only, one thread, a few seconds).
The loops below are written from the formulas in the reference notes (section A), not from the code.
"""

import math
import statistics

import pytest
import torch

from rlstages.engines.algorithms import (
    ADV_ESTIMATORS,
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    PolicyLossParams,
    agg_loss,
    apply_kl_in_reward,
    compute_advantages,
    compute_gae,
    compute_grpo,
    compute_reinforce_pp,
    compute_reinforce_pp_baseline,
    compute_rloo,
    entropy_from_logits,
    filter_groups,
    kl_penalty,
    logprobs_from_logits,
    make_kl_controller,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    outcome_to_token_rewards,
    overlong_penalty,
    policy_loss,
    value_loss,
)

torch.set_num_threads(1)
SEEDS = (0, 1, 2)
B, T = 8, 6


def close(actual, expected, atol=1e-5, rtol=1e-4):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol)


def random_batch(seed):
    """Random per-token data; the mask has holes (multi-turn), row 1 fully masked, one singleton uid."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[1] = 0.0
    index = [("a", "b", "c")[int(i)] for i in torch.randint(0, 3, (B - 1,), generator=g)] + ["solo"]
    data = {name: torch.randn(B, T, generator=g) for name in ("x", "y", "z", "w")}
    return mask, index, data


# ---------- slow references -------------------------------------------------------------------------


def ref_stats(v, m):
    """(mean with verl's +1e-8, unbiased variance or 0 if < 2 valid) over the masked entries."""
    vals = [x for row, mrow in zip(v, m, strict=True) for x, k in zip(row, mrow, strict=True) if k]
    mean = sum(vals) / (len(vals) + 1e-8)
    if len(vals) < 2:
        return mean, 0.0
    mu = sum(vals) / len(vals)
    return mean, sum((x - mu) ** 2 for x in vals) / (len(vals) - 1)


def ref_whiten(v, m):
    if not any(k for row in m for k in row):
        return [[0.0] * len(row) for row in v]
    mean, var = ref_stats(v, m)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in v]


def ref_groups(scores, index):
    groups = {}
    for s, uid in zip(scores, index, strict=True):
        groups.setdefault(uid, []).append(s)
    return groups


def ref_agg(L, m, mode, scale=None, n_tokens=None, n_seqs=None):
    rows = [[x for x, k in zip(lr, mr, strict=True) if k] for lr, mr in zip(L, m, strict=True)]
    if mode == "token-mean":
        n = sum(len(r) for r in rows) if n_tokens is None else n_tokens
        return sum(sum(r) for r in rows) / n if n else 0.0
    if mode == "token-sum":
        return sum(sum(r) for r in rows)
    nonempty = [r for r in rows if r]
    per_seq = [sum(r) / len(r) if mode == "seq-mean-token-mean" else sum(r) for r in nonempty]
    n = len(nonempty) if n_seqs is None else n_seqs
    loss = sum(per_seq) / n if n else 0.0
    return loss / (scale or len(L[0])) if mode == "seq-mean-token-sum-norm" else loss


def ref_token_ppo(old, new, adv, lo, hi, c):
    ratio = math.exp(min(max(new - old, -20.0), 20.0))
    l1, l2 = -adv * ratio, -adv * min(max(ratio, 1 - lo), 1 + hi)
    loss = max(l1, l2)
    lower = c is not None and adv < 0 and loss > -adv * c
    if c is not None and adv < 0:
        loss = min(loss, -adv * c)
    return loss, float(l2 > l1), float(lower)


def ref_kl(lp, ref, kind):
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "abs":
        return abs(d)
    if kind == "k2":
        return 0.5 * d * d
    x = min(max(-d, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1, -10.0), 10.0)


# ---------- masked statistics -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_stats_match_loops(seed):
    mask, _, d = random_batch(seed)
    v, m = d["x"].tolist(), mask.tolist()
    total = sum(x * k for row, mr in zip(v, m, strict=True) for x, k in zip(row, mr, strict=True))
    close(masked_sum(d["x"], mask), total)
    close(
        masked_sum(d["x"], mask.bool(), dim=-1),
        [sum(x * k for x, k in zip(*p, strict=True)) for p in zip(v, m, strict=True)],
    )
    mean, var = ref_stats(v, m)
    close(masked_mean(d["x"], mask), mean)
    close(masked_var(d["x"], mask), var)
    n = mask.sum().item()
    close(masked_var(d["x"], mask, unbiased=False), var * (n - 1) / n)
    close(masked_whiten(d["x"], mask), ref_whiten(v, m))
    close(masked_whiten(d["x"], mask, shift_mean=False), [[x + mean for x in r] for r in ref_whiten(v, m)])


def test_masked_stats_edge_cases_are_finite_zero():
    x = torch.tensor([[1.0, float("nan"), 3.0]])
    none, one = torch.zeros(1, 3), torch.tensor([[0.0, 0.0, 1.0]])
    assert masked_sum(x, none).item() == 0.0 and masked_mean(x, none).item() == 0.0
    assert masked_var(x, none).item() == 0.0 and masked_var(x, one).item() == 0.0  # verl raises here
    assert masked_var(x.double(), one).item() == 0.0  # exactly, although mean = 3 / (1 + 1e-8) in float64
    assert torch.equal(masked_whiten(x, none), torch.zeros(1, 3))
    close(masked_mean(x, torch.tensor([[1.0, 0.0, 1.0]])), 2.0)  # NaN outside the mask is ignored


# ---------- log-probs, entropy, outcome rewards ------------------------------------------------------


def test_logprobs_and_entropy_match_loops():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 7, generator=g) * 3
    labels = torch.randint(0, 7, (3, 4), generator=g)
    for temp in (1.0, 0.7):
        expected = [
            [row[lab] / temp - math.log(sum(math.exp(z / temp) for z in row)) for row, lab in zip(r, lr, strict=True)]
            for r, lr in zip(logits.tolist(), labels.tolist(), strict=True)
        ]
        close(logprobs_from_logits(logits, labels, temperature=temp), expected)
    ent = []
    for r in logits.tolist():
        ent.append([])
        for row in r:
            p = [math.exp(z) / sum(math.exp(y) for y in row) for z in row]
            ent[-1].append(-sum(q * math.log(q) for q in p))
    close(entropy_from_logits(logits), ent)
    assert logprobs_from_logits(logits.bfloat16(), labels).dtype == torch.float32


def test_outcome_to_token_rewards():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]])
    out = outcome_to_token_rewards(torch.tensor([0.5, 2.0, -1.0, 3.0]), mask)
    expected = [[0, 0.5, 0, 0], [0, 0, 0, 0], [0, 0, -1.0, 0], [0, 0, 0, 3.0]]
    close(out, expected)
    assert outcome_to_token_rewards(torch.tensor([1.0]), torch.zeros(1, 0)).shape == (1, 0)


# ---------- advantage estimators -------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_matches_loop(seed):
    mask, _, d = random_batch(seed)
    r, v, m = d["x"].tolist(), d["y"].tolist(), mask.tolist()
    gamma, lam = 0.9, 0.8
    raw = [[0.0] * T for _ in range(B)]
    for i in range(B):
        next_v, last = 0.0, 0.0
        for t in reversed(range(T)):
            if m[i][t]:  # masked tokens are skipped by the TD chain
                last = r[i][t] + gamma * next_v - v[i][t] + gamma * lam * last
                next_v = v[i][t]
            raw[i][t] = last
    adv, ret = compute_gae(d["x"], d["y"], mask, gamma, lam)
    close(ret, [[a + b for a, b in zip(ra, va, strict=True)] for ra, va in zip(raw, v, strict=True)])
    close(adv, ref_whiten(raw, m))


def test_gae_single_turn_equals_textbook_sum():
    """For right-padded masks GAE is sum_l (gamma*lam)^l delta_{t+l} with V = 0 past the end."""
    g = torch.Generator().manual_seed(3)
    r, v = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    lengths = [5, 3, 1]
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths])
    gamma, lam = 0.95, 0.7
    raw = []
    for i, n in enumerate(lengths):
        vv = v[i, :n].tolist() + [0.0]
        delta = [r[i, t].item() + gamma * vv[t + 1] - vv[t] for t in range(n)]
        raw.append([sum((gamma * lam) ** k * delta[t + k] for k in range(n - t)) for t in range(n)] + [0.0] * (5 - n))
    _, ret = compute_gae(r, v, mask, gamma, lam)
    close(ret - v, raw)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_loop(seed, norm_by_std):
    mask, index, d = random_batch(seed)
    scores = d["x"].sum(-1).tolist()  # verl sums the whole row
    groups = ref_groups(scores, index)
    expected = []
    for s, uid, mrow in zip(scores, index, mask.tolist(), strict=True):
        grp = groups[uid]
        mu, sd = (statistics.mean(grp), statistics.stdev(grp)) if len(grp) > 1 else (0.0, 1.0)
        a = (s - mu) / (sd + 1e-6) if norm_by_std else s - mu
        expected.append([a * k for k in mrow])
    adv, ret = compute_grpo(d["x"], mask, index, norm_by_std=norm_by_std)
    close(adv, expected)
    assert torch.equal(adv, ret) and adv.data_ptr() != ret.data_ptr()


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_leave_one_out_loop(seed):
    mask, index, d = random_batch(seed)
    scores = d["x"].sum(-1).tolist()
    expected = []
    for i, (s, mrow) in enumerate(zip(scores, mask.tolist(), strict=True)):
        others = [scores[j] for j in range(B) if j != i and index[j] == index[i]]
        a = s - sum(others) / len(others) if others else s
        expected.append([a * k for k in mrow])
    close(compute_rloo(d["x"], mask, index)[0], expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_matches_loop(seed):
    mask, _, d = random_batch(seed)
    r, m, gamma = d["x"].tolist(), mask.tolist(), 0.9
    returns = [[0.0] * T for _ in range(B)]
    for i in range(B):
        running = 0.0
        for t in reversed(range(T)):
            if m[i][t]:
                running = r[i][t] + gamma * running
                returns[i][t] = running
    adv, ret = compute_reinforce_pp(d["x"], mask, gamma)
    close(ret, returns)
    close(adv, [[a * k for a, k in zip(ra, mr, strict=True)] for ra, mr in zip(ref_whiten(returns, m), m, strict=True)])


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_baseline_matches_loop(seed):
    mask, index, d = random_batch(seed)
    scores, m = d["x"].sum(-1).tolist(), mask.tolist()
    groups = ref_groups(scores, index)
    tiled = []
    for s, uid, mrow in zip(scores, index, m, strict=True):
        base = statistics.mean(groups[uid]) if len(groups[uid]) > 1 else 0.0
        tiled.append([(s - base) * k for k in mrow])
    expected = [[a * k for a, k in zip(ra, mr, strict=True)] for ra, mr in zip(ref_whiten(tiled, m), m, strict=True)]
    adv, ret = compute_reinforce_pp_baseline(d["x"], mask, index)
    close(adv, expected)
    close(ret, expected)


FIXTURE_SCORES = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
FIXTURE_UIDS = ["a", "a", "a", "b", "b", "c"]
FIXTURE_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]]).float()


@pytest.mark.parametrize(
    ("name", "kwargs", "expected"),
    [
        ("grpo", {}, [0.57735, -1.15470, 0.57735, 0.70711, -0.70711, 0.5]),
        ("grpo", {"norm_by_std": False}, [1 / 3, -2 / 3, 1 / 3, 0.5, -0.5, 0.5]),  # Dr.GRPO
        ("rloo", {}, [0.5, -1.0, 0.5, 1.0, -1.0, 0.5]),
    ],
)
def test_reference_fixtures_group_estimators(name, kwargs, expected):
    rewards = outcome_to_token_rewards(FIXTURE_SCORES, FIXTURE_MASK)
    adv, _ = compute_advantages(name, rewards, FIXTURE_MASK, FIXTURE_UIDS, **kwargs)
    close(adv, torch.tensor(expected).unsqueeze(-1) * FIXTURE_MASK, atol=1e-5)


def test_groups_by_uid_not_position():
    perm = [5, 2, 0, 4, 1, 3]
    rewards = outcome_to_token_rewards(FIXTURE_SCORES, FIXTURE_MASK)
    adv, _ = compute_grpo(rewards, FIXTURE_MASK, FIXTURE_UIDS)
    adv_perm, _ = compute_grpo(rewards[perm], FIXTURE_MASK[perm], [FIXTURE_UIDS[i] for i in perm])
    close(adv_perm, adv[perm])


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_compute_advantages_dispatch_and_edge_cases(name):
    mask, index, d = random_batch(0)
    kwargs = {"values": d["y"], "gamma": 0.9, "lam": 0.95}
    via_entry = compute_advantages(name, d["x"], mask, index, **kwargs)
    direct = {
        "gae": lambda: compute_gae(d["x"], d["y"], mask, 0.9, 0.95),
        "grpo": lambda: compute_grpo(d["x"], mask, index),
        "rloo": lambda: compute_rloo(d["x"], mask, index),
        "reinforce_pp": lambda: compute_reinforce_pp(d["x"], mask, 0.9),
        "reinforce_pp_baseline": lambda: compute_reinforce_pp_baseline(d["x"], mask, index),
    }[name]()
    for got, want in zip(via_entry, direct, strict=True):
        assert torch.equal(got, want)
    # Edge cases: singleton batch, all-equal group, whole-batch zero mask, fully masked rows, T = 0.
    equal = torch.full((4, 3), 0.7)
    cases = [
        (torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), ["u"]),
        (equal, torch.ones(4, 3), ["g"] * 4),
        (d["x"], torch.zeros(B, T), index),
        (d["x"][:3], torch.zeros(3, T), ["g"] * 3),
        (torch.zeros(2, 0), torch.zeros(2, 0), ["g", "h"]),
    ]
    for rewards, m, idx in cases:
        adv, ret = compute_advantages(name, rewards, m, idx, values=torch.zeros_like(rewards))
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        assert adv.shape == ret.shape == rewards.shape
    adv, _ = compute_advantages(name, equal, torch.ones(4, 3), ["g"] * 4, values=torch.zeros_like(equal))
    if name in ("grpo", "rloo", "reinforce_pp_baseline"):
        assert torch.equal(adv, torch.zeros_like(adv))  # exactly 0, thanks to float64 group stats


def test_grpo_singleton_keeps_raw_score_like_verl():
    adv, _ = compute_grpo(torch.tensor([[0.0, 2.0]]), torch.ones(1, 2), ["u"])
    close(adv, [[2 / (1 + 1e-6)] * 2])


def test_compute_advantages_errors():
    mask, index, d = random_batch(0)
    with pytest.raises(ValueError, match="'gae'.*values"):
        compute_advantages("gae", d["x"], mask, index)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*grpo"):
        compute_advantages("ppo", d["x"], mask, index)
    with pytest.raises(ValueError, match="uids"):
        compute_grpo(d["x"], mask, index[:-1])
    assert set(ADV_ESTIMATORS) == {"gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}


# ---------- loss aggregation ------------------------------------------------------------------------


def test_agg_loss_hand_fixture():
    L = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [5.0, 6.0, 9.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    expected = {
        "token-mean": 10 / 4,
        "seq-mean-token-sum": (6 + 4) / 2,
        "seq-mean-token-mean": (2 + 4) / 2,
        "seq-mean-token-sum-norm": (6 + 4) / 2 / 4,  # / T
    }
    for mode, value in expected.items():
        close(agg_loss(L, m, mode), value)
    close(agg_loss(L, m, "seq-mean-token-sum-norm", loss_scale_factor=10), 0.5)
    # Reference fixture: the 0.9.1 norm form is the seq-mean-token-sum form divided by T = 5.
    close(torch.tensor(-0.30987 / 5), -0.061974)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_loop_and_micro_batches_sum_to_full(seed, mode):
    mask, _, d = random_batch(seed)
    close(agg_loss(d["x"], mask, mode), ref_agg(d["x"].tolist(), mask.tolist(), mode))
    n_tokens, n_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    full = agg_loss(d["x"], mask, mode)
    parts = [slice(0, 3), slice(3, 5), slice(5, B)]
    summed = sum(agg_loss(d["x"][p], mask[p], mode, global_tokens=n_tokens, global_seqs=n_seqs) for p in parts)
    close(summed, full)
    close(agg_loss(d["x"], mask, mode, global_tokens=40, global_seqs=5),
          ref_agg(d["x"].tolist(), mask.tolist(), mode, n_tokens=40, n_seqs=5))  # fmt: skip


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_zero_tokens_is_zero(mode):
    L = torch.randn(3, 4, requires_grad=True)
    loss = agg_loss(L, torch.zeros(3, 4), mode)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(L.grad, torch.zeros(3, 4))
    if mode != "token-sum":  # token-sum has no normaliser to be zero
        assert agg_loss(L, torch.ones(3, 4), mode, global_tokens=0, global_seqs=0).item() == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(L, torch.ones(3, 4), "sum")


# ---------- policy and value losses -----------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_c", [3.0, None])
def test_policy_loss_matches_loop(seed, clip_c):
    mask, _, d = random_batch(seed)
    old, new, adv = d["x"], d["x"] + 0.5 * d["y"], d["z"]
    params = PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_c)
    loss, metrics = policy_loss(old, new, adv, mask, params)
    per_token, frac, lower = [], [], []
    for o_r, n_r, a_r in zip(old.tolist(), new.tolist(), adv.tolist(), strict=True):
        rows = [ref_token_ppo(o, n, a, 0.2, 0.28, clip_c) for o, n, a in zip(o_r, n_r, a_r, strict=True)]
        per_token.append([x[0] for x in rows])
        frac.append([x[1] for x in rows])
        lower.append([x[2] for x in rows])
    m = mask.tolist()
    close(loss, ref_agg(per_token, m, "token-mean"))
    close(metrics["pg_clipfrac"], ref_agg(frac, m, "token-mean"))
    close(metrics["pg_clipfrac_lower"], ref_agg(lower, m, "token-mean"))
    close(metrics["ppo_kl"], ref_agg((old - new).tolist(), m, "token-mean"))
    assert all(not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize(
    ("delta", "adv", "params", "loss", "frac", "lower"),
    [
        (2.0, -1.0, PolicyLossParams(clip_ratio_c=3.0), 3.0, 0.0, 1.0),  # dual clip caps at c*|A|
        (2.0, -1.0, PolicyLossParams(clip_ratio_c=None), math.exp(2.0), 0.0, 0.0),
        (0.5, 1.0, PolicyLossParams(clip_ratio_high=0.28), -1.28, 1.0, 0.0),  # DAPO clip-higher
        (-0.5, 1.0, PolicyLossParams(), -math.exp(-0.5), 0.0, 0.0),  # below 1-eps, A>0: unclipped
        (-0.5, -1.0, PolicyLossParams(), 0.8, 1.0, 0.0),
    ],
)
def test_policy_loss_reference_fixtures(delta, adv, params, loss, frac, lower):
    old = torch.tensor([[-1.0]])
    got, metrics = policy_loss(old, old + delta, torch.tensor([[adv]]), torch.ones(1, 1), params)
    close(got, loss)
    close(metrics["pg_clipfrac"], frac)
    close(metrics["pg_clipfrac_lower"], lower)
    close(metrics["ppo_kl"], -delta)


def test_policy_loss_gradients_terms_and_micro_batches():
    mask, _, d = random_batch(1)
    ref = d["w"]
    new = (d["x"] + 0.3 * d["y"]).requires_grad_()
    ent = torch.rand(B, T, requires_grad=True)
    params = PolicyLossParams(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
    loss, metrics = policy_loss(d["x"], new, d["z"], mask, params, entropy=ent, ref_logprobs=ref)
    pg, _ = policy_loss(d["x"], new, d["z"], mask, PolicyLossParams())
    kl = agg_loss(kl_penalty(new, ref, "k3"), mask, "token-mean")
    close(loss, pg - 0.01 * agg_loss(ent, mask, "token-mean") + 0.1 * kl)
    close(metrics["kl_loss"], kl)
    loss.backward()
    assert torch.isfinite(new.grad).all() and new.grad.abs().sum() > 0
    assert torch.equal(new.grad * (1 - mask), torch.zeros(B, T))  # no gradient on masked tokens
    # Micro-batches normalised by the mini-batch counts add up to the full loss.
    for mode in LOSS_AGG_MODES:
        p = PolicyLossParams(loss_agg_mode=mode)
        full, _ = policy_loss(d["x"], new, d["z"], mask, p)
        g_tok, g_seq = mask.sum(), (mask.sum(-1) > 0).sum()
        parts = [
            policy_loss(d["x"][s], new[s], d["z"][s], mask[s], p, g_tok, g_seq)[0] for s in (slice(0, 5), slice(5, B))
        ]
        close(sum(parts), full)


def test_policy_loss_empty_mask_and_missing_inputs():
    new = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = policy_loss(torch.zeros(2, 3), new, torch.ones(2, 3), torch.zeros(2, 3), PolicyLossParams())
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(new.grad).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(new, new, new, new, PolicyLossParams(use_kl_loss=True))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(new, new, new, new, PolicyLossParams(entropy_coeff=0.1))
    for bad in ({"clip_ratio_c": 1.0}, {"loss_agg_mode": "mean"}, {"kl_loss_type": "k4"}, {"clip_ratio_low": -0.1}):
        with pytest.raises(ValueError):
            PolicyLossParams(**bad)


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss_matches_loop(seed):
    mask, _, d = random_batch(seed)
    vpred, ret, old, eps = d["x"], d["y"], d["x"] + 0.6 * d["z"], 0.5
    per_token, frac = [], []
    for vr, rr, orow in zip(vpred.tolist(), ret.tolist(), old.tolist(), strict=True):
        per_token.append([])
        frac.append([])
        for v, r, o in zip(vr, rr, orow, strict=True):
            vc = min(max(v, o - eps), o + eps)
            per_token[-1].append(max((v - r) ** 2, (vc - r) ** 2))
            frac[-1].append(float((vc - r) ** 2 > (v - r) ** 2))
    for mode in LOSS_AGG_MODES:
        loss, clipfrac = value_loss(vpred, ret, old, mask, eps, loss_agg_mode=mode)
        close(loss, 0.5 * ref_agg(per_token, mask.tolist(), mode))
        close(clipfrac, ref_agg(frac, mask.tolist(), "token-mean"))
    loss, clipfrac = value_loss(vpred, ret, old, torch.zeros(B, T), eps)
    assert loss.item() == 0.0 and clipfrac.item() == 0.0


# ---------- KL ----------------------------------------------------------------------------------------


def test_kl_reference_fixtures():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    for kind, value in {"k1": 1.0, "abs": 1.0, "k2": 0.5, "k3": 0.367879}.items():
        close(kl_penalty(lp, ref, kind), [value])
        close(kl_penalty(lp, ref, kind + "+"), [value])
    close(kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3"), [10.0])
    # The -20/20 pre-clamp keeps exp() finite: an -inf log-prob or a huge gap gives 10 and a zero gradient.
    close(kl_penalty(torch.tensor([-math.inf]), torch.tensor([0.0]), "k3"), [10.0])
    far = torch.tensor([-200.0], requires_grad=True)
    kl_penalty(far, torch.tensor([0.0]), "k3").backward()
    assert far.grad.item() == 0.0
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(lp, ref, "full")


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
def test_kl_matches_loop_and_straight_through_gradient(kind):
    g = torch.Generator().manual_seed(5)
    lp, ref = torch.randn(4, 5, generator=g) * 3, torch.randn(4, 5, generator=g) * 3
    expected = [
        [ref_kl(a, b, kind) for a, b in zip(ra, rb, strict=True)]
        for ra, rb in zip(lp.tolist(), ref.tolist(), strict=True)
    ]
    close(kl_penalty(lp, ref, kind), expected)
    x = lp.clone().requires_grad_()
    kl_penalty(x, ref, kind + "+").sum().backward()
    close(x.grad, lp - ref)  # gradient of k2 = 0.5 * delta^2


def test_kl_controllers():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6, horizon=10000)
    ctrl.update(12, n_steps=256)
    assert ctrl.value == pytest.approx(0.100512, abs=1e-9)
    ctrl.update(float("nan"), n_steps=256)
    assert ctrl.value == pytest.approx(0.100512, abs=1e-9)
    ctrl.update(torch.tensor(0.0), n_steps=10000)  # error clipped at -0.2
    assert ctrl.value == pytest.approx(0.100512 * 0.8)
    restored = make_kl_controller("adaptive", 1.0, target_kl=6, horizon=10000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    fixed = make_kl_controller("fixed", 0.05)
    assert isinstance(fixed, FixedKLController)
    fixed.update(100.0, n_steps=1000)
    assert fixed.value == 0.05 and fixed.state_dict() == {"value": 0.05}
    with pytest.raises(ValueError, match="adaptive"):
        make_kl_controller("linear", 0.1)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


@pytest.mark.parametrize("seed", SEEDS)
def test_apply_kl_in_reward_matches_loop(seed):
    mask, _, d = random_batch(seed)
    scores, old, ref, m, coef = d["x"], d["y"], d["z"], mask.tolist(), 0.05
    rewards, metrics = apply_kl_in_reward(scores, old, ref, mask, coef, "k1")
    kl = [
        [ref_kl(a, b, "k1") * k for a, b, k in zip(*rows, strict=True)]
        for rows in zip(old.tolist(), ref.tolist(), m, strict=True)
    ]
    close(
        rewards,
        [[s - coef * x for s, x in zip(sr, kr, strict=True)] for sr, kr in zip(scores.tolist(), kl, strict=True)],
    )
    row_means = [sum(kr) / sum(mr) for kr, mr in zip(kl, m, strict=True) if sum(mr)]  # empty rows left out
    close(metrics["kl_in_reward"], sum(row_means) / len(row_means))
    close(metrics["kl_coef"], coef)
    _, empty = apply_kl_in_reward(scores, old, ref, torch.zeros(B, T), coef, "k3")
    assert empty["kl_in_reward"].item() == 0.0


# ---------- DAPO ---------------------------------------------------------------------------------------


def test_filter_groups_matches_loop():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 2, (12,), generator=g).float()
    index = [("a", "b", "c", "d")[i % 4] for i in range(11)] + ["solo"]
    scores[[0, 4, 8]] = 1.0  # group "a" all equal
    groups = ref_groups(scores.tolist(), index)
    expected = [len(set(groups[u])) > 1 or len(groups[u]) == 1 for u in index]
    assert filter_groups(scores, index).tolist() == expected
    assert not expected[0] and expected[-1]  # equal group dropped, singleton kept (as verl's DAPO trainer)
    assert filter_groups(torch.tensor([0.7, 0.7]), ["x", "x"]).tolist() == [False, False]


def test_overlong_penalty():
    lengths = torch.tensor([10, 12, 14, 16, 20])
    expected = [min(-(n - 12) / 4 * 1.0, 0.0) for n in lengths.tolist()]
    close(overlong_penalty(lengths, max_len=16, buffer_len=4, factor=1.0), expected)
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist()[:4] == [0.0, 0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 16, 0, 1.0)
