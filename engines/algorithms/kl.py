"""KL between the policy and the reference: per-token estimators, the KL-in-reward penalty and its
coefficient controllers (fixed, adaptive).

Non-goal: the KL loss term of the actor (`policy_loss` adds it with `kl_penalty`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from rlstages.engines.algorithms.advantages import _float_mask, masked_mean


def _k1(delta: Tensor) -> Tensor:
    return delta


def _abs(delta: Tensor) -> Tensor:
    return delta.abs()


def _k2(delta: Tensor) -> Tensor:
    return 0.5 * delta.square()


def _k3(delta: Tensor) -> Tensor:
    # Low-variance estimator; the clamps keep exp() finite and bound outliers, as verl does.
    x = torch.clamp(-delta, -20.0, 20.0)
    return torch.clamp(torch.exp(x) - x - 1.0, -10.0, 10.0)


# Estimators of KL(pi || pi_ref) from delta = logp - logp_ref (Schulman 2020, "Approximating KL Divergence").
KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "abs": _abs, "k2": _k2, "k3": _k3}


def _check_kl_kind(kind: str) -> None:
    if kind.removesuffix("+") not in KL_ESTIMATORS:
        known = [*KL_ESTIMATORS, *(k + "+" for k in KL_ESTIMATORS)]
        raise ValueError(f"unknown KL estimator {kind!r}; known: {known}")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate ("k1", "abs", "k2", "k3"), from Schulman's k1/k2/k3 estimators.

    A "+" suffix (e.g. "k3+") is straight-through: the forward value of the named estimator with the
    gradient of k2 (unbiased gradient of the KL), as in verl 0.9.1.
    """
    _check_kl_kind(kind)
    delta = logprobs - ref_logprobs
    value = KL_ESTIMATORS[kind.removesuffix("+")](delta)
    if not kind.endswith("+"):
        return value
    k2 = _k2(delta)
    return k2 - k2.detach() + value.detach()


class FixedKLController:
    """Constant KL coefficient beta (verl `FixedKLController`)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        """The coefficient, for checkpoints."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient from `state_dict()`."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive beta of Ziegler et al. 2019 (arXiv:1909.08593, §2.2), steering the KL towards a target."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """Apply beta <- beta * (1 + clip(KL/target - 1, -0.2, 0.2) * n_steps / horizon).

        Deviation from verl: a non-finite `current_kl` leaves beta unchanged instead of making it NaN.
        """
        kl = float(current_kl)
        if not math.isfinite(kl):
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """The current coefficient, for checkpoints (target and horizon come from config)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient from `state_dict()`."""
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> KLController:
    """Build the KL-in-reward controller by name, "fixed" or "adaptive" (verl defaults for the rest)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; known: ['fixed', 'adaptive']")


def apply_kl_in_reward(
    token_scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    coef: float,
    kind: str,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL penalty in the reward (Ziegler et al. 2019, Eq. 2): r_t = score_t - coef * KL_t on valid tokens.

    Metrics: "kl_in_reward" = mean over rows of each row's masked-mean KL (feed it to the controller's
    update), "kl_coef" = coef. Deviation from verl: rows without valid tokens are left out of that mean
    (verl counts them as KL 0), so empty responses don't pull the controller's signal down.
    """
    m = _float_mask(response_mask, token_scores)
    kl = kl_penalty(old_logprobs, ref_logprobs, kind)
    kl = torch.where(m != 0, kl, torch.zeros_like(kl)) * m
    rewards = token_scores - coef * kl
    row_kl = masked_mean(kl, m, dim=-1)
    current_kl = masked_mean(row_kl, (m.sum(dim=-1) > 0).to(m.dtype))
    return rewards, {"kl_in_reward": current_kl.detach(), "kl_coef": torch.tensor(float(coef))}
