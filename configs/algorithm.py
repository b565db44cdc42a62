"""RL algorithm knobs: advantage estimator, PPO clip, loss aggregation, KL terms, DAPO options.

Defaults are the papers' (verl's) defaults; new features are opt-in.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlstages.configs.base import StrictModel

AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "abs", "k2", "k3"]


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


class AlgorithmConfig(StrictModel):
    """Everything that turns rollouts and rewards into a loss."""

    adv_estimator: AdvEstimator = "grpo"
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    lam: float = Field(default=1.0, ge=0.0, le=1.0)
    norm_adv_by_std: bool = Field(default=True, description="GRPO std normalisation; False = Dr.GRPO.")
    clip_ratio_low: float = Field(default=0.2, ge=0.0)
    clip_ratio_high: float = Field(default=0.2, ge=0.0, description="DAPO clip-higher uses 0.28.")
    clip_ratio_c: float | None = Field(default=3.0, gt=1.0, description="Dual-clip bound; None disables.")
    loss_agg_mode: LossAggMode = "token-mean"
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
