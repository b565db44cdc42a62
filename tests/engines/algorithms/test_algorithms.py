"""Tests for engines/algorithms.py, part 1: masked statistics, log-probs and entropy, outcome rewards and every
advantage estimator, each against a slow Python loop (algorithm_refs.py) and the reference fixtures.

Run: `.venv/bin/pytest -q tests/engines/algorithms/test_algorithms.py` (CPU only, one thread, a few seconds).
"""

import math
import statistics

import pytest
import torch
from algorithm_refs import (
    SEEDS,
    B,
    T,
    close,
    random_batch,
    ref_groups,
    ref_stats,
    ref_whiten,
)

from rlstages.engines.algorithms import (
    ADV_ESTIMATORS,
    compute_advantages,
    compute_gae,
    compute_grpo,
    compute_reinforce_pp,
    compute_reinforce_pp_baseline,
    compute_rloo,
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    outcome_to_token_rewards,
)

torch.set_num_threads(1)

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
