"""What every weight transport implements (`WeightSync`), what one sync round names (`SyncRound`) and what a
transport needs of the rollout side (`WeightTarget`).

A transport is built once per run, when the workers are built (`sync.registry.build_weight_sync`, chosen by
placement, cluster mode and the configured transport); the driver's `sync_weights` stage calls `push` once per step.
`prepare` connects a round's peers (cached while they live), `push` moves the source trainer rank's weights to every
rollout rank, `receive` is what each rollout process runs per message, and `close` forgets what `prepare` built.
Inside a colocated engine's own worker processes the push is an `EnginePush`, by the engine's device
(`sync.registry.ENGINE_PUSH`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SyncRound:
    """One trainer -> rollout sync as the driver asks for it."""

    trainers: list[Any]  # every trainer rank: Ray actor handles, or engines in this process
    source: int  # the rank whose weights are sent (the others take part in the gathers of sharded weights)
    rollouts: list[Any]  # every rollout rank (handles or engines)
    bucket_bytes: int  # a bucket's size in the travelling dtype (`sync.buckets.group_buckets`)
    dtype: str  # the rollout's dtype, which the weights travel in
    timeout: float  # seconds for each blocking wait of the round
    in_process: bool = False  # the ranks are engines of this process (`cluster.mode=in_process`), not Ray actors


@runtime_checkable
class WeightTarget(Protocol):
    """What every transport needs of a rollout engine: HF-named tensors loaded in place, and its weights woken
    before they are written. Optional, where an engine has them (`rlstages.engines.base`): `adopt_weights` (take
    the sender's tensors as its own), `GroupReceiver` (its own processes join a broadcast group), `BucketReceiver`
    (its own group API: SGLang), `sync_local` (a hybrid worker copies from its trainer in-process)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors in place (a subset of the weights is allowed)."""
        ...

    def wake(self) -> None:
        """Re-allocate what `sleep` freed, so the weights can be written."""
        ...


@runtime_checkable
class WeightSync(Protocol):
    """A trainer -> rollout weight transport, as the driver runs it. One class per transport, one entry in
    `sync.registry.TRANSPORTS`; the buckets come from the one bucketizer, `sync.buckets`."""

    def prepare(self, round: SyncRound) -> None:
        """Connect the round's peers (form a group, wake the engines); kept while the same actors live."""
        ...

    def push(self, round: SyncRound) -> dict[str, float]:
        """One round: the source rank's weights, in buckets, to every rollout rank; the round's metrics
        (`sync/buckets`, `sync/tensors`, `timing/sync_weights_s`, ...)."""
        ...

    @staticmethod
    def receive(engine: Any, *message: Any) -> Any:
        """Runs in a rollout process: load what one message of this transport carries; what it loaded (the
        tensor count, or a hybrid worker's metrics)."""
        ...

    def close(self) -> None:
        """Forget what `prepare` built (the peers were replaced or the run ends)."""
        ...


@runtime_checkable
class EnginePush(Protocol):
    """How a colocated engine hands weights to its own worker processes on this node (`sync.registry.ENGINE_PUSHERS`,
    chosen by the engine's device): `cuda_ipc.FlatPusher` (one persistent buffer), `shm_files.ShmFilePush` (files)."""

    dtype: torch.dtype  # the dtype the weights are cast to on the way

    def push(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], send: Callable[[Any], int]) -> dict[str, float]:
        """Hand every bucket over; `send` delivers one message of plain values to the workers and returns once they
        have loaded it, with one worker's tensor count. Returns the push's metrics."""
        ...

    def release(self, send: Callable[[Any], int] | None = None) -> None:
        """Free what is kept between pushes (the workers told first where `send` is given)."""
        ...
