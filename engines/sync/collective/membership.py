"""Who is in a weight-sync group and how each member process joins and leaves it.

The driver asks every member for its node, its process count and its GPUs (`sync_endpoint`, `worker_node`,
`group_size`, `member_gpus`) and refuses a group NCCL would refuse (`distinct_gpus`, `same_nccl_cumem`); each member
then joins (`join_sync_group` / `join_group`; the flat-bucket source of SGLang: `join_flat_source`) and keeps its
`SyncGroup` in this process's `SYNC_GROUPS` until it leaves. The protocol: `rlstages.engines.sync.collective`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SyncGroup:
    """A sync group as one member process holds it: the process group, this member's rank, and (same-node
    groups) the shared-memory file's path prefix, the generation mapped here and the mapping."""

    group: Any
    rank: int
    shm_path: str | None = None
    generation: int = 0
    mapping: torch.Tensor | None = None
    created: list[str] = field(default_factory=list)  # new files, unlinked once every receiver has mapped them
    receivers: list[Any] | None = None  # the source of a flat-bucket group (SGLang): the rollout actors
    protocol: str = "broadcast"  # how the source sends each bucket (`wire.SENDERS`), fixed when it joins
    device: str = "cpu"  # where broadcast tensors live: the GPU under NCCL


SYNC_GROUPS: dict[str, SyncGroup] = {}  # inside a worker process: group name -> its sync group


def sync_endpoint(engine: Any) -> tuple[str, int]:
    """Runs in the source trainer rank: this node's address and a port free here, for the sync group's store."""
    from rlstages.engines.runtime.rendezvous import node_ip
    from rlstages.engines.utils import free_port

    addr = node_ip()
    return addr, free_port(addr)


def worker_node(engine: Any) -> str:
    """Runs in a rollout worker: the address of its node (a receiver on the source's node shares its memory)."""
    from rlstages.engines.runtime.rendezvous import node_ip

    return node_ip()


def member_gpus(engine: Any) -> list[str | None]:
    """Runs in a sync group member's actor: the UUID of the GPU of each process it adds (None on CPU): an
    engine's own workers (`weight_group_devices`), else the engine's device (resolved where its worker started)."""
    own = getattr(engine, "weight_group_devices", None)
    if own is not None:
        return list(own())
    device = engine.device
    if device.type != "cuda":
        return [None]
    from rlstages.engines.sync.cuda_ipc import gpu_uuid

    return [gpu_uuid(device.index or 0)]


def distinct_gpus(members: list[tuple[str, list[str | None]]]) -> None:
    """Refuse a sync group that puts two ranks on one GPU (NCCL's "Duplicate GPU detected"), given each member's
    label and the GPU UUIDs of its processes in rank order.

    Raises:
        ValueError: in one line, which ranks share which GPU and what to do instead.
    """
    seen: dict[str, str] = {}
    rank = 0
    for label, gpus in members:
        for i, gpu in enumerate(gpus):
            who = f"{label} (sync rank {rank})" if len(gpus) == 1 else f"{label} process {i} (sync rank {rank})"
            if gpu is not None and gpu in seen:
                raise ValueError(
                    f"weight sync: {seen[gpu]} and {who} are on the same GPU {gpu}, and NCCL refuses two ranks of "
                    "one group on one device ('Duplicate GPU detected'); give the rollout its own GPUs "
                    "(cluster.colocate: false) or share the trainer's process (cluster.hybrid_engine: true, "
                    "weights by CUDA IPC)"
                )
            if gpu is not None:
                seen[gpu] = who
            rank += 1


def member_nccl_cumem(engine: Any) -> str | None:
    """Runs in a sync group member's actor: its `NCCL_CUMEM_ENABLE` (an engine's workers inherit the actor's env)."""
    import os

    return os.environ.get("NCCL_CUMEM_ENABLE")


