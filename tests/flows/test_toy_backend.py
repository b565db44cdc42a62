"""A new rollout backend is one class and one registry entry: a toy engine (the HF engine counting its calls) with its
options class, registered here, runs the tiny flow (1 step, engines in the driver) with no other file changed.
The pre-flight, the plan, the specs and the stage tasks learn what it can do from its entry alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
from flow_support import IN_DRIVER, mlflow_run, reward_steps, tiny_cfg

from rlstages.configs.rollout import HFRolloutConfig
from rlstages.engines.registry import ROLLOUT_BACKENDS, RolloutBackend
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.flows.train import rl_post_train
from rlstages.tasks.driver.preflight import PreflightError, preflight


class ToyRolloutConfig(HFRolloutConfig):
    """The toy backend's options: the HF engine's, under its own name."""

    backend: Literal["toy"] = "toy"  # type: ignore[assignment]


class ToyRollout(HFRolloutEngine):
    """The HF engine, counting the generate calls it served."""

    calls = 0

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Count, then generate as the HF engine does."""
        ToyRollout.calls += 1
        return super().generate(*args, **kwargs)


def toy_entry(**capabilities: Any) -> RolloutBackend:
    """The toy's registry entry: its class, the options it takes, its capabilities."""
    return RolloutBackend(f"{__name__}:ToyRollout", ("batch_size", "attention"), ("model_type",), **capabilities)


def with_toy(cfg: Any) -> Any:
    """`cfg` with the toy as its rollout section (the schema's union knows the built-in backends only)."""
    return cfg.model_copy(update={"rollout": ToyRolloutConfig(**cfg.rollout.model_dump(exclude={"backend"}))})


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # the run's config.yaml: a union member it lacks
def test_a_registered_toy_rollout_backend_runs_the_flow(
    tmp_path: Path, tiny_model_dir: Path, prefect_harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(ROLLOUT_BACKENDS, "toy", toy_entry())
    monkeypatch.setattr(ToyRollout, "calls", 0)
    steps = ["trainer.total_steps=1", "trainer.eval_every=0", "trainer.eval_at_start=false"]
    cfg = with_toy(tiny_cfg(tmp_path, tiny_model_dir, "toy", IN_DRIVER, *steps))
    preflight(cfg, measure_prompts=False)
    rl_post_train(cfg)
    assert ToyRollout.calls > 0  # the step's rollouts came from the toy (the group's only rollout engine)
    assert reward_steps(cfg) == [1]
    _, run = mlflow_run(cfg)
    assert run.info.status == "FINISHED" and run.data.tags["rlstages.rollout_backend"] == "toy"


def test_the_pre_flight_reads_the_toy_s_capabilities(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(ROLLOUT_BACKENDS, "toy", toy_entry(needs_gpu=True))
    cfg = with_toy(tiny_cfg(tmp_path, tiny_model_dir, "toy-gpu", IN_DRIVER))
    with pytest.raises(PreflightError, match="rollout.backend=toy needs GPUs"):
        preflight(cfg, measure_prompts=False)
    monkeypatch.setitem(ROLLOUT_BACKENDS, "toy", toy_entry(transports=frozenset({"collective"})))
    with pytest.raises(PreflightError, match="sends weights by in_process, which rollout.backend=toy does not"):
        preflight(cfg, measure_prompts=False)
