"""The terminal of a run: ours alone. `rlstages run` / `resume` send everything the process and its children
write to stdout and stderr (library warnings and progress bars, Prefect's and Ray's workers' logs) into the
run's log file, `<trainer.output_dir>/<run name>.log`, whose path is printed once; the terminal keeps what
this module prints: the machine measured at start-up, one rich live display (step, reward, held-out accuracy,
time per step, ETA) or, with `--log-format plain` or when stdout is not a terminal, one plain line per step,
and the summary panel at the end. `-v` (or `--debug`) leaves the terminal as it was: everything shows.

Where no CLI set a terminal up (a deployment's flow run, an in-process test) `terminal()` is stderr and
nothing is redirected.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner

from rlstages.configs import RunConfig

LogFormat = Literal["auto", "rich", "plain"]
NO_REDIRECT: dict[str, Any] = {
    "redirect_stdout": False,
    "redirect_stderr": False,
}  # rich's live displays leave sys.std* alone


@dataclass
class Terminal:
    """Where our own output goes, and how."""

    console: Console
    live: bool  # a rich live display (a terminal, --log-format auto or rich); else one plain line per step
    log_path: Path | None = None  # where everything else went; None: nothing was redirected
    status: Live | None = None  # the start-up spinner, until the steps' display replaces it

    @property
    def redirected(self) -> bool:
        """True when libraries' output goes to the log file, not here (our lines must be printed here)."""
        return self.log_path is not None

    def starting(self) -> None:
        """Say that the run is starting (Prefect, MLflow, the workers, the model): the longest silence otherwise."""
        what = "starting: Prefect, MLflow, the workers and the model (the first time: its download or conversion)"
        if self.live:
            # not redirecting sys.stdout/stderr into the terminal, as rich does by default: those are the log's
            self.status = Live(Spinner("dots", what), console=self.console, transient=True, **NO_REDIRECT)
            self.status.start()
        else:
            self.console.print(what, highlight=False, soft_wrap=True)

    def started(self) -> None:
        """The start-up is over (the steps' display follows, or the run failed)."""
        if self.status is not None:
            self.status.stop()
            self.status = None


_current: Terminal | None = None


def terminal() -> Terminal:
    """The terminal a CLI command set up, else stderr with a live display where it is a terminal."""
    if _current is not None:
        return _current
    console = Console(stderr=True)
    return Terminal(console, console.is_terminal)


def log_path_of(cfg: RunConfig) -> Path:
    """The run's log file: beside its run directory (which may be cleared when a failed start starts over)."""
    from rlstages.tasks.run import run_dir

    path = run_dir(cfg)
    return path.with_name(f"{path.name}.log")


@contextlib.contextmanager
def terminal_session(
    log_path: Path, log_format: LogFormat, verbose: bool, consoles: tuple[Console, Console]
) -> Iterator[Terminal]:
    """Redirect file descriptors 1 and 2 into `log_path` (appended) from here until the process exits, unless
    `verbose` or the process's streams are not its own (an in-process CLI runner); `consoles` (the CLI's stdout
    and stderr consoles) keep writing to the terminal. Meant for a CLI command's last act."""
    global _current
    own = sys.stdout is sys.__stdout__ and sys.stderr is sys.__stderr__
    if verbose or not own:
        console = Console(stderr=True)
        _current = Terminal(console, log_format == "rich" or (log_format == "auto" and console.is_terminal))
        try:
            yield _current
        finally:
            _current.started()
            _current = None
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out_console, err_console = consoles
    sys.stdout.flush()
    sys.stderr.flush()
    term_out: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    term_err: IO[str] = os.fdopen(os.dup(2), "w", buffering=1)
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - open until the process exits
    log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} rlstages {' '.join(sys.argv[1:])}\n")
    # Descriptors 1 and 2 stay on the log until the process exits: what libraries print while shutting down
    # (the temporary Prefect server stopping, Ray's workers leaving) is theirs too. Our consoles stay here.
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    out_console.file, err_console.file = term_out, term_err
    console = Console(file=term_out)
    if not console.is_terminal:  # a log or a pipe: paths and links on one line (80 columns would fold them)
        console = Console(file=term_out, width=200)
    live = log_format == "rich" or (log_format == "auto" and console.is_terminal)
    _current = Terminal(console, live, log_path)
    console.print(f"log: {log_path} (libraries' and workers' output; -v shows it here)", highlight=False)
    try:
        yield _current
    finally:
        _current.started()
        _current = None


