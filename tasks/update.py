"""Update stages: critic, then actor, on the step's training batch; each returns its metrics."""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlstages.configs import RunConfig
from rlstages.engines import types as T
from rlstages.engines.runtime.actor_group import ActorGroup
from rlstages.tasks.context import RunHandle
from rlstages.tasks.faults import maybe_fail
from rlstages.tasks.policies import guard_workers
from rlstages.tasks.workers import get_workers


def _train(cfg: RunConfig, run: RunHandle, step: int, group: ActorGroup, stage: str, prefix: str) -> dict[str, float]:
    start = time.perf_counter()
    maybe_fail(run, stage, step, get_workers(cfg, run))
    batch = T.load_batch(run.batch(step, "train"))
    if batch.batch_size[0] == 0:
        return {f"{prefix}/skipped": 1.0}
    timeout = cfg.prefect.policy(stage).timeout_seconds
    results = guard_workers(lambda: group.dp(timeout).train_step(batch))
    per_rank = results if isinstance(results, list) else [results]
    metrics = {f"{prefix}/{k}": sum(r[k] for r in per_rank) / len(per_rank) for k in per_rank[0]}
    metrics[f"timing/{stage}_s"] = time.perf_counter() - start
    tokens = float(batch[T.ATTENTION_MASK].sum())
    metrics[f"throughput/{stage}_tokens_per_s"] = tokens / max(metrics[f"timing/{stage}_s"], 1e-9)
    return metrics


@task(name="update_critic", cache_policy=NO_CACHE)
def update_critic(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """PPO value-function update."""
    group = get_workers(cfg, run).critic
    assert group is not None, "update_critic runs only with a critic"
    return _train(cfg, run, step, group, "update_critic", "critic")


@task(name="update_actor", cache_policy=NO_CACHE)
def update_actor(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """Policy update; also reports `rollout/logprob_diff` (trainer vs rollout log-probs before the update)."""
    metrics = _train(cfg, run, step, get_workers(cfg, run).actor, "update_actor", "actor")
    for key in ("logprob_diff", "logprob_diff_max"):
        if f"actor/{key}" in metrics:
            metrics[f"rollout/{key}"] = metrics.pop(f"actor/{key}")
    return metrics
