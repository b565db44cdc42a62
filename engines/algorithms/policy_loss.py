"""The actor's policy-gradient loss: a per-token loss chosen by name (PPO-clip with DAPO clip-higher and dual
clip, GSPO, CISPO, Clip-Cov, KL-Cov), rollout IS weights, aggregation, plus entropy and KL terms.

Non-goal: the critic's loss (`value_loss`) and advantage estimation (`advantages`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlstages.engines.algorithms.advantages import _float_mask
from rlstages.engines.algorithms.aggregation import LOSS_AGG_MODES, Count, LossAggMode, agg_loss
from rlstages.engines.algorithms.kl import _check_kl_kind, kl_penalty
from rlstages.engines.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLossName,
    cispo,
    clip_cov,
    gspo,
    kl_cov,
    vanilla,
)


@dataclass(frozen=True)
class PolicyLossParams:
    """Knobs of `policy_loss`; defaults are PPO's (eps 0.2) with dual clip c=3 and no entropy/KL terms.

    DAPO clip-higher: clip_ratio_high=0.28. Dr.GRPO: loss_agg_mode="seq-mean-token-sum-norm" with a
    fixed loss_scale_factor. `clip_ratio_c=None` disables dual clip. `name` picks the per-token loss; the
    gspo_* / cispo_* / clip_cov_* / kl_cov_* fields are read only by that loss (`clip_cov` also uses
    clip_ratio_low/high). `dp_size` scales token-sum aggregation (see `agg_loss`).
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
    name: PolicyLossName = "vanilla"
    gspo_clip_ratio_low: float = 3e-4
    gspo_clip_ratio_high: float = 4e-4
    cispo_clip_ratio_low: float = 1.0
    cispo_clip_ratio_high: float = 0.28
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 1.0
    dp_size: int = 1

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
        if self.name not in POLICY_LOSSES:
            raise ValueError(f"policy loss {self.name!r} is not one of {list(POLICY_LOSSES)}")
        for field in ("gspo_clip_ratio_low", "gspo_clip_ratio_high", "cispo_clip_ratio_low", "cispo_clip_ratio_high"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 0 (the band is [1-low, 1+high])")
        for field in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"{field}={getattr(self, field)} must be in (0, 1]: the fraction of tokens selected")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb={self.clip_cov_lb} must be < clip_cov_ub={self.clip_cov_ub}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")


def per_token_loss(
    params: PolicyLossParams, old: Tensor, logp: Tensor, adv: Tensor, m: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The [B, T] loss of `params.name` and its metrics (see `policy_losses`)."""
    if params.name == "gspo":
        return gspo(old, logp, adv, m, params.gspo_clip_ratio_low, params.gspo_clip_ratio_high)
    if params.name == "cispo":
        return cispo(old, logp, adv, m, params.cispo_clip_ratio_low, params.cispo_clip_ratio_high)
    if params.name == "clip_cov":
        low, high = params.clip_ratio_low, params.clip_ratio_high
        return clip_cov(old, logp, adv, m, low, high, params.clip_cov_ratio, params.clip_cov_lb, params.clip_cov_ub)
    if params.name == "kl_cov":
        return kl_cov(old, logp, adv, m, params.kl_cov_ratio, params.kl_cov_coef)
    return vanilla(old, logp, adv, m, params.clip_ratio_low, params.clip_ratio_high, params.clip_ratio_c)


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
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss `params.name` (default PPO-clip with clip-higher and dual clip; see `policy_losses`).

    The per-token loss is multiplied by `rollout_is_weights` (detached pi_old / pi_rollout, after clipping
    and before aggregation, as verl 0.9 does) when given, then aggregated by `agg_loss`. Optional terms,
    as verl's actor adds them: `- entropy_coeff * agg(entropy)` (pass per-token `entropy`) and
    `+ kl_loss_coef * agg(kl_penalty(logp, ref, kl_loss_type))` if `use_kl_loss` (pass `ref_logprobs`).
    Metrics (detached): pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl, and entropy / kl_loss / kl_coef
    when those terms are present.

    Raises:
        ValueError: if params ask for an entropy or KL term whose input tensor was not passed.
    """
    m = _float_mask(response_mask, logprobs)
    per_token, pg = per_token_loss(params, old_logprobs, logprobs, advantages, m)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights.detach()

    def agg(values: Tensor) -> Tensor:
        return agg_loss(
            values, m, params.loss_agg_mode, params.loss_scale_factor, global_tokens, global_seqs, params.dp_size
        )

    loss = agg(per_token)
    metrics = {"pg_loss": loss.detach(), **{k: v.detach() for k, v in pg.items()}}
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
