"""RL post-training math as pure torch functions, one module per concern, all re-exported here.

`advantages` (estimators, masked statistics, DAPO shaping), `aggregation` (loss modes), `logits`
(log-probs, entropy), `policy_loss` (with the per-token losses of `policy_losses`), `value_loss`, `kl`
(estimators, KL in reward, controllers), `rollout_is` (rollout-trainer mismatch weights and metrics),
`decoupled` (the asynchronous decoupled PPO objective).
Numerics follow verl 0.9.1 (`core_algos.py`, see the
project's reference notes, section A) except that no edge case (empty mask, fully masked rows) raises
or yields NaN; each deviation is stated where it happens. Selection is by name through plain dicts.

Non-goals: models, optimisers, batching, distributed reduction (callers pass global counts), and any
Ray/Prefect/MLflow import.
"""

from __future__ import annotations

from rlstages.engines.algorithms.advantages import (
    ADV_ESTIMATORS,
    AdvantageEstimator,
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
from rlstages.engines.algorithms.aggregation import LOSS_AGG_MODES, LossAggMode, agg_loss
from rlstages.engines.algorithms.decoupled import decoupled_policy_loss
from rlstages.engines.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_in_reward,
    kl_penalty,
    make_kl_controller,
)
from rlstages.engines.algorithms.logits import (
    chunked_entropy,
    chunked_logprobs,
    chunked_logprobs_entropy,
    entropy_from_logits,
    logprobs_from_logits,
)
from rlstages.engines.algorithms.policy_loss import PolicyLossParams, policy_loss
from rlstages.engines.algorithms.policy_losses import POLICY_LOSSES, PolicyLossName
from rlstages.engines.algorithms.rollout_is import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
    mismatch_metrics,
    rollout_is_weights,
)
from rlstages.engines.algorithms.value_loss import value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "KLController",
    "LossAggMode",
    "PolicyLossName",
    "PolicyLossParams",
    "agg_loss",
    "apply_kl_in_reward",
    "chunked_entropy",
    "chunked_logprobs",
    "chunked_logprobs_entropy",
    "compute_advantages",
    "compute_gae",
    "compute_grpo",
    "compute_reinforce_pp",
    "compute_reinforce_pp_baseline",
    "compute_rloo",
    "decoupled_policy_loss",
    "entropy_from_logits",
    "filter_groups",
    "kl_penalty",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "outcome_to_token_rewards",
    "overlong_penalty",
    "policy_loss",
    "rollout_is_weights",
    "value_loss",
]
