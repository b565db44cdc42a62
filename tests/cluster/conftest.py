"""The simulated multi-node GPU cluster, once per session: `scripts/sim_cluster.sh up` starts a Ray head
(`--num-cpus 0`, on the bridge address of a private /24 it creates) and 2 worker nodes, each in its own
network namespace with its own address, each `--num-gpus 4 --num-cpus 1` (fake GPUs: Ray hands out
CUDA_VISIBLE_DEVICES, torch sees no CUDA, engines use gloo). Token auth is on (a fresh random token).

Teardown (`sim_cluster.sh down`: every process by namespace / session id, then the namespaces and the bridge)
runs in a finally block and at exit, even when a test fails; the fixture then checks that nothing is left.
Skips, saying why, where `ip netns` is not permitted (not root / no CAP_NET_ADMIN). All drivers run as
subprocesses, so the pytest process's own local Ray is never touched.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sim_support import SimCluster, free_subnet, leftovers


@pytest.fixture(scope="session")
def sim_cluster() -> Iterator[SimCluster]:
    """Ray head + 2 worker nodes in network namespaces with fake GPUs; torn down however the session ends."""
    if shutil.which("ip") is None:
        pytest.skip("simulated cluster: the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("simulated cluster: `ip netns` needs root (CAP_NET_ADMIN); run the cluster tests as root")
    prefix = "r" + secrets.token_hex(2)  # interface names stay under 15 characters
    state = Path(tempfile.mkdtemp(prefix="rls-sim-", dir="/tmp"))
    cluster = SimCluster("", state, prefix, free_subnet())
    done = False

    def down() -> None:
        nonlocal done
        if not done:
            done = True
            cluster.script("down", timeout=300)

    atexit.register(down)
    try:
        up = cluster.script("up", timeout=900)
        if up.returncode == 3:
            pytest.skip(f"simulated cluster: {up.stderr.strip()}")
        assert up.returncode == 0, f"sim_cluster.sh up failed:\n{up.stdout}\n{up.stderr}"
        address = (state / "address").read_text().strip()
        yield SimCluster(address, state, prefix, cluster.subnet)
    finally:
        down()
    left = leftovers(prefix)
    assert not left, f"teardown left {left}"
