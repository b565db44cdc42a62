"""`rlstages replay RUN` (issue 52): the replayed run's config (the recorded one, following its schedule into a
directory of its own), and the comparison of the two runs: final weights tensor by tensor (safetensors), every
logged metric at every step (MLflow histories), and the two schedule files line by line.

Metrics excluded from "equal", and why: they measure the real clock, which a replay does not reproduce (it
reproduces the order of events, not their durations) -- every `timing/*` and `time/*` (seconds; the evaluations'
share of the run), `throughput/*` (per second), `rollout/generate_ahead_s` (seconds), `async/queue_wait_s`
(seconds in the queue), `async/rollout_idle_fraction` and `async/trainer_idle_fraction` (shares of wall-clock
time), `perf/*` (tokens per second).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlstages.configs import RunConfig, load_config
from rlstages.engines.registry import rollout_backend
from rlstages.tasks.driver.async_schedule import SCHEDULE, ScheduleError, read_schedule
from rlstages.tasks.driver.context import RUN_STATE
from rlstages.tasks.driver.fleet_control import EVENTS
from rlstages.tasks.driver.tracking.queries import metric_histories
from rlstages.tasks.driver.tracking.store import tracking_uri

TIMING_PREFIXES = ("timing/", "time/", "throughput/", "perf/")
TIMING_KEYS = frozenset(
    {
        "rollout/generate_ahead_s",
        "rollout/generate_wall_s",
        "async/queue_wait_s",
        "async/rollout_idle_fraction",
        "async/trainer_idle_fraction",
    }
)


def wall_clock(key: str) -> bool:
    """A metric of the real clock (or the machine), left out of the comparison (module docstring)."""
    return key in TIMING_KEYS or key.startswith(TIMING_PREFIXES)


def find_run(run: str, output_dir: Path) -> Path:
    """RUN as a run directory (one holding config.yaml) or a run name under `output_dir`."""
    for path in (Path(run), output_dir / run):
        if (path / "config.yaml").is_file():
            return path
    raise FileNotFoundError(f"{run}: neither a run directory (with config.yaml) nor a run under {output_dir}")


def replay_config(run_dir: Path, name: str | None = None) -> RunConfig:
    """The recorded run's config, following its schedule (checked first: a bad one is refused in one line),
    into `name` (default `<run>-replay`) beside it; that directory must not hold a run yet."""
    schedule = run_dir / SCHEDULE
    read_schedule(schedule)
    fleet = run_dir / EVENTS
    if fleet.is_file() and fleet.read_text().strip():
        raise ScheduleError(f"{fleet}: the rollout fleet changed during the run; replay covers a fixed fleet")
    name = name or f"{run_dir.name}-replay"
    if (run_dir.parent / name).exists():
        raise FileExistsError(f"{run_dir.parent / name} exists: remove it or choose another --name")
    return load_config(
        run_dir / "config.yaml",
        [
            f"trainer.output_dir={run_dir.resolve().parent}",
            f"trainer.run_name={name}",
            f"trainer.async.replay={schedule.resolve()}",
            "checkpoint.resume=never",
        ],
    )


def bitwise(cfg: RunConfig) -> bool:
    """Whether the run's rollout engine reproduces bits from the same calls (the registry's `bitwise_replay`)."""
    return rollout_backend(cfg.rollout.backend).bitwise_replay


def _metrics(cfg: RunConfig, run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    run_id = json.loads((run_dir / RUN_STATE).read_text())["mlflow_run_id"]
    return metric_histories(tracking_uri(cfg), run_id)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted((run_dir / "final").glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def differences(cfg: RunConfig, original: Path, replayed: Path) -> tuple[list[str], int, int]:
    """Where the replayed run differs from the original (one line each; [] when bitwise equal), the number of
    weight tensors and of metric series compared."""
    diffs = []
    a, b = _weights(original), _weights(replayed)
    if sorted(a) != sorted(b):
        diffs.append(f"final weights: tensors differ ({sorted(set(a) ^ set(b))[:3]})")
    diffs += [f"final weights: {k} differs" for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
    ma, mb = _metrics(cfg, original), _metrics(cfg, replayed)
    compared = [k for k in sorted(set(ma) | set(mb)) if not wall_clock(k)]
    for k in compared:
        if ma.get(k) != mb.get(k):
            diffs.append(f"metric {k}: {str(ma.get(k))[:60]} vs {str(mb.get(k))[:60]}")
    sa, sb = (original / SCHEDULE).read_text(), (replayed / SCHEDULE).read_text()
    if sa != sb:
        diffs.append(f"schedule: {replayed / SCHEDULE} differs from {original / SCHEDULE}")
    return diffs, len(a), len(compared)
