"""The one helper of the stage tasks for calling their workers: a stage's typed view of the run's worker groups
(`driver.role_handles`) whose every call carries the stage's configured timeout
(`prefect.stages.<name>.timeout_seconds`) and turns a dead Ray actor into `WorkerLost` (the flow rebuilds the
workers from the last checkpoint; never retried in place).

    w = stage_workers(cfg, run, "generate")
    batch = w.rollout.generate(prompts, params, seed)   # scattered over the data-parallel ranks, gathered
    w.rollout.sleep()                                   # every rank
    w.reward.score(...)                                 # the scorer
"""

from __future__ import annotations

from typing import Literal

from rlstages.configs import RunConfig
from rlstages.engines.workers.actor_group import ActorGroup
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.role_handles import RewardGroup, RewardModelGroup, RolloutGroup, TrainerGroup
from rlstages.tasks.driver.workers import Workers, get_workers
from rlstages.tasks.policies import guard_workers

TrainerRole = Literal["actor", "critic", "reference"]


class StageWorkers:
    """The run's worker groups as one stage calls them: a typed handle per role, with the stage's timeout, guarded."""

    def __init__(self, workers: Workers, stage: str, timeout: float | None) -> None:
        self.workers, self.stage, self.timeout = workers, stage, timeout

    def _group(self, role: str) -> ActorGroup:
        group: ActorGroup | None = getattr(self.workers, role)
        assert group is not None, f"{self.stage} runs only with {role} workers"
        return group

    @property
    def rollout(self) -> RolloutGroup:
        """The rollout engines (the actor's group under the hybrid engine)."""
        return RolloutGroup(self._group("rollout"), self.timeout, guard_workers)

    @property
    def actor(self) -> TrainerGroup:
        """The policy's trainers."""
        return self.trainer("actor")

    def trainer(self, role: TrainerRole) -> TrainerGroup:
        """The trainers of `role` (a role this run does not have is a programming error)."""
        return TrainerGroup(self._group(role), self.timeout, guard_workers)

    @property
    def reward(self) -> RewardGroup:
        """The reward-function scorer."""
        return RewardGroup(self._group("reward"), self.timeout, guard_workers)

    @property
    def reward_model(self) -> RewardModelGroup:
        """The learned reward model."""
        return RewardModelGroup(self._group("reward_model"), self.timeout, guard_workers)


def stage_workers(cfg: RunConfig, run: RunHandle, stage: str) -> StageWorkers:
    """The run's live worker groups as stage `stage` calls them (its configured timeout, dead actors guarded)."""
    return StageWorkers(get_workers(run), stage, cfg.prefect.policy(stage).timeout_seconds)
