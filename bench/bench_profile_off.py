"""Profiling switched off costs nothing measurable: a flow step with `trainer.profile` off vs the code path
without the feature (goal: ratio <= 1.01).

The feature's whole cost when off is the check in `flows.stages.Stage.__call__` (and `Stages.together`): is this
stage of this step profiled? Timing two flow runs would bury it in their noise (seconds per step vs microseconds),
so this bench times the check itself: a million calls through `Stage.__call__` of a no-op stage, against the same
calls without the check (the pre-feature body, `self.task(*_quoted(args))`), and adds the difference for every
stage call of one step to that step's measured time (the tiny preset in the driver, `cluster.mode=in_process`).
`python -m bench.bench_profile_off`
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench.common import record, report

CALLS = 1_000_000


def _per_call_overhead(cfg) -> float:  # type: ignore[no-untyped-def]
    """Seconds the off-path check adds to one stage call (best of 5 rounds of CALLS calls)."""
    from rlstages.flows.stages import Stage, _quoted
    from rlstages.tasks.driver.context import RunHandle

    def noop(cfg, run, step):  # type: ignore[no-untyped-def]
        return None

    stage = Stage(noop, "update_actor")  # type: ignore[arg-type]
    run = RunHandle("bench", "/tmp/bench")

    def with_feature() -> float:
        start = time.perf_counter()
        for _ in range(CALLS):
            stage(cfg, run, 2)
        return time.perf_counter() - start

    def without_feature() -> float:
        start = time.perf_counter()
        for _ in range(CALLS):
            stage.task(*_quoted((cfg, run, 2)))
        return time.perf_counter() - start

    ours = min(with_feature() for _ in range(5))
    base = min(without_feature() for _ in range(5))
    return max(0.0, (ours - base) / CALLS)


def _step_seconds(tmp: Path) -> tuple[float, int]:
    """(median seconds per step after the first, stage calls per step) of the tiny preset in the driver."""
    from mlflow import MlflowClient

    from rlstages.configs import load_config
    from rlstages.flows.train import rl_post_train

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(
        root / "configs" / "tiny.yaml",
        [
            "cluster.mode=in_process",
            "trainer.total_steps=4",
            "trainer.eval_every=0",
            "trainer.eval_at_start=false",
            "checkpoint.every=0",
            f"trainer.output_dir={tmp}",
            "trainer.run_name=profile-off",
            f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
            "tracking.log_model=false",
        ],
    )
    rl_post_train(cfg)
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id])
    steps = [m.value for m in client.get_metric_history(run.info.run_id, "timing/step_s")][1:]
    calls = 6 + int(cfg.uses_reference) + int(cfg.needs_old_logprobs)  # generate..sync_weights, readers
    return statistics.median(steps), calls


def main() -> None:
    """Time the off path, a step, and record the ratio."""
    from rlstages.configs import load_config

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "tiny.yaml", [])
    overhead = _per_call_overhead(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        step, calls = _step_seconds(Path(tmp))
    ours = step + overhead * calls
    report("profiling off vs without the feature (one flow step)", [("tiny, in_process", ours, step, "<= 1.01")])
    record(
        "profiling off: step time / without the feature",
        ours / step,
        "<= 1.01",
        f"{overhead * 1e9:.0f} ns per stage call x {calls} calls on a {step:.3f} s step",
    )


if __name__ == "__main__":
    main()
