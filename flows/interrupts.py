"""Ctrl-C and SIGTERM during a training flow (a person, a scheduler, `kubectl delete`, a spot reclaim): the run
stops at a safe point within seconds and says in one line what was kept.

While the flow runs, its thread handles SIGINT and SIGTERM (Prefect's own SIGTERM handler is put back after).
By default a signal stops the run at once: it raises `Interrupted` where the flow is (a stage's Ray call, a wait
on a stage), the flow ends its MLflow run KILLED, frees the workers and returns a Cancelled state, so the flow
run is Cancelled and its caller gets `RunStopped`: the step it stopped at, the last committed checkpoint and
what a re-run does. With `trainer.checkpoint_on_signal: true` the first signal only asks: the step in progress
finishes, a checkpoint is committed at its boundary, then the run stops the same way; a second signal stops at
once. Further signals while the run closes are ignored (it takes seconds; SIGKILL still ends it).
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any

from prefect.states import Cancelled, State

from rlstages.configs import RunConfig
from rlstages.tasks.driver.checkpoints import latest_checkpoint
from rlstages.tasks.driver.context import RunHandle

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A signal stopped the run (raised in the flow's thread, at once or at a step's boundary)."""

    def __init__(self, signum: int, at_boundary: bool = False) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.at_boundary = signum, at_boundary


@dataclass
class RunStopped(Exception):
    """A run stopped by a signal, as its caller learns it (the flow run itself is Cancelled)."""

    signum: int
    step: int  # the step in progress, or the last step done when `done`; 0 while the run was starting
    done: bool
    total: int
    checkpoint: int | None  # the newest committed checkpoint's step
    run_dir: str

    def __str__(self) -> str:
        return self.line()

    def __reduce__(self) -> tuple[type[RunStopped], tuple[int, int, bool, int, int | None, str]]:
        return RunStopped, (self.signum, self.step, self.done, self.total, self.checkpoint, self.run_dir)

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by this signal (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum

    def line(self, command: str | None = None) -> str:
        """What was kept, in one line; `command` re-runs the run (default `rlstages resume <run dir>`)."""
        name = signal.Signals(self.signum).name
        if self.step == 0:
            where = "while starting"
        else:
            where = f"{'after' if self.done else 'at'} step {self.step} of {self.total}"
        if self.checkpoint is None:
            kept = "last checkpoint: none, a re-run starts over"
        else:
            again = command or f"rlstages resume {self.run_dir}"
            kept = f"last checkpoint: step {self.checkpoint}; `{again}` resumes from it"
        return f"stopped {where} ({name}); {kept}"

    def state(self) -> State[Any]:
        """The flow's Cancelled final state; its caller gets this exception raised."""
        return Cancelled(message=self.line(), data=self)


class StopOnSignal:
    """The flow's SIGINT / SIGTERM handlers while it runs (see the module's docstring)."""

    def __init__(self, graceful: bool) -> None:
        self.graceful = graceful
        self.requested: int | None = None
        self.stopping = False
        self._previous: dict[int, Any] = {}

    def install(self) -> StopOnSignal:
        """Handle the signals in this thread (only the main thread can: elsewhere the defaults stay)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put the handlers back as they were before `install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            return  # the run is closing (MLflow KILLED, workers freed): let it finish
        if self.graceful and self.requested is None:
            self.requested = signum  # the step finishes and commits a checkpoint first (`at_boundary`)
            return
        self.requested, self.stopping = signum, True
        raise Interrupted(signum)

    def checkpoint_now(self) -> bool:
        """True when a signal asked for a checkpoint at this step's boundary."""
        return self.graceful and self.requested is not None

    def at_boundary(self) -> None:
        """Stop here, between steps, when a signal asked for it."""
        if self.requested is not None and not self.stopping:
            self.stopping = True
            raise Interrupted(self.requested, at_boundary=True)

    def stopped(self, exc: BaseException, cfg: RunConfig, run: RunHandle, step: int) -> RunStopped | None:
        """What the flow tells its caller when `exc` is our interrupt (None for any other exception); `step` is
        the step the loop was at (0 before it began). A signal that lands while the flow waits in `ray.get` (most
        of a run) reaches the flow as a plain KeyboardInterrupt: Ray re-raises whatever the handler raised as
        one. It is ours when our handler ran; without this the run ended FAILED-looking (MLflow KILLED with
        "KeyboardInterrupt", Prefect Crashed, exit 130, no line saying what was kept)."""
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted) and self.requested is not None:
            exc = Interrupted(self.requested)
        if not isinstance(exc, Interrupted):
            return None
        self.stopping = True
        try:
            found = latest_checkpoint(run)
        except (OSError, ValueError):  # a damaged checkpoint: the re-run says so
            found = None
        return RunStopped(
            exc.signum, step, exc.at_boundary, cfg.trainer.total_steps, found[0] if found else None, run.run_dir
        )


def stop_on_signal(cfg: RunConfig) -> StopOnSignal:
    """Install the flow's signal handlers for this run (`trainer.checkpoint_on_signal` decides when it stops)."""
    return StopOnSignal(cfg.trainer.checkpoint_on_signal).install()
