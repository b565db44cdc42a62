"""The training flow's checkpoints: each written in the flow's thread, its commit (fsync, checksums, manifest,
pruning: `tasks/checkpoint.py`) run beside the next step where `checkpoint.commit_in_background` is on.

At most one commit is in flight. It is joined before the next checkpoint is written, before a recovery reloads
the last committed checkpoint, before the policy is exported, and on the way out of a failed or stopped run.
A commit only reads files the engines finished writing, so the next step's update may change the engines
meanwhile; a crash before its manifest leaves the previous checkpoint the newest, as a synchronous commit does.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect.futures import PrefectFuture

from rlstages.configs import RunConfig
from rlstages.flows.progress import RunProgress
from rlstages.flows.stages import Stages
from rlstages.tasks.driver.checkpoints import MANIFEST, checkpoint_dir
from rlstages.tasks.driver.context import RunHandle

log = logging.getLogger(__name__)


class CheckpointCommits:
    """Saves the flow's checkpoints and keeps the one commit in flight (module docstring)."""

    def __init__(self, s: Stages, cfg: RunConfig, run: RunHandle) -> None:
        self.s, self.cfg, self.run = s, cfg, run
        self._pending: PrefectFuture[str] | None = None

    def save(self, step: int, driver_state: dict[str, Any], ui: RunProgress) -> None:
        """Write step `step`'s checkpoint (the last commit joined first), then commit it: beside the next step
        where `checkpoint.commit_in_background`, else now."""
        self.wait()
        fields = self.s.checkpoint(self.cfg, self.run, step, driver_state)
        ui.written()
        if fields is None:  # an earlier attempt of this step committed it
            ui.committed(step, str(checkpoint_dir(self.run, step) / MANIFEST))
        elif self.cfg.checkpoint.commit_in_background:
            self._pending = self.s.commit_checkpoint.submit(self.cfg, self.run, step, fields)
            self._pending.add_done_callback(lambda done: _say_committed(done, step, ui))  # said when it is
        else:
            ui.committed(step, self.s.commit_checkpoint(self.cfg, self.run, step, fields))

    def wait(self) -> None:
        """Join the commit in flight, if any; its failure is raised here (after its task's retries)."""
        future, self._pending = self._pending, None
        if future is not None:
            future.result()

    def settle(self) -> None:
        """Join the commit in flight on the way out of a failed or stopped run, or before a recovery: a commit
        that succeeds is a checkpoint to resume from; one that fails is logged, not raised over the run's own
        error (the previous checkpoint stays the newest)."""
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - the run's own error or recovery is what the caller handles
            log.warning("a checkpoint's commit failed (%s: %s); the previous checkpoint stays the newest",
                        type(exc).__name__, exc)  # fmt: skip


def _say_committed(future: PrefectFuture[str], step: int, ui: RunProgress) -> None:
    """The line of a commit that succeeded, in the thread that ran it (a failure is the caller's, at the join)."""
    if future.state.is_completed():
        ui.committed(step, future.result())
