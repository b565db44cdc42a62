"""Trainer -> rollout weight sync, streamed in buckets by HF name.

The trainer turns its `named_weights()` into buckets of at most `bucket_bytes`, cast to the rollout dtype
and encoded as numpy (bf16 travels as an int16 view), so Ray moves them zero-copy through the object
store; each rollout rank decodes a bucket and calls its engine's `update_weights`. At most two buckets
are in flight, so no process ever holds a second full copy of the model.

For split placement there is also a collective transport (`CollectiveSync`, below): a broadcast group of the
trainer's source rank and the rollout workers, gloo on CPU and NCCL on GPUs. Non-goal: CUDA IPC handles.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlstages.engines.utils import DTYPES

Bucket = list[tuple[str, str, np.ndarray]]
_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def encode_tensor(tensor: torch.Tensor, dtype: str) -> tuple[str, np.ndarray]:
    """A tensor cast to `dtype` as a numpy array (half types as an int16 view)."""
    t = tensor.detach().to(DTYPES[dtype]).contiguous()
    view = _VIEW.get(t.dtype)
    return dtype, (t.view(view) if view is not None else t).numpy()


def decode_tensor(dtype: str, array: np.ndarray) -> torch.Tensor:
    """Inverse of `encode_tensor` (no copy; the result may be read-only)."""
    t = torch.from_numpy(np.asarray(array))
    return t.view(DTYPES[dtype]) if DTYPES[dtype] in _VIEW else t


def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: str) -> Iterator[Bucket]:
    """Group named tensors into encoded buckets of about `bucket_bytes`; storage shared by two names
    (tied embeddings) is sent under every name."""
    bucket: Bucket = []
    size = 0
    for name, tensor in named:
        kind, array = encode_tensor(tensor, dtype)
        bucket.append((name, kind, array))
        size += array.nbytes
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def decode_bucket(bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a bucket."""
    for name, kind, array in bucket:
        yield name, decode_tensor(kind, array)


def apply_bucket(engine: Any, bucket: Bucket) -> int:
    """Runs inside a rollout actor (`__ray_call__`): hand a decoded bucket to the engine."""
    engine.update_weights(decode_bucket(bucket))
    return len(bucket)


def sync_weights_ray(
    trainers: list[Any], source: int, rollouts: list[Any], bucket_bytes: int, dtype: str, timeout: float
) -> dict[str, float]:
    """Stream buckets from trainer rank `source` to every rollout actor.

    Every trainer rank runs its `weight_buckets` generator at once, because gathering sharded weights
    (ZeRO-3, TP) is a collective; only the source rank's buckets are applied, the others are dropped.
    """
    import ray

    start = time.perf_counter()
    streams = [t.weight_buckets.options(num_returns="streaming").remote(bucket_bytes, dtype) for t in trainers]
    inflight: list[Any] = []
    buckets = tensors = 0
    for ref in streams[source]:
        if inflight:
            tensors += sum(ray.get(inflight, timeout=timeout)) // max(1, len(rollouts))
        inflight = [h.__ray_call__.remote(apply_bucket, ref) for h in rollouts]
        buckets += 1
    if inflight:
        tensors += sum(ray.get(inflight, timeout=timeout)) // max(1, len(rollouts))
    for rank, stream in enumerate(streams):
        if rank != source:
            for _ in stream:  # let the other ranks finish their part of the collectives
                pass
    return {
        "sync/buckets": float(buckets),
        "sync/tensors": float(tensors),
        "timing/sync_weights_s": time.perf_counter() - start,
    }


def sync_weights_local(trainer: Any, rollouts: list[Any], bucket_bytes: int, dtype: str) -> dict[str, float]:
    """The same through plain calls (engines in-process, for tests)."""
    start = time.perf_counter()
    buckets = tensors = 0
    for bucket in trainer.weight_buckets(bucket_bytes, dtype):
        for rollout in rollouts:
            apply_bucket(rollout, bucket)
        buckets += 1
        tensors += len(bucket)
    return {
        "sync/buckets": float(buckets),
        "sync/tensors": float(tensors),
        "timing/sync_weights_s": time.perf_counter() - start,
    }


