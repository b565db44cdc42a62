"""RL post-training math as pure torch functions: losses, KL, and (re-exported) advantage estimators.

The public entry point for `engines/`: advantage estimators, masked statistics and DAPO shaping live
in `engines.advantages` and are re-exported here. Numerics follow verl 0.9.1 (`core_algos.py`, see the
project's reference notes, section A) except that no edge case (empty mask, fully masked rows) raises
or yields NaN; each deviation is stated where it happens. Selection is by name through plain dicts.

Non-goals: models, optimisers, batching, distributed reduction (callers pass global counts), and any
Ray/Prefect/MLflow import.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from engines.advantages import (
    ADV_ESTIMATORS,
    AdvantageEstimator,
    _float_mask,
    compute_advantages,
    compute_gae,
    compute_grpo,
    compute_reinforce_pp,
    compute_reinforce_pp_baseline,
    compute_rloo,
    filter_groups,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    outcome_to_token_rewards,
    overlong_penalty,
)

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "KLController",
    "LossAggMode",
    "PolicyLossParams",
    "agg_loss",
    "apply_kl_in_reward",
    "compute_advantages",
    "compute_gae",
    "compute_grpo",
    "compute_reinforce_pp",
    "compute_reinforce_pp_baseline",
    "compute_rloo",
    "entropy_from_logits",
    "filter_groups",
    "kl_penalty",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "outcome_to_token_rewards",
    "overlong_penalty",
    "policy_loss",
    "value_loss",
]

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
Count = float | Tensor  # a normaliser: Python number or an all-reduced scalar tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(z) over the last dim, logsumexp(z) - sum softmax(z)*z, in float32 or wider."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature) gathered at `labels` ([..., V] -> [...]), in float32 or wider.

    Dividing by the rollout temperature makes trainer log-probs match the sampler's (verl does the same).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        z = z / temperature
    picked = torch.gather(z, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def _safe_div(num: Tensor, den: Count) -> Tensor:
    """Divide, giving 0 where `den` <= 0, with finite gradients in both branches."""
    den_t = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    positive = den_t > 0
    quotient = num / torch.where(positive, den_t, torch.ones_like(den_t))
    return torch.where(positive, quotient, torch.zeros_like(quotient))


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    loss_scale_factor: float | None = None,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar (verl 0.9.1 `agg_loss`; DAPO §3.3, Dr.GRPO arXiv:2503.20783).

    token-mean: sum(L*m) / N_tokens. seq-mean-token-sum: sum_i S_i / N_seqs with S_i = sum_t L*m over
    rows with >= 1 token. seq-mean-token-mean: sum_i (S_i / n_i) / N_seqs. seq-mean-token-sum-norm:
    seq-mean-token-sum / loss_scale_factor (default T, the padded length). N_* default to local counts;
    pass the mini-batch totals as `global_tokens` / `global_seqs` so micro-batch losses sum to the
    mini-batch loss (scaling by the DP world size, if DDP averages gradients, is the caller's job).
    Deviation from verl: zero tokens (or a zero normaliser) gives 0, not NaN.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {list(LOSS_AGG_MODES)}")
    m = _float_mask(mask, loss_mat)
    if mode == "token-mean":
        return _safe_div(masked_sum(loss_mat, m), m.sum() if global_tokens is None else global_tokens)
    tokens = m.sum(dim=-1)
    seq_sum = masked_sum(loss_mat, m, dim=-1)
    per_seq = _safe_div(seq_sum, tokens) if mode == "seq-mean-token-mean" else seq_sum
    valid = tokens > 0
    total = torch.where(valid, per_seq, torch.zeros_like(per_seq)).sum()
    loss = _safe_div(total, valid.sum() if global_seqs is None else global_seqs)
    if mode == "seq-mean-token-sum-norm":
        loss = _safe_div(loss, loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


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


@dataclass(frozen=True)
class PolicyLossParams:
    """Knobs of `policy_loss`; defaults are PPO's (eps 0.2) with dual clip c=3 and no entropy/KL terms.

    DAPO clip-higher: clip_ratio_high=0.28. Dr.GRPO: loss_agg_mode="seq-mean-token-sum-norm" with a
    fixed loss_scale_factor. `clip_ratio_c=None` disables dual clip.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: LossAggMode = "token-mean"
    loss_scale_factor: int | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"

    def __post_init__(self) -> None:
        """Reject settings that would silently train wrong, with the fix in the message."""
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError("clip_ratio_low/high must be >= 0 (the ratio is clipped to [1-low, 1+high])")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError(
                f"clip_ratio_c={self.clip_ratio_c} must be > 1: dual clip caps the loss of negative-advantage "
                "tokens at c*|A|, above the PPO clip; use None to disable it"
            )
        if self.loss_scale_factor is not None and self.loss_scale_factor <= 0:
            raise ValueError(f"loss_scale_factor must be > 0 or None (= padded length), got {self.loss_scale_factor}")
        _check_kl_kind(self.kl_loss_type)


