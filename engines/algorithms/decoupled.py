"""The decoupled PPO objective for asynchronous training.

Hilton et al. 2022, "Batch size-invariance for policy optimization"; AReaL, Fu et al. 2025, arXiv:2505.24298
Eq. 5. In asynchronous training the policy that sampled a token (behaviour,
pi_behav: the rollout engine's per-token log-prob, possibly of an older policy version, and of several versions
within one trajectory) is not the policy the update's trust region is centred on (proximal, pi_prox: the trainer's
recompute of the log-probs before this update, `old_logprobs`):

    L_t = w_t * l(pi_theta / pi_prox, A_t),   w_t = trunc(pi_prox(y_t) / pi_behav(y_t))   (detached)

l is the configured per-token loss (PPO-clip for `vanilla`: max(-A r, -A clip(r, 1-low, 1+high))), so clipping
bounds the step from the proximal policy while w corrects for sampling from the behaviour policy. w is a
rollout-IS weight (`rollout_is_weights`): token level truncated (TIS) by default, or any level/mode of
`algorithm.rollout_is` (masked IS, sequence level). When pi_behav == pi_prox, w = 1 and L is the loss itself.

Non-goal: where the log-probs come from (the rollout engine stamps behaviour log-probs and versions per token).
"""

from __future__ import annotations

from torch import Tensor

from rlstages.engines.algorithms.aggregation import Count
from rlstages.engines.algorithms.policy_loss import PolicyLossParams, policy_loss
from rlstages.engines.algorithms.rollout_is import rollout_is_weights


def decoupled_policy_loss(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    cap: float = 2.0,
    level: str = "token",
    mode: str = "truncate",
    lower: float | None = None,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The decoupled objective above: `params.name`'s loss with ratio pi_theta / pi_prox, each token weighted by
    the detached behaviour weight pi_prox / pi_behav (truncated at `cap`, or masked outside [lower, cap]).
    Metrics: the loss's, plus behav_ratio_mean/max/min, behav_clipped_fraction, behav_weight_mean."""
    weights, is_metrics = rollout_is_weights(
        proximal_logprobs, behaviour_logprobs, response_mask, level, mode, cap, lower
    )
    loss, metrics = policy_loss(
        proximal_logprobs,
        logprobs,
        advantages,
        response_mask,
        params,
        global_tokens,
        global_seqs,
        rollout_is_weights=weights,
    )
    return loss, metrics | {f"behav_{k}": v for k, v in is_metrics.items()}