# ---- collective transport (split placement): torch.distributed broadcast, trainer rank -> rollout ranks -------
#
# verl / OpenRLHF's split-placement sync: a process group of its own joins the trainer's source rank (rank 0
# of the group, it hosts the store) and every rollout worker; gloo on CPU, NCCL on GPUs
# (`rendezvous.collective_backend`). Per bucket the source broadcasts a header (meta length, payload length),
# the JSON meta (name, dtype, shape, offset) and one flat byte payload; receivers view their copy of the payload
# as the named tensors and hand them to `engine.update_weights` (the HF engine copies each into its parameter).
# One bucket at a time on both sides: no process holds a second full copy of the model. Every trainer rank
# walks `named_weights()` in step, because gathering sharded weights (ZeRO-3, TP/PP) is a collective itself.
#
# When every receiver runs on the source's node, the payload skips the socket (the CPU twin of verl's CUDA IPC):
# the source casts each tensor straight into its own region of a shared-memory file under /dev/shm, mapped by
# every member and reused by every sync, and broadcasts only the header and meta. A receiver whose engine can
# adopt tensors (`adopt_weights`, the HF engine) makes its weights views of that file, so the next sync's cast
# is the only copy; other engines copy out of it. One all-reduce at the end tells the source every receiver is
# done. The file grows (a new, larger file) when the weights outgrow it, and each file is unlinked once all have
# mapped it: the memory lives as long as the mappings, so a killed worker leaves nothing behind in /dev/shm.
# Across nodes the payload is broadcast as above (and adopted as received).


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


def join_sync_group(
    engine: Any, name: str, addr: str, port: int, rank: int, world: int, timeout: float, shm_path: str | None = None
) -> int:
    """Runs in every member: join the sync group `name` (rank 0 hosts its TCP store) and keep it here; with
    `shm_path` (all members on one node) bucket payloads pass through that shared-memory file."""
    import datetime

    import torch.distributed as dist

    from rlstages.engines.runtime.rendezvous import collective_backend, node_ip

    if name in _SYNC_GROUPS:
        return rank
    delta = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=delta)
    if collective_backend() == "nccl":  # pragma: no cover - GPU only
        group: Any = dist.ProcessGroupNCCL(dist.PrefixStore(name, store), rank, world)  # type: ignore[call-arg]  # options has a default
    else:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch private API, not in its stubs
        options._timeout = delta
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=node_ip())]
        group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, options)
    _SYNC_GROUPS[name] = _SyncGroup(group, rank, shm_path)
    return rank


def leave_sync_group(engine: Any, name: str) -> None:
    """Drop a sync group (its peers are gone or replaced) and this process's mapping of its bucket file."""
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


def _layout(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A bucket's meta bytes (name, dtype, shape, offset) once cast to `dtype`, and its payload size."""
    import json

    meta, offset = [], 0
    for name, tensor in bucket:
        meta.append([name, str(dtype).removeprefix("torch."), list(tensor.shape), offset])
        offset += tensor.numel() * dtype.itemsize
    return torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8), offset


def _pack_into(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype, payload: torch.Tensor) -> None:
    """Cast each tensor of the bucket into its slice of `payload` (one pass: the cast is the copy)."""
    offset = 0
    for _, tensor in bucket:
        n = tensor.numel() * dtype.itemsize
        payload[offset : offset + n].view(dtype).view(tensor.shape).copy_(tensor.detach())
        offset += n


