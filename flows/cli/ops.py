"""Operations commands on the `rlstages` app: deploy, server up|down|status, doctor, plan, scale, compare.

Each lives in its own module (`deploy`, `servers`, `doctor`, `compare` beside this one), which
imports nothing heavy at import time, so `rlstages --help` stays fast; `flows/cli.py` calls `register`.
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the operations commands to `app`."""
    from rlstages.flows.cli.compare import compare_command
    from rlstages.flows.cli.deploy import deploy_command
    from rlstages.flows.cli.doctor import doctor_command
    from rlstages.flows.cli.plan import plan_command
    from rlstages.flows.cli.scale import scale_command
    from rlstages.flows.cli.servers import server_app

    app.command("deploy", help="Serve the training flow as a scheduled Prefect deployment (concurrency 1).")(
        deploy_command
    )
    app.add_typer(server_app, name="server")
    app.command("doctor", help="What can run here and why not: versions, backends, Ray, Prefect, MLflow.")(
        doctor_command
    )
    app.command("plan", help="Memory per rank of a config's layout before launch, and whether it fits a GPU.")(
        plan_command
    )
    app.command("scale", help="Resize a running async run's rollout fleet (applied between two steps).")(scale_command)
    app.command("compare", help="Runs of an MLflow experiment side by side; optional PNG of their curves.")(
        compare_command
    )
