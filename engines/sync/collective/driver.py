"""The driver's side of collective sync: `CollectiveSync` builds the group once per set of live actors (a rebuilt
group gets a new one) and runs one broadcast round per `sync` (the protocol: `rlstages.engines.sync.collective`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlstages.engines.sync.collective.flat import begin_flat_round, end_flat_round, receives_flat_buckets
from rlstages.engines.sync.collective.membership import (
    distinct_gpus,
    group_size,
    join_flat_source,
    join_sync_group,
    leave_sync_group,
    member_gpus,
    member_nccl_cumem,
    same_nccl_cumem,
    sync_endpoint,
    worker_node,
)
from rlstages.engines.sync.collective.wire import receive_weights, send_weights
from rlstages.engines.sync.protocol import SyncRound
from rlstages.engines.sync.shm_files import shm_dir


@dataclass(frozen=True)
class GroupProtocol:
    """One group protocol as the driver runs it (`PROTOCOLS`): how the source joins, whether the payload may pass
    through a shared-memory file, and what the rollout actors run before, during and after the source sends
    (each `fn(engine, group_name)` inside the actor, or nothing)."""

    join_source: Callable[..., Any]  # `fn(engine, name, addr, port, world, timeout, rollouts, shm_path)` in the source
    shares_memory: bool
    begin: Callable[[Any, str], Any] | None = None
    receive: Callable[[Any, str], Any] | None = None
    end: Callable[[Any, str], Any] | None = None


def _join_broadcast_source(
    engine: Any, name: str, addr: str, port: int, world: int, timeout: float, rollouts: list[Any], shm_path: str | None
) -> int:
    """Runs in the source trainer rank: join the group at rank 0 (our receivers: `wire.receive_into`)."""
    return join_sync_group(engine, name, addr, port, 0, world, timeout, shm_path)


def _join_flat_source(
    engine: Any, name: str, addr: str, port: int, world: int, timeout: float, rollouts: list[Any], shm_path: str | None
) -> int:
    """Runs in the source trainer rank: host the group the engines' own API joins (SGLang; no shared file)."""
    return join_flat_source(engine, name, addr, port, world, timeout, rollouts)


# By whether the rollout engines take flat buckets through their own API (`flat.receives_flat_buckets`).
PROTOCOLS: dict[bool, GroupProtocol] = {
    False: GroupProtocol(_join_broadcast_source, shares_memory=True, receive=receive_weights),
    True: GroupProtocol(_join_flat_source, shares_memory=False, begin=begin_flat_round, end=end_flat_round),
}


class CollectiveSync:
    """The collective transport (`cluster.weight_sync=collective|auto`): a gloo / NCCL broadcast group from the
    trainer's source rank to every rollout process, its payload through a shared-memory file when every member is
    on the source's node (`shared_memory`). Builds the group once per set of live actors (a rebuilt group gets a
    new one) and runs one broadcast round per `push`."""

    def __init__(self, shared_memory: bool = True) -> None:
        self.shared_memory = shared_memory  # False: payloads go over the group's sockets even on one node
        self._groups: dict[tuple[str, ...], str] = {}
        self._members: list[Any] = []
        self._protocol = PROTOCOLS[False]  # chosen when a group is formed, by what the rollout engines take

    @staticmethod
    def _ids(handles: list[Any]) -> tuple[str, ...]:
        return tuple(h._actor_id.hex() for h in handles)

    def _group(self, source: Any, rollouts: list[Any], timeout: float) -> str:
        import uuid

        import ray

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
        self._protocol = PROTOCOLS[flat == {True}]
        one_node = self.shared_memory and self._protocol.shares_memory and all(n == addr for n in nodes)
        shm_path = str(shm_dir() / f"rlstages-{name}") if one_node else None
        world = 1 + sum(sizes)
        ranks = [0, *(1 + sum(sizes[:i]) for i in range(len(rollouts)))]  # an engine's workers: consecutive ranks
        refs = [
            h.__ray_call__.remote(join_sync_group, name, addr, port, r, world, timeout, shm_path)
            for r, h in zip(ranks[1:], rollouts, strict=True)
        ]
        join = self._protocol.join_source
        refs.append(source.__ray_call__.remote(join, name, addr, port, world, timeout, rollouts, shm_path))
        ray.get(refs, timeout=timeout)
        for old_name in self._groups.values():  # the survivors of an older group drop it and its bucket mapping
            for h in self._members:
                h.__ray_call__.remote(leave_sync_group, old_name)  # fire and forget: some are dead
        self._groups, self._members = {ids: name}, [source, *rollouts]
        return name

    def prepare(self, round: SyncRound) -> None:
        """Form the group of the round's source rank and rollout workers, unless these actors already have one."""
        self._group(round.trainers[round.source], round.rollouts, round.timeout)

    def push(self, round: SyncRound) -> dict[str, float]:
        """Broadcast the source trainer rank's weights to every rollout rank (the receivers wake themselves)."""
        import ray

        trainers, source, rollouts, timeout = round.trainers, round.source, round.rollouts, round.timeout
        start = time.perf_counter()
        name = self._group(trainers[source], rollouts, timeout)
        protocol = self._protocol

        def in_rollouts(fn: Callable[[Any, str], Any] | None) -> list[Any]:
            return [] if fn is None else [h.__ray_call__.remote(fn, name) for h in rollouts]

        try:
            ray.get(in_rollouts(protocol.begin), timeout=timeout)  # e.g. the engines' weight-update sessions
            sends = [
                t.__ray_call__.remote(send_weights, name if r == source else None, round.bucket_bytes, round.dtype)
                for r, t in enumerate(trainers)
            ]
            receives = in_rollouts(protocol.receive)
            out = ray.get(sends, timeout=timeout)[source]
            ray.get(receives, timeout=timeout)
            ray.get(in_rollouts(protocol.end), timeout=timeout)
        except BaseException:
            # a broken round (a member died) leaves the group's streams out of step: every member that lives drops
            # it -- the source's sockets close, so a receiver still waiting in it fails now instead of at the
            # group's timeout -- and the next sync builds anew
            self.close()
            raise
        return {**out, "timing/sync_weights_s": time.perf_counter() - start}

    @staticmethod
    def receive(engine: Any, *message: Any) -> int:
        """Runs in a rollout actor: take the round of the group named `message[0]` (`wire.receive_weights`)."""
        return receive_weights(engine, message[0])

    def close(self) -> None:
        """Forget the group: every member that still lives drops it (the next round forms a new one)."""
        for old_name in self._groups.values():
            for h in self._members:
                h.__ray_call__.remote(leave_sync_group, old_name)  # fire and forget: some are dead
        self._groups, self._members = {}, []
