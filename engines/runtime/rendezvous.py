"""torch.distributed rendezvous of a Ray actor group, from rank 0's own node.

Rank 0 of a group picks its node's address and a port free there *inside its own process*, before its
engine's constructor joins the process group, and publishes `addr:port` in Ray's GCS key-value store under
the group's key; the driver waits for it (bounded: an unschedulable rank 0 is a clear error, not a hang) and
hands it to ranks 1..N-1 as MASTER_ADDR/MASTER_PORT. So a group whose ranks sit on nodes other than the
driver's connects to an address where rank 0 listens. LOCAL_RANK / LOCAL_WORLD_SIZE count a rank among the
group's ranks on the same node (from the placement group's bundle -> node table).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlstages.engines.utils import free_port

if TYPE_CHECKING:
    import torch

KEY_ENV = "RLSTAGES_RENDEZVOUS_KEY"
KV_NAMESPACE = "rlstages-rendezvous"


def collective_backend(device: torch.device) -> str:
    """NCCL when the worker computes on a GPU (its `device`, resolved where it started), else gloo (the simulated
    cluster's fake GPUs: Ray sets CUDA_VISIBLE_DEVICES, torch sees no CUDA)."""
    return "nccl" if device.type == "cuda" else "gloo"


def collective_device(device: torch.device) -> str:
    """Where tensors a collective moves must live: the GPU under NCCL, host memory under gloo."""
    return "cuda" if collective_backend(device) == "nccl" else "cpu"


def node_ip() -> str:
    """This process's node address (Ray's view; loopback without Ray)."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except Exception:  # noqa: BLE001 - no Ray, no cluster: a local rendezvous
        return "127.0.0.1"


def interface_of(addr: str) -> str | None:
    """The network interface holding `addr` (None when no interface has it)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            return name
    return None


def pin_gloo_interface() -> None:
    """Make gloo use the interface of this node's Ray address: by default it resolves the hostname, which on
    many hosts (and in the simulated cluster's namespaces) is loopback, and peers on other nodes then dial
    127.0.0.1. GLOO_SOCKET_IFNAME set by the user wins."""
    addr = node_ip()
    if "GLOO_SOCKET_IFNAME" in os.environ or addr.startswith("127."):
        return
    name = interface_of(addr)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def publish_master() -> None:
    """In every rank before its engine starts: gloo on this node's interface. In rank 0 also: listen address
    = this node's IP and a port free here, published under the group's key."""
    key = os.environ.get(KEY_ENV)
    if key:
        pin_gloo_interface()
    if not key or os.environ.get("RANK", "0") != "0":
        return
    from ray.experimental.internal_kv import _internal_kv_put

    addr = node_ip()
    port = free_port(addr)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    _internal_kv_put(key, f"{addr}:{port}".encode(), overwrite=True, namespace=KV_NAMESPACE)


def forget_master(key: str) -> None:
    """Drop a published address (before a fresh rank 0 publishes a new one)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key, namespace=KV_NAMESPACE)


def wait_master(key: str, rank0: Any, group: str, timeout: float) -> tuple[str, int]:
    """The driver's side: rank 0's published (addr, port); raises if rank 0 dies or is not scheduled in time."""
    import ray
    from ray.experimental.internal_kv import _internal_kv_get

    ready = rank0.__ray_ready__.remote()
    deadline = time.monotonic() + timeout
    while True:
        value = _internal_kv_get(key, namespace=KV_NAMESPACE)
        if value:
            addr, port = value.decode().rsplit(":", 1)
            return addr, int(port)
        done, _ = ray.wait([ready], timeout=0.2)
        if done:
            ray.get(done[0])  # raises when rank 0 died in its constructor
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"group {group}: rank 0 did not start within {timeout:g}s (not scheduled: the cluster lacks the "
                f"resources it asks for? it has {ray.available_resources()} free); raise "
                "cluster.rendezvous_timeout_seconds or free resources"
            )


def local_ranks(nodes: Sequence[str | None]) -> list[tuple[int, int]]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) per rank, given each rank's node (None = unknown: one node assumed)."""
    if any(n is None for n in nodes):
        return [(r, len(nodes)) for r in range(len(nodes))]
    seen: dict[str | None, int] = {}
    out = []
    for node in nodes:
        out.append((seen.get(node, 0), sum(1 for n in nodes if n == node)))
        seen[node] = seen.get(node, 0) + 1
    return out


def bundle_nodes(group_name: str, bundle_indices: Sequence[int]) -> list[str | None]:
    """The node id of each rank's bundle in a (ready) placement group."""
    import ray

    table = ray.util.placement_group_table(ray.util.get_placement_group(group_name))
    nodes = table.get("bundles_to_node_id", {})
    return [nodes.get(i) for i in bundle_indices]
