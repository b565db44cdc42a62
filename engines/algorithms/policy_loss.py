"""The actor's policy-gradient loss: PPO-clip with DAPO clip-higher and dual clip, plus entropy and KL terms.

Non-goal: the critic's loss (`value_loss`) and advantage estimation (`advantages`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlstages.engines.algorithms.advantages import _float_mask, masked_mean
from rlstages.engines.algorithms.aggregation import LOSS_AGG_MODES, Count, LossAggMode, agg_loss
from rlstages.engines.algorithms.kl import _check_kl_kind, kl_penalty


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
