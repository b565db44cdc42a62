"""The `rl-scale` Prefect flow: change a running async run's rollout fleet from a deployment parameter.

    rlstages deploy ... is for training; this flow is served or deployed on its own (docs/async.md,
    "Elastic fleet"), then `prefect deployment run rl-scale/<name> -p run_dir=runs/x -p rollout_workers=4`.

It writes the run directory's control file (`tasks/driver/fleet_control.py`), which the running driver reads
between two steps; `rlstages scale RUN --rollout-workers N` does the same from a shell.
"""

from __future__ import annotations

from pathlib import Path

from rlstages.flows.flow_guard import guarded_flow
from rlstages.tasks.driver.fleet_control import request_scale


@guarded_flow(name="rl-scale", validate_parameters=True)
def scale_rollout(run_dir: str, rollout_workers: int) -> str:
    """Ask the async run in `run_dir` for `rollout_workers` rollout workers; returns the control file's path."""
    return str(request_scale(Path(run_dir), rollout_workers))
