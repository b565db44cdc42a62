"""Helpers of the simulated-cluster tests (imported by conftest.py and the test module): the cluster handle,
driver subprocesses, leftovers after teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "sim_cluster.sh"
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class SimCluster:
    """A running simulated cluster: its address, token, state dir and namespace prefix."""

    address: str
    state: Path
    prefix: str
    subnet: str
    prefect_api: str = ""  # the Prefect API the flow runs report to; "" = each run's own temporary server

    def env(self, **extra: str) -> dict[str, str]:
        """Environment of a driver subprocess joining the cluster (token auth on)."""
        env = {k: v for k, v in os.environ.items() if k not in {"PREFECT_API_URL", "RLSTAGES_FAULTS"}}
        if self.prefect_api:
            env["PREFECT_API_URL"] = self.prefect_api
        env.update(
            RAY_ADDRESS=self.address,
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=(self.state / "auth_token").read_text().strip(),
            RAY_USAGE_STATS_ENABLED="0",
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",  # a cluster (a local Ray of this session may have set 0)
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            OMP_NUM_THREADS="1",
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_LOGGING_LEVEL="WARNING",
            COLUMNS="400",
        )
        env.update(extra)
        return env

    def script(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """Run `sim_cluster.sh ACTION STATE ...` with this cluster's settings."""
        env = {**os.environ, **_sim_env(self.prefix, self.subnet)}
        return subprocess.run(
            ["bash", str(SCRIPT), args[0], str(self.state), *args[1:]],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def node_ip(self, index: int) -> str:
        """Address of worker node `index` (1-based)."""
        return f"{self.subnet}.{index + 1}"

    def node_index(self, ip: str) -> int:
        """The index of the worker node at address `ip` (`node_ip`'s inverse)."""
        return int(ip.rsplit(".", 1)[1]) - 1

    def live_nodes(self) -> list[int]:
        """Indices of the worker nodes whose namespace still runs processes (a killed node's namespace stays)."""
        return [i for i in self._namespaces() if _run(["ip", "netns", "pids", f"{self.prefix}n{i}"]).split()]

    def next_node(self) -> int:
        """The first index no node has used yet (`add-node` cannot reuse a killed node's namespace): tests of one
        session share the cluster, so each picks its nodes from what earlier tests left."""
        used = set(self._namespaces())
        return next(i for i in range(1, 100) if i not in used)

    def _namespaces(self) -> list[int]:
        names = [n for n in _run(["ip", "netns", "list"]).split() if n.startswith(f"{self.prefix}n")]
        return sorted(int(n[len(self.prefix) + 1 :]) for n in names if n[len(self.prefix) + 1 :].isdigit())


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def _sim_env(prefix: str, subnet: str) -> dict[str, str]:
    return {"SIM_PREFIX": prefix, "SIM_SUBNET": subnet, "RAY": str(BIN / "ray"), "SIM_NODES": "2"}


def free_subnet() -> str:
    """A 10.213.X.0/24 no interface of this host uses."""
    used = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True, check=True).stdout
    for third in range(256):
        if f" 10.213.{third}." not in used:
            return f"10.213.{third}"
    raise RuntimeError("no free 10.213.X.0/24 on this host")


def leftovers(prefix: str) -> list[str]:
    """Namespaces and links of this prefix still present (must be none after teardown)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout.split("\n")
    return [n for n in names if n.startswith(prefix)] + [
        line.split()[0] for line in links if line.strip() and line.split()[0].startswith(prefix)
    ]


def run_driver(cluster: SimCluster, scenario: str, *args: str, timeout: float = 900) -> dict:
    """Run a `sim_driver.py` scenario against the cluster; its JSON result."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "sim_driver.py"), scenario, *args],
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
