"""The scorer's result type, apart from `engines.types` so that the reward scorer, its Ray actor and its pool
workers import no torch (`engines/rewards/__init__.py`): ~150 MB less in each of those processes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScoreResult:
    """Scores of one batch: weighted totals, per-function (and extra-key) columns, and metrics (the names:
    `rlstages.engines.rewards.scorer`)."""

    scores: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
