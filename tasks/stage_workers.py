"""The one helper of the stage tasks for calling their workers: a stage's view of the run's worker groups whose
every call carries the stage's configured timeout (`prefect.stages.<name>.timeout_seconds`) and turns a dead
Ray actor into `WorkerLost` (the flow rebuilds the workers from the last checkpoint; never retried in place).

    w = stage_workers(cfg, run, "generate")
    batch = w.dp("rollout").generate(prompts, params, seed)   # scattered over the data-parallel ranks
    w.all("rollout").sleep()                                  # every rank
    w.one("reward").score(...)                                # rank 0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlstages.configs import RunConfig
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.workers import Workers, get_workers
from rlstages.tasks.policies import guard_workers

if TYPE_CHECKING:
    from rlstages.engines.workers.actor_group import ActorGroup


class _Guarded:
    """A group's dispatch whose method calls run under `guard_workers`."""

    def __init__(self, dispatch: Any) -> None:
        self._dispatch = dispatch

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return guard_workers(lambda: getattr(self._dispatch, method)(*args, **kwargs))

        return call


class StageWorkers:
    """The run's worker groups as one stage calls them: `dp` / `all` / `one` of a role (`"rollout"`, `"actor"`,
    `"critic"`, `"reference"`, `"reward"`, `"reward_model"`) or of a group, with the stage's timeout, guarded."""

    def __init__(self, workers: Workers, stage: str, timeout: float | None) -> None:
        self.workers, self.stage, self.timeout = workers, stage, timeout

    def group(self, role: str | ActorGroup) -> ActorGroup:
        """The group of a role (a group is itself); a role this run does not have is a programming error."""
        if not isinstance(role, str):
            return role
        group = getattr(self.workers, role)
        assert group is not None, f"{self.stage} runs only with {role} workers"
        return group

    def dp(self, role: str | ActorGroup) -> Any:
        """Call the data-parallel ranks (the batch split among them, results gathered)."""
        return _Guarded(self.group(role).dp(self.timeout))

    def all(self, role: str | ActorGroup) -> Any:
        """Call every rank with the same arguments (a list of results)."""
        return _Guarded(self.group(role).all(self.timeout))

    def one(self, role: str | ActorGroup, rank: int = 0) -> Any:
        """Call one rank."""
        return _Guarded(self.group(role).one(rank, self.timeout))


def stage_workers(cfg: RunConfig, run: RunHandle, stage: str) -> StageWorkers:
    """The run's live worker groups as stage `stage` calls them (its configured timeout, dead actors guarded)."""
    return StageWorkers(get_workers(cfg, run), stage, cfg.prefect.policy(stage).timeout_seconds)
