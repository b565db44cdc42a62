"""Evaluation statistics over per-prompt groups of scored samples: mean@k and the unbiased pass@k.

Non-goals: generation and scoring (the rollout engines and `scorer` do those).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples is correct) from n samples with c correct:
    1 - C(n-c, k) / C(n, k) (Chen et al., 2021), as a numerically stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def ks_up_to(k: int) -> list[int]:
    """The pass@j reported for k samples: powers of two below k, and k itself."""
    out = [j for j in (2**i for i in range(9)) if j < k]
    return [*out, k]


def group_metrics(correct: Sequence[Sequence[bool]], prefix: str) -> dict[str, float]:
    """mean@k and pass@j of prompt groups (each the correctness of its k samples), averaged over prompts."""
    if not correct:
        return {}
    k = min(len(g) for g in correct)
    metrics = {f"{prefix}mean_at_{k}": float(np.mean([np.mean(g[:k]) for g in correct]))}
    for j in ks_up_to(k):
        metrics[f"{prefix}pass_at_{j}"] = float(np.mean([pass_at_k(k, int(sum(g[:k])), j) for g in correct]))
    return metrics
