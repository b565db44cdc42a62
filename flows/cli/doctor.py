"""`rlstages doctor`: what this machine can run, and why not (the probes: `doctor_probes`; with --config the
config's checks: `doctor_config`).

Versions of every stack piece; the machine's class for the README's demo times (CPU, native bf16 flags, the
GEMM kernel the demo's bf16 layers take here); which rollout and training backends can run here (no GPU,
package missing, an import that fails on a version clash); the Ray cluster's resources (RAY_ADDRESS);
whether the Prefect and MLflow endpoints answer; and the settings that matter (thread counts,
CUDA_DEVICE_MAX_CONNECTIONS for Megatron, heartbeats). Backend packages are imported in subprocesses with a
timeout, never here: a broken install cannot hang or crash the doctor, and flows never import the backends
(design §1).
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlstages.flows.cli.doctor_config import config_checks, detected_gpu
from rlstages.flows.cli.doctor_probes import (
    Check,
    backends,
    machine,
    mlflow_endpoint,
    prefect_endpoint,
    ray_cluster,
    settings,
    versions,
    vllm_interpreter,
)

out = Console()


def diagnose(
    ray_address: str | None, prefect_url: str | None, tracking_uri: str, vllm_python: Path | None, timeout: float
) -> list[Check]:
    """Every check, in report order."""
    with ThreadPoolExecutor(2) as pool:
        ray_rows = pool.submit(ray_cluster, ray_address, timeout)
        backend_rows = pool.submit(backends, vllm_python, timeout)
        return [
            *versions(),
            *backend_rows.result(),
            *ray_rows.result(),
            *prefect_endpoint(prefect_url),
            *mlflow_endpoint(tracking_uri),
            *machine(),
            *settings(),
        ]


def _mark(ok: bool | None) -> str:
    return {True: "[green]ok[/]", False: "[red]no[/]", None: ""}[ok]


def doctor_command(
    ray_address: Annotated[str | None, typer.Option(help="Ray cluster (default: RAY_ADDRESS).")] = None,
    prefect_url: Annotated[str | None, typer.Option(help="Prefect API URL (default: PREFECT_API_URL).")] = None,
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow URI (default: MLFLOW_TRACKING_URI).")] = None,
    vllm_python: Annotated[
        Path | None,
        typer.Option(
            help="Interpreter of the vLLM venv (default: the one the rollout uses, .venv-vllm).", show_default=False
        ),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds per probe (imports, Ray).")] = 180.0,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    config: Annotated[
        Path | None, typer.Option("--config", help="Also check this config: memory plan, NCCL, version pair.")
    ] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="The plan's GPU (default: this machine's).")] = None,
) -> None:
    """Versions, usable backends (and why not), Ray resources, Prefect/MLflow endpoints, relevant settings; with
    --config the config's memory plan and the troubleshooting table's checks."""
    cfg = None
    if config is not None:
        from rlstages.configs import ConfigError, load_config

        try:
            cfg = load_config(config, [])
        except ConfigError as exc:
            Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True, highlight=False)
            raise typer.Exit(2) from None
    checks = diagnose(
        ray_address or os.environ.get("RAY_ADDRESS"),
        prefect_url or os.environ.get("PREFECT_API_URL"),
        tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db",
        vllm_interpreter(vllm_python),
        timeout,
    )
    if cfg is not None:
        checks += config_checks(cfg, gpu or detected_gpu(), vllm_python)
    if as_json:
        sys.stdout.write(json.dumps([asdict(c) for c in checks], indent=1) + "\n")
        return
    for section in dict.fromkeys(c.section for c in checks):
        table = Table("", "", "", title=section, show_header=False, title_justify="left")
        for c in (c for c in checks if c.section == section):
            table.add_row(escape(c.name), _mark(c.ok), escape(c.detail))
        out.print(table)
