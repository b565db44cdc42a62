"""Engine latencies fitted from a recorded run: the per-step metrics every run logs (generation time and reply
lengths, each trainer stage's time, the weight sync's time), read by the tasks layer from MLflow
(`tasks.driver.async_fit`) and turned into an `EngineProfile` here.

What is fitted: the mean generation time per step (a whole step's rows on each worker at once), the reply
length model (its mean from `response_length/mean`, its spread so that the longest of a step matches
`response_length/max`), the trainer's time per step (its stages' times summed) and the sync's time. The split of
a token step into a per-row and a fixed part cannot be told from one batch size: `memory_bound_share` says it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from statistics import fmean, linear_regression

from rlstages.engines.async_sim.profile import EngineProfile, LengthModel, matched_profile

GENERATE_KEYS = ("rollout/generate_wall_s", "timing/generate_s", "rollout/generate_ahead_s")
NOT_TRAINER = ("timing/generate_s", "timing/step_s", "timing/evaluate_s", "timing/checkpoint_s")
SIGMAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0, 1.3)


@dataclass(frozen=True)
class RunShape:
    """The recorded run's batch: prompt groups per step, replies per group, the reply cap, rollout workers."""

    groups_per_step: int
    samples_per_group: int
    max_new_tokens: int
    rollout_workers: int = 1

    @property
    def rows_per_worker(self) -> int:
        """Rows the busiest worker generates per step: a step's prompts spread over the workers whole (a prompt's
        replies stay on one worker: `RolloutGroup.generate`)."""
        return max(1, -(-self.groups_per_step // self.rollout_workers) * self.samples_per_group)


def stage_times(metrics: dict[str, float]) -> tuple[float, float, float]:
    """One step's generation, trainer and sync seconds from its logged metrics (waits left out)."""
    generate = next((metrics[k] for k in GENERATE_KEYS if k in metrics), None)
    if generate is None:
        raise ValueError(f"step metrics have no generation time ({' or '.join(GENERATE_KEYS)})")
    sync = sum(v for k, v in metrics.items() if k.startswith("timing/sync"))
    train = sum(
        v
        for k, v in metrics.items()
        if k.startswith("timing/") and k not in NOT_TRAINER and not k.startswith(("timing/sync", "timing/wait"))
    )
    return generate, train, sync


def fit_lengths(steps: list[dict[str, float]], shape: RunShape, seed: int = 0) -> LengthModel:
    """The length model: the recorded mean reply length, and the spread whose expected longest reply of a step
    is nearest the recorded one."""
    rows = shape.groups_per_step * shape.samples_per_group
    if not all("response_length/mean" in m or "rollout/tokens" in m for m in steps):
        raise ValueError("step metrics have no reply lengths (response_length/mean or rollout/tokens)")
    mean = fmean(m.get("response_length/mean", m.get("rollout/tokens", 0.0) / rows) for m in steps)
    longest = fmean(m.get("response_length/max", mean) for m in steps)

    def expected_max(sigma: float) -> float:
        rng, model = random.Random(seed), LengthModel(mean, shape.max_new_tokens, sigma)
        return fmean(max(model.sample(rng) for _ in range(rows)) for _ in range(16))

    sigma = min(SIGMAS, key=lambda s: abs(expected_max(s) - longest))
    return LengthModel(mean, shape.max_new_tokens, sigma)


def fit_profile(
    steps: list[dict[str, float]], shape: RunShape, memory_bound_share: float = 0.5, skip_first: bool = True
) -> EngineProfile:
    """An `EngineProfile` from a run's per-step metrics (the first step left out when there are others: it pays
    the warm-up)."""
    if skip_first and len(steps) > 1:
        steps = steps[1:]
    if not steps:
        raise ValueError("no step metrics to fit the simulator from")
    times = [stage_times(m) for m in steps]
    generate, train, sync = (fmean(t[i] for t in times) for i in range(3))
    lengths = fit_lengths(steps, shape)
    return matched_profile(
        generate, shape.rows_per_worker, lengths, train, sync, memory_bound_share, workers=shape.rollout_workers
    )


def memory_bound_share(times: dict[int, float], rows: int) -> float:
    """The share of a token step that does not depend on the rows, at a batch of `rows`, from whole-generation
    times of one engine at several batch sizes (rows -> seconds; `batch_times`): the least-squares line
    t = a + b * rows through them gives a / (a + b * rows), clipped to [0, 1]."""
    if len(times) < 2:
        raise ValueError(f"need generation times at two or more batch sizes, got {sorted(times)}")
    slope, fixed = linear_regression(list(times), list(times.values()))
    return min(max(fixed / (fixed + slope * rows), 0.0), 1.0) if fixed + slope * rows > 0 else 1.0
