"""Reward functions (registered names or `module:function`) and an optional reward model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from rlstages.configs.base import StrictModel


class RewardFnConfig(StrictModel):
    """One reward function, by registered name or `package.module:function`; scores are weighted and summed.

    Registered: `math_verify`, `exact_match`, `boxed_format`, `last_integer`, `digit_ratio`.
    """

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = Field(default_factory=dict)


class RewardModelConfig(StrictModel):
    """A sequence-classification model hosted as a Ray actor; its scalar output is added, weighted."""

    path: Path
    weight: float = 1.0
    micro_batch_size: int = Field(default=16, ge=1)


class RewardConfig(StrictModel):
    """How rollouts are scored, with per-sample timeout and a fallback score on failure."""

    functions: tuple[RewardFnConfig, ...] = Field(min_length=1)
    reward_model: RewardModelConfig | None = None
    timeout_seconds: float = Field(default=10.0, gt=0.0)
    fallback_score: float = 0.0
    num_processes: int = Field(default=1, ge=1, description="Process pool that runs CPU-bound functions.")
