"""What a person watches while a run goes: a rich live display (step i/N, stage, reward, held-out accuracy,
time per step, ETA from the measured step times) where the terminal is one, else one plain line per step
(`--log-format plain`, or stdout not a terminal); a Prefect progress artifact; and the run log: one line per step
(step, reward, KL, tokens/s, time, stage timings) for headless logs and Prefect's log pane, plus evaluations,
checkpoint commits and recoveries. Where the terminal goes: `rlstages.flows.console`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.exceptions import MissingContextError
from prefect.logging.handlers import PrefectConsoleHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlstages.engines.runtime.compile_time import COMPILE_METRIC
from rlstages.flows.console import NO_REDIRECT, terminal
from rlstages.tasks.prefect_api import best_effort

ARTIFACT_EVERY_S = 10.0  # each Prefect artifact update is an API round trip (~50 ms): throttle it
# the ETA's time per step is the mean of the last few steps: a step's cost follows its replies' length, which
# halves over the demo's first 6 steps as the policy learns to answer with the number alone (docs/observability.md)
RECENT_STEPS = 5
KL_KEYS = ("actor/kl_loss", "actor/reward_kl_in_reward", "actor/ppo_kl")  # the KL a run is steered by, first found


class _StageTimeoutNotice(logging.Filter):
    """Prefect warns that thread-run tasks' timeouts cannot interrupt blocking calls; ours block only in
    `ray.get(..., timeout=)`, which does fire, so the warning is noise here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeouts in worker threads cannot interrupt" not in record.getMessage()


class _ConsoleChatter(logging.Filter):
    """Keeps each successful task run's "Finished in state Completed()" out of the terminal (the Prefect UI
    still gets it): ten of them a step would bury the one step line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "prefect.task_runs" and record.getMessage().startswith("Finished in state Comp"))


logging.getLogger("prefect.task_runs").addFilter(_StageTimeoutNotice())
for _handler in logging.getLogger().handlers:
    if isinstance(_handler, PrefectConsoleHandler):
        _handler.addFilter(_ConsoleChatter())


def run_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The Prefect run logger (its lines show in the UI's log pane), or a plain logger outside a run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("rlstages")


def flow_run_name() -> str:
    """The flow run's name: the training run's name (`trainer.run_name`, else `run-<config hash>`)."""
    from prefect.runtime import flow_run

    return run_name_of(flow_run.parameters.get("cfg"))


def run_name_of(cfg: Any) -> str:
    """The run name of a config given as a RunConfig or (from a deployment) as its JSON dict."""
    from rlstages.configs import RunConfig
    from rlstages.tasks.run import run_dir

    try:
        return run_dir(cfg if isinstance(cfg, RunConfig) else RunConfig.model_validate(cfg)).name
    except Exception:  # noqa: BLE001 - a name must never fail the run; validation reports a bad config
        return "rl-post-train"


def step_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """The per-step log line: step, reward, KL, tokens/s, time, and where the time went."""
    kl = next((metrics[k] for k in KL_KEYS if k in metrics), float("nan"))
    stages = sorted(
        ((k.removeprefix("timing/").removesuffix("_s"), v) for k, v in metrics.items() if k.startswith("timing/")),
        key=lambda kv: -kv[1],
    )
    where = ", ".join(f"{name} {sec:.2f}s" for name, sec in stages if name != "step")
    return (
        f"step {step}/{total} reward {metrics.get('reward/mean', float('nan')):.4f} kl {kl:.4g} "
        f"tokens/s {metrics.get('throughput/tokens_per_s', 0.0):,.0f} time {metrics.get('timing/step_s', 0.0):.2f}s"
        f" ({where})"
    )


@dataclass(frozen=True)
class Plan:
    """What the ETA knows of the run ahead: which steps evaluate and checkpoint, the start's evaluation time
    (seconds, where one ran) and each step's seconds in an earlier run of the same config (where there is one)."""

    evaluates: Callable[[int], bool] = lambda _step: False
    checkpoints: Callable[[int], bool] = lambda _step: False
    evaluated_s: tuple[float, ...] = ()
    earlier_step_s: tuple[float, ...] = ()


def configured_shape(shape: list[float], total: int) -> tuple[float, ...]:
    """The relative cost of each of `total` steps from `trainer.step_cost_shape` (steps past its end cost as its
    last), for the ETA before a run of the config has finished; () where none is configured."""
    return tuple(shape[min(k, len(shape) - 1)] for k in range(total)) if shape else ()


