"""The `rlstages` command line: run, resume, replay, eval, config show, convert and export.

Bad input is a one-line error naming the file or field and a non-zero exit; `--debug` shows tracebacks.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import shlex
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from rlstages.configs import ConfigError, RunConfig, load_config, to_yaml
from rlstages.flows.cli.early_start import build_model_early, start_services_early
from rlstages.flows.cli.quiet import one_line, quiet_prefect

STARTED = time.monotonic()  # the summary's wall time counts from the command's start (imports, pre-flight included)


def one_malloc_arena() -> None:
    """One glibc malloc arena for the driver, as its workers have (`cluster.heap`): Prefect's, Ray's and MLflow's
    threads otherwise each get an arena whose freed blocks the others never reuse. Set before they start."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, 1)  # M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc
        pass


one_malloc_arena()

app = typer.Typer(
    help="RL post-training of LLMs as a Prefect workflow over Ray, recorded in MLflow.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # `rlstages --install-completion` (bash, zsh, fish, PowerShell)
)
config_app = typer.Typer(help="Inspect configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")
err = Console(stderr=True)
out = Console()

ConfigArg = Annotated[Path, typer.Argument(help="YAML config (e.g. configs/demo.yaml).")]
Overrides = Annotated[list[str] | None, typer.Argument(help="Dotted overrides: actor.optim.lr=1e-6 rollout.n=8")]
Debug = Annotated[bool, typer.Option("--debug", help="Show full tracebacks (and everything -v shows).")]
Verbose = Annotated[
    bool,
    typer.Option(
        "-v", "--verbose", help="Show libraries' warnings, progress bars and workers' output here, not only in the log."
    ),
]


class LogFormat(StrEnum):
    """How a run shows its steps on the terminal."""

    auto = "auto"
    rich = "rich"
    plain = "plain"


