"""The stages of a step by name, and the Prefect retry and timeout policy of each."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlstages.configs.base import StrictModel

StageName = Literal[
    "start_tracking",
    "start_workers",
    "export_policy",
    "convert",
    "generate",
    "score_rewards",
    "actor_logprobs",
    "ref_logprobs",
    "critic_values",
    "advantages",
    "update_critic",
    "update_actor",
    "sync_weights",
    "evaluate",
    "checkpoint",
    "commit_checkpoint",
]


class StagePolicy(StrictModel):
    """Prefect retry and timeout policy of one stage."""

    retries: int = Field(default=2, ge=0)
    retry_delay_seconds: float = Field(default=1.0, ge=0.0)
    backoff_factor: float = Field(default=2.0, ge=1.0)
    jitter_factor: float = Field(default=0.2, ge=0.0)
    timeout_seconds: float = Field(default=1800.0, gt=0.0)


class PrefectConfig(StrictModel):
    """Per-stage policies over a default; stage names are the task names."""

    default: StagePolicy = StagePolicy()
    stages: dict[StageName, StagePolicy] = Field(default_factory=dict)
    max_concurrent_stages: int = Field(
        default=4,
        ge=1,
        description="The read-only stages of a step (rewards, old/reference log-probs, critic values) run at most "
        "this many at once; 4 such stages exist.",
    )
    max_worker_recoveries: int = Field(
        default=3, ge=0, description="Worker deaths the flow recovers from (reload + replay) before it fails."
    )

    def policy(self, stage: str) -> StagePolicy:
        """The policy of `stage`, falling back to the default."""
        return self.stages.get(stage, self.default)  # type: ignore[call-overload]
