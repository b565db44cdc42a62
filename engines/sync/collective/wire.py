"""The wire protocol of a sync group: per bucket a header (meta length, payload length, shared file generation,
offset), the JSON meta and one flat payload, broadcast by the source (`send_weights`) and taken by every receiver
(`receive_weights` / `receive_into`) until the end header; one all-reduce tells the source every receiver is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rlstages.engines.runtime.payload import layout, pack_into, unpack
from rlstages.engines.sync.buckets import tensor_buckets
from rlstages.engines.sync.collective.flat import FlatSender
from rlstages.engines.sync.collective.membership import SYNC_GROUPS, SyncGroup
from rlstages.engines.sync.collective.shared_region import align, shared_region, unlink_mapped
from rlstages.engines.utils import torch_dtype


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from the source (group rank 0) and wait."""
    group.broadcast(tensor, 0).wait()


class BroadcastSender:
    """The source's side of the wire protocol: per bucket the header, the meta and the payload (or, in a same-node
    group, its region of the shared file); at the end the end header, the all-reduce, and the new files unlinked."""

    def __init__(self, member: SyncGroup, name: str, kind: torch.dtype) -> None:
        self.member, self.kind, self.offset = member, kind, 0
        self.shared = member.shm_path is not None
        self.header = torch.zeros(4, dtype=torch.int64, device=member.device)  # meta, payload, generation, offset

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one bucket (cast to `kind` into the payload)."""
        member, header = self.member, self.header
        meta, nbytes = layout(bucket, self.kind)
        if self.shared:
            payload = shared_region(member, self.offset, nbytes)
        else:
            payload = torch.empty(nbytes, dtype=torch.uint8, device=member.device)
            pack_into(bucket, self.kind, payload)
        header[0], header[1], header[2], header[3] = meta.numel(), nbytes, member.generation, self.offset
        _broadcast(member.group, header)
        _broadcast(member.group, meta.to(member.device))
        if self.shared:  # the receivers adopt their views of the region while it is being written
            pack_into(bucket, self.kind, payload)
        else:
            _broadcast(member.group, payload)
        self.offset = align(self.offset + nbytes)

    def end(self) -> None:
        """The end header, then wait until every receiver has its weights (the all-reduce)."""
        self.header.zero_()
        _broadcast(self.member.group, self.header)
        self.member.group.allreduce([torch.zeros(1, device=self.member.device)]).wait()
        if self.shared:
            unlink_mapped(self.member)


SENDERS: dict[str, Callable[[SyncGroup, str, torch.dtype], Any]] = {
    "broadcast": BroadcastSender,  # our receivers: `receive_into`
    "flat": lambda member, name, kind: FlatSender(
        member.group, name, member.receivers or [], kind, member.device
    ),  # SGLang
}


def send_weights(engine: Any, name: str | None, bucket_bytes: int, dtype: str) -> dict[str, float]:
    """Runs in every trainer rank; the one holding the sync group `name` (the source) sends the buckets
    (`buckets.tensor_buckets`) by the group's protocol (`SENDERS`), the others only take part in the gathers of
    `named_weights()`."""
    start = time.perf_counter()
    stream = engine.named_weights()
    member = SYNC_GROUPS[name] if name is not None else None
    if member is None or name is None:
        for _ in stream:  # let the source's gathers complete
            pass
        return {
            "sync/buckets": 0.0,
            "sync/tensors": 0.0,
            "sync/shared_memory": 0.0,
            "timing/sync_source_s": time.perf_counter() - start,
        }
    kind = torch_dtype(dtype)
    sender = SENDERS[member.protocol](member, name, kind)
    buckets = tensors = 0
    for bucket in tensor_buckets(stream, bucket_bytes, kind):
        sender.send(bucket)
        buckets, tensors = buckets + 1, tensors + len(bucket)
    sender.end()
    return {
        "sync/buckets": float(buckets),
        "sync/tensors": float(tensors),
        "sync/shared_memory": float(member.shm_path is not None),
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
    member = SYNC_GROUPS[name]
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
            payload = shared_region(member, offset, payload_len, generation)
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
