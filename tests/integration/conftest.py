"""Fixtures of the integration tests: a real Prefect server and a real MLflow server (started once per session
with `rlstages server up`, SQLite in a temp dir, 127.0.0.1, free ports, stopped by PID), and a two-node Ray
cluster (`ray start --head` + `ray start --address`, 1 CPU each, stopped by process group, never `ray stop`).

Everything here talks to the servers over HTTP or runs subprocesses, so the pytest process's own Ray and
Prefect harness (tests/conftest.py) are never touched. Every wait is bounded in time. CPU only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from integration_support import BIN, RLSTAGES, PrefectAPI, RayCluster, Servers, base_env, wait_for_line
from session_cache import mlflow_store

from rlstages.engines.utils import free_port
from rlstages.flows.cli import servers as srv


@pytest.fixture(scope="session")
def servers(session_tmp: Path) -> Iterator[Servers]:
    """`rlstages server up` once per session; `rlstages server down` at the end must leave nothing running."""
    state = session_tmp / "servers"
    mlflow_store(state)  # a migrated empty store: the server opens it without running MLflow's migrations
    # the scheduler service makes a deployment's scheduled runs every 5 s instead of Prefect's 60: the `nightly`
    # deployment's first tick fires on time, not up to a minute late (tests/integration/test_deployments.py)
    env = base_env(PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="5")
    for attempt in range(3):  # a port free when picked can be another process's by the time its server binds it
        cmd = [RLSTAGES, "server", "up", "--dir", str(state), "--prefect-port", str(free_port())]
        cmd += ["--mlflow-port", str(free_port()), "--mlflow-backend", f"sqlite:///{state / 'mlflow.db'}"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, check=False)
        if proc.returncode == 0 or "is taken" not in proc.stderr or attempt == 2:  # `up`'s line for a lost port
            break
    recorded = srv.read_state(state)
    if proc.returncode != 0:
        for server in recorded.values():
            srv.stop(server.pid)
        pytest.fail(f"rlstages server up failed:\n{proc.stdout}\n{proc.stderr}")
    yield Servers(recorded["prefect"].api_url, recorded["mlflow"].api_url, state)
    down = subprocess.run(
        [RLSTAGES, "server", "down", "--dir", str(state)], env=base_env(), capture_output=True, text=True, timeout=120
    )
    leftover = [s.name for s in recorded.values() if srv.alive(s.pid)]
    for server in recorded.values():  # belt and braces: by PID, never by name
        srv.stop(server.pid)
    assert down.returncode == 0 and not leftover, f"server down left {leftover}: {down.stdout}{down.stderr}"


@pytest.fixture(scope="session")
def prefect_api(servers: Servers) -> PrefectAPI:
    """REST access to the session's Prefect server."""
    return PrefectAPI(servers.prefect_api)


@pytest.fixture(scope="session")
def ray_cluster(session_tmp: Path) -> Iterator[RayCluster]:
    """`ray start --head --block` and `ray start --address --block`, each in its own session, 1 CPU each."""
    temp = Path(tempfile.mkdtemp(prefix="rlsray-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    port = free_port()
    env = base_env()
    common = ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--num-gpus", "0"]
    common += ["--object-store-memory", str(256 * 2**20), "--disable-usage-stats"]
    nodes = [
        (
            "head",
            ["--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", str(temp)],
            "rollout_node",
        ),
        ("worker", ["--address", f"127.0.0.1:{port}"], "trainer_node"),
    ]
    started: list[int] = []
    try:
        for role, args, resource in nodes:
            log = session_tmp / f"ray-{role}.log"
            with log.open("wb") as fh:
                cmd = [str(BIN / "ray"), "start", *args, *common, "--resources", json.dumps({resource: 4})]
                proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
            started.append(proc.pid)
            wait_for_line(proc, log, "will now block", timeout=180)
        yield RayCluster(f"127.0.0.1:{port}", (started[0], started[1]))
    finally:
        for pid in reversed(started):  # worker first, then head; by process group, never `ray stop`
            srv.stop(pid, grace=5)
        shutil.rmtree(temp, ignore_errors=True)
