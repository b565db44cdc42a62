"""Slow Python references for the algorithm tests, written from the formulas in the reference notes
(section A), not from the code. Not a test file: imported by test_algorithms.py and test_algorithm_losses.py
(pytest puts this folder on sys.path)."""

import math

import torch

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
