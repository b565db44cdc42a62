"""RL algorithm knobs: advantage estimator, policy loss and its clip, loss aggregation, KL terms, DAPO options,
rollout-trainer mismatch correction.

Defaults are the papers' (verl's) defaults; new features are opt-in.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlstages.configs.base import StrictModel

AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "abs", "k2", "k3"]
PolicyLoss = Literal["vanilla", "gspo", "cispo", "clip_cov", "kl_cov"]


class KLControlConfig(StrictModel):
    """Coefficient of the KL-in-reward penalty: fixed, or adaptive towards a target KL (Ziegler et al.)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(default=0.001, ge=0.0)
    target_kl: float = Field(default=0.1, gt=0.0)
    horizon: int = Field(default=10000, gt=0)


class OverlongConfig(StrictModel):
    """DAPO's soft overlong punishment: linear penalty inside the last `buffer_len` tokens."""

    enable: bool = False
    buffer_len: int = Field(default=16, ge=1)
    penalty_factor: float = Field(default=1.0, ge=0.0)


class GSPOConfig(StrictModel):
    """GSPO's clip range on the length-normalised sequence ratio (Zheng et al. 2025: 3e-4 / 4e-4)."""

    clip_ratio_low: float = Field(default=3e-4, ge=0.0)
    clip_ratio_high: float = Field(default=4e-4, ge=0.0)


class CISPOConfig(StrictModel):
    """CISPO's clip of the stop-gradient IS weight to [1-low, 1+high]; low >= 1 means no lower bound (the paper's)."""

    clip_ratio_low: float = Field(default=1.0, ge=0.0)
    clip_ratio_high: float = Field(default=0.28, ge=0.0)


class ClipCovConfig(StrictModel):
    """Clip-Cov: detach a random `ratio` of the tokens whose covariance Cov(logp, A) lies in (lb, ub)."""

    ratio: float = Field(default=2e-4, gt=0.0, le=1.0, description="Fraction of response tokens detached.")
    lb: float = Field(default=1.0, description="Covariance lower bound of the candidates.")
    ub: float = Field(default=5.0, description="Covariance upper bound of the candidates.")


class KLCovConfig(StrictModel):
    """KL-Cov: add coef * |logp - old| to the top `ratio` of tokens by Cov(logp, A); no clipping."""

    ratio: float = Field(default=2e-4, gt=0.0, le=1.0, description="Fraction of response tokens penalised.")
    coef: float = Field(default=1.0, ge=0.0, description="Weight of |logp - old| on those tokens.")


class RolloutISConfig(StrictModel):
    """Rollout-trainer mismatch correction: weight each token's loss by pi_old(trainer) / pi_rollout.

    level: none (off), token or sequence (the ratio of the whole response); mode: truncate (TIS, w = min(rho,
    threshold)) or mask (w = rho inside [threshold_lower, threshold], 0 outside). Mismatch metrics
    (`rollout_corr/*`) are logged whenever old log-probs are computed.
    """

    level: Literal["none", "token", "sequence"] = Field(
        default="none",
        description="none = off; token: rho_t = pi_old/pi_rollout per token; sequence: the response's product.",
    )
    mode: Literal["truncate", "mask"] = Field(
        default="truncate", description="truncate (TIS): min(rho, threshold); mask: rho in band, else 0."
    )
    threshold: float = Field(default=2.0, ge=1.0, description="Cap on the IS ratio (TIS truncation / mask upper).")
    threshold_lower: float | None = Field(
        default=None, ge=0.0, le=1.0, description="Lower bound of the mask mode; None = 1/threshold."
    )


class AlgorithmConfig(StrictModel):
    """Everything that turns rollouts and rewards into a loss."""

    def behaviour_correction(self) -> RolloutISConfig:
        """The IS weight applied to the loss: `rollout_is` as set, or token-level TIS when only the decoupled
        loss asks for one (its behaviour weight is never skipped)."""
        if self.decoupled_loss and self.rollout_is.level == "none":
            return self.rollout_is.model_copy(update={"level": "token", "mode": "truncate"})
        return self.rollout_is

    adv_estimator: AdvEstimator = "grpo"
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    lam: float = Field(default=1.0, ge=0.0, le=1.0)
    norm_adv_by_std: bool = Field(default=True, description="GRPO std normalisation; False = Dr.GRPO.")
    clip_ratio_low: float = Field(default=0.2, ge=0.0)
    clip_ratio_high: float = Field(default=0.2, ge=0.0, description="DAPO clip-higher uses 0.28.")
    clip_ratio_c: float | None = Field(default=3.0, gt=1.0, description="Dual-clip bound; None disables.")
    policy_loss: PolicyLoss = Field(
        default="vanilla",
        description="Per-token policy loss: vanilla (PPO-clip, clip_ratio_* and dual clip), gspo, cispo, clip_cov "
        "(uses clip_ratio_low/high too) or kl_cov; each reads its own section below.",
    )
    gspo: GSPOConfig = GSPOConfig()
    cispo: CISPOConfig = CISPOConfig()
    clip_cov: ClipCovConfig = ClipCovConfig()
    kl_cov: KLCovConfig = KLCovConfig()
    rollout_is: RolloutISConfig = RolloutISConfig()
    decoupled_loss: bool = Field(
        default=False,
        description="Decoupled PPO (docs/algorithms.md): the loss's ratio is against the trainer's recompute of "
        "the pre-update log-probs (proximal), and every token is weighted by pi_prox / pi_behav (behaviour = the "
        "rollout's per-token log-probs) as rollout_is configures it; with rollout_is.level none the weight is "
        "token-level truncated at rollout_is.threshold. For trainer.mode async / one_step_off.",
    )
    loss_agg_mode: LossAggMode = Field(
        default="token-mean", description="token-sum: sum over tokens x DP size, no normaliser (verl 0.9.1)."
    )
    loss_scale_factor: int | None = Field(
        default=None, description="Constant normaliser of seq-mean-token-sum-norm; None = max_new_tokens."
    )
    entropy_coeff: float = 0.0
    cliprange_value: float = Field(default=0.5, gt=0.0)
    use_kl_in_reward: bool = False
    kl_penalty: KLEstimator = "k1"
    kl_ctrl: KLControlConfig = KLControlConfig()
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(default=0.001, ge=0.0)
    kl_loss_type: KLEstimator = "k3"
    allow_kl_in_reward_and_loss: bool = False
    filter_groups: bool = Field(default=False, description="DAPO dynamic sampling: drop all-equal groups.")
    overlong: OverlongConfig = OverlongConfig()
    critic_warmup_steps: int = Field(default=0, ge=0)