class RunProgress:
    """Step progress of one run: on the terminal (`rlstages.flows.console.terminal`: a rich live display, or one
    plain line per step), in Prefect's log pane (the step line) and as a Prefect artifact."""

    def __init__(
        self,
        progress: Progress | None,
        task_id: Any,
        total: int,
        start: int,
        artifact_id: Any,
        plan: Plan | None = None,
    ) -> None:
        self.progress, self.task_id, self.total, self.artifact_id = progress, task_id, total, artifact_id
        self._artifact_at = self._started = self._mark = time.monotonic()
        self._first = start  # steps done before this process started (a resume): not in its step times
        self.plan = plan or Plan()
        self._spent: dict[str, list[float]] = {"step": [], "evaluate": list(self.plan.evaluated_s), "checkpoint": []}
        self._steps: list[int] = []  # the step each of `_spent["step"]` timed (a replay after a lost worker repeats)
        self._evaluated_at = [0] * len(self.plan.evaluated_s)  # the step each of `_spent["evaluate"]` came after
        self._stage_at: tuple[str, float] | None = None
        self._accuracy, self._reward, self._timing = "-", "", ""
        self.log = run_logger()
        self.term = terminal()

    def _say(self, line: str) -> None:
        """A line on the terminal: above the live display, or (plain, the log going elsewhere) as is."""
        if self.progress is not None:
            self.progress.console.print(line, highlight=False, markup=False, soft_wrap=True)
        elif self.term.redirected:
            self.term.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def stage(self, name: str) -> None:
        """Show the stage being run (an evaluation's or a checkpoint's start is timed for the ETA)."""
        self._stage_at = (name, time.monotonic())
        if self.progress is not None:
            self.progress.update(self.task_id, stage=name)

    def seconds_per_step(self, step: int) -> float | None:
        """Measured wall time per step in this process (evaluations and checkpoints included)."""
        done = step - self._first
        return (time.monotonic() - self._started) / done if done > 0 else None

    def _timed(self, kind: str, one_off: float = 0.0) -> None:
        """The time since the last mark (a step) or since its stage began (an evaluation, a checkpoint), less
        `one_off` seconds that will not come again (compiling)."""
        now = time.monotonic()
        began = self._stage_at[1] if self._stage_at is not None and self._stage_at[0] == kind else self._mark
        self._spent[kind].append(max(now - began - one_off, 0.0))
        self._mark = now

    def eta_seconds(self, step: int) -> float:
        """The rest of the run after step `step`: the steps left at the mean time of the last `RECENT_STEPS`
        steps (their compiling left out; the first one, with its other warm-ups, left out once others are
        measured) or, where an earlier run of the same config timed each step (or the config gives their shape),
        its times scaled by how fast those same steps ran here; plus the evaluations and checkpoints still due (this
        step's included) at their measured times, an evaluation's scaled by the same shape (its replies shorten
        as the steps' do)."""
        evals, saves = self._spent["evaluate"], self._spent["checkpoint"]
        timed = list(zip(self._steps, self._spent["step"], strict=True))
        recent = (timed[1:] if len(timed) > 1 else timed)[-RECENT_STEPS:]
        earlier = self.plan.earlier_step_s
        shaped = len(earlier) >= self.total
        then = sum(earlier[k - 1] for k, _ in recent) if shaped else 0.0
        now = sum(seconds for _, seconds in recent)
        if then > 0:
            eta = now / then * sum(earlier[step : self.total])
        else:
            eta = now / len(recent) * (self.total - step) if recent else 0.0
        later = range(step, self.total + 1)
        if evals:
            eta += self._evaluations_ahead(later, earlier if shaped else ())
        if saves:
            eta += sum(saves) / len(saves) * sum(self.plan.checkpoints(s) for s in later)
        return eta

    def _evaluations_ahead(self, later: range, shape: tuple[float, ...]) -> float:
        """The seconds of the evaluations due in `later`: the measured ones' mean or, given the steps' `shape`,
        their seconds per unit of the cost of the step each followed (the start's: the first step's) times the
        cost of the steps the due ones follow."""
        evals, due = self._spent["evaluate"], [s for s in later if self.plan.evaluates(s)]
        weights = [shape[max(k, 1) - 1] for k in self._evaluated_at] if shape else []
        if not shape or sum(weights) <= 0:
            return sum(evals) / len(evals) * len(due)
        return sum(evals) / sum(weights) * sum(shape[max(k, 1) - 1] for k in due)

    def evaluation_seconds(self) -> list[float]:
        """Each held-out evaluation's wall time in this process (the start's included), logging and plot too."""
        return list(self._spent["evaluate"])

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        """Advance to `step` with its reward, the last held-out accuracy, time per step and the ETA."""
        self._timed("step", sum(v for k, v in metrics.items() if k.startswith(COMPILE_METRIC)))
        self._steps.append(step)
        per_step = self.seconds_per_step(step)
        eta = None if per_step is None else _clock(self.eta_seconds(step))
        self._timing = "" if per_step is None else f" | {per_step:.1f} s/step | ETA {eta}"
        self._reward = f"reward {metrics.get('reward/mean', float('nan')):.3f}"
        if self.progress is not None:
            self.progress.update(self.task_id, completed=step, stage="")
            self._show()
        line = step_line(step, self.total, metrics)
        self.log.info(line)
        if self.progress is None:
            self._say(line + self._timing)
        now = time.monotonic()
        if self.artifact_id is not None and (step == self.total or now - self._artifact_at >= ARTIFACT_EVERY_S):
            artifact_id, progress = self.artifact_id, 100.0 * step / self.total
            best_effort(lambda: update_progress_artifact(artifact_id, progress=progress), "the progress artifact")
            self._artifact_at = now

    def _show(self) -> None:
        if self.progress is not None:
            info = f"{self._reward} | held-out {self._accuracy}{self._timing}"
            self.progress.update(self.task_id, info=info)

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        """Log a held-out evaluation."""
        self._timed("evaluate")
        self._evaluated_at.append(step)
        self._accuracy = f"{metrics.get('eval/accuracy', float('nan')):.3f}"
        self._show()
        line = (
            f"evaluation at step {step}: held-out reward {metrics.get('eval/reward_mean', float('nan')):.4f} "
            f"accuracy {self._accuracy}"
        )
        self.log.info(line)
        self._say(line)

    def written(self) -> None:
        """A checkpoint's engines have written their state: what the step loop waited for (its commit may run
        beside the next step)."""
        self._timed("checkpoint")

    def committed(self, step: int, manifest: str) -> None:
        """Log a committed checkpoint."""
        self.log.info(f"checkpoint of step {step} committed: {manifest}")

    def recovering(self, step: int, lost: BaseException, attempt: int, limit: int) -> None:
        """Log a worker loss and the recovery that follows (reload the last checkpoint, replay)."""
        line = (
            f"worker lost at step {step} ({lost}); recovery {attempt}/{limit}: rebuilding the workers from the "
            "last committed checkpoint and replaying"
        )
        self.log.warning(line)
        self._say(line)


