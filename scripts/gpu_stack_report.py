"""After `scripts/gpu_check.sh --stack`'s demo run: its MLflow metrics as JSON, its reward curve, and a summary.

    python scripts/gpu_stack_report.py RESULTS_DIR

Reads the run named `demo-gpu` from `./mlflow.db` (the demo's default store) and writes
`RESULTS_DIR/demo_gpu_metrics.json` (every metric's history) and `RESULTS_DIR/demo_gpu_reward_curve.png`;
prints the step time, GPU memory, reward and held-out accuracy.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path


def main() -> None:
    """Dump the demo run's metrics and curve into the results folder and print the summary lines."""
    import mlflow

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    client = mlflow.MlflowClient(tracking_uri="sqlite:///mlflow.db")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    runs = [r for r in runs if r.info.run_name and r.info.run_name.startswith("demo-gpu")]
    if not runs:
        print("gpu_stack_report: no demo-gpu run in ./mlflow.db")
        sys.exit(1)
    run = max(runs, key=lambda r: r.info.start_time)
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics
    }
    (out / "demo_gpu_metrics.json").write_text(
        json.dumps({"run_id": run.info.run_id, "status": run.info.status, "params": run.data.params, **history})
    )
    for png in Path("runs").rglob("reward_curve.png"):
        shutil.copy(png, out / "demo_gpu_reward_curve.png")
    print(f"demo-gpu run {run.info.run_id}: {run.info.status}, {len(history.get('reward/mean', []))} steps")
    for key in sorted(history):
        values = [v for _, v in history[key]]
        if key.startswith(("perf/", "reward/mean", "eval/", "timing/", "rollout/logprob_diff", "async/")) and values:
            print(f"  {key}: first {values[0]:.4g} median {statistics.median(values):.4g} last {values[-1]:.4g}")
    pending = ["profiles"]  # trainer.profile's artifacts (traces, top-ops tables, CUDA memory snapshots), if any
    while pending:
        for item in client.list_artifacts(run.info.run_id, pending.pop()):
            if item.is_dir:
                pending.append(item.path)
            else:
                print(f"  artifact {item.path}: {item.file_size} bytes")


if __name__ == "__main__":
    main()
