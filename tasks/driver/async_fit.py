"""The simulator of asynchronous training fitted from a recorded run: its per-step metrics read from MLflow (the
run's id from its run directory) and its batch shape from its config (engines/async_sim/fit.py fits them)."""

from __future__ import annotations

from rlstages.configs import RunConfig
from rlstages.engines.async_sim.fit import RunShape, fit_profile
from rlstages.engines.async_sim.profile import EngineProfile
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.tracking.queries import step_metrics
from rlstages.tasks.driver.tracking.store import tracking_uri

STEP_KEYS = ("timing/", "rollout/", "response_length/", "async/")


def run_shape(cfg: RunConfig) -> RunShape:
    """A run's batch as the simulator sees it: groups per step, replies per group, the cap, rollout workers."""
    workers = cfg.rollout.num_workers if cfg.cluster.mode == "ray" else 1
    return RunShape(cfg.data.prompts_per_step, cfg.rollout.n, cfg.rollout.response_budget, max(1, workers))


def recorded_steps(cfg: RunConfig) -> list[dict[str, float]]:
    """The per-step metrics (timing, rollout, lengths, async) of `cfg`'s run from MLflow, in step order."""
    run = RunHandle(str(cfg.trainer.run_name), str(cfg.trainer.output_dir / str(cfg.trainer.run_name)))
    run_id = run.mlflow_run_id()
    if run_id is None:
        raise ValueError(f"{run.path}: no recorded MLflow run to fit the simulator from (run_state.json)")
    steps = step_metrics(tracking_uri(cfg), run_id, STEP_KEYS)
    return [steps[s] for s in sorted(steps) if s >= 1 and "timing/step_s" in steps[s]]


def fitted_profile(cfg: RunConfig, memory_bound_share: float = 0.5) -> EngineProfile:
    """The simulator's latencies fitted from `cfg`'s recorded run."""
    return fit_profile(recorded_steps(cfg), run_shape(cfg), memory_bound_share)