def eval_share(evaluations_s: list[float], run_s: float) -> dict[str, float]:
    """The run's evaluation cost as logged at its end: evaluations, their seconds, the run's, and the share
    (issue 53's figure: at most 0.15 in the demo)."""
    spent = sum(evaluations_s)
    return {
        "time/evaluations": float(len(evaluations_s)),
        "time/eval_total_s": spent,
        "time/run_s": run_s,
        "time/eval_fraction": spent / run_s if run_s > 0 else 0.0,
    }


def _clock(seconds: float) -> str:
    minutes, sec = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{sec:02d}"


@contextlib.contextmanager
def run_progress(name: str, total: int, start: int, plan: Plan | None = None) -> Iterator[RunProgress]:
    """The run's progress for `total` steps starting after `start`: a live display where the terminal is one."""
    try:
        artifact_id = create_progress_artifact(
            progress=100.0 * start / total, key=f"progress-{_key(name)}", description=f"training steps of {name}"
        )
    except Exception:  # noqa: BLE001 - progress reporting must never fail a run
        artifact_id = None
    term = terminal()
    term.started()
    if not term.live:
        yield RunProgress(None, None, total, start, artifact_id, plan)
        return
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stage]}"),
        TextColumn("{task.fields[info]}"),
        TextColumn("[dim]elapsed"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=term.console, transient=False, refresh_per_second=2, **NO_REDIRECT) as progress:
        task_id = progress.add_task(name, total=total, completed=start, stage="", info="")
        yield RunProgress(progress, task_id, total, start, artifact_id, plan)
        progress.update(task_id, stage="")  # the last stage (a checkpoint) is over


def _key(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())[:50]
