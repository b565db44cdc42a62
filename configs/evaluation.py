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


class EvalWindow(StrictModel):
    """Steps `first`..`last` evaluated every `every` steps (denser where the curve crosses what is read off it)."""

    first: int = Field(ge=1)
    last: int = Field(ge=1)
    every: int = Field(ge=1)


def eval_due(step: int, every: int, windows: list[EvalWindow], last: int) -> bool:
    """Whether step `step` of `last` is evaluated: the last always; inside a window at its cadence, elsewhere
    every `every` steps (0: none between the start and the end)."""
    if step == last:
        return True
    window = next((w for w in windows if w.first <= step <= w.last), None)
    cadence = window.every if window is not None else every
    return cadence > 0 and step % cadence == 0
