"""The stage tasks of the training flow, each carrying its configured retries, timeout and run name.

Every field is the task itself (go-to-definition on `rollout.generate` lands on it), typed with its
parameters and result, so the recipe in train.py type-checks. Task runs are named by stage and step
(`generate[step=12]`): a 300-step run shows named, filterable task runs in the Prefect UI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Generic, ParamSpec, TypeVar

from prefect import Task
from prefect.futures import PrefectFuture
from prefect.utilities.annotations import quote

from rlstages.configs import RunConfig
from rlstages.tasks import advantage, evaluate, logprobs, reward, rollout, run, update
from rlstages.tasks import checkpoint as checkpoints
from rlstages.tasks.advantage import AdvantageResult
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.policies import with_policy
from rlstages.tasks.profiling import due, profiled
from rlstages.tasks.run import StartPoint

MAX_PARALLEL_STAGES = 4  # the widest fan-out of a step: rewards, old/ref log-probs, critic values
POOL_THREADS = MAX_PARALLEL_STAGES + 1  # the flow's task pool: that fan-out beside a checkpoint's commit in flight

Metrics = dict[str, float]
P = ParamSpec("P")
R = TypeVar("R")


class Stage(Generic[P, R]):
    """A stage task called with its run config and run handle passed through as they are (`quote`): Prefect
    otherwise walks every field of the config on each call looking for futures, twice (parameters and task
    inputs) -- the largest part of its per-stage overhead. Everything else (`retries`, `fn`...) is the task's."""

    def __init__(self, task: Task[P, R], name: str = "") -> None:
        self.task, self.name = task, name

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the task now (in the flow's thread) and return its result; inside the workers' profilers when
        `trainer.profile` names this stage and step."""
        if self.profiled(*args):
            with profiled(args[0], args[1], self.name, args[2]):  # type: ignore[arg-type]
                return self.task(*_quoted(args), **kwargs)  # type: ignore[arg-type]
        return self.task(*_quoted(args), **kwargs)  # type: ignore[arg-type]  # quote() unwraps to the same value

    def profiled(self, *args: Any) -> bool:
        """Whether a call with these (cfg, run, step, ...) arguments is profiled."""
        return len(args) >= 3 and isinstance(args[0], RunConfig) and due(args[0], self.name, args[2])

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> PrefectFuture[R]:
        """Run concurrently in the flow's task runner."""
        return self.task.submit(*_quoted(args), **kwargs)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)


def _quoted(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(quote(a) if isinstance(a, RunConfig | RunHandle) else a for a in args)


StepStage = Stage[[RunConfig, RunHandle, int], Metrics]


@dataclass(frozen=True)
class Stages:
    """Prefect tasks by stage name (the same names as in `prefect.stages` of the config)."""

    prepare_run: Stage[[RunConfig], RunHandle] = Stage(run.prepare_run)
    start_tracking: Stage[[RunConfig, RunHandle], str] = Stage(run.start_tracking)
    start_workers: Stage[[RunConfig, RunHandle], StartPoint] = Stage(run.start_workers)
    recover_workers: Stage[[RunConfig, RunHandle], StartPoint] = Stage(run.recover_workers)
    generate: StepStage = Stage(rollout.generate)
    score_rewards: StepStage = Stage(reward.score_rewards)
    actor_logprobs: StepStage = Stage(logprobs.actor_logprobs)
    ref_logprobs: StepStage = Stage(logprobs.ref_logprobs)
    critic_values: StepStage = Stage(logprobs.critic_values)
    advantages: Stage[[RunConfig, RunHandle, int, dict[str, float]], AdvantageResult] = Stage(advantage.advantages)
    update_critic: StepStage = Stage(update.update_critic)
    update_actor: StepStage = Stage(update.update_actor)
    sync_weights: StepStage = Stage(rollout.sync_weights)
    evaluate: Stage[[RunConfig, RunHandle, int, str], Metrics] = Stage(evaluate.evaluate)
    checkpoint: Stage[[RunConfig, RunHandle, int, dict[str, Any]], dict[str, Any] | None] = Stage(
        checkpoints.write_checkpoint
    )
    commit_checkpoint: Stage[[RunConfig, RunHandle, int, dict[str, Any]], str] = Stage(checkpoints.commit_checkpoint)
    export_policy: Stage[[RunConfig, RunHandle, str], str] = Stage(run.export_policy)
    max_parallel: int = MAX_PARALLEL_STAGES

    @classmethod
    def configured(cls, cfg: RunConfig) -> Stages:
        """Every stage task with `cfg.prefect`'s policy for it and a run name with the step where it has one."""
        unpolicied = {"prepare_run", "recover_workers"}  # set-up and recovery keep their own (fixed) policy
        tasks: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "max_parallel":
                continue
            t: Task[Any, Any] = f.default.task  # type: ignore[union-attr]  # every field has a Stage default
            if f.name not in unpolicied:
                t = with_policy(t, cfg.prefect.policy(f.name))
            has_step = "step" in t.fn.__code__.co_varnames[: t.fn.__code__.co_argcount]
            name = f"{f.name}[step={{step}}]" if has_step else f.name
            tasks[f.name] = Stage(t.with_options(task_run_name=name), f.name)
        return replace(cls(), **tasks, max_parallel=min(cfg.prefect.max_concurrent_stages, MAX_PARALLEL_STAGES))

    def together(self, stages: Sequence[StepStage], cfg: RunConfig, run: RunHandle, step: int) -> list[Metrics]:
        """Run step stages concurrently, at most `prefect.max_concurrent_stages` at a time; results in order.
        A group of one runs in the flow's thread: the same task run and retries, without a hand-off to a pool
        thread and back (and its timeout is the main thread's alarm, not a watcher thread per run)."""
        results: list[Metrics] = []
        for i in range(0, len(stages), self.max_parallel):
            group = stages[i : i + self.max_parallel]
            if len(group) == 1 or any(stage.profiled(cfg, run, step) for stage in group):  # profiles: one at a time
                results.extend(stage(cfg, run, step) for stage in group)
                continue
            futures = [stage.submit(cfg, run, step) for stage in group]
            results.extend(future.result() for future in futures)
        return results
