"""The elastic fleet's control file and event log in the run directory (docs/async.md, "Elastic fleet").

`rlstages scale RUN --rollout-workers N` (and the `rl-scale` Prefect flow) writes `fleet.json`; the running async
driver reads it between two steps. Every join and leave is appended to `fleet.jsonl`, one JSON object a line with a
`kind` (`worker_join` | `worker_leave`), and handed to every function in `EVENT_HOOKS` (where a schedule recorder,
e.g. a replay's, registers to take the fleet's events into its own file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

CONTROL = "fleet.json"  # {"rollout_workers": N}: what the run should have
EVENTS = "fleet.jsonl"  # one event a line, as they happened

EVENT_HOOKS: list[Callable[[dict[str, Any]], None]] = []  # called with every event after it is written


def request_scale(run_dir: Path, rollout_workers: int) -> Path:
    """Ask the run in `run_dir` for `rollout_workers` rollout workers (atomically replaces the control file)."""
    if rollout_workers < 1:
        raise ValueError(f"--rollout-workers: expected an integer >= 1, got {rollout_workers}")
    if not run_dir.is_dir():
        raise ValueError(f"RUN: no run directory at {run_dir}")
    path = run_dir / CONTROL
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"rollout_workers": rollout_workers}))
    tmp.replace(path)
    return path


def requested(run_dir: Path) -> int | None:
    """The rollout worker count the control file asks for (None: no file, or unreadable: keep what is there)."""
    try:
        value = json.loads((run_dir / CONTROL).read_text())["rollout_workers"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and value >= 1 else None


def record(run_dir: Path, event: dict[str, Any]) -> None:
    """Append one fleet event to the run's `fleet.jsonl` and pass it to the `EVENT_HOOKS`."""
    with (run_dir / EVENTS).open("a") as fh:
        fh.write(json.dumps(event) + "\n")
    for hook in EVENT_HOOKS:
        hook(event)


def events(run_dir: Path) -> list[dict[str, Any]]:
    """Every fleet event of the run, in order."""
    path = run_dir / EVENTS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
