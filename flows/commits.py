"""The training flow's checkpoints: each written in the flow's thread, its commit (fsync, checksums, manifest,
pruning: `tasks/checkpoint.py`) run beside the next step where `checkpoint.commit_in_background` is on.

At most one commit is in flight. It is joined before the next checkpoint is written, before a recovery reloads
the last committed checkpoint, before the policy is exported, and on the way out of a failed or stopped run; one
that ended beside a step is said after that step. A commit only reads files the engines finished writing, so the
next step's update may change the engines meanwhile; a crash before its manifest leaves the previous checkpoint
the newest, as a synchronous commit does. Its line is logged from the flow's thread, where Prefect files it under
the flow run.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from prefect.futures import PrefectFuture

from rlstages.configs import RunConfig
from rlstages.flows.progress import RunProgress
from rlstages.flows.stages import Stages
from rlstages.tasks.driver.checkpoints import MANIFEST, checkpoint_dir
from rlstages.tasks.driver.context import RunHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Commit:
    step: int
    future: PrefectFuture[str]
    ui: RunProgress
    ended: threading.Event  # set by the future's callback (in the pool's thread): the flow's thread joins it


class CheckpointCommits:
    """Saves the flow's checkpoints and keeps the one commit in flight (module docstring)."""

    def __init__(self, s: Stages, cfg: RunConfig, run: RunHandle) -> None:
        self.s, self.cfg, self.run = s, cfg, run
        self._pending: _Commit | None = None

    def save(self, step: int, driver_state: dict[str, Any], ui: RunProgress) -> None:
        """Write step `step`'s checkpoint (the last commit joined first), then commit it: beside the next step
        where `checkpoint.commit_in_background`, else now."""
        self.wait()
        fields = self.s.checkpoint(self.cfg, self.run, step, driver_state)
        ui.written()
        if fields is None:  # an earlier attempt of this step committed it
            ui.committed(step, str(checkpoint_dir(self.run, step) / MANIFEST))
        elif self.cfg.checkpoint.commit_in_background:
            ended = threading.Event()
            future = self.s.commit_checkpoint.submit(self.cfg, self.run, step, fields)
            future.add_done_callback(lambda _: ended.set())
            self._pending = _Commit(step, future, ui, ended)
        else:
            ui.committed(step, self.s.commit_checkpoint(self.cfg, self.run, step, fields))

    def poll(self) -> None:
        """Join the commit in flight if it has ended (said now; its failure raised here), else leave it running."""
        if self._pending is not None and self._pending.ended.is_set():
            self.wait()

    def wait(self) -> None:
        """Join the commit in flight, if any, and say it; its failure is raised here (after its task's retries)."""
        commit, self._pending = self._pending, None
        if commit is not None:
            commit.ui.committed(commit.step, commit.future.result())

    def settle(self) -> None:
        """Join the commit in flight on the way out of a failed or stopped run, or before a recovery: a commit
        that succeeds is a checkpoint to resume from; one that fails is logged, not raised over the run's own
        error (the previous checkpoint stays the newest)."""
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - the run's own error or recovery is what the caller handles
            log.warning("a checkpoint's commit failed (%s: %s); the previous checkpoint stays the newest",
                        type(exc).__name__, exc)  # fmt: skip
