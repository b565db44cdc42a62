"""The object-store transport (`cluster.weight_sync=object_store`): buckets through Ray's object store.

The trainer turns its `named_weights()` into encoded buckets (`buckets.bucketize`: cast to the rollout dtype, numpy,
bf16 as an int16 view), so Ray moves them zero-copy; each rollout actor decodes a bucket and calls its engine's
`update_weights` (`buckets.apply_bucket`). At most two buckets are in flight, so no process ever holds a second
full copy of the model.
"""

from __future__ import annotations

import time
from typing import Any

from rlstages.engines.sync.buckets import apply_bucket
from rlstages.engines.sync.protocol import SyncRound


class ObjectStoreSync:
    """Split placement through Ray's object store: the source rank's streamed buckets applied in every rollout
    actor. Every trainer rank runs its `weight_buckets` generator at once, because gathering sharded weights
    (ZeRO-3, TP) is a collective; only the source rank's buckets are applied, the others are dropped."""

    def prepare(self, round: SyncRound) -> None:
        """Wake every rollout engine (their weights were freed while the trainers worked)."""
        import ray

        ray.get([h.wake.remote() for h in round.rollouts], timeout=round.timeout)

    def push(self, round: SyncRound) -> dict[str, float]:
        """Stream buckets from trainer rank `round.source` to every rollout actor."""
        import ray

        self.prepare(round)
        start = time.perf_counter()
        streams = [
            t.weight_buckets.options(num_returns="streaming").remote(round.bucket_bytes, round.dtype)
            for t in round.trainers
        ]
        rollouts, timeout = round.rollouts, round.timeout
        inflight: list[Any] = []
        buckets = tensors = 0
        for ref in streams[round.source]:
            if inflight:
                tensors += sum(ray.get(inflight, timeout=timeout)) // max(1, len(rollouts))
            inflight = [h.__ray_call__.remote(apply_bucket, ref) for h in rollouts]
            buckets += 1
        if inflight:
            tensors += sum(ray.get(inflight, timeout=timeout)) // max(1, len(rollouts))
        for rank, stream in enumerate(streams):
            if rank != round.source:
                for _ in stream:  # let the other ranks finish their part of the collectives
                    pass
        return {
            "sync/buckets": float(buckets),
            "sync/tensors": float(tensors),
            "timing/sync_weights_s": time.perf_counter() - start,
        }

    @staticmethod
    def receive(engine: Any, *message: Any) -> int:
        """Runs in a rollout actor: decode one bucket and load it."""
        return apply_bucket(engine, message[0])

    def close(self) -> None:
        """Nothing is kept between rounds."""
