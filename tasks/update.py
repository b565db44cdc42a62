"""Update stages: critic, then actor, on the step's training batch; each returns its metrics."""

from __future__ import annotations

import math
import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlstages.configs import RunConfig
from rlstages.engines import types as T
from rlstages.engines.registry import training_backend
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.faults import maybe_fail, nan_due
from rlstages.tasks.stage_workers import TrainerRole, stage_workers


def _train(cfg: RunConfig, run: RunHandle, step: int, stage: str, prefix: TrainerRole) -> dict[str, float]:
    start = time.perf_counter()
    w = stage_workers(cfg, run, stage)
    maybe_fail(run, stage, step, w.workers)
    batch = T.load_batch(run.batch(step, "train"))
    if batch.batch_size[0] == 0:
        return {f"{prefix}/skipped": 1.0}
    if nan_due(run, stage, step):  # drill: a step whose loss is NaN
        field = T.RETURNS if prefix == "critic" else T.ADVANTAGES
        batch[field] = batch[field] * float("nan")
    per_rank = w.trainer(prefix).train_step(batch)  # the role: actor or critic
    metrics = {_name(prefix, k): _across_ranks(k, [r[k] for r in per_rank]) for k in per_rank[0]}
    metrics.update(reject_nonfinite(cfg, stage, step, metrics))
    metrics[f"timing/{stage}_s"] = time.perf_counter() - start
    tokens = float(batch[T.ATTENTION_MASK].sum())
    metrics[f"throughput/{stage}_tokens_per_s"] = tokens / max(metrics[f"timing/{stage}_s"], 1e-9)
    return metrics


def _name(prefix: str, key: str) -> str:
    """`actor/pg_loss`; the engine's `perf/mfu` becomes `perf/mfu/actor` (all roles' perf side by side)."""
    return f"{key}/{prefix}" if key.startswith("perf/") else f"{prefix}/{key}"


def _across_ranks(key: str, values: list[float]) -> float:
    """Ranks' metrics averaged (per-GPU throughput and MFU too); memory peaks are the largest rank's."""
    return max(values) if key.startswith("perf/") and key.endswith("_gb") else sum(values) / len(values)


class NonFiniteStep(ValueError):
    """A train step whose loss or gradient norm is NaN/inf (never retried: the same batch fails again)."""


def reject_nonfinite(cfg: RunConfig, stage: str, step: int, metrics: dict[str, float]) -> dict[str, float]:
    """Refuse a step with a non-finite loss or grad norm: raise (trainer.on_nonfinite=stop, before the weights
    are synced or checkpointed) or count it in `train/rejected_steps` (skip; the trainers do not apply it)."""
    train = cfg.critic if stage == "update_critic" else cfg.actor
    # a backend without `finite_grad_norm` (DeepSpeed: NaN for a norm it did not compute) handles overflow itself
    norms = "grad_norm" if train is None or training_backend(train.backend).finite_grad_norm else "\0"
    bad = sorted(k for k, v in metrics.items() if ("loss" in k or norms in k) and not math.isfinite(v))
    if not bad:
        return {}
    if cfg.trainer.on_nonfinite == "stop":
        raise NonFiniteStep(
            f"{stage} at step {step}: non-finite {', '.join(bad)}; the step is rejected and the run stops "
            "(trainer.on_nonfinite=skip goes on without it)"
        )
    return {"train/rejected_steps": 1.0}


@task(name="update_critic", cache_policy=NO_CACHE)
def update_critic(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """PPO value-function update."""
    return _train(cfg, run, step, "update_critic", "critic")


@task(name="update_actor", cache_policy=NO_CACHE)
def update_actor(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """Policy update; also reports `rollout/logprob_diff` (trainer vs rollout log-probs before the update)."""
    metrics = _train(cfg, run, step, "update_actor", "actor")
    for key in ("logprob_diff", "logprob_diff_max"):
        if f"actor/{key}" in metrics:
            metrics[f"rollout/{key}"] = metrics.pop(f"actor/{key}")
    return metrics