def machine_of(cfg: RunConfig):  # noqa: ANN201 - engines' Machine, imported lazily (torch)
    """This machine as `cfg`'s actor sees it (`rlstages.engines.training.machine.measure`, once per process)."""
    from rlstages.engines.training.machine import measure

    actor = cfg.actor
    bf16 = cfg.model.dtype == "bfloat16" or bool(getattr(actor, "bf16_autocast", False))
    rollout = getattr(cfg.rollout, "fp32_weights", None)  # the HF rollout's (another backend: None)
    threads = cfg.cluster.threads_per_worker
    return measure(getattr(actor, "fp32_matmul", None), bf16, threads, rollout, cfg.rollout.dtype == "bfloat16")


def _duration(seconds: float) -> str:
    minutes, sec = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {sec:02d} s" if minutes else f"{sec} s"


def _accuracy_story(history: list[tuple[int, float]]) -> str:
    if not history:
        return "not evaluated"
    first, last = history[0], history[-1]
    best = max(history, key=lambda sv: sv[1])
    return (
        f"{first[1]:.3f} (step {first[0]}) → best {best[1]:.3f} (step {best[0]}) → last {last[1]:.3f} (step {last[0]})"
    )


def _eval_time_story(cfg: RunConfig, run_id: str) -> str:
    """The held-out evaluations' share of the run (`time/eval_fraction`, logged at its end)."""
    from rlstages.tasks.driver import tracking

    share = {key: tracking.metric_history(cfg, run_id, f"time/{key}") for key in ("eval_fraction", "eval_total_s")}
    count = tracking.metric_history(cfg, run_id, "time/eval_s")
    if not share["eval_fraction"] or not share["eval_total_s"]:
        return "not measured"
    spent = share["eval_total_s"][-1][1]
    return (
        f"{len(count)} evaluations, {_duration(spent)} in all: {100 * share['eval_fraction'][-1][1]:.1f} % of the run"
    )


def prefect_ui_command() -> str:
    """How to open the Prefect UI on the flow runs this machine recorded."""
    api = os.environ.get("PREFECT_API_URL")
    if api:
        return f"open {api.removesuffix('/').removesuffix('/api')}"
    return "prefect server start   (then http://127.0.0.1:4200; the run's temporary server kept its database)"


def summary_rows(cfg: RunConfig, policy: str, wall_s: float) -> list[tuple[str, str]]:
    """The end-of-run summary: steps, wall time, held-out accuracy first → best → last, where things are."""
    from rlstages.tasks.driver import tracking
    from rlstages.tasks.driver.run_dir import read_state

    run = Path(policy).parent
    run_id = read_state(run).get("mlflow_run_id")
    history = tracking.metric_history(cfg, run_id, "eval/accuracy") if run_id else []
    uri = tracking.tracking_uri(cfg)
    curve = run / "reward_curve.png"
    rows = [
        ("steps", str(cfg.trainer.total_steps)),
        ("wall time", _duration(wall_s)),
        ("held-out accuracy", _accuracy_story(history)),
        ("evaluation time", _eval_time_story(cfg, run_id) if run_id else "not measured"),
        ("reward curve", str(curve) if curve.is_file() else "(none)"),
        ("run directory", str(run)),
        ("final model", policy),
        ("MLflow UI", f"open {uri}" if uri.startswith("http") else f"mlflow ui --backend-store-uri {uri}"),
        ("Prefect UI", prefect_ui_command()),
    ]
    if run_id:
        rows.insert(6, ("MLflow run", tracking.run_link(cfg, run_id)))
    return rows


def print_summary(cfg: RunConfig, policy: str, wall_s: float, console: Console | None = None) -> None:
    """The summary panel, on the terminal."""
    from rich.panel import Panel
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for name, value in summary_rows(cfg, policy, wall_s):
        table.add_row(name, value)
    target = console or terminal().console
    target.print(Panel(table, title=f"run summary: {Path(policy).parent.name}", expand=False), highlight=False)