def _unpack(meta: torch.Tensor, payload: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    import json

    for name, dtype, shape, offset in json.loads(bytes(meta.numpy()).decode()):
        kind = getattr(torch, dtype)
        size = int(np.prod(shape, dtype=np.int64)) * kind.itemsize
        yield name, payload[offset : offset + size].view(kind).reshape(shape)


def send_weights(engine: Any, name: str | None, bucket_bytes: int, dtype: str) -> dict[str, float]:
    """Runs in every trainer rank; the one holding the sync group `name` (the source) broadcasts the buckets,
    the others only take part in the gathers of `named_weights()`."""
    start = time.perf_counter()
    member = _SYNC_GROUPS[name] if name is not None else None
    shared = member is not None and member.shm_path is not None
    kind = DTYPES[dtype]
    header = torch.zeros(4, dtype=torch.int64)  # meta bytes, payload bytes, shared file generation, offset in it
    buckets = tensors = offset = 0
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size, buckets, offset
        assert member is not None
        meta, nbytes = _layout(bucket, kind)
        payload = _shared_region(member, offset, nbytes) if shared else torch.empty(nbytes, dtype=torch.uint8)
        if not shared:
            _pack_into(bucket, kind, payload)
        header[0], header[1], header[2], header[3] = meta.numel(), nbytes, member.generation, offset
        _broadcast(member.group, header)
        _broadcast(member.group, meta)
        if shared:  # the receivers adopt their views of the region while it is being written
            _pack_into(bucket, kind, payload)
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
    if member is not None:
        if bucket:
            flush()
        header.zero_()
        _broadcast(member.group, header)  # the end
        member.group.allreduce([torch.zeros(1)]).wait()  # every receiver has its weights
        if shared:
            _mapped(member)
    return {
        "sync/buckets": float(buckets),
        "sync/tensors": float(tensors),
        "sync/shared_memory": float(shared),
        "timing/sync_source_s": time.perf_counter() - start,  # inside the source rank, Ray calls excluded
    }


def receive_weights(engine: Any, name: str) -> int:
    """Runs in every rollout rank: wake the engine if it sleeps (no separate round trip), then receive buckets
    from the source until the end header, handing each to the engine as it arrives: adopted as its weights
    where the engine can (`adopt_weights`), copied in otherwise. Returns the number of tensors loaded."""
    engine.wake()
    member = _SYNC_GROUPS[name]
    adopt = getattr(engine, "adopt_weights", None)
    header = torch.zeros(4, dtype=torch.int64)
    written_later: list[tuple[str, torch.Tensor]] = []  # shared regions to copy once the source has filled them
    count = 0
    while True:
        _broadcast(member.group, header)
        meta_len, payload_len, generation, offset = (int(v) for v in header)
        if meta_len == 0:
            if written_later:  # the end header comes after the last region is written
                engine.update_weights(iter(written_later))
            member.group.allreduce([torch.zeros(1)]).wait()
            return count
        meta = torch.empty(meta_len, dtype=torch.uint8)
        _broadcast(member.group, meta)
        if member.shm_path is not None:
            payload = _shared_region(member, offset, payload_len, generation)
        else:
            payload = torch.empty(payload_len, dtype=torch.uint8)
            _broadcast(member.group, payload)
        named = list(_unpack(meta, payload))
        count += len(named)
        if adopt is not None:  # views only: nothing is read before the source has written it
            named = adopt(iter(named))
        if member.shm_path is not None:
            written_later.extend(named)
        elif named:
            engine.update_weights(iter(named))
        del named, payload


class CollectiveSync:
    """The driver's side of collective sync: builds the group once per set of live actors (a rebuilt group
    gets a new one) and runs one broadcast round per `sync`."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, ...], str] = {}
        self._members: list[Any] = []

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
        shm_path = str(shm_dir() / f"rlstages-{name}") if all(n == addr for n in nodes) else None
        world = 1 + len(rollouts)
        refs = [
            h.__ray_call__.remote(join_sync_group, name, addr, port, r, world, timeout, shm_path)
            for r, h in enumerate([source, *rollouts])
        ]
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
        sends = [
            t.__ray_call__.remote(send_weights, name if r == source else None, bucket_bytes, dtype)
            for r, t in enumerate(trainers)
        ]
        receives = [h.__ray_call__.remote(receive_weights, name) for h in rollouts]
        try:
            out = ray.get(sends, timeout=timeout)[source]
            ray.get(receives, timeout=timeout)
        except BaseException:
            self._groups = {}  # a broken round leaves the group's streams out of step: the next sync builds anew
            raise
        return {**out, "timing/sync_weights_s": time.perf_counter() - start}