def same_nccl_cumem(members: list[tuple[str, str | None]]) -> None:
    """Refuse an NCCL sync group whose members disagree on `NCCL_CUMEM_ENABLE` (SkyRL #143: a mismatch hangs or
    fails the first collective), given each member's label and value (None: unset).

    Raises:
        ValueError: in one line, the values by member.
    """
    if len({value for _, value in members}) > 1:
        seen = ", ".join(f"{label}: {value if value is not None else 'unset'}" for label, value in members)
        raise ValueError(
            f"weight sync: NCCL_CUMEM_ENABLE differs between the sync group's processes ({seen}); set it once "
            "for every worker so trainer and rollout agree"
        )


def group_size(engine: Any) -> int:
    """Runs in a rollout actor: how many processes it adds to a sync group (an engine's workers, or itself)."""
    own = getattr(engine, "weight_group_size", None)
    return int(own()) if own is not None else 1


def join_sync_group(
    engine: Any, name: str, addr: str, port: int, rank: int, world: int, timeout: float, shm_path: str | None = None
) -> int:
    """Runs in every member actor: join the sync group `name` at `rank` (the engine's workers take ranks
    `rank`, `rank + 1`, ... where the engine receives in processes of its own)."""
    from rlstages.engines.runtime.rendezvous import node_ip

    own = getattr(engine, "join_weight_group", None)
    if own is not None:
        own(name, addr, port, rank, world, timeout, shm_path, node_ip())
    else:
        join_group(name, addr, port, rank, world, timeout, shm_path, device=engine.device)
    return rank


def join_group(
    name: str,
    addr: str,
    port: int,
    rank: int,
    world: int,
    timeout: float,
    shm_path: str | None = None,
    host: str | None = None,
    device: torch.device | None = None,
) -> None:
    """Join the sync group `name` from this process and keep it here (rank 0 hosts its TCP store); with
    `shm_path` (all members on one node) bucket payloads pass through that shared-memory file. `host` is this
    node's address (default: Ray's view of it) for gloo to bind; `device` this process's (None: the CPU)."""
    import datetime

    import torch.distributed as dist

    from rlstages.engines.runtime.rendezvous import collective_backend, collective_device, node_ip

    if name in SYNC_GROUPS:
        return
    on = device if device is not None else torch.device("cpu")
    where = collective_device(on)
    shm_path = shm_path if where == "cpu" else None  # NCCL moves GPU memory; the file is for host memory
    delta = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=delta)
    if collective_backend(on) == "nccl":  # pragma: no cover - GPU only
        group: Any = dist.ProcessGroupNCCL(dist.PrefixStore(name, store), rank, world)  # type: ignore[call-arg]  # options has a default
    else:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch private API, not in its stubs
        options._timeout = delta
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host or node_ip())]
        group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, options)
    SYNC_GROUPS[name] = SyncGroup(group, rank, shm_path, device=where)


def join_flat_source(
    engine: Any, name: str, addr: str, port: int, world: int, timeout: float, receivers: list[Any]
) -> int:
    """Runs in the source trainer rank: host the group `name` that engines with their own group API (SGLang)
    join, and keep the rollout actors to send each bucket's layout to (`sync.collective.flat`)."""
    from rlstages.engines.sync.collective.flat import join_flat_group

    if name not in SYNC_GROUPS:
        group = join_flat_group(name, addr, port, 0, world, timeout, engine.device)
        SYNC_GROUPS[name] = SyncGroup(group, 0, receivers=receivers, protocol="flat", device=str(engine.device))
    return 0


def leave_sync_group(engine: Any, name: str) -> None:
    """Drop a sync group (its peers are gone or replaced) and this process's mapping of its bucket file."""
    own = getattr(engine, "leave_weight_group", None)
    if own is not None:
        own(name)
    leave_group(name)


def leave_group(name: str) -> None:
    """Forget the sync group `name` in this process."""
    SYNC_GROUPS.pop(name, None)
