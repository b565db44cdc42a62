"""What a recorded run cannot tell the simulator, measured on the engine: generation time by batch size
(`async_sim.probe.batch_times`, the tiny model in-process) and the fixed share of a token step fitted from such
times (`fit.memory_bound_share`); the busiest worker's rows when a step's prompts do not divide evenly. CPU, ~5 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlstages.engines.async_sim.fit import RunShape, memory_bound_share
from rlstages.engines.async_sim.probe import batch_times
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.types import Prompt, SamplingParams


def test_the_fixed_share_comes_from_the_line_through_the_times() -> None:
    # t = 2 + 0.5 * rows: at 8 rows the fixed 2 s are a third of 6 s
    assert memory_bound_share({4: 4.0, 8: 6.0, 12: 8.0}, 8) == pytest.approx(1 / 3)
    assert memory_bound_share({4: 5.0, 8: 5.0}, 8) == 1.0  # flat: every token step costs the same
    assert memory_bound_share({4: 2.0, 8: 4.0}, 8) == pytest.approx(0.0)  # through the origin: all per row
    with pytest.raises(ValueError, match="two or more batch sizes"):
        memory_bound_share({8: 6.0}, 8)


def test_a_split_that_does_not_divide_the_prompts_loads_one_worker_more() -> None:
    # 8 prompts of 4 replies over 3 workers: 3, 3 and 2 prompts, never 11 rows (a prompt's replies stay together)
    assert RunShape(8, 4, 48, 3).rows_per_worker == 12
    assert RunShape(8, 4, 48, 2).rows_per_worker == 16


def test_batch_times_time_each_batch_on_the_engine(tiny_model_dir: Path) -> None:
    engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    prompts = [Prompt(f"p{i}", f"{i}+1=", str(i + 1)) for i in range(4)]
    sampling = SamplingParams(n=2, max_new_tokens=6)
    times = batch_times(engine, prompts, sampling, [8, 2], repeats=1)
    assert sorted(times) == [2, 8] and all(t > 0 for t in times.values())
    assert 0.0 <= memory_bound_share(times, 8) <= 1.0
    with pytest.raises(ValueError, match="multiples of n=2"):
        batch_times(engine, prompts, sampling, [3])
