"""Advantage stage (on the driver, CPU): token rewards (with KL-in-reward if on), the configured
estimator, rollout IS weights and mismatch metrics, DAPO group filtering; merges every field into the step's
training batch.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from rlstages.configs import RunConfig
from rlstages.configs.algorithm import RolloutISConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.tensordict_import import TensorDict
from rlstages.tasks.driver.context import RunHandle


class AdvantageResult(NamedTuple):
    """What the advantage stage returns: its metrics and the KL controller's state after this step."""

    metrics: dict[str, float]
    kl_state: dict[str, float]


_FIELDS = {"actor_logprobs": T.OLD_LOGPROBS, "ref_logprobs": T.REF_LOGPROBS, "critic_values": T.VALUES}


def initial_kl_state(cfg: RunConfig) -> dict[str, float]:
    """The KL controller's state before step 1."""
    return A.make_kl_controller(
        cfg.algorithm.kl_ctrl.type,
        cfg.algorithm.kl_ctrl.kl_coef,
        cfg.algorithm.kl_ctrl.target_kl,
        cfg.algorithm.kl_ctrl.horizon,
    ).state_dict()


def rollout_correction(batch: TensorDict, rollout_is: RolloutISConfig) -> dict[str, float]:
    """Mismatch metrics of trainer (old) vs rollout log-probs, and the IS weights into `batch` if configured."""
    if T.OLD_LOGPROBS not in batch.keys() or T.ROLLOUT_LOGPROBS not in batch.keys():
        return {}
    old, rollout, mask = batch[T.OLD_LOGPROBS], batch[T.ROLLOUT_LOGPROBS], batch[T.RESPONSE_MASK]
    metrics = {f"rollout_corr/{k}": float(v) for k, v in A.mismatch_metrics(old, rollout, mask).items()}
    if rollout_is.level != "none":
        weights, is_metrics = A.rollout_is_weights(
            old, rollout, mask, rollout_is.level, rollout_is.mode, rollout_is.threshold, rollout_is.threshold_lower
        )
        batch[T.ROLLOUT_IS_WEIGHTS] = weights
        metrics.update({f"rollout_corr/is_{k}": float(v) for k, v in is_metrics.items()})
    return metrics


@task(name="advantages", cache_policy=NO_CACHE)
def advantages(cfg: RunConfig, run: RunHandle, step: int, kl_state: dict[str, float]) -> AdvantageResult:
    """Build the training batch; returns its metrics and the KL controller after this step."""
    start = time.perf_counter()
    algo = cfg.algorithm
    batch = T.load_batch(run.batch(step, "rollout"))
    scores = T.load_batch(run.batch(step, "scores"))[T.SCORES]
    for stage, key in _FIELDS.items():
        path = run.batch(step, stage)
        if path.is_file():
            batch[key] = T.load_batch(path)[key]
    mask = batch[T.RESPONSE_MASK]
    token_scores = A.outcome_to_token_rewards(scores, mask)
    metrics = rollout_correction(batch, algo.behaviour_correction())
    ctrl = A.make_kl_controller(algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl, algo.kl_ctrl.horizon)
    ctrl.load_state_dict(kl_state)
    if algo.use_kl_in_reward:
        old = batch[T.OLD_LOGPROBS] if T.OLD_LOGPROBS in batch.keys() else batch[T.ROLLOUT_LOGPROBS]
        token_rewards, kl_metrics = A.apply_kl_in_reward(
            token_scores, old, batch[T.REF_LOGPROBS], mask, ctrl.value, algo.kl_penalty
        )
        ctrl.update(kl_metrics["kl_in_reward"], n_steps=batch.batch_size[0])
        metrics.update({f"actor/reward_{k}": float(v) for k, v in kl_metrics.items()})
    else:
        token_rewards = token_scores
    uids = T.get_rows(batch, "uid")
    adv, returns = A.compute_advantages(
        algo.adv_estimator,
        token_rewards,
        mask,
        uids,
        values=batch.get(T.VALUES, None),
        gamma=algo.gamma,
        lam=algo.lam,
        norm_by_std=algo.norm_adv_by_std,
    )
    batch[T.TOKEN_REWARDS], batch[T.ADVANTAGES], batch[T.RETURNS] = token_rewards, adv, returns
    batch[T.SCORES] = scores
    keep = A.filter_groups(scores, uids) if algo.filter_groups else torch.ones(len(uids), dtype=torch.bool)
    metrics["batch/kept_fraction"] = float(keep.float().mean())
    batch = batch[keep]
    T.save_batch(batch, run.batch(step, "train"))
    metrics.update(
        {
            "critic/advantages/mean": float(A.masked_mean(adv, mask)),
            "critic/advantages/max": float(adv.max()) if adv.numel() else 0.0,
            "critic/returns/mean": float(A.masked_mean(returns, mask)),
            "timing/advantages_s": time.perf_counter() - start,
        }
    )
    return AdvantageResult(metrics, ctrl.state_dict())
