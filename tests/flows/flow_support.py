"""Helpers of the flow tests (one copy, imported by every tests/flows file): the tiny preset's config with a run's
paths, its final weights, its MLflow run and reward steps. The session's reference run is a fixture of
tests/flows/conftest.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from click.testing import Result
from mlflow import MlflowClient
from safetensors.torch import load_file
from session_cache import mlflow_store
from typer.testing import CliRunner

from rlstages.configs import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
IN_DRIVER = "cluster.mode=in_process"  # no actor start-up (~25 s a run on two cores) where Ray is not the point


def overrides(tmp: Path, model_dir: Path, name: str, *extra: str) -> list[str]:
    """tiny.yaml's overrides for a run named `name` under `tmp` (runs/, mlflow.db) on the local model."""
    return [
        f"model.path={model_dir}",
        "model.provider=local",
        f"trainer.output_dir={tmp / 'runs'}",
        f"trainer.run_name={name}",
        f"tracking.tracking_uri={mlflow_store(tmp)}",
        "tracking.log_model=false",
        "prefect.default.retry_delay_seconds=0",
        *extra,
    ]


def tiny_cfg(tmp: Path, model_dir: Path, name: str, *extra: str) -> RunConfig:
    """configs/tiny.yaml (2 steps) with `overrides`."""
    return load_config(ROOT / "configs" / "tiny.yaml", overrides(tmp, model_dir, name, *extra))


def run_dir(cfg: RunConfig) -> Path:
    """The run's directory (trainer.output_dir / run_name)."""
    return cfg.trainer.output_dir / str(cfg.trainer.run_name)


def final_weights(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """The run's final policy weights."""
    return load_file(str(run_dir(cfg) / "final" / "model.safetensors"))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-for-bit equal state dicts."""
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def mlflow_run(cfg: RunConfig):  # type: ignore[no-untyped-def]
    """The MLflow client and the one run named after the training run."""
    c = MlflowClient(cfg.tracking.tracking_uri)
    exp = c.get_experiment_by_name(cfg.tracking.experiment)
    runs = c.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{cfg.trainer.run_name}'")
    assert len(runs) == 1, f"expected one MLflow run for {cfg.trainer.run_name}, got {len(runs)}"
    return c, runs[0]


def reward_steps(cfg: RunConfig) -> list[int]:
    """The steps at which reward/mean was logged."""
    c, run = mlflow_run(cfg)
    return [m.step for m in c.get_metric_history(run.info.run_id, "reward/mean")]


@dataclass(frozen=True)
class Reference:
    """The session's uninterrupted 2-step run of tiny.yaml (Ray, real Prefect, MLflow with the model logged and
    registered as `tiny-policy`): `tmp` holds runs/base and mlflow.db, `policy` is runs/base/final."""

    tmp: Path
    cfg: RunConfig
    policy: Path

    @property
    def run_dir(self) -> Path:
        """runs/base."""
        return run_dir(self.cfg)


def clean_env() -> dict[str, str]:
    """This process's environment without what points a CLI process at another Ray, Prefect API or faults."""
    drop = {"RAY_ADDRESS", "RLSTAGES_FAULTS", "RLSTAGES_ALLOWED_IMPORTS", "PREFECT_API_URL"}
    return {k: v for k, v in os.environ.items() if k not in drop}


@dataclass(frozen=True)
class CliRun:
    """A finished CLI process: its exit code, output, and whether its process group outlived it."""

    returncode: int
    stdout: str
    stderr: str
    left_behind: list[str]  # the command lines of its process group's processes alive 10 s after it ended


def start_cli(tmp: Path, *args: str, env: dict[str, str], tag: str = "") -> subprocess.Popen[str]:
    """The CLI started in `tmp` in its own process group, output in files `<command><tag>.out/.err` (a killed
    driver's Ray children would hold pipes open)."""
    out, err = tmp / f"{args[0]}{tag}.out", tmp / f"{args[0]}{tag}.err"
    with out.open("w") as fo, err.open("w") as fe:
        return subprocess.Popen(
            [sys.executable, "-m", "rlstages.flows.cli", *args],
            cwd=tmp,
            env={**clean_env(), "PREFECT_HOME": str(tmp / ".prefect"), **env},
            stdin=subprocess.DEVNULL,
            stdout=fo,
            stderr=fe,
            text=True,
            start_new_session=True,
        )


def wait_cli(proc: subprocess.Popen[str], tmp: Path, tag: str = "") -> CliRun:
    """Wait for a `start_cli` process; whatever it leaves behind in its group (the local Ray of a killed driver)
    is noted, then killed with the group."""
    left: list[str] = []
    try:
        proc.wait(timeout=1200)
        for _ in range(20):  # what the run started gets 10 s to follow it
            left = group_members(proc.pid)
            if not left:
                break
            time.sleep(0.5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # only the group we created
        except ProcessLookupError:
            pass
    name = str(proc.args[3]) + tag  # type: ignore[index]  # [python, -m, module, command, ...]
    return CliRun(proc.returncode, (tmp / f"{name}.out").read_text(), (tmp / f"{name}.err").read_text(), left)


def group_members(pgid: int) -> list[str]:
    """The command lines of the live (not zombie) processes of process group `pgid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, IndexError, ValueError):
            continue
    return found


def cli(tmp: Path, *args: str, env: dict[str, str]) -> CliRun:
    """The CLI in its own process group, to its end (`start_cli`, `wait_cli`)."""
    return wait_cli(start_cli(tmp, *args, env=env), tmp)


def invoke(*args: str, cwd: Path) -> Result:
    """The CLI in this process (typer's CliRunner) in `cwd`; stdout and stderr apart."""
    from rlstages.flows.cli.main import app

    old = Path.cwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(app, list(args), env={"RLSTAGES_FAULTS": "", "COLUMNS": "2000"})
    finally:
        os.chdir(old)
