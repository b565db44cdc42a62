"""Reward stage: score every rollout with the configured functions (and reward model), never crashing
on one bad sample: failures and timeouts get the fallback score and are counted.
"""

from __future__ import annotations

import json
import time

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from rlstages.configs import RunConfig
from rlstages.engines import types as T
from rlstages.engines.algorithms import overlong_penalty
from rlstages.engines.rollout.trajectory import trajectory_infos
from rlstages.engines.tensordict_import import TensorDict
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.faults import maybe_fail
from rlstages.tasks.stage_workers import StageWorkers, stage_workers


def score_batch(cfg: RunConfig, w: StageWorkers, batch: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
    """Scores [B] of a rollout batch and the reward metrics (functions + reward model + overlong penalty)."""
    prompts, responses = T.get_rows(batch, "prompt"), T.get_rows(batch, "response")
    truths = T.get_rows(batch, "ground_truth")
    sources = T.get_rows(batch, "data_source") if "data_source" in batch.keys() else None
    infos = [json.loads(x) for x in T.get_rows(batch, "extra_info")] if "extra_info" in batch.keys() else None
    trajectories = trajectory_infos(batch)
    if trajectories is not None:  # multi-turn: the functions may read the row's calls (e.g. tool_call_format)
        infos = [
            {**info, "trajectory": {k: t[k] for k in ("turns", "stop_reason", "tool_calls")}}
            for info, t in zip(infos or [{} for _ in trajectories], trajectories, strict=True)
        ]
    result = w.reward.score(prompts, responses, truths, sources, infos)
    scores = torch.tensor(result.scores, dtype=torch.float32)
    metrics = dict(result.metrics)
    if trajectories is not None:  # multi-turn: an environment's own final reward wins, the tools' turn rewards add
        env = [x["env_reward"] for x in trajectories]
        scores = torch.tensor([s if e is None else e for s, e in zip(scores.tolist(), env, strict=True)])
        scores = scores + torch.tensor([float(sum(x["turn_rewards"])) for x in trajectories])
        metrics["reward/environment_scored"] = sum(e is not None for e in env) / max(len(env), 1)
    metrics["reward/accuracy"] = float((scores > 0).float().mean())
    if w.workers.reward_model is not None and cfg.reward.reward_model is not None:
        weight = cfg.reward.reward_model.weight
        rm_scores = torch.tensor(w.reward_model.score(prompts, responses), dtype=torch.float32)
        scores = scores + weight * rm_scores
        metrics["reward/model_mean"] = float(rm_scores.mean())
    penalty = length_penalty(cfg, batch[T.RESPONSE_MASK].sum(-1))
    if penalty is not None:
        scores = scores + penalty
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
    metrics.update(
        {"reward/mean": float(scores.mean()), "reward/max": float(scores.max()), "reward/min": float(scores.min())}
    )
    return scores, metrics


@task(name="score_rewards", cache_policy=NO_CACHE)
def score_rewards(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """Score the step's rollouts; writes the `scores` batch."""
    start = time.perf_counter()
    batch = T.load_batch(run.batch(step, "rollout"))
    w = stage_workers(cfg, run, "score_rewards")
    maybe_fail(run, "score_rewards", step, w.workers)
    scores, metrics = score_batch(cfg, w, batch)
    T.save_batch(TensorDict({T.SCORES: scores}, batch_size=[len(scores)]), run.batch(step, "scores"))
    metrics["timing/score_rewards_s"] = time.perf_counter() - start
    return metrics


def length_penalty(cfg: RunConfig, lengths: torch.Tensor) -> torch.Tensor | None:
    """DAPO's soft overlong penalty of each row's response length (`algorithm.overlong`), against the response's
    budget (`rollout.response_budget`: a multi-turn trajectory's, not one turn's); None where it is off."""
    overlong = cfg.algorithm.overlong
    if not overlong.enable:
        return None
    return overlong_penalty(lengths, cfg.rollout.response_budget, overlong.buffer_len, overlong.penalty_factor)
