"""Stages that only read the rollouts and run concurrently: old (actor) log-probs, reference log-probs,
critic values. Each writes one [B, T] field.
"""

from __future__ import annotations

import time

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from rlstages.configs import RunConfig
from rlstages.engines import types as T
from rlstages.engines.algorithms import masked_mean
from rlstages.engines.tensordict_import import TensorDict
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.stage_workers import TrainerRole, stage_workers


def _write(run: RunHandle, step: int, stage: str, key: str, value: torch.Tensor) -> None:
    tensor = value
    T.save_batch(TensorDict({key: tensor}, batch_size=[tensor.shape[0]]), run.batch(step, stage))


def _logprobs(
    cfg: RunConfig, run: RunHandle, step: int, role: TrainerRole, stage: str, key: str, base: bool = False
) -> dict[str, float]:
    start = time.perf_counter()
    batch = T.load_batch(run.batch(step, "rollout"))
    w = stage_workers(cfg, run, stage)
    if base:  # the actor's frozen LoRA base serves as the reference
        out = w.trainer(role).logprobs(batch, None, True)
    else:
        out = w.trainer(role).logprobs(batch)
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
    return _logprobs(cfg, run, step, "actor", "actor_logprobs", T.OLD_LOGPROBS)


@task(name="ref_logprobs", cache_policy=NO_CACHE)
def ref_logprobs(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """Log-probs of the rollouts under the frozen reference policy."""
    if cfg.model.lora is not None:  # no second copy of the weights: the actor with its adapter disabled
        return _logprobs(cfg, run, step, "actor", "ref_logprobs", T.REF_LOGPROBS, base=True)
    return _logprobs(cfg, run, step, "reference", "ref_logprobs", T.REF_LOGPROBS)


@task(name="critic_values", cache_policy=NO_CACHE)
def critic_values(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """Critic values of the rollouts (PPO with GAE)."""
    start = time.perf_counter()
    batch = T.load_batch(run.batch(step, "rollout"))
    values = stage_workers(cfg, run, "critic_values").trainer("critic").values(batch)
    _write(run, step, "critic_values", T.VALUES, values)
    return {
        "critic/values_mean": float(masked_mean(values, batch[T.RESPONSE_MASK])),
        "timing/critic_values_s": time.perf_counter() - start,
    }
