"""Generation stages: sample a step's rollouts, and push the trainer's weights to the rollout engines."""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlstages.configs import RunConfig
from rlstages.engines import types as T
from rlstages.engines.rollout.streaming import stamp_version
from rlstages.engines.rollout.trajectory import decoded_table, rollout_metrics, trajectory_infos
from rlstages.engines.sync.protocol import SyncRound
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.tools.registry import isolation_label
from rlstages.engines.types import SamplingParams
from rlstages.tasks.driver import tracking
from rlstages.tasks.driver.context import RunHandle, derive_seed
from rlstages.tasks.driver.data.loading import prompts_for_step, tokenizer_path
from rlstages.tasks.driver.faults import maybe_fail
from rlstages.tasks.driver.workers import get_workers
from rlstages.tasks.policies import guard_workers
from rlstages.tasks.stage_workers import stage_workers

BUCKET_BYTES = 256 << 20


def sampling(cfg: RunConfig, evaluation: bool = False) -> SamplingParams:
    """Training (n per prompt) or evaluation (one per prompt) sampling parameters."""
    r = cfg.rollout
    temperature = r.eval_temperature if evaluation and r.eval_temperature is not None else r.temperature
    return SamplingParams(
        n=1 if evaluation else r.n,
        temperature=temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop=tuple(r.stop),
    )


@task(name="generate", cache_policy=NO_CACHE)
def generate(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """Sample `rollout.n` responses for the step's prompts (seeded by run seed, step); writes rollout batch."""
    start = time.perf_counter()
    prompts = prompts_for_step(cfg.data, step, cfg.trainer.seed, tokenizer_path(cfg))
    w = stage_workers(cfg, run, "generate")
    maybe_fail(run, "generate", step, w.workers)
    seed = derive_seed(cfg.trainer.seed, step, "generate")
    batch = w.rollout.generate(prompts, sampling(cfg), seed)
    T.save_batch(batch, run.batch(step, "rollout"))
    # free the rollout weights while the trainers work (sync_weights wakes them), unless the next step's
    # generation runs during the update (one-step off-policy)
    if cfg.cluster.colocate and not cfg.trainer.overlaps_generation:
        w.rollout.sleep()
    elapsed = time.perf_counter() - start
    lengths = batch[T.ATTENTION_MASK][:, batch[T.PROMPT_IDS].shape[1] :].sum(-1).float()  # policy + observations
    tokens = float(lengths.sum())
    limit = cfg.rollout.response_budget
    log_trajectories(cfg, run, step, batch)
    return rollout_metrics(batch) | {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= limit).float().mean()),
        "throughput/rollout_tokens_per_s": tokens / max(elapsed, 1e-9),
        "rollout/tokens": tokens,
        "timing/generate_s": elapsed,
    }


def log_trajectories(cfg: RunConfig, run: RunHandle, step: int, batch: TensorDict) -> None:
    """A multi-turn step's trajectories, decoded with policy and tool tokens told apart, as an MLflow table
    (`rollout/trajectories_step_N.json`; `tracking.log_samples` rows)."""
    mlflow_run_id = run.mlflow_run_id()
    keep = cfg.tracking.log_samples
    if trajectory_infos(batch) is None or not mlflow_run_id or not keep:
        return
    table = decoded_table(batch, keep)
    label = isolation_label(cfg.rollout.multi_turn.environment)
    if label:  # how the python tool's programs ran (an explicit `require_isolation: false` shows here)
        table["sandbox"] = [label] * len(table["uid"])
    tracking.log_table(cfg, mlflow_run_id, table, f"rollout/trajectories_step_{step:06d}.json")


@task(name="sync_weights", cache_policy=NO_CACHE)
def sync_weights(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """Trainer -> rollout engines, streamed by HF name in buckets (woken first if they sleep), by the transport
    chosen when the workers were built (`Workers.weight_sync`, `engines.sync.registry`)."""
    workers = get_workers(run)
    timeout = cfg.prefect.policy("sync_weights").timeout_seconds
    actor = workers.actor
    source = actor.collect_ranks()[0]
    round = SyncRound(
        actor.handles, source, workers.rollout.handles, BUCKET_BYTES, cfg.rollout.dtype, timeout, actor.in_process
    )
    transport = workers.weight_sync
    assert transport is not None, "build_workers chooses the transport"
    metrics = guard_workers(lambda: transport.push(round))
    # the engines now sample with policy `step`: each token's `rollout_versions` says so (the start's sync: the
    # checkpoint's step)
    guard_workers(lambda: workers.rollout.each(stamp_version, step, timeout=timeout))
    return metrics
