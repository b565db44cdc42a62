"""The stage tasks of the training flow, each carrying its configured retry and timeout policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect.utilities.annotations import opaque

from rlstages.configs import RunConfig
from rlstages.tasks import advantage, checkpoint, evaluate, logprobs, reward, rollout, run, update
from rlstages.tasks.policies import with_policy


class _Stage:
    """A stage task called with its config wrapped in `opaque`: Prefect hands the task the same RunConfig but
    does not walk its ~150 fields looking for futures (input tracking and input resolution each did, on every
    call: most of Prefect's own CPU time per stage). A config holds no futures, so nothing is lost."""

    def __init__(self, task: Any) -> None:
        self.task = task

    def __call__(self, cfg: RunConfig, *args: Any, **kwargs: Any) -> Any:
        return self.task(opaque(cfg), *args, **kwargs)

    def submit(self, cfg: RunConfig, *args: Any, **kwargs: Any) -> Any:
        """Run the stage in the flow's task runner (a future)."""
        return self.task.submit(opaque(cfg), *args, **kwargs)


@dataclass(frozen=True)
class Stages:
    """Prefect tasks by stage name (the same names as in `prefect.stages` of the config)."""

    prepare_run: Any
    start_tracking: Any
    start_workers: Any
    recover_workers: Any
    generate: Any
    score_rewards: Any
    actor_logprobs: Any
    ref_logprobs: Any
    critic_values: Any
    advantages: Any
    update_critic: Any
    update_actor: Any
    sync_weights: Any
    evaluate: Any
    checkpoint: Any
    export_policy: Any

    @classmethod
    def configured(cls, cfg: RunConfig) -> Stages:
        """Every stage task with `cfg.prefect`'s policy for it."""

        def p(t: Any, name: str) -> Any:
            return _Stage(with_policy(t, cfg.prefect.policy(name)))

        return cls(
            prepare_run=_Stage(run.prepare_run),
            start_tracking=p(run.start_tracking, "start_tracking"),
            start_workers=p(run.start_workers, "start_workers"),
            recover_workers=_Stage(run.recover_workers),
            generate=p(rollout.generate, "generate"),
            score_rewards=p(reward.score_rewards, "score_rewards"),
            actor_logprobs=p(logprobs.actor_logprobs, "actor_logprobs"),
            ref_logprobs=p(logprobs.ref_logprobs, "ref_logprobs"),
            critic_values=p(logprobs.critic_values, "critic_values"),
            advantages=p(advantage.advantages, "advantages"),
            update_critic=p(update.update_critic, "update_critic"),
            update_actor=p(update.update_actor, "update_actor"),
            sync_weights=p(rollout.sync_weights, "sync_weights"),
            evaluate=p(evaluate.evaluate, "evaluate"),
            checkpoint=p(checkpoint.save_checkpoint, "checkpoint"),
            export_policy=p(run.export_policy, "export_policy"),
        )
