"""Split placement's weight sync: a torch.distributed broadcast group from the trainer's source rank to every
process that holds rollout weights (verl / OpenRLHF's split-placement sync; gloo on CPU, NCCL on GPUs).

The group joins the trainer's source rank (rank 0, it hosts the store) and the rollout side's receiving
processes: the rollout actor itself for the HF engine, or an engine's own worker processes for engines that
keep their weights out of the actor (vLLM's workers, through `collective_rpc`): such an engine implements
`GroupReceiver` (`rlstages.engines.base`) and its workers run `join_group` / `receive_into` below, so the
payload goes from the trainer straight into the process that loads it, with no hop through the actor.

Per bucket the source broadcasts a header (meta length, payload length, shared file generation, offset), the
JSON meta (name, dtype, shape, offset) and one flat byte payload; receivers view their copy of the payload as
the named tensors and load them. One bucket at a time on both sides: no process holds a second full copy of
the model. Every trainer rank walks `named_weights()` in step, because gathering sharded weights (ZeRO-3,
TP/PP) is a collective itself.

When every receiver runs on the source's node, the payload skips the socket (the CPU twin of verl's CUDA IPC):
the source casts each tensor straight into its own region of a shared-memory file under /dev/shm, mapped by
every member and reused by every sync, and broadcasts only the header and meta. A receiver that can adopt
tensors (`adopt_weights`, the HF engine) makes its weights views of that file, so the next sync's cast is the
only copy; others copy out of it once the source is done. One all-reduce at the end tells the source every
receiver is done. The file grows (a new, larger file) when the weights outgrow it, and each file is unlinked
once all have mapped it: the memory lives as long as the mappings, so a killed worker leaves nothing behind
in /dev/shm. Across nodes the payload is broadcast (and adopted as received).

On GPUs the group is NCCL (bf16 buckets broadcast from the source's GPU), a group of its own beside the trainer's
world group, as OpenRLHF's and TRL's sync groups are. NCCL refuses two ranks of one communicator on one GPU
("Duplicate GPU detected"), which happens when a rollout worker shares the source's GPU without sharing its
process: the driver asks every member for its GPU's UUID before forming the group and says so in one line
(`distinct_gpus`); such a layout takes the hybrid engine instead, whose push is CUDA IPC (`runtime.cuda_ipc`).
Members must also agree on `NCCL_CUMEM_ENABLE` (vLLM >= 0.16 no longer forces it; the config sets it for every
worker): a mismatch is refused the same way (`same_nccl_cumem`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rlstages.engines.runtime.device import worker_device
from rlstages.engines.runtime.flat_sync import (
    begin_flat_round,
    end_flat_round,
    receives_flat_buckets,
    send_flat_bucket,
)
from rlstages.engines.runtime.payload import layout, pack_into, unpack
from rlstages.engines.utils import DTYPES


@dataclass
class _SyncGroup:
    """A sync group as one member process holds it: the process group, this member's rank, and (same-node
    groups) the shared-memory file's path prefix, the generation mapped here and the mapping."""

    group: Any
    rank: int
    shm_path: str | None = None
    generation: int = 0
    mapping: torch.Tensor | None = None
    created: list[str] = field(default_factory=list)  # new files, unlinked once every receiver has mapped them
    receivers: list[Any] | None = None  # the source of a flat-bucket group (SGLang): the rollout actors
    device: str = "cpu"  # where broadcast tensors live: the GPU under NCCL


