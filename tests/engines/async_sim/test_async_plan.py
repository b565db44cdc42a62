"""`rlstages plan CONFIG --async` (flows/cli/plan_async.py, engines/async_sim/advise.py): the split and eta the
simulator suggests, printed beside the memory plan, labelled a prediction; the rule that picks it; bad input refused
in one line. Pure arithmetic, seconds (a small batch stands in for the preset's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlstages.engines.async_sim.advise import Reference, Suggestion, candidates, suggest
from rlstages.engines.async_sim.profile import LengthModel
from rlstages.flows.cli.main import app

ROOT = Path(__file__).resolve().parents[3]
QWEN2 = str(ROOT / "configs" / "qwen2_7b_grpo_megatron.yaml")
SMALL = ["data.prompts_per_step=16", "actor.mini_batch_size=16", "rollout.max_new_tokens=256"]


def test_plan_async_prints_the_suggestion_beside_the_memory_plan() -> None:
    """Generation 60 s of a 120 s step, 8 GPUs in 4 rollout workers: a split of whole workers, an eta, the
    predicted speed-up over the synchronous reference, and the lag bound it keeps."""
    args = ["plan", QWEN2, *SMALL, "--async", "--generate-s", "60", "--step-s", "120", "--response-length", "64"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "gpu_peak_gib" in result.output  # the memory plan is still there, before
    assert (
        "async plan (simulated prediction" in result.output
        and "given: generation 60 s of a 120 s step" in result.output
    )
    line = next(x for x in result.output.splitlines() if x.startswith("async suggestion:"))
    rollout, trainer = (int(line.split(" GPUs")[i].split()[-1]) for i in (0, 1))
    assert rollout + trainer == 8 and rollout % 2 == 0  # whole rollout workers of 2 GPUs (8 / 4)
    eta = int(line.split("max_staleness=")[1].split(",")[0])
    predicted = next(x for x in result.output.splitlines() if x.startswith("async predicted:"))
    assert f"max {eta}" in predicted and "x);" in predicted
    assert sum(x.startswith("async eta ") for x in result.output.splitlines()) == 4  # eta 0..3 each


def test_plan_async_refuses_what_it_cannot_simulate() -> None:
    """No GPU profile for the model, or a single rollout worker: one line naming what to give, exit 2."""
    runner = CliRunner()
    unknown = runner.invoke(app, ["plan", QWEN2, "model.path=/models/Llama-3.1-8B-Instruct", "--async"])
    assert unknown.exit_code == 2 and "--generate-s and --step-s" in unknown.output
    single = runner.invoke(app, ["plan", QWEN2, "rollout.num_workers=1", "--async"])
    assert single.exit_code == 2 and "rollout.num_workers=1" in single.output
    backwards = runner.invoke(app, ["plan", QWEN2, "--async", "--generate-s", "130", "--step-s", "120"])
    assert backwards.exit_code == 2 and "below --step-s" in backwards.output


def test_the_suggestion_is_the_least_stale_of_the_nearly_fastest() -> None:
    def layout(eta: int, partial: bool, rate: float) -> Suggestion:
        return Suggestion(4, 4, eta, partial, rate, 1.0, eta / 2, eta, 0.1, 0.1)

    found = [layout(0, False, 0.6), layout(1, False, 1.5), layout(2, True, 1.52), layout(3, True, 1.8)]
    assert suggest(found).eta == 3  # 1.8 is far ahead
    found.append(layout(1, True, 1.78))
    best = suggest(found)
    assert (best.eta, best.partial_rollout, best.speedup) == (1, True, 1.78)  # within 3 %: less staleness


def test_the_synchronous_reference_is_the_step_it_was_given() -> None:
    """The speed-up's denominator: simulated at eta 0 on all GPUs, the reference makes its batch in step_s (the
    slowest of its workers' batches fitted to generate_s), so sync samples/s = samples per step / step_s."""
    ref = Reference(12, 3, 8, 4, LengthModel(300, 2048, 0.8), 70.0, 100.0, 2.0)
    found = candidates(ref, etas=(0, 1), steps=8)
    assert len(found) == 2 * 2 * 2  # splits of 1 and 2 workers x eta x partial
    assert found[0].sync_samples_per_s == pytest.approx(8 * 4 / 100.0, rel=0.08)
    assert {(s.rollout_gpus, s.trainer_gpus) for s in found} == {(4, 8), (8, 4)}
    assert all(s.lag_max <= s.eta for s in found)
