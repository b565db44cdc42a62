"""What one recorded run cannot tell the simulator: how a rollout engine's generation time grows with the rows it
decodes at once (every row of a step starts together, so a run sees one batch size per worker). Timed here on the
engine itself, in-process, at the batch sizes a split would give each worker; `fit.memory_bound_share` turns the
times into the profile's fixed share of a token step."""

from __future__ import annotations

import time

from rlstages.engines.base import RolloutEngine
from rlstages.engines.types import Prompt, SamplingParams


def batch_times(
    engine: RolloutEngine, prompts: list[Prompt], sampling: SamplingParams, rows: list[int], repeats: int = 2
) -> dict[int, float]:
    """The best of `repeats` whole-generation times (seconds) of `engine` at each batch of `rows` rows (prompts
    taken in order, `sampling.n` rows each, so every count must be a multiple of it); one warm-up first."""
    if any(r % sampling.n or r // sampling.n > len(prompts) for r in rows):
        raise ValueError(f"rows {rows} must be multiples of n={sampling.n} within {len(prompts)} prompts")
    engine.generate(prompts[: rows[0] // sampling.n], sampling, seed=0)  # warm-up: allocations, kernel choice
    out: dict[int, float] = {}
    for r in rows:
        best = float("inf")
        for i in range(repeats):
            start = time.perf_counter()
            engine.generate(prompts[: r // sampling.n], sampling, seed=i)
            best = min(best, time.perf_counter() - start)
        out[r] = best
    return out