_SYNC_GROUPS: dict[str, _SyncGroup] = {}  # inside a worker process: group name -> its sync group


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
    engine's own workers (`weight_group_devices`), else this worker's device (`device.worker_device`)."""
    own = getattr(engine, "weight_group_devices", None)
    if own is not None:
        return list(own())
    device = worker_device()
    if device.type != "cuda":
        return [None]
    from rlstages.engines.runtime.cuda_ipc import gpu_uuid

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
        join_group(name, addr, port, rank, world, timeout, shm_path)
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
) -> None:
    """Join the sync group `name` from this process and keep it here (rank 0 hosts its TCP store); with
    `shm_path` (all members on one node) bucket payloads pass through that shared-memory file. `host` is this
    node's address (default: Ray's view of it) for gloo to bind."""
    import datetime

    import torch.distributed as dist

    from rlstages.engines.runtime.rendezvous import collective_backend, collective_device, node_ip

    if name in _SYNC_GROUPS:
        return
    device = collective_device()
    shm_path = shm_path if device == "cpu" else None  # NCCL moves GPU memory; the file is for host memory
    delta = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=delta)
    if collective_backend() == "nccl":  # pragma: no cover - GPU only
        group: Any = dist.ProcessGroupNCCL(dist.PrefixStore(name, store), rank, world)  # type: ignore[call-arg]  # options has a default
    else:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch private API, not in its stubs
        options._timeout = delta
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host or node_ip())]
        group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, options)
    _SYNC_GROUPS[name] = _SyncGroup(group, rank, shm_path, device=device)


def join_flat_source(
    engine: Any, name: str, addr: str, port: int, world: int, timeout: float, receivers: list[Any]
) -> int:
    """Runs in the source trainer rank: host the group `name` that engines with their own group API (SGLang)
    join, and keep the rollout actors to send each bucket's layout to (`flat_sync`)."""
    from rlstages.engines.runtime.flat_sync import join_flat_group

    if name not in _SYNC_GROUPS:
        _SYNC_GROUPS[name] = _SyncGroup(join_flat_group(name, addr, port, 0, world, timeout), 0, receivers=receivers)
    return 0


def leave_sync_group(engine: Any, name: str) -> None:
    """Drop a sync group (its peers are gone or replaced) and this process's mapping of its bucket file."""
    own = getattr(engine, "leave_weight_group", None)
    if own is not None:
        own(name)
    leave_group(name)


def leave_group(name: str) -> None:
    """Forget the sync group `name` in this process."""
    _SYNC_GROUPS.pop(name, None)


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    group.broadcast(tensor, 0).wait()


def _shared_region(member: _SyncGroup, offset: int, nbytes: int, generation: int | None = None) -> torch.Tensor:
    """Bytes [offset, offset + nbytes) of this process's mapping of the group's shared-memory file. The source
    (no `generation`) makes a new file, twice as large or more, when the region does not fit; a receiver maps the
    file of the `generation` the header names. Views taken earlier keep their own file mapped."""
    import os

    assert member.shm_path is not None
    end = offset + nbytes
    if generation is None and (member.mapping is None or member.mapping.numel() < end):
        size = max(end, 2 * (member.mapping.numel() if member.mapping is not None else 0))
        member.generation += 1
        member.created.append(f"{member.shm_path}.{member.generation}")
        member.mapping = torch.from_file(member.created[-1], shared=True, size=size, dtype=torch.uint8)
    elif generation is not None and generation != member.generation:
        path = f"{member.shm_path}.{generation}"
        member.mapping = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
        member.generation = generation
    assert member.mapping is not None
    return member.mapping[offset:end]


def _mapped(member: _SyncGroup) -> None:
    """After the final all-reduce (every receiver has mapped the files): unlink the newly made ones."""
    import contextlib
    import os

    for path in member.created:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    member.created = []


