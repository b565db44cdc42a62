"""Collective weight sync into engines that form the broadcast group with their own API (SGLang).

SGLang's TP workers join a trainer's group with `init_weights_update_group` and receive with
`update_weights_from_distributed(names, dtypes, shapes, load_format="flattened_bucket")`: one flat byte tensor
per bucket, the tensors laid end to end in the order named, which is the payload layout of
`payload.layout` / `payload.pack_into`. So per bucket the source sends the bucket's names, dtypes and shapes
to each rollout actor through Ray (the actor calls SGLang, which then waits in the broadcast) and broadcasts the
packed payload; the actors' weight-update session (`begin_weight_update` / `end_weight_update`) is opened and
closed by the driver around the round (`collective.driver.CollectiveSync`).

The source joins the group as SGLang's workers form it: torch's tcp:// rendezvous (rank 0 hosts the store),
the store prefixed by the group name, and torch's own process-group factory, which prefixes it again by the
group name and the device, as every member of a torch group does.
"""

from __future__ import annotations

import datetime
from typing import Any, cast

import torch

from rlstages.engines.runtime.payload import pack_into


def receives_flat_buckets(engine: Any) -> bool:
    """Runs in a rollout actor: whether its engine takes flat buckets through its own API (`BucketReceiver`)."""
    return callable(getattr(engine, "receive_weight_bucket", None))


def join_flat_group(
    name: str, addr: str, port: int, rank: int, world: int, timeout: float, device: torch.device
) -> Any:
    """Join (rank 0: host) the group `name` the way SGLang's workers form theirs, from a process computing on
    `device`; returns the process group."""
    from torch.distributed import distributed_c10d as c10d

    from rlstages.engines.runtime.rendezvous import collective_backend

    delta = datetime.timedelta(seconds=timeout)
    store, _, _ = next(c10d.rendezvous(f"tcp://{addr}:{port}", rank, world, timeout=delta))
    store.set_timeout(delta)
    backend = c10d.Backend(collective_backend(device))
    group, _ = c10d._new_process_group_helper(
        world, rank, [], backend, c10d.PrefixStore(name, store), group_name=cast("c10d.GroupName", name), timeout=delta
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}  # group rank == rank in it
    return group


def send_flat_bucket(
    group: Any,
    name: str,
    receivers: list[Any],
    bucket: list[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    where: str = "cpu",
) -> None:
    """Runs in the source: tell every receiver actor the bucket's layout (through Ray), broadcast the payload,
    and wait until each has loaded it."""
    import ray
    import torch.distributed as dist

    nbytes = sum(t.numel() for _, t in bucket) * dtype.itemsize
    names = [key for key, _ in bucket]
    kind = str(dtype).removeprefix("torch.")
    shapes = [list(t.shape) for _, t in bucket]
    loads = [h.__ray_call__.remote(receive_flat_bucket, name, names, [kind] * len(names), shapes) for h in receivers]
    payload = torch.empty(nbytes, dtype=torch.uint8, device=where)  # the group's: the GPU under NCCL
    pack_into(bucket, dtype, payload)
    dist.broadcast(payload, src=0, group=group)
    ray.get(loads)


class FlatSender:
    """The source's side of a flat-bucket group (`wire.SENDERS["flat"]`): each bucket by `send_flat_bucket`; the
    round's end is the driver's (`end_flat_round` closes the engines' sessions)."""

    def __init__(self, group: Any, name: str, receivers: list[Any], kind: torch.dtype, where: str = "cpu") -> None:
        self.group, self.name, self.receivers, self.kind, self.where = group, name, receivers, kind, where

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """The bucket's layout to every receiver actor, its payload broadcast; returns once all have loaded it."""
        send_flat_bucket(self.group, self.name, self.receivers, bucket, self.kind, self.where)

    def end(self) -> None:
        """Nothing to send: the receivers know the round's end from the driver."""


def receive_flat_bucket(engine: Any, name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
    """Runs in a rollout actor: its engine receives one broadcast bucket and loads it."""
    return int(engine.receive_weight_bucket(name, names, dtypes, shapes))


def begin_flat_round(engine: Any, name: str) -> None:
    """Runs in a rollout actor before a round: wake and open the engine's weight-update session."""
    engine.begin_weight_group_update(name)


def end_flat_round(engine: Any, name: str) -> None:
    """Runs in a rollout actor after a round: close the session (the engine post-processes and flushes caches)."""
    engine.end_weight_group_update(name)
