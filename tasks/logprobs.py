"""Stages that only read the rollouts and run concurrently: old (actor) log-probs, reference log-probs,
critic values. Each writes one [B, T] field.
"""

from __future__ import annotations

import time

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from tensordict import TensorDict

from rlstages.configs import RunConfig
from rlstages.engines import types as T
from rlstages.engines.algorithms import masked_mean
from rlstages.engines.runtime.actor_group import ActorGroup
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.workers import get_workers
from rlstages.tasks.policies import guard_workers


def _write(run: RunHandle, step: int, stage: str, key: str, value: torch.Tensor) -> None:
    tensor = value
    T.save_batch(TensorDict({key: tensor}, batch_size=[tensor.shape[0]]), run.batch(step, stage))


def _logprobs(
    cfg: RunConfig, run: RunHandle, step: int, group: ActorGroup, stage: str, key: str, base: bool = False
) -> dict[str, float]:
    start = time.perf_counter()
    batch = T.load_batch(run.batch(step, "rollout"))
    timeout = cfg.prefect.policy(stage).timeout_seconds
    if base:  # the actor's frozen LoRA base serves as the reference
        out = guard_workers(lambda: group.dp(timeout).logprobs(batch, None, True))
    else:
        out = guard_workers(lambda: group.dp(timeout).logprobs(batch))
    _write(run, step, stage, key, out["logprobs"])
    metrics = {f"timing/{stage}_s": time.perf_counter() - start}
    if stage == "actor_logprobs":
        mask = batch[T.RESPONSE_MASK]
        metrics["actor/entropy_old"] = float(masked_mean(out["entropy"], mask))
        diff = (out["logprobs"] - batch[T.ROLLOUT_LOGPROBS]).abs()
        metrics["rollout/logprob_diff"] = float(masked_mean(diff, mask))
    return metrics


@task(name="actor_logprobs", cache_policy=NO_CACHE)
def actor_logprobs(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """Log-probs of the rollouts under the current actor (PPO's old policy)."""
    return _logprobs(cfg, run, step, get_workers(cfg, run).actor, "actor_logprobs", T.OLD_LOGPROBS)


@task(name="ref_logprobs", cache_policy=NO_CACHE)
def ref_logprobs(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """Log-probs of the rollouts under the frozen reference policy."""
    workers = get_workers(cfg, run)
    if cfg.model.lora is not None:  # no second copy of the weights: the actor with its adapter disabled
        return _logprobs(cfg, run, step, workers.actor, "ref_logprobs", T.REF_LOGPROBS, base=True)
    group = workers.reference
    assert group is not None, "ref_logprobs runs only when the reference is enabled"
    return _logprobs(cfg, run, step, group, "ref_logprobs", T.REF_LOGPROBS)


@task(name="critic_values", cache_policy=NO_CACHE)
def critic_values(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """Critic values of the rollouts (PPO with GAE)."""
    start = time.perf_counter()
    group = get_workers(cfg, run).critic
    assert group is not None, "critic_values runs only with a critic"
    batch = T.load_batch(run.batch(step, "rollout"))
    timeout = cfg.prefect.policy("critic_values").timeout_seconds
    values = guard_workers(lambda: group.dp(timeout).values(batch))
    _write(run, step, "critic_values", T.VALUES, values)
    return {
        "critic/values_mean": float(masked_mean(values, batch[T.RESPONSE_MASK])),
        "timing/critic_values_s": time.perf_counter() - start,
    }