LogFormatOpt = Annotated[
    LogFormat,
    typer.Option("--log-format", help="auto: a live display on a terminal, one line per step otherwise; rich; plain."),
]


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            out.print(f"rlstages {version('rlstages')}", highlight=False)
        except PackageNotFoundError:  # run from a source tree that was never installed
            out.print("rlstages (not installed)", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """RL post-training of LLMs as a Prefect workflow over Ray, recorded in MLflow."""


def fail(message: str, code: int = 1) -> None:
    """Print a one-line error and exit non-zero."""
    from rlstages.flows.console import terminal

    terminal().started()  # a start-up spinner stops first
    err.print(f"[bold red]error:[/] {escape(one_line(message))}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def warn(message: str) -> None:
    """Print a one-line warning (the run goes on)."""
    err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True, highlight=False)


def _load(path: Path, overrides: list[str] | None) -> RunConfig:
    try:
        return load_config(path, overrides or [])
    except ConfigError as exc:
        fail(str(exc), 2)
        raise


def _guard(debug: bool, action) -> object:  # type: ignore[no-untyped-def]
    from rlstages.flows.interrupts import RunStopped

    try:
        return action()
    except (typer.Exit, RunStopped):
        raise
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as exc:
        if debug:
            raise
        fail(f"{exc}", 2)
    except Exception as exc:  # noqa: BLE001 - the CLI reports any failure in one line
        if debug:
            raise
        fail(f"{type(exc).__name__}: {exc}", 1)
    return None


def _precheck(cfg: RunConfig) -> None:
    """Refuse, before any flow starts, what the pre-flight finds (`rlstages.tasks.driver.preflight.CHECKS`: the model,
    data files and rows, imports, the tracking store, LoRA targets, prompts, faults, a run directory of another
    config or with a damaged checkpoint, a missing backend package, GPUs or CPUs this machine lacks)."""
    from rlstages.tasks.driver.preflight import preflight

    for message in preflight(cfg):
        warn(message)


def _hold_run_dir(cfg: RunConfig, debug: bool) -> None:
    """Take the run directory's lock (`rlstages.tasks.driver.run_lock`): a second run under a name that is running
    is refused in one line here, before the run directory, its log, Prefect, Ray or MLflow are touched."""
    if cfg.checkpoint.resume == "fresh":  # every flow run gets its own directory; the flow locks it
        return
    from rlstages.tasks.driver.run_dir import run_dir
    from rlstages.tasks.driver.run_lock import acquire

    _guard(debug, lambda: acquire(run_dir(cfg)))


def _train(cfg: RunConfig, debug: bool, verbose: bool, log_format: LogFormat, again: str | None = None) -> None:
    """Run the training flow with the terminal to ourselves (`rlstages.flows.console`): the machine measured,
    the live display or plain step lines, the summary panel; everything else into the run's log file. A run
    stopped by Ctrl-C or SIGTERM says what was kept and that `again` (the command) resumes it."""
    from rlstages.flows.console import log_path_of, machine_of, print_summary, terminal_session
    from rlstages.flows.interrupts import RunStopped

    _hold_run_dir(cfg, debug)
    build_model_early(cfg)
    quiet_prefect(debug)
    log_path = _guard(debug, lambda: log_path_of(cfg))
    assert isinstance(log_path, Path)
    try:
        with terminal_session(log_path, log_format.value, verbose or debug, (out, err)) as term:  # type: ignore[arg-type]
            term.console.print(machine_of(cfg).line(), highlight=False, soft_wrap=True)
            term.starting()
            start_services_early(cfg)
            from rlstages.flows.train import rl_post_train

            policy = _guard(debug, lambda: rl_post_train(cfg))
            assert isinstance(policy, str)
            out.print(f"[green]done[/]: final policy in {escape(policy)}", soft_wrap=True)
            _guard(debug, lambda: print_summary(cfg, policy, time.monotonic() - STARTED, term.console))
    except RunStopped as stopped:
        again = again if cfg.checkpoint.resume == "auto" else None  # else `rlstages resume <its directory>`
        err.print(f"[yellow]{escape(stopped.line(again))}[/]", soft_wrap=True, highlight=False)
        raise typer.Exit(stopped.exit_code) from None


@app.command()
def run(
    config: ConfigArg,
    overrides: Overrides = None,
    debug: Debug = False,
    verbose: Verbose = False,
    log_format: LogFormatOpt = LogFormat.auto,
) -> None:
    """Run (or continue) the training flow of CONFIG on the configured cluster."""
    cfg = _load(config, overrides)
    _guard(debug, lambda: _precheck(cfg))
    _train(cfg, debug, verbose, log_format, shlex.join(["rlstages", "run", str(config), *(overrides or [])]))


@app.command()
def resume(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (runs/<name>).")],
    debug: Debug = False,
    verbose: Verbose = False,
    log_format: LogFormatOpt = LogFormat.auto,
) -> None:
    """Continue a run from its last committed checkpoint, into the same MLflow run."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        fail(f"{run_dir}: not a run directory (no config.yaml)", 2)
    cfg = _load(
        saved,
        [
            f"trainer.output_dir={run_dir.resolve().parent}",
            f"trainer.run_name={run_dir.name}",
            "checkpoint.resume=auto",
        ],
    )
    from rlstages.tasks.driver.run_dir import finished

    if _guard(debug, lambda: finished(run_dir, cfg)):  # nothing starts: no Ray, Prefect or MLflow
        out.print(f"[green]nothing to resume[/]: {escape(str(run_dir))} finished; final policy in {run_dir / 'final'}")
        return
    _guard(debug, lambda: _precheck(cfg))
    _train(cfg, debug, verbose, log_format, shlex.join(["rlstages", "resume", str(run_dir)]))


@app.command()
def replay(
    run: Annotated[str, typer.Argument(help="An async run: its run directory, or its name under --output-dir.")],
    name: Annotated[str | None, typer.Option("--name", help="The replay's run name (default <RUN>-replay).")] = None,
    output_dir: Annotated[Path, typer.Option("--output-dir", help="Where run names are looked up.")] = Path("runs"),
    debug: Debug = False,
) -> None:
    """Re-execute an async run on its recorded schedule (docs/async.md, Replay): bit for bit on the HF backend
    (final weights, every metric but wall-clock ones, the schedule); on vLLM/SGLang the schedule only."""
    from rlstages.tasks.driver.replay_check import bitwise, differences, find_run, replay_config

    recorded = _guard(debug, lambda: find_run(run, output_dir))
    assert isinstance(recorded, Path)
    cfg = _guard(debug, lambda: replay_config(recorded, name))
    assert isinstance(cfg, RunConfig)
    if not (exact := bitwise(cfg)):
        out.print(f"rollout.backend={cfg.rollout.backend} is not bitwise-stable (its batching): the replay "
                  "reproduces the schedule (samples, updates, versions), not the bits", soft_wrap=True)  # fmt: skip
    _guard(debug, lambda: _precheck(cfg))
    _train(cfg, debug, False, LogFormat.auto)
    replayed = cfg.trainer.output_dir / str(cfg.trainer.run_name)
    found = _guard(debug, lambda: differences(cfg, recorded, replayed)) if exact else ([], 0, 0)
    assert isinstance(found, tuple)
    for line in found[0]:
        err.print(f"[red]differs[/]: {escape(line)}", soft_wrap=True, highlight=False)
    if found[0]:
        raise typer.Exit(1)
    what = f"{found[1]} weight tensors, {found[2]} metrics (wall-clock ones excluded) and the schedule equal"
    out.print(f"[green]replayed[/]: {what if exact else 'the schedule reproduced'}", soft_wrap=True)


@app.command("eval")
def eval_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
    checkpoint: Annotated[Path | None, typer.Option(help="A checkpoint dir; default the newest.")] = None,
    sample: Annotated[bool, typer.Option(help="Sample as in training instead of greedy.")] = False,
    k: Annotated[int | None, typer.Option("--k", min=1, help="Samples per prompt for mean@k / pass@k.")] = None,
    debug: Debug = False,
) -> None:
    """Greedy accuracy on the held-out prompts of a run's checkpoint (and mean@k / pass@k with --k)."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        fail(f"{run_dir}: not a run directory (no config.yaml)", 2)
    cfg = _load(saved, [f"trainer.output_dir={run_dir.resolve().parent}", f"trainer.run_name={run_dir.name}"])
    chosen = _guard(debug, lambda: _eval_checkpoint(cfg, run_dir, checkpoint))
    quiet_prefect(debug)
    from rlstages.flows.evaluate import evaluate_checkpoint

    metrics = _guard(debug, lambda: evaluate_checkpoint(cfg, str(chosen), not sample, k))
    assert isinstance(metrics, dict)
    from rich.table import Table

    table = Table("metric", "value", title=f"{run_dir.name} (step {int(metrics['step'])})")
    for key, value in metrics.items():
        table.add_row(key, f"{value:.4f}")
    out.print(table)


def _eval_checkpoint(cfg: RunConfig, run_dir: Path, checkpoint: Path | None) -> Path:
    """Pre-flight of `eval`: the model and data, and a committed, intact checkpoint of this run's config."""
    from rlstages.configs import config_hash
    from rlstages.tasks.driver.checkpoints import (
        CheckpointError,
        checked_manifest,
        latest_checkpoint,
        verify_checkpoint,
    )
    from rlstages.tasks.driver.context import RunHandle
    from rlstages.tasks.driver.preflight import check_run_dir, preflight

    preflight(cfg, measure_prompts=False, skip=(check_run_dir,))  # the run exists: its checkpoint is checked below
    if checkpoint is None:
        found = latest_checkpoint(RunHandle(run_dir.name, str(run_dir.resolve())), True, cfg.checkpoint.on_corrupt)
        if found is None:
            raise CheckpointError(f"{run_dir}: no committed checkpoint to evaluate")
        return found[1]
    verify_checkpoint(checkpoint)
    recorded = (checked_manifest(checkpoint, verify=False) or {}).get("config_hash")
    if recorded is not None and recorded != config_hash(cfg):
        raise CheckpointError(
            f"--checkpoint {checkpoint}: a checkpoint of another config (hash {recorded}), not of {run_dir}"
        )
    return checkpoint


@config_app.command("show")
def config_show(
    config: ConfigArg,
    overrides: Overrides = None,
    debug: Debug = False,
    schema_only: Annotated[
        bool,
        typer.Option(
            "--schema-only",
            help="Check the config alone (schema and cross-field checks, the cluster it asks for), not this "
            "machine's files, GPUs or stores: for a preset meant for another cluster.",
        ),
    ] = False,
) -> None:
    """Print the resolved config (defaults filled in, overrides applied) after the pre-flight `run` does: a
    config shown here starts, as far as anything can be known without starting it (`--schema-only`: the
    config alone, for a preset of another cluster)."""
    cfg = _load(config, overrides)
    if not schema_only:
        _guard(debug, lambda: _precheck(cfg))
    sys.stdout.write(to_yaml(cfg))
    _show_plan(cfg)


def _show_plan(cfg: RunConfig) -> None:
    """The memory plan's headline (`rlstages plan`) as YAML comments after the config; skipped when the model's
    sizes are unknown here."""
    from rlstages.flows.cli.plan import build_plan, plan_lines

    gpu = "H100" if cfg.cluster.num_gpus else None
    try:
        result = build_plan(cfg, gpu)
    except (ValueError, OSError) as exc:
        sys.stdout.write(f"# memory plan: not available ({one_line(str(exc))})\n")
        return
    sys.stdout.write("# memory plan (rlstages plan CONFIG --gpu NAME for the per-rank table):\n")
    sys.stdout.write("".join(f"#   {line}\n" for line in plan_lines(result)))


@config_app.command("schema")
def config_schema() -> None:
    """Print the JSON schema of the config."""
    import json

    sys.stdout.write(json.dumps(RunConfig.model_json_schema(), indent=2) + "\n")


def _register_conversion() -> None:
    from rlstages.flows.cli.convert import convert_command, export_command

    app.command("convert", help="Convert an HF directory to Megatron-Core (TP/PP shards, optional parity gate).")(
        convert_command
    )
    app.command("export", help="Export a Megatron-Core conversion back to an HF directory.")(export_command)


_register_conversion()


def _register_ops() -> None:
    from rlstages.flows.cli.ops import register

    register(app)


_register_ops()


def main() -> None:
    """Console-script entry point. What is alive at exit is frozen out of the collector first: the interpreter's
    final collections over the heap of torch, MLflow and Prefect took ~2.5 s of CPU at every command's exit and freed
    nothing the process's end does not (objects outside reference cycles are still freed as their modules clear)."""
    atexit.register(gc.freeze)  # registered before the run's own (Ray's shutdown...): run after them (LIFO)
    app()


if __name__ == "__main__":
    main()
