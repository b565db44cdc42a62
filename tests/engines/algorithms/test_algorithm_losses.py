"""Tests for engines/algorithms.py, part 2: loss aggregation, policy and value losses, KL and DAPO's filters,
each against a slow Python loop (algorithm_refs.py) and the reference fixtures.

Run: `.venv/bin/pytest -q tests/engines/algorithms/test_algorithm_losses.py` (CPU only, one thread, a few seconds).
"""

import math

import pytest
import torch
from algorithm_refs import (
    SEEDS,
    B,
    T,
    close,
    random_batch,
    ref_agg,
    ref_groups,
    ref_kl,
    ref_token_ppo,
)

from rlstages.engines.algorithms import (
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    PolicyLossParams,
    agg_loss,
    apply_kl_in_reward,
    filter_groups,
    kl_penalty,
    make_kl_controller,
    overlong_penalty,
    policy_loss,
    value_loss,
)

torch.set_num_threads(1)

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
