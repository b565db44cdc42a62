"""Evaluate a run's checkpoint (or its final policy's checkpoint): greedy accuracy on the held-out prompts,
and mean@k / pass@k of k samples per prompt when k > 1 (per data source when there are several)."""

from __future__ import annotations

from pathlib import Path

from rlstages.configs import RunConfig
from rlstages.flows.flow_guard import guarded_flow
from rlstages.tasks.checkpoint import restore_engines
from rlstages.tasks.driver.checkpoints import latest_checkpoint
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.workers import build_workers, forget_workers
from rlstages.tasks.evaluate import run_eval
from rlstages.tasks.rollout import sync_weights
from rlstages.tasks.run import run_dir


@guarded_flow(name="rl-evaluate", validate_parameters=True)
def evaluate_checkpoint(
    cfg: RunConfig, checkpoint: str | None = None, greedy: bool = True, k: int | None = None
) -> dict[str, float]:
    """Load a committed checkpoint (default: the run's newest) into fresh workers and score held-out prompts
    (greedy, and k samples each when k > 1; k defaults to `evaluation.k`)."""
    path = run_dir(cfg)
    run = RunHandle(name=path.name, run_dir=str(path.resolve()))
    if checkpoint is None:
        found = latest_checkpoint(run, verify=True)
        if found is None:
            raise FileNotFoundError(f"{path}: no committed checkpoint to evaluate")
        step, ckpt = found
    else:
        ckpt = Path(checkpoint)
        step = int(ckpt.name.rsplit("_", 1)[-1]) if ckpt.name.startswith("step_") else 0
    build_workers(cfg, run)
    try:
        restore_engines(cfg, run, ckpt)
        sync_weights.fn(cfg, run, step)
        metrics, _ = run_eval(cfg, run, step, greedy=greedy, k=k)
    finally:
        forget_workers(run, kill=True)
    return {"step": float(step), **metrics}
