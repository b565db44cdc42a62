"""The demo's task learned synchronously, one step off and asynchronously, 3 seeds each (issue 51's measurement).

Every run is `rlstages run configs/demo.yaml` as a user starts it (its own process: Ray, Prefect, MLflow), rollout
and trainer on disjoint Ray workers with one thread each (`cluster.hybrid_engine=false cluster.colocate=false
cluster.threads_per_worker=1`, the layout of `make demo-async`), decoupled PPO in all three so the work per step
is the same; async is `trainer.mode=async trainer.async.max_staleness=1 trainer.async.partial_rollout=true`
(streamed, in-flight replies continued under the new weights: without partial rollouts, async at eta 1 is
one-step-off bit for bit). The seed is `trainer.seed` (sampling, the data order); the prompts are the demo's.

Per run, from its MLflow run: samples trained per second (the demo's prompts x replies a step / wall seconds a
step after the first, evaluations included), held-out steps and seconds to accuracy >= 0.8 (seconds from the
command's start), the final held-out accuracy. Figures, as ratios against the synchronous runs of the same invocation:
- `demo_<mode>_samples_per_s_vs_sync`, `demo_<mode>_time_to_08_vs_sync` (mean seconds over the seeds that reach
  0.8; the detail says how many did), `demo_<mode>_steps_to_08_vs_sync`;
- `demo_<mode>_final_gap_over_spread` (goal <= 1): how far the mode's mean final held-out accuracy falls below
  sync's (0 where it does not), over the spread (max - min) of sync's seeds: "not worse beyond the seeds' spread".
The held-out curves of all runs: bench/async-demo-seeds.png (minutes from the command's start).

`python -m bench async_demo` (or `python -m bench.bench_async_demo`); BENCH_ASYNC_DEMO_SEEDS (3),
BENCH_ASYNC_DEMO_STEPS (the demo's 30) and BENCH_ASYNC_DEMO_MODES (sync,one_step_off,async) change the runs;
BENCH_ASYNC_DEMO_DIR keeps them in a directory of your choice, where a rerun reuses every run already there (each
run's figures are saved beside its MLflow store as `<run name>-<steps>.json`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.bench_step import demo_config
from bench.common import record, run_named, seconds_per_step

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ["cluster.hybrid_engine=false", "cluster.colocate=false", "cluster.threads_per_worker=1",
          "algorithm.decoupled_loss=true"]  # fmt: skip
MODES = {"sync": ["trainer.mode=sync"], "one_step_off": ["trainer.mode=one_step_off"],
         "async": ["trainer.mode=async", "trainer.async.max_staleness=1",
                   "trainer.async.partial_rollout=true"]}  # fmt: skip
DEMO = demo_config()
SAMPLES_PER_STEP = DEMO.data.prompts_per_step * DEMO.rollout.n
GOAL = 0.8
PICTURE = Path(__file__).resolve().parent / "async-demo-seeds.png"


@dataclass(frozen=True)
class DemoRun:
    """What one run of the demo showed."""

    mode: str
    seed: int
    wall_s: float
    seconds_per_step: float
    curve: list[tuple[int, float, float]]  # (step, held-out accuracy, seconds from the command's start)

    @property
    def first_at_goal(self) -> tuple[int, float] | None:
        """(step, seconds) of the first held-out accuracy >= 0.8, None where never."""
        return next(((step, s) for step, acc, s in self.curve if acc >= GOAL), None)

    @property
    def final(self) -> float:
        """The held-out accuracy at the last evaluation."""
        return self.curve[-1][1]


def run_demo(tmp: Path, mode: str, seed: int, steps: int) -> DemoRun:
    """One `rlstages run configs/demo.yaml` in its own process, its MLflow run read back."""
    from mlflow import MlflowClient

    name, db = f"bench-{mode}-s{seed}", tmp / "mlflow.db"
    saved = tmp / f"{name}-{steps}.json"
    if saved.is_file():
        kept = json.loads(saved.read_text())
        return DemoRun(**{**kept, "curve": [tuple(point) for point in kept["curve"]]})
    args = [*LAYOUT, *MODES[mode], f"trainer.seed={seed}", f"trainer.run_name={name}",
            f"trainer.total_steps={steps}", f"trainer.output_dir={tmp / 'runs'}",
            f"tracking.tracking_uri=sqlite:///{db}", "tracking.log_model=false"]  # fmt: skip
    shutil.rmtree(tmp / "runs" / name, ignore_errors=True)  # a killed bench's partial run: timed afresh, not resumed
    rlstages = Path(sys.executable).with_name("rlstages")
    start = time.time()
    with open(tmp / f"{name}.out", "w") as out:
        subprocess.run([str(rlstages), "run", "configs/demo.yaml", *args, "--log-format", "plain"],
                       cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=True)  # fmt: skip
    wall = time.time() - start
    uri = f"sqlite:///{db}"
    run_id = run_named(uri, DEMO.tracking.experiment, name)  # the newest: an interrupted bench's run is older
    evals = sorted(MlflowClient(uri).get_metric_history(run_id, "eval/accuracy"), key=lambda m: m.step)
    curve = [(m.step, m.value, m.timestamp / 1000 - start) for m in evals]
    per_step = seconds_per_step(uri, run_id)
    print(f"{name}: {wall:.0f} s, {per_step:.1f} s/step, held-out "
          + " ".join(f"{acc:.2f}@{step}" for step, acc, _ in curve), flush=True)  # fmt: skip
    done = DemoRun(mode, seed, wall, per_step, curve)
    saved.write_text(json.dumps(asdict(done)))
    return done


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _describe(r: DemoRun) -> str:
    """One seed's line of a figure's detail."""
    reached = r.first_at_goal
    goal = f"0.8 at step {reached[0]} ({reached[1] / 60:.1f} min)" if reached else "0.8 not reached"
    speed = SAMPLES_PER_STEP / r.seconds_per_step
    return f"seed {r.seed}: {speed:.2f} samples/s, {goal}, final {r.final:.2f}, {r.wall_s / 60:.1f} min"


def summarise(runs: list[DemoRun]) -> None:
    """Record each mode's figures against the synchronous runs'."""
    by_mode = {mode: [r for r in runs if r.mode == mode] for mode in MODES if any(r.mode == mode for r in runs)}
    sync = by_mode["sync"]
    sync_final = _mean([r.final for r in sync])
    spread = max(r.final for r in sync) - min(r.final for r in sync)
    sync_reached = [r.first_at_goal for r in sync if r.first_at_goal]
    sync_speed = _mean([SAMPLES_PER_STEP / r.seconds_per_step for r in sync])
    sync_s, sync_steps = _mean([s for _, s in sync_reached]), _mean([st for st, _ in sync_reached])
    for mode, group in by_mode.items():
        reached = [r.first_at_goal for r in group if r.first_at_goal]
        speed = _mean([SAMPLES_PER_STEP / r.seconds_per_step for r in group])
        where = f"{len(reached)}/{len(group)} seeds reach 0.8; " + "; ".join(_describe(r) for r in group)
        print(f"{mode}: {speed:.2f} samples/s; {where}", flush=True)
        if mode == "sync":
            continue
        record(f"demo_{mode}_samples_per_s_vs_sync", speed / sync_speed, None, f"{speed:.2f} vs {sync_speed:.2f}")
        if reached and sync_reached:  # a mean over no seed is no figure: the detail above says which reached
            record(f"demo_{mode}_time_to_08_vs_sync", _mean([s for _, s in reached]) / sync_s, None, where)
            record(f"demo_{mode}_steps_to_08_vs_sync", _mean([st for st, _ in reached]) / sync_steps, None, where)
        final = _mean([r.final for r in group])
        gap = max(0.0, sync_final - final)
        detail = f"final held-out {final:.3f} vs sync {sync_final:.3f}, the sync seeds' spread {spread:.3f}"
        record(f"demo_{mode}_final_gap_over_spread", gap / spread if spread else (0.0 if gap == 0 else 99.0), "<= 1",
               detail)  # fmt: skip


def picture(runs: list[DemoRun]) -> None:
    """Held-out accuracy against minutes from the start: a colour per mode, a line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"sync": "tab:blue", "one_step_off": "tab:orange", "async": "tab:green"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot([s / 60 for _, _, s in r.curve], [acc for _, acc, _ in r.curve], color=colours[r.mode], alpha=0.8,
                label=r.mode if r.seed == min(x.seed for x in runs if x.mode == r.mode) else None)  # fmt: skip
    ax.axhline(GOAL, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="minutes from the command's start", ylabel="held-out accuracy", ylim=(0, 1))
    ax.legend()
    ax.set_title("the demo's task, rollout and trainer on disjoint workers, a line per seed")
    fig.tight_layout()
    fig.savefig(PICTURE, dpi=110)
    print(f"wrote {PICTURE}", flush=True)


def main() -> None:
    """Every mode at every seed, then the figures and the picture."""
    modes = os.environ.get("BENCH_ASYNC_DEMO_MODES", ",".join(MODES)).split(",")
    seeds = int(os.environ.get("BENCH_ASYNC_DEMO_SEEDS", "3"))
    steps = int(os.environ.get("BENCH_ASYNC_DEMO_STEPS", "30"))
    where = os.environ.get("BENCH_ASYNC_DEMO_DIR")
    tmp = Path(where) if where else Path(tempfile.mkdtemp(prefix="rlstages-bench-async-demo-"))
    tmp.mkdir(parents=True, exist_ok=True)
    runs = [run_demo(tmp, mode, seed, steps) for seed in range(seeds) for mode in modes]
    summarise(runs)
    picture(runs)


if __name__ == "__main__":
    main()
