"""mean@k and the unbiased pass@k estimator (Chen et al., 2021) against the closed form with binomials."""

from __future__ import annotations

from math import comb

import pytest

from rlstages.engines.rewards.metrics import group_metrics, ks_up_to, pass_at_k


@pytest.mark.parametrize(("n", "c"), [(1, 0), (1, 1), (5, 2), (8, 3), (16, 1), (16, 15), (200, 7)])
def test_pass_at_k_is_the_unbiased_estimator(n: int, c: int) -> None:
    for k in range(1, n + 1):
        exact = 1.0 - comb(n - c, k) / comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_refuses_impossible_counts() -> None:
    for n, c, k in [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_group_metrics_average_over_prompts() -> None:
    groups = [[True, False, False, False], [False] * 4, [True] * 4]
    m = group_metrics(groups, "eval/")
    assert m["eval/mean_at_4"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert m["eval/pass_at_1"] == pytest.approx(m["eval/mean_at_4"])
    assert m["eval/pass_at_2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["eval/pass_at_4"] == pytest.approx(2 / 3)
    assert ks_up_to(8) == [1, 2, 4, 8] and ks_up_to(6) == [1, 2, 4, 6] and ks_up_to(1) == [1]
