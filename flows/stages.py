"""The stage tasks of the training flow, each carrying its configured retries, timeout and run name.

Every field is the task itself (go-to-definition on `rollout.generate` lands on it), typed with its
parameters and result, so the recipe in train.py type-checks. Task runs are named by stage and step
(`generate[step=12]`): a 300-step run shows named, filterable task runs in the Prefect UI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from prefect import Task

from rlstages.configs import RunConfig
from rlstages.tasks import advantage, checkpoint, evaluate, logprobs, reward, rollout, run, update
from rlstages.tasks.advantage import AdvantageResult
from rlstages.tasks.context import RunHandle
from rlstages.tasks.policies import with_policy
from rlstages.tasks.run import StartPoint

MAX_PARALLEL_STAGES = 4  # the widest fan-out of a step: rewards, old/ref log-probs, critic values

Metrics = dict[str, float]
StepStage = Task[[RunConfig, RunHandle, int], Metrics]


@dataclass(frozen=True)
class Stages:
    """Prefect tasks by stage name (the same names as in `prefect.stages` of the config)."""

    prepare_run: Task[[RunConfig], RunHandle] = run.prepare_run
    start_tracking: Task[[RunConfig, RunHandle], str] = run.start_tracking
    start_workers: Task[[RunConfig, RunHandle], StartPoint] = run.start_workers
    recover_workers: Task[[RunConfig, RunHandle], StartPoint] = run.recover_workers
    generate: StepStage = rollout.generate
    score_rewards: StepStage = reward.score_rewards
    actor_logprobs: StepStage = logprobs.actor_logprobs
    ref_logprobs: StepStage = logprobs.ref_logprobs
    critic_values: StepStage = logprobs.critic_values
    advantages: Task[[RunConfig, RunHandle, int, dict[str, float]], AdvantageResult] = advantage.advantages
    update_critic: StepStage = update.update_critic
    update_actor: StepStage = update.update_actor
    sync_weights: StepStage = rollout.sync_weights
    evaluate: Task[[RunConfig, RunHandle, int, str], Metrics] = evaluate.evaluate
    checkpoint: Task[[RunConfig, RunHandle, int, dict[str, Any]], str] = checkpoint.save_checkpoint
    export_policy: Task[[RunConfig, RunHandle, str], str] = run.export_policy
    max_parallel: int = MAX_PARALLEL_STAGES

    @classmethod
    def configured(cls, cfg: RunConfig) -> Stages:
        """Every stage task with `cfg.prefect`'s policy for it and a run name with the step where it has one."""
        unpolicied = {"prepare_run", "recover_workers"}  # set-up and recovery keep their own (fixed) policy
        tasks: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "max_parallel":
                continue
            t: Task[Any, Any] = f.default  # type: ignore[assignment]
            if f.name not in unpolicied:
                t = with_policy(t, cfg.prefect.policy(f.name))
            has_step = "step" in t.fn.__code__.co_varnames[: t.fn.__code__.co_argcount]
            t = t.with_options(task_run_name=f"{f.name}[step={{step}}]" if has_step else f.name)
            tasks[f.name] = t
        return replace(cls(), **tasks, max_parallel=min(cfg.prefect.max_concurrent_stages, MAX_PARALLEL_STAGES))

    def together(self, stages: Sequence[StepStage], cfg: RunConfig, run: RunHandle, step: int) -> list[Metrics]:
        """Run step stages concurrently, at most `prefect.max_concurrent_stages` at a time; results in order."""
        results: list[Metrics] = []
        for i in range(0, len(stages), self.max_parallel):
            futures = [stage.submit(cfg, run, step) for stage in stages[i : i + self.max_parallel]]
            results.extend(future.result() for future in futures)
        return results
