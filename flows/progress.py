"""What a person watches while a run goes: a rich progress bar (step i/N, stage, reward, tokens/s) and a
Prefect progress artifact.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ARTIFACT_EVERY_S = 10.0  # each Prefect artifact update is an API round trip (~50 ms): throttle it


class RunProgress:
    """Step progress of one run, in the terminal and in Prefect."""

    def __init__(self, progress: Progress, task_id: Any, total: int, artifact_id: Any) -> None:
        self.progress, self.task_id, self.total, self.artifact_id = progress, task_id, total, artifact_id
        self._artifact_at = time.monotonic()

    def stage(self, name: str) -> None:
        """Show the stage being run."""
        self.progress.update(self.task_id, stage=name)

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        """Advance to `step` with its reward and throughput."""
        reward = metrics.get("reward/mean", float("nan"))
        tps = metrics.get("throughput/tokens_per_s", 0.0)
        self.progress.update(self.task_id, completed=step, stage="", info=f"reward {reward:.3f} | {tps:,.0f} tok/s")
        now = time.monotonic()
        if self.artifact_id is not None and (step == self.total or now - self._artifact_at >= ARTIFACT_EVERY_S):
            update_progress_artifact(self.artifact_id, progress=100.0 * step / self.total)
            self._artifact_at = now


@contextlib.contextmanager
def run_progress(name: str, total: int, start: int) -> Iterator[RunProgress]:
    """A live progress display for `total` steps starting after `start`."""
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stage]}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    ]
    try:
        artifact_id = create_progress_artifact(
            progress=100.0 * start / total, key=f"progress-{_key(name)}", description=f"training steps of {name}"
        )
    except Exception:  # noqa: BLE001 - progress reporting must never fail a run
        artifact_id = None
    with Progress(*columns, console=Console(stderr=True), transient=False, refresh_per_second=2) as progress:
        task_id = progress.add_task(name, total=total, completed=start, stage="", info="")
        yield RunProgress(progress, task_id, total, artifact_id)


def _key(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())[:50]
