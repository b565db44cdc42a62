"""The demo as issue 53 states its goals, measured in one run: `rlstages run configs/demo.yaml` (its 30 steps and
the preset's evaluations) in a fresh process under the PSS sampler, then its MLflow run read back. The figures are
absolute, as the issue states them (minutes, GB, a share), the goal of the time by the run's own class of CPU (its
`machine.class` tag):

- `demo_peak_pss_gb`: peak PSS of the run's whole process tree (Ray's workers, Prefect's temporary server), GB
  (goal <= 3.5);
- `demo_minutes_to_08`: minutes from the MLflow run's start to its first held-out evaluation >= 0.8 (goal:
  native-bf16 <= 2, avx512 <= 8, avx2 <= 12; NaN where none reached it);
- `demo_first_08_step`: that evaluation's step (goal <= 16); `demo_final_heldout`: the last one (goal >= 0.8);
- `demo_eval_fraction`: the evaluations' share of the run's time (`time/eval_fraction`, goal <= 0.15).

The model is converted first, outside the timed run. ~5 min on a native-bf16 2-core machine, ~25 on AVX2 only.
`python -m bench demo`
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import PssSampler, record

ROOT = Path(__file__).resolve().parents[1]
RUN_NAME, EXPERIMENT = "bench-demo", "bench-demo"
MINUTES_GOAL = {"native-bf16": 2.0, "avx512": 8.0, "avx2": 12.0}  # issue 53, by class of CPU
REACHED = 0.8


def demo_figures(tracking_uri: str, experiment: str, run_name: str) -> dict[str, Any]:
    """The newest MLflow run named `run_name` in `experiment`, as the figures of this bench: the first held-out
    evaluation >= 0.8 (step, minutes after the run's start), the last one, the evaluations' share of the run's
    time and the run's class of CPU."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"no MLflow experiment {experiment!r} at {tracking_uri}")
    runs = client.search_runs(
        [exp.experiment_id], f"attributes.run_name = '{run_name}'", order_by=["attributes.start_time DESC"]
    )
    if not runs:
        raise LookupError(f"no MLflow run {run_name!r} in {experiment!r}")
    run = runs[0]
    evals = sorted(client.get_metric_history(run.info.run_id, "eval/reward_mean"), key=lambda m: m.step)
    first = next((m for m in evals if m.value >= REACHED), None)
    fraction = sorted(client.get_metric_history(run.info.run_id, "time/eval_fraction"), key=lambda m: m.step)
    return {
        "cpu_class": run.data.tags.get("machine.class", "unknown"),
        "first_step": first.step if first is not None else None,
        "minutes_to_08": (first.timestamp - run.info.start_time) / 60_000 if first is not None else math.nan,
        "final": evals[-1].value if evals else math.nan,
        "eval_fraction": fraction[-1].value if fraction else math.nan,
        "curve": [(m.step, round(m.value, 3)) for m in evals],
    }


def record_figures(figures: dict[str, Any], peak_gb: float, wall_s: float) -> None:
    """The bench's rows from `demo_figures` and the sampled peak."""
    cls = figures["cpu_class"]
    curve = " ".join(f"{v}@{s}" for s, v in figures["curve"])
    where = f"{cls}; the run {wall_s / 60:.1f} min"
    record("demo_peak_pss_gb", peak_gb, "<= 3.5", f"GB, the run's process tree; {where}")
    goal = MINUTES_GOAL.get(cls)
    first = figures["first_step"]
    record("demo_minutes_to_08", figures["minutes_to_08"], f"<= {goal:g}" if goal else None,
           f"minutes to the first held-out >= {REACHED} (step {first}); {where}")  # fmt: skip
    record("demo_first_08_step", first if first is not None else math.nan, "<= 16", f"held-out {curve}")
    record("demo_final_heldout", figures["final"], f">= {REACHED}", f"the last evaluation; {where}")
    record("demo_eval_fraction", figures["eval_fraction"], "<= 0.15", f"evaluations / run time; {where}")


def main() -> None:
    """Convert the model, run the demo under the sampler in a temporary directory, record the figures."""
    from bench.__main__ import bench_env
    from rlstages.configs import load_config
    from rlstages.engines.models import ensure_model

    cfg = load_config(ROOT / "configs" / "demo.yaml", [])
    ensure_model(ROOT / cfg.model.path, cfg.model.provider)
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
        uri = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        cmd = [sys.executable, "-m", "rlstages.flows.cli.main", "run", str(ROOT / "configs" / "demo.yaml"),
               f"trainer.output_dir={tmp}", f"trainer.run_name={RUN_NAME}", f"tracking.experiment={EXPERIMENT}",
               f"tracking.tracking_uri={uri}", "tracking.log_model=false"]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=bench_env())  # its own Prefect home, hubs offline
        with PssSampler(proc.pid) as pss:
            code = proc.wait()
        wall = time.perf_counter() - start
        if code:
            raise SystemExit(f"bench_demo: the demo exited with {code}")
        record_figures(demo_figures(uri, EXPERIMENT, RUN_NAME), pss.peak / 1e9, wall)


if __name__ == "__main__":
    main()
