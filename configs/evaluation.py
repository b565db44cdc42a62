"""Held-out evaluation: greedy accuracy, mean@k and pass@k per data source."""

from __future__ import annotations

from pydantic import Field

from rlstages.configs.base import StrictModel


class EvalConfig(StrictModel):
    """What each evaluation measures on the held-out prompts (`data.eval_prompts` of them).

    The sampled pass draws `k` responses per prompt at `rollout.eval_temperature`: `eval/accuracy` and
    `eval/mean_at_k` are the share of correct samples, `eval/pass_at_j` (j = 1, 2, 4, ... up to k) the unbiased
    estimate (Chen et al., 2021) that one of j samples is correct. `greedy` adds a temperature-0 pass
    (`eval/greedy_accuracy`). With several data sources each metric is also logged as `eval/<source>/...`.
    """

    k: int = Field(default=1, ge=1, le=256, description="Samples per held-out prompt (pass@k, mean@k).")
    greedy: bool = Field(default=False, description="Also run a greedy pass (eval/greedy_accuracy).")
    correct_above: float = Field(
        default=0.0, description="A sample counts as correct when its reward is above this (as reward/accuracy)."
    )
