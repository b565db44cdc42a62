"""Rollout-trainer mismatch correction: importance weights pi_old(trainer) / pi_rollout, and mismatch metrics.

The rollout engine (other kernels, bf16, or weights one update old) samples from pi_rollout, while the loss
treats the samples as drawn from pi_old (the trainer's log-probs before the update). Weighting each token's
loss by pi_old / pi_rollout, truncated (TIS) or masked outside a trust band (masked IS), removes most of that
bias at a bounded variance cost (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
RL training"; verl's `rollout_is` family).

Non-goal: the losses that consume the weights (`policy_loss` multiplies them in).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from rlstages.engines.algorithms.advantages import _float_mask, masked_mean, masked_sum

RolloutISLevel = Literal["token", "sequence"]
RolloutISMode = Literal["truncate", "mask"]
ROLLOUT_IS_LEVELS: tuple[str, ...] = get_args(RolloutISLevel)
ROLLOUT_IS_MODES: tuple[str, ...] = get_args(RolloutISMode)
_LOG_CLAMP = 20.0


def rollout_is_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached [B, T] weights w and their metrics (ratio_mean/max/min, clipped_fraction, weight_mean).

    token: rho_t = exp(old_t - rollout_t). sequence: rho_i = exp(sum_t (old - rollout)), the likelihood ratio of
    the whole response, on every token of row i. truncate (TIS): w = min(rho, cap). mask (masked IS): w = rho
    inside [lower, cap] (lower defaults to 1/cap), 0 outside, so outliers drop out instead of being clipped.
    Log-ratios are clamped to +-20 before exp; padding and fully masked rows get weight 0 (no NaN).
    `clipped_fraction` counts truncated (or masked-out) tokens, or sequences at sequence level.

    Raises:
        ValueError: on an unknown level or mode, or a band that is empty.
    """
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout IS level {level!r} is not one of {list(ROLLOUT_IS_LEVELS)}")
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"rollout IS mode {mode!r} is not one of {list(ROLLOUT_IS_MODES)}")
    low = 1.0 / cap if lower is None else lower
    if not 0 <= low <= 1 <= cap:
        raise ValueError(f"rollout IS needs 0 <= lower <= 1 <= cap, got lower={low} cap={cap}")
    m = _float_mask(response_mask, old_logprobs)
    delta = torch.where(m != 0, old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs)).detach()
    if level == "token":
        log_rho, unit_mask = delta.clamp(-_LOG_CLAMP, _LOG_CLAMP), m
    else:
        log_rho = masked_sum(delta, m, dim=-1).clamp(-_LOG_CLAMP, _LOG_CLAMP).unsqueeze(-1)
        unit_mask = (m.sum(-1, keepdim=True) > 0).to(m.dtype)
    rho = torch.exp(log_rho)
    if mode == "truncate":
        weights, clipped = torch.clamp(rho, max=cap), rho > cap
    else:
        inside = (rho >= low) & (rho <= cap)
        weights, clipped = torch.where(inside, rho, torch.zeros_like(rho)), ~inside
    valid = unit_mask != 0
    metrics = {
        "ratio_mean": masked_mean(rho, unit_mask),
        "ratio_max": rho[valid].max() if valid.any() else torch.zeros(()),
        "ratio_min": rho[valid].min() if valid.any() else torch.zeros(()),
        "clipped_fraction": masked_mean(clipped.to(m.dtype), unit_mask),
        "weight_mean": masked_mean(weights, unit_mask),
    }
    return (weights * m).detach(), metrics


def mismatch_metrics(old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """How far the rollout engine's log-probs are from the trainer's, on the sampled tokens.

    kl = E[log pi_rollout - log pi_old] (k1 estimate of KL(pi_rollout || pi_old), the samples being the
    rollout's); k3_kl = E[rho - 1 - log rho] with rho = pi_old / pi_rollout (non-negative, lower variance);
    logprob_abs_diff = E|log pi_old - log pi_rollout|. Means over response tokens; 0 on an empty mask.
    """
    m = _float_mask(response_mask, old_logprobs)
    log_rho = torch.where(m != 0, old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs)).detach()
    log_rho = log_rho.clamp(-_LOG_CLAMP, _LOG_CLAMP)
    return {
        "kl": masked_mean(-log_rho, m),
        "k3_kl": masked_mean(torch.exp(log_rho) - 1.0 - log_rho, m),
        "logprob_abs_diff": masked_mean(log_rho.abs(), m),
    }
