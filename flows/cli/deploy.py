"""`rlstages deploy`: the training flow as a scheduled Prefect deployment, served from this machine.

    rlstages deploy configs/tiny.yaml --name nightly --cron "0 2 * * *"
    rlstages deploy configs/tiny.yaml checkpoint.resume=fresh --name hourly --interval 3600

A Prefect runner (what `flow.serve` starts) registers the deployment and polls for its runs; each run
executes in a subprocess of the serve process, so it inherits this environment (RLSTAGES_FAULTS, RAY_ADDRESS,
thread counts). The parameter is the whole `RunConfig` (`cfg`): the Prefect UI renders it as a form and the
server validates it against the schema. Every deployment has a concurrency limit of 1: a run that arrives
while one is still going is cancelled (`--on-overlap cancel`, the default) or queued (`enqueue`), never
started beside it on the same GPUs. Runs emit heartbeats (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, `--heartbeat`)
and an automation marks a run Crashed when they stop (`--crash-after`). What a run does with the previous
run's checkpoint is `checkpoint.resume`: `auto` continues the run directory, `fresh` starts a new one per
flow run. `prefect.yaml` declares the same kind of deployments for work pools (`prefect deploy`).
"""

from __future__ import annotations

import datetime as dt
import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from rich.console import Console
from rich.markup import escape

from rlstages.configs import ConfigError, RunConfig, config_hash, load_config

FLOW_NAME = "rl-post-train"
DEPLOYMENT_TAG = "rlstages"
ZOMBIE_AUTOMATION = "rlstages: mark silent training runs Crashed"
err = Console(stderr=True)


class Overlap(StrEnum):
    """What a new run of a busy deployment does."""

    cancel = "cancel"
    enqueue = "enqueue"


def schedules_for(
    cron: str | None,
    interval: float | None,
    anchor: dt.datetime | None = None,
    timezone: str = "UTC",
) -> list[Any]:
    """Prefect schedules from the CLI options (none: the deployment only runs when triggered)."""
    from zoneinfo import available_timezones

    from prefect.schedules import Cron, Interval

    if timezone != "UTC" and (timezone not in available_timezones() or timezone == "localtime"):  # Prefect's list
        raise ValueError(f"--timezone {timezone!r}: not an IANA time zone (expected e.g. UTC or Europe/Paris)")
    if cron and interval:
        raise ValueError("give --cron or --interval, not both")
    if interval is not None and interval <= 0:
        raise ValueError(f"--interval must be positive seconds (got {interval})")
    if anchor is not None and interval is None:
        raise ValueError("--anchor sets the first run of an --interval schedule; it needs --interval")
    if cron:
        return [Cron(cron, timezone=timezone)]
    if interval is not None:
        return [Interval(dt.timedelta(seconds=interval), anchor_date=anchor, timezone=timezone)]
    return []


def concurrency_limit(on_overlap: Overlap) -> Any:
    """One run at a time per deployment; a colliding run is cancelled or queued."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    strategy = ConcurrencyLimitStrategy.CANCEL_NEW if on_overlap == Overlap.cancel else ConcurrencyLimitStrategy.ENQUEUE
    return ConcurrencyLimitConfig(limit=1, collision_strategy=strategy)


def deployment_parameters(cfg: RunConfig) -> dict[str, Any]:
    """The deployment's default parameters: the resolved config as JSON (the UI shows it as a form)."""
    return {"cfg": cfg.model_dump(mode="json", by_alias=True)}  # trainer.async: the schema's name for it


