"""`rlstages scale RUN --rollout-workers N`: resize the rollout fleet of a running async run.

The command writes `RUN/fleet.json`; the run's driver reads it between two steps and starts or stops rollout
workers (a joiner gets the current weights first; a leaver's prompts are not lost: docs/async.md, "Elastic fleet").
Only `trainer.mode: async` runs on Ray with rollout workers of their own resize; anything else is refused here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from rlstages.flows.cli.quiet import one_line

err = Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    """One line on stderr, exit `code`."""
    err.print(f"[bold red]error:[/] {escape(one_line(message))}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def scale_command(
    run_dir: Annotated[Path, typer.Argument(help="The run directory of a running async run (runs/<name>).")],
    rollout_workers: Annotated[
        int, typer.Option("--rollout-workers", help="How many rollout workers the run should have (>= 1).")
    ],
) -> None:
    """Ask a running async run for N rollout workers; it applies the change between two steps."""
    from rlstages.configs import ConfigError, load_config
    from rlstages.tasks.driver.fleet_control import request_scale

    saved = run_dir / "config.yaml"
    if not saved.is_file():
        fail(f"{run_dir}: not a run directory (no config.yaml)", 2)
    try:
        cfg = load_config(saved, [])
    except ConfigError as exc:
        fail(f"{saved}: {exc}", 2)
    if cfg.trainer.mode != "async" or cfg.cluster.mode != "ray" or cfg.cluster.hybrid_engine:
        fail(
            f"{run_dir}: only a trainer.mode=async run on Ray with cluster.hybrid_engine=false resizes its rollout "
            f"fleet (this one: trainer.mode={cfg.trainer.mode}, cluster.mode={cfg.cluster.mode}, "
            f"cluster.hybrid_engine={cfg.cluster.hybrid_engine})",
            2,
        )
    if cfg.trainer.async_.partial_rollout:
        fail(f"{run_dir}: trainer.async.partial_rollout=true runs a fixed rollout fleet", 2)
    try:
        path = request_scale(run_dir, rollout_workers)
    except ValueError as exc:
        fail(str(exc), 2)
    err.print(f"asked {run_dir.name} for {rollout_workers} rollout workers ({path}); applied between two steps")
