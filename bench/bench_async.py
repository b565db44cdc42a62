"""Samples trained per second: asynchronous (eta 2) vs one-step-off vs synchronous, rollout and trainer on disjoint
Ray workers (`cluster.hybrid_engine: false`, `cluster.colocate: false`), the same task and seeds, the addition task's
replies sampled at temperature 1 up to 32 tokens (long-tailed lengths on a random model).

Samples trained per second = prompts x n per step / wall seconds per step (MLflow step timestamps, after the
first step). Ratios against the synchronous run of the same invocation. The decoupled loss is on in every run (it
computes old log-probs in all three, so the work per step is the same).
`python -m bench.bench_async [steps]`
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from bench.common import record, report, run_named, seconds_per_step, small_model, tiny_run_config

MODES = {"sync": ["trainer.mode=sync"], "one_step_off": ["trainer.mode=one_step_off"],
         "async": ["trainer.mode=async", "trainer.async.max_staleness=2"]}  # fmt: skip
PROMPTS, N = 8, 4


def _config(tmp: Path, model: Path, name: str, steps: int, mode: list[str]):  # type: ignore[no-untyped-def]
    """The bench's run (`common.tiny_run_config`) with its own settings."""
    return tiny_run_config(
        tmp,
        model,
        name,
        steps,
        *mode,
        "cluster.hybrid_engine=false",
        "cluster.colocate=false",
        "algorithm.decoupled_loss=true",
        f"data.prompts_per_step={PROMPTS}",
        f"rollout.n={N}",
        "rollout.max_new_tokens=32",
        "data.source.num_train=512",
    )


def step_time_and_reward(cfg) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall seconds per step after the first, mean reward) of one flow run."""
    from mlflow import MlflowClient

    from rlstages.flows.train import rl_post_train

    rl_post_train(cfg)
    uri = cfg.tracking.tracking_uri
    run_id = run_named(uri, cfg.tracking.experiment, cfg.trainer.run_name)
    rewards = [m.value for m in MlflowClient(uri).get_metric_history(run_id, "reward/mean")]
    return seconds_per_step(uri, run_id), sum(rewards) / len(rewards)


def main(steps: int = 6) -> None:
    """One run per mode; report samples trained per second as ratios to the synchronous run."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="rlstages-bench-async-"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    model = small_model(128, 4, 512, name="bench-async")
    per_step = {mode: step_time_and_reward(_config(tmp, model, mode, steps, extra)) for mode, extra in MODES.items()}
    samples = PROMPTS * N
    sync_s = per_step["sync"][0]
    rows = [
        (f"{mode}: {samples / s:.1f} samples/s, reward {r:.3f}", s, sync_s, "< 1") for mode, (s, r) in per_step.items()
    ]
    report(f"seconds per step (samples trained/s = {samples} / s), split layout, {steps} steps", rows)
    for mode in ("one_step_off", "async"):
        speed = sync_s / per_step[mode][0]
        record(f"{mode}_samples_per_s", speed, ">= 1.0", f"{mode} / synchronous samples trained per second")
    ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