def _align(offset: int) -> int:
    return -(-offset // 64) * 64  # each bucket's region starts on a cache line


def send_weights(engine: Any, name: str | None, bucket_bytes: int, dtype: str) -> dict[str, float]:
    """Runs in every trainer rank; the one holding the sync group `name` (the source) broadcasts the buckets,
    the others only take part in the gathers of `named_weights()`."""
    start = time.perf_counter()
    member = _SYNC_GROUPS[name] if name is not None else None
    shared = member is not None and member.shm_path is not None
    kind = DTYPES[dtype]
    device = member.device if member is not None else "cpu"
    header = torch.zeros(4, dtype=torch.int64, device=device)  # meta, payload bytes, shared file generation, offset
    buckets = tensors = offset = 0
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size, buckets, offset
        assert member is not None and name is not None
        if member.receivers is not None:  # SGLang: layout through Ray, one flat broadcast (`flat_sync`)
            send_flat_bucket(member.group, name, member.receivers, bucket, kind)
            bucket, size, buckets = [], 0, buckets + 1
            return
        meta, nbytes = layout(bucket, kind)
        payload = (
            _shared_region(member, offset, nbytes) if shared else torch.empty(nbytes, dtype=torch.uint8, device=device)
        )
        if not shared:
            pack_into(bucket, kind, payload)
        header[0], header[1], header[2], header[3] = meta.numel(), nbytes, member.generation, offset
        _broadcast(member.group, header)
        _broadcast(member.group, meta.to(device))
        if shared:  # the receivers adopt their views of the region while it is being written
            pack_into(bucket, kind, payload)
        else:
            _broadcast(member.group, payload)
        bucket, size, buckets, offset = [], 0, buckets + 1, _align(offset + nbytes)

    for key, tensor in engine.named_weights():
        if member is None:
            continue
        bucket.append((key, tensor))
        size += tensor.numel() * kind.itemsize
        tensors += 1
        if size >= bucket_bytes:
            flush()
    if member is not None and bucket:
        flush()
    if member is not None and member.receivers is None:
        header.zero_()
        _broadcast(member.group, header)  # the end
        member.group.allreduce([torch.zeros(1, device=device)]).wait()  # every receiver has its weights
        if shared:
            _mapped(member)
    return {
        "sync/buckets": float(buckets),
        "sync/tensors": float(tensors),
        "sync/shared_memory": float(shared),
        "timing/sync_source_s": time.perf_counter() - start,  # inside the source rank, Ray calls excluded
    }


def receive_weights(engine: Any, name: str) -> int:
    """Runs in every rollout actor: an engine that receives in processes of its own (`GroupReceiver`) has its
    workers receive; otherwise wake the engine if it sleeps (no separate round trip) and receive here.
    Returns the number of tensors loaded."""
    own = getattr(engine, "receive_weight_group", None)
    if own is not None:
        return int(own(name))
    engine.wake()
    return receive_into(engine, name)


def receive_into(target: Any, name: str) -> int:
    """Runs in every receiving process: take buckets from the source until the end header, handing each to
    `target` as it arrives: adopted as its weights where it can (`adopt_weights`), else `update_weights`
    (in one call, once the source has filled the shared file, when the payload comes through one).
    Returns the number of tensors received."""
    member = _SYNC_GROUPS[name]
    adopt = getattr(target, "adopt_weights", None)
    header = torch.zeros(4, dtype=torch.int64, device=member.device)
    written_later: list[tuple[str, torch.Tensor]] = []  # shared regions to copy once the source has filled them
    count = 0
    while True:
        _broadcast(member.group, header)
        meta_len, payload_len, generation, offset = (int(v) for v in header)
        if meta_len == 0:
            if written_later:  # the end header comes after the last region is written
                target.update_weights(iter(written_later))
            member.group.allreduce([torch.zeros(1, device=member.device)]).wait()
            return count
        meta = torch.empty(meta_len, dtype=torch.uint8, device=member.device)
        _broadcast(member.group, meta)
        if member.shm_path is not None:
            payload = _shared_region(member, offset, payload_len, generation)
        else:
            payload = torch.empty(payload_len, dtype=torch.uint8, device=member.device)
            _broadcast(member.group, payload)
        named = list(unpack(meta, payload))
        count += len(named)
        if adopt is not None:  # views only: nothing is read before the source has written it
            named = adopt(iter(named))
        if member.shm_path is not None:
            written_later.extend(named)
        elif named:
            target.update_weights(iter(named))
        del named, payload


class CollectiveSync:
    """The driver's side of collective sync: builds the group once per set of live actors (a rebuilt group
    gets a new one) and runs one broadcast round per `sync`."""

    def __init__(self, shared_memory: bool = True) -> None:
        self.shared_memory = shared_memory  # False: payloads go over the group's sockets even on one node
        self._groups: dict[tuple[str, ...], str] = {}
        self._members: list[Any] = []
        self._flat = False  # the rollout engines take flat buckets through their own API (SGLang)

    @staticmethod
    def _ids(handles: list[Any]) -> tuple[str, ...]:
        return tuple(h._actor_id.hex() for h in handles)

    def _group(self, source: Any, rollouts: list[Any], timeout: float) -> str:
        import uuid

        import ray

        from rlstages.engines.rollout.ipc import shm_dir

        ids = self._ids([source, *rollouts])
        if ids in self._groups:
            return self._groups[ids]
        name = f"wsync-{uuid.uuid4().hex[:12]}"
        addr, port = ray.get(source.__ray_call__.remote(sync_endpoint), timeout=timeout)
        nodes = ray.get([h.__ray_call__.remote(worker_node) for h in rollouts], timeout=timeout)
        sizes = ray.get([h.__ray_call__.remote(group_size) for h in rollouts], timeout=timeout)
        gpus = ray.get([h.__ray_call__.remote(member_gpus) for h in [source, *rollouts]], timeout=timeout)
        labels = ["trainer source", *(f"rollout worker {i}" for i in range(len(rollouts)))]
        distinct_gpus(list(zip(labels, gpus, strict=True)))
        if any(g is not None for member in gpus for g in member):  # NCCL: its env must agree everywhere
            cumem = ray.get([h.__ray_call__.remote(member_nccl_cumem) for h in [source, *rollouts]], timeout=timeout)
            same_nccl_cumem(list(zip(labels, cumem, strict=True)))
        flat = set(ray.get([h.__ray_call__.remote(receives_flat_buckets) for h in rollouts], timeout=timeout))
        if len(flat) > 1:
            raise ValueError("one weight-sync group cannot mix rollout engines with and without their own group API")
        self._flat = flat == {True}
        one_node = self.shared_memory and not self._flat and all(n == addr for n in nodes)
        shm_path = str(shm_dir() / f"rlstages-{name}") if one_node else None
        world = 1 + sum(sizes)
        ranks = [0, *(1 + sum(sizes[:i]) for i in range(len(rollouts)))]  # an engine's workers: consecutive ranks
        refs = [
            h.__ray_call__.remote(join_sync_group, name, addr, port, r, world, timeout, shm_path)
            for r, h in zip(ranks[1:], rollouts, strict=True)
        ]
        if self._flat:
            refs.append(source.__ray_call__.remote(join_flat_source, name, addr, port, world, timeout, rollouts))
        else:
            refs.append(source.__ray_call__.remote(join_sync_group, name, addr, port, 0, world, timeout, shm_path))
        ray.get(refs, timeout=timeout)
        for old_name in self._groups.values():  # the survivors of an older group drop it and its bucket mapping
            for h in self._members:
                h.__ray_call__.remote(leave_sync_group, old_name)  # fire and forget: some are dead
        self._groups, self._members = {ids: name}, [source, *rollouts]
        return name

    def sync(
        self, trainers: list[Any], source: int, rollouts: list[Any], bucket_bytes: int, dtype: str, timeout: float
    ) -> dict[str, float]:
        """Broadcast the source trainer rank's weights to every rollout rank."""
        import ray

        start = time.perf_counter()
        name = self._group(trainers[source], rollouts, timeout)
        try:
            if self._flat:  # the engines' weight-update sessions, opened and closed around the round
                ray.get([h.__ray_call__.remote(begin_flat_round, name) for h in rollouts], timeout=timeout)
            sends = [
                t.__ray_call__.remote(send_weights, name if r == source else None, bucket_bytes, dtype)
                for r, t in enumerate(trainers)
            ]
            receives = [] if self._flat else [h.__ray_call__.remote(receive_weights, name) for h in rollouts]
            out = ray.get(sends, timeout=timeout)[source]
            ray.get(receives, timeout=timeout)
            if self._flat:
                ray.get([h.__ray_call__.remote(end_flat_round, name) for h in rollouts], timeout=timeout)
        except BaseException:
            self._groups = {}  # a broken round leaves the group's streams out of step: the next sync builds anew
            raise
        return {**out, "timing/sync_weights_s": time.perf_counter() - start}
