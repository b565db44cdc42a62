"""`rlstages replay RUN [--name NAME]`: re-execute a recorded async run on its schedule (issue 52, docs/async.md
"Replay") and say whether it reproduced the run bit for bit.

RUN is a run directory or a run name under `--output-dir`. Its `schedule.jsonl` is checked first (a damaged or
tampered one is refused in one line naming the file and the entry, before anything starts); the run's own config
then runs again into `<RUN>-replay` with `trainer.async.replay` set, every event at its recorded turn. On an engine
that reproduces bits from the same calls (the registry's `bitwise_replay`: hf) the final weights and every logged
metric (wall-clock ones excluded: `tasks/driver/replay_check.py`) are compared and any difference exits 1; on
another (vLLM, SGLang: their batching) it says so in one line and checks the schedule only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

RunArg = Annotated[str, typer.Argument(help="An async run: its run directory, or its name under --output-dir.")]
NameOpt = Annotated[str | None, typer.Option("--name", help="The replay's run name (default: <RUN>-replay).")]
OutputOpt = Annotated[Path, typer.Option("--output-dir", help="Where run names are looked up.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]


def replay_command(
    run: RunArg, name: NameOpt = None, output_dir: OutputOpt = Path("runs"), debug: DebugOpt = False
) -> None:
    """Re-execute an async run on its recorded schedule; bitwise-equal weights and metrics on the HF backend."""
    from rlstages.configs import RunConfig
    from rlstages.flows.cli.main import LogFormat, _guard, _precheck, _train, err, out
    from rlstages.tasks.driver.replay_check import bitwise, differences, find_run, replay_config

    recorded = _guard(debug, lambda: find_run(run, output_dir))
    assert isinstance(recorded, Path)
    cfg = _guard(debug, lambda: replay_config(recorded, name))
    assert isinstance(cfg, RunConfig)
    exact = bitwise(cfg)
    if not exact:
        out.print(
            f"rollout.backend={cfg.rollout.backend} is not bitwise-stable (its batching): the replay reproduces the "
            "schedule (samples, updates, versions), not the bits",
            soft_wrap=True,
            highlight=False,
        )
    _guard(debug, lambda: _precheck(cfg))
    _train(cfg, debug, False, LogFormat.auto)
    replayed = cfg.trainer.output_dir / str(cfg.trainer.run_name)
    if not exact:
        out.print(f"[green]schedule reproduced[/]: {escape(str(replayed / 'schedule.jsonl'))}", soft_wrap=True)
        return
    found = _guard(debug, lambda: differences(cfg, recorded, replayed))
    assert isinstance(found, tuple)
    diffs, tensors, metrics = found
    for line in diffs:
        err.print(f"[red]differs[/]: {escape(line)}", soft_wrap=True, highlight=False)
    if diffs:
        raise typer.Exit(1)
    out.print(
        f"[green]replayed bit for bit[/]: {tensors} weight tensors, {metrics} metrics at every step (wall-clock "
        "ones excluded) and the schedule equal",
        soft_wrap=True,
        highlight=False,
    )