def policy_loss(
    old_logprobs: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    *,
    entropy: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip (Schulman et al. 2017, arXiv:1707.06347, Eq. 7) with DAPO clip-higher and dual clip.

    rho = exp(clamp(logp - old, -20, 20)); L = max(-A*rho, -A*clip(rho, 1-low, 1+high)); for A < 0 the
    dual clip (Ye et al. 2020, arXiv:1912.09729) takes min(L, -A*c). Aggregated by `agg_loss`. Optional
    terms, as verl's actor adds them: `- entropy_coeff * agg(entropy)` (pass per-token `entropy`) and
    `+ kl_loss_coef * agg(kl_penalty(logp, ref, kl_loss_type))` if `use_kl_loss` (pass `ref_logprobs`).
    Metrics (detached): pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl, and entropy / kl_loss / kl_coef
    when those terms are present.

    Raises:
        ValueError: if params ask for an entropy or KL term whose input tensor was not passed.
    """
    m = _float_mask(response_mask, logprobs)
    log_ratio = torch.clamp(logprobs - old_logprobs, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    per_token = loss_clip
    clipfrac_lower = torch.zeros((), dtype=m.dtype, device=m.device)
    if params.clip_ratio_c is not None:
        loss_dual = -advantages * params.clip_ratio_c
        negative = advantages < 0
        per_token = torch.where(negative, torch.minimum(loss_clip, loss_dual), loss_clip)
        clipfrac_lower = masked_mean(((loss_clip > loss_dual) & negative).to(m.dtype), m)

    def agg(values: Tensor) -> Tensor:
        return agg_loss(values, m, params.loss_agg_mode, params.loss_scale_factor, global_tokens, global_seqs)

    loss = agg(per_token)
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(m.dtype), m).detach(),
        "pg_clipfrac_lower": clipfrac_lower.detach(),
        "ppo_kl": masked_mean(-log_ratio, m).detach(),
    }
    if params.entropy_coeff != 0 and entropy is None:
        raise ValueError("entropy_coeff != 0 needs per-token `entropy` (entropy_from_logits) in policy_loss")
    if entropy is not None:
        entropy_agg = agg(entropy)
        loss = loss - params.entropy_coeff * entropy_agg
        metrics["entropy"] = entropy_agg.detach()
    if params.use_kl_loss:
        if ref_logprobs is None:
            raise ValueError("use_kl_loss=True needs `ref_logprobs` in policy_loss (or set use_kl_loss=False)")
        kl = agg(kl_penalty(logprobs, ref_logprobs, params.kl_loss_type))
        loss = loss + params.kl_loss_coef * kl
        metrics["kl_loss"] = kl.detach()
        metrics["kl_coef"] = torch.tensor(params.kl_loss_coef)
    return loss, metrics


def value_loss(
    vpreds: Tensor,
    returns: Tensor,
    old_values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss (PPO2 baselines; Engstrom et al. 2020, arXiv:2005.12729): 0.5*agg(max(u, c)).

    u = (v - R)^2, c = (clip(v, V_old - eps, V_old + eps) - R)^2. Returns (loss, clipfrac) with
    clipfrac = masked mean of [c > u] (detached).
    """
    m = _float_mask(response_mask, vpreds)
    vpreds_clipped = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpreds_clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped, clipped), m, loss_agg_mode, None, global_tokens, global_seqs)
    return loss, masked_mean((clipped > unclipped).to(m.dtype), m).detach()


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
