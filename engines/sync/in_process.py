"""The in-process transports: no process boundary between the trainer's weights and the rollout engine's.

`InProcessSync` (`cluster.mode=in_process`: every engine in the driver, for tests and debugging) applies the
trainer's buckets (`buckets.bucketize`) to each engine by plain calls. `HybridSync` (`cluster.hybrid_engine`) asks
each hybrid worker to copy its own trainer's weights into its rollout engine tensor by tensor (`sync_local`); an
engine with processes of its own takes them there by its device's push (`sync.registry.ENGINE_PUSH`).
"""

from __future__ import annotations

import time
from typing import Any

from rlstages.engines.sync.buckets import apply_bucket
from rlstages.engines.sync.protocol import SyncRound


class InProcessSync:
    """Trainer and rollout engines are objects of this process: buckets handed over by plain calls."""

    def prepare(self, round: SyncRound) -> None:
        """Wake every rollout engine."""
        for rollout in round.rollouts:
            rollout.wake()

    def push(self, round: SyncRound) -> dict[str, float]:
        """The source trainer's buckets, applied to every rollout engine in turn."""
        self.prepare(round)
        start = time.perf_counter()
        buckets = tensors = 0
        for bucket in round.trainers[round.source].weight_buckets(round.bucket_bytes, round.dtype):
            for rollout in round.rollouts:
                self.receive(rollout, bucket)
            buckets += 1
            tensors += len(bucket)
        return {
            "sync/buckets": float(buckets),
            "sync/tensors": float(tensors),
            "timing/sync_weights_s": time.perf_counter() - start,
        }

    @staticmethod
    def receive(engine: Any, *message: Any) -> int:
        """Load one bucket into `engine`."""
        return apply_bucket(engine, message[0])

    def close(self) -> None:
        """Nothing is kept between rounds."""


class HybridSync:
    """Each hybrid worker (`workers.hybrid.HybridEngine`) copies its trainer's weights into its own rollout engine;
    the round's metrics are the first rank's. The rollout ranks are the trainer ranks."""

    def prepare(self, round: SyncRound) -> None:
        """Nothing to connect: trainer and engine share each worker's process."""

    def push(self, round: SyncRound) -> dict[str, float]:
        """Every rank's in-process copy at once; rank 0's metrics."""
        if round.in_process:
            return [self.receive(engine) for engine in round.trainers][0]
        import ray

        per_rank = ray.get([t.sync_local.remote() for t in round.trainers], timeout=round.timeout)
        return per_rank[0]

    @staticmethod
    def receive(engine: Any, *message: Any) -> Any:
        """Runs in a hybrid worker: its trainer -> its rollout engine (`HybridEngine.sync_local`)."""
        return engine.sync_local()

    def close(self) -> None:
        """Nothing is kept between rounds."""