def zombie_automation(crash_after: int) -> Any:
    """An automation that marks a run of our deployments Crashed when its heartbeats stop for `crash_after` s."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    ends = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    return Automation(
        name=ZOMBIE_AUTOMATION,
        description=f"A training run silent for {crash_after} s (no heartbeat, no end state) lost its process.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *ends},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.id": f"prefect.tag.{DEPLOYMENT_TAG}"}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=dt.timedelta(seconds=crash_after),
        ),
        actions=[
            ChangeFlowRunState(  # type: ignore[call-arg]  # prefect: name and force default to None / False
                state=StateType.CRASHED,
                message=f"no heartbeat for {crash_after} s: the flow-run process is gone",
            )
        ],
    )


def ensure_zombie_automation(crash_after: int) -> str:
    """Create the zombie automation, or update it to `crash_after` (one for every rlstages deployment: the last
    `rlstages deploy` sets it); returns its id.
    """
    from prefect.automations import Automation

    wanted = zombie_automation(crash_after)
    try:
        found = cast(Automation, Automation.read(name=ZOMBIE_AUTOMATION))  # prefect: sync call, sync result
    except ValueError:
        return str(wanted.create().id)
    found.trigger = wanted.trigger
    found.actions = wanted.actions
    found.description = wanted.description
    found.update()
    return str(found.id)


def serve_training(
    cfg: RunConfig,
    name: str,
    schedules: list[Any],
    on_overlap: Overlap = Overlap.cancel,
    heartbeat: int = 60,
    crash_after: int = 300,
    paused: bool = False,
    description: str | None = None,
    allow_imports: tuple[str, ...] = (),
) -> None:
    """Register the deployment `rl-post-train/<name>` and serve its runs until interrupted (schedules pause).
    Runs may import only the modules in `allow_imports` (fixed here, inherited by every run's process)."""
    if heartbeat < 30:
        raise ValueError(f"--heartbeat must be at least 30 s (Prefect's minimum), got {heartbeat}")
    if crash_after and crash_after <= heartbeat:
        raise ValueError(f"--crash-after ({crash_after} s) must exceed --heartbeat ({heartbeat} s)")
    import asyncio

    from prefect.deployments.runner import EntrypointType, RunnerDeployment
    from prefect.exceptions import TerminationSignal
    from prefect.runner import Runner

    from rlstages.engines.imports import ALLOWED_IMPORTS_ENV
    from rlstages.flows.train import rl_post_train

    os.environ[ALLOWED_IMPORTS_ENV] = ",".join(allow_imports)  # set at deploy time; a run's parameters cannot
    if not os.environ.get("PREFECT_API_URL"):
        err.print("[yellow]PREFECT_API_URL is not set[/]: serving against a temporary local Prefect server "
                  "(schedules live only as long as this process; `rlstages server up` starts a real one)")  # fmt: skip
    elif crash_after:
        try:
            ensure_zombie_automation(crash_after)
        except Exception as exc:  # noqa: BLE001 - serving still works without the automation
            err.print(f"[yellow]could not create the zombie-run automation[/]: {exc}")
    deployment = rl_post_train.to_deployment(
        name=name,
        schedules=schedules,
        concurrency_limit=concurrency_limit(on_overlap),
        parameters=deployment_parameters(cfg),
        description=description,
        tags=[DEPLOYMENT_TAG, cfg.algorithm.adv_estimator],
        version=config_hash(cfg),
        paused=paused,
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    assert isinstance(deployment, RunnerDeployment)  # a sync call returns the deployment, not a coroutine
    deployment.work_pool_name = None  # served here: clear a work pool a `prefect deploy` may have set
    deployment.work_queue_name = None
    # What `flow.serve` does, with two differences: heartbeats are set on the runner, and the runner is given the
    # deployment rather than the flow object, so each run imports `rlstages.flows.train` by its entrypoint in a fresh
    # `python -m prefect.engine` process (a pickled flow object would lose the `RunConfig` annotation's module).
    runner = Runner(name=name, heartbeat_seconds=heartbeat, pause_on_shutdown=True)
    deployment_id = runner.add_deployment(deployment)
    err.print(f"serving deployment [bold]{FLOW_NAME}/{name}[/] ({deployment_id}); Ctrl-C stops and pauses it")
    try:
        asyncio.run(runner.start())
    except (KeyboardInterrupt, TerminationSignal):  # Ctrl-C or SIGTERM: the runner has paused the schedules
        pass


def deploy_command(
    config: Annotated[Path, typer.Argument(help="YAML config (e.g. configs/tiny.yaml).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides: checkpoint.resume=fresh")] = None,
    name: Annotated[str | None, typer.Option(help="Deployment name (default: the config's file name).")] = None,
    cron: Annotated[str | None, typer.Option(help='Cron schedule, e.g. "0 2 * * *".')] = None,
    interval: Annotated[float | None, typer.Option(help="Interval schedule in seconds.")] = None,
    anchor: Annotated[
        dt.datetime | None, typer.Option(help="First run of an --interval schedule (ISO time, in --timezone).")
    ] = None,
    timezone: Annotated[str, typer.Option(help="IANA timezone of the schedule.")] = "UTC",
    on_overlap: Annotated[Overlap, typer.Option(help="A run arriving while one is going: cancel or enqueue.")] = (
        Overlap.cancel
    ),
    heartbeat: Annotated[int, typer.Option(help="Seconds between flow-run heartbeats (>= 30).")] = 60,
    crash_after: Annotated[
        int, typer.Option(help="Mark a run Crashed after this many silent seconds (0: no automation).")
    ] = 300,
    paused: Annotated[bool, typer.Option(help="Register the schedule paused.")] = False,
    allow_import: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-import",
            help="A module (and its submodules) runs may import: reward module:function, model.plugins. Repeatable; "
            "none = only built-ins.",
        ),
    ] = None,
) -> None:
    """Serve the training flow of CONFIG as a deployment with a schedule (concurrency limit 1)."""
    from rlstages.engines.imports import ALLOWED_IMPORTS_ENV
    from rlstages.tasks.driver.preflight import check_run_dir, preflight

    allowed = tuple(allow_import or ())
    try:
        schedules = schedules_for(cron, interval, anchor, timezone)  # the options first: no config is read for them
        cfg = load_config(config, overrides or [])
        os.environ[ALLOWED_IMPORTS_ENV] = ",".join(allowed)
        # the deployment's own defaults pass every check, incl. the list; each run checks its run directory
        preflight(cfg, measure_prompts=False, skip=(check_run_dir,))
        if not (cron or interval):
            err.print("no --cron/--interval: the deployment runs only when triggered (prefect deployment run)")
        description = f"{config} ({cfg.algorithm.adv_estimator}, {cfg.model.path.name}, resume={cfg.checkpoint.resume})"
        serve_training(
            cfg, name or config.stem, schedules, on_overlap, heartbeat, crash_after, paused, description, allowed
        )
    except (ConfigError, ValueError) as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
