"""Helpers of the integration tests (imported by conftest.py and the test modules): bounded REST calls
against the Prefect server, served deployments (`rlstages deploy` subprocesses), subprocess environments.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rlstages.flows.cli import servers as srv
from rlstages.tasks.driver.ray_auth import secure_env

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RLSTAGES = str(BIN / "rlstages")
TINY = str(REPO / "configs" / "tiny.yaml")
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


@dataclass(frozen=True)
class Servers:
    """The session's servers."""

    prefect_api: str
    mlflow_uri: str
    state_dir: Path


def base_env(**extra: str) -> dict[str, str]:
    """Environment of a subprocess: quiet, offline, single-threaded, no inherited Prefect/Ray endpoints."""
    env = {k: v for k, v in os.environ.items() if k not in {"PREFECT_API_URL", "RAY_ADDRESS", "RLSTAGES_FAULTS"}}
    env.update(
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="INFO",
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        COLUMNS="400",
    )
    env.update(secure_env(local=False))  # the clusters we start check Ray's auth token
    env.update(extra)
    return env


class PrefectAPI:
    """A few bounded REST calls against the Prefect server."""

    def __init__(self, api_url: str) -> None:
        self.http = httpx.Client(base_url=api_url.rstrip("/") + "/", timeout=30)

    def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """One request, repeated (at most 5 times, 2 s apart) while the SQLite-backed server answers 503."""
        for _ in range(4):
            resp = self.http.request(method, path, json=body)
            if resp.status_code not in (502, 503):
                return resp
            time.sleep(2)
        return self.http.request(method, path, json=body)

    def get(self, path: str) -> Any:
        """GET, raising on an HTTP error."""
        resp = self._send("GET", path)
        resp.raise_for_status()
        return resp.json()

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """POST (the caller checks the status)."""
        return self._send("POST", path, body or {})

    def deployment(self, name: str, flow: str = "rl-post-train") -> dict[str, Any] | None:
        """A deployment by name, or None."""
        resp = self._send("GET", f"deployments/name/{flow}/{name}")
        return resp.json() if resp.status_code == 200 else None

    def create_run(self, deployment_id: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """A manual run of a deployment (as `prefect deployment run` makes)."""
        resp = self.post(f"deployments/{deployment_id}/create_flow_run", body)
        resp.raise_for_status()
        return resp.json()

    def flow_run(self, run_id: str) -> dict[str, Any]:
        """One flow run."""
        return self.get(f"flow_runs/{run_id}")

    def runs_of(self, deployment_id: str) -> list[dict[str, Any]]:
        """Every flow run of a deployment, by expected start."""
        body = {"deployments": {"id": {"any_": [deployment_id]}}, "sort": "EXPECTED_START_TIME_ASC", "limit": 100}
        resp = self.post("flow_runs/filter", body)
        resp.raise_for_status()
        return resp.json()

    def task_runs(self, flow_run_id: str) -> list[dict[str, Any]]:
        """Every task run of a flow run."""
        resp = self.post("task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200})
        resp.raise_for_status()
        return resp.json()

    def events(self, name: str, resource_id: str) -> list[dict[str, Any]]:
        """Events called `name` about one resource."""
        body = {"filter": {"event": {"name": [name]}, "resource": {"id": [resource_id]}}, "limit": 50}
        resp = self.post("events/filter", body)
        resp.raise_for_status()
        return resp.json()["events"]

    def wait(self, run_id: str, done: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        """Poll a flow run until `done(run)` (at most `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        run = self.flow_run(run_id)
        while not done(run):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; run is {run['state_name']}")
            time.sleep(2)
            run = self.flow_run(run_id)
        return run

    def wait_final(self, run_id: str, timeout: float = 420) -> dict[str, Any]:
        """Poll until the flow run is in a terminal state."""
        return self.wait(run_id, lambda r: r["state_type"] in FINAL, timeout, f"flow run {run_id} to finish")


def tiny_overrides(tmp: Path, model_dir: Path, mlflow_uri: str, name: str, experiment: str, *extra: str) -> list[str]:
    """Dotted overrides turning configs/tiny.yaml into a short run inside `tmp`, tracked on the MLflow server."""
    return [
        f"model.path={model_dir}",
        "model.provider=local",
        f"trainer.output_dir={tmp / 'runs'}",
        f"trainer.run_name={name}",
        f"tracking.tracking_uri={mlflow_uri}",
        f"tracking.experiment={experiment}",
        "tracking.log_model=false",
        "trainer.eval_at_start=false",
        "prefect.default.retry_delay_seconds=0",
        *extra,
    ]


@dataclass
class Served:
    """A `rlstages deploy` process and the deployment it registered."""

    name: str
    pid: int
    log: Path
    deployment: dict[str, Any] = field(default_factory=dict)

    def stop(self) -> None:
        """Stop the serve process group by PID (its schedules are paused on the way out)."""
        assert srv.stop(self.pid, grace=20), f"serve process {self.pid} did not stop"

    def tail(self, chars: int = 4000) -> str:
        """The end of its log, for assertion messages."""
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def serve(
    api: PrefectAPI,
    servers: Servers,
    ray_address: str,
    workdir: Path,
    name: str,
    overrides: list[str],
    args: list[str],
    faults: str = "",
) -> Served:
    """Start `rlstages deploy tiny.yaml OVERRIDES --name NAME ARGS` with RAY_ADDRESS (its runs join that
    cluster, as on a Ray head) and wait until the deployment is registered.
    """
    env = base_env(
        PREFECT_API_URL=servers.prefect_api,
        PREFECT_HOME=str(workdir / "prefect-client"),
        PREFECT_RUNNER_POLL_FREQUENCY="2",
        RLSTAGES_FAULTS=faults,
        RAY_ADDRESS=ray_address,
    )
    log = workdir / f"serve-{name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [RLSTAGES, "deploy", TINY, *overrides, "--name", name, *args],
            cwd=workdir,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    served = Served(name, proc.pid, log)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        found = api.deployment(name)
        if found is not None:
            served.deployment = found
            return served
        if proc.poll() is not None:
            break
        time.sleep(1)
    srv.stop(proc.pid)
    raise AssertionError(f"deployment {name} was not registered:\n{served.tail()}")


@dataclass(frozen=True)
class RayCluster:
    """A local two-node Ray cluster: the head offers `rollout_node`, the worker `trainer_node`."""

    address: str
    pids: tuple[int, int]


def wait_for_line(proc: subprocess.Popen[bytes], log: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"`ray start` did not come up:\n{log.read_text(errors='replace')[-3000:]}")
