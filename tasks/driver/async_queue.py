"""The driver's side of the asynchronous rollout queue: the queue as a Ray actor (or in the driver), and the
per-token policy versions of a step's rollouts.

`engines.rollout.async_queue.RolloutQueue` is a plain class; here it becomes a named Ray actor (no CPU reserved:
it only counts; on the driver's node) so that generation and training talk to one queue, or stays an
object in the driver when the engines do (`cluster.mode: in_process`).
"""

from __future__ import annotations

from typing import Any

import torch

from rlstages.configs import RunConfig
from rlstages.engines import types as T
from rlstages.engines.rollout.async_queue import ROLLOUT_VERSIONS, Batch, QueueItem, RolloutQueue
from rlstages.engines.tensordict_import import TensorDict
from rlstages.tasks.driver.async_schedule import row_runs
from rlstages.tasks.driver.context import RunHandle


class QueueClient:
    """Calls the queue's methods where it lives: `client.take(step)` is `ray.get(actor.take.remote(step))` for the
    actor, a plain call in the driver."""

    def __init__(self, queue: Any, remote: bool) -> None:
        self.queue, self.remote = queue, remote

    def __getattr__(self, method: str) -> Any:
        target = getattr(self.queue, method)
        if not self.remote:
            return target

        def call(*args: Any) -> Any:
            import ray

            return ray.get(target.remote(*args))

        return call

    def kill(self) -> None:
        """End the actor (a no-op in the driver)."""
        if self.remote:
            import ray

            ray.kill(self.queue)


def open_queue(cfg: RunConfig, run: RunHandle, start_step: int) -> QueueClient:
    """A fresh queue for a run (re)starting after `start_step` updates, sized by `trainer.async`."""
    a = cfg.trainer.async_
    args = (cfg.data.prompts_per_step, a.max_staleness, a.queue_capacity, start_step)
    if cfg.cluster.mode != "ray":
        return QueueClient(RolloutQueue(*args), remote=False)
    import ray

    from rlstages.engines.workers.driver_node import beside_driver

    actor = ray.remote(num_cpus=0, max_restarts=0)(RolloutQueue)
    name = f"rollout-queue-{run.key}"
    try:  # a queue left by an earlier attempt of this run (recovery): its counts are stale
        ray.kill(ray.get_actor(name, namespace=cfg.cluster.namespace))
    except ValueError:
        pass
    where = beside_driver()  # the queue outlives any rollout node leaving (the elastic fleet)
    handle = actor.options(name=name, namespace=cfg.cluster.namespace, scheduling_strategy=where).remote(*args)  # type: ignore[attr-defined]
    return QueueClient(handle, remote=True)


def stamp_versions(run: RunHandle, step: int, version: int, first: int, groups: int) -> QueueItem:
    """Record that every token of step `step`'s rollouts came from policy `version` (no partial rollouts: the
    weights do not change during a generation); writes `rollout_versions` [B, T] (0 on padding) beside the
    batch and returns the queue item of its `groups` prompt groups, numbered from `first`."""
    batch = T.load_batch(run.batch(step, "rollout"))
    mask = batch[T.RESPONSE_MASK]
    versions = torch.where(mask > 0, torch.full_like(mask, version, dtype=torch.int64), 0)
    T.save_batch(TensorDict({ROLLOUT_VERSIONS: versions}, batch_size=batch.batch_size), run.batch(step, "versions"))
    return QueueItem(
        first=first,
        groups=groups,
        version_tokens={version: int(mask.sum())},
        lengths=[int(n) for n in mask.sum(-1).tolist()],
        payload=step,
    )


def take_record(run: RunHandle, step: int, taken: Batch) -> dict[str, Any]:
    """The schedule's `take` event of update `step`: its samples [group, member] in row order (the batch is group
    major, `rollout.n` rows a group), each row's per-token versions (from the versions file), the queue depth."""
    mask = T.load_batch(run.batch(step, "rollout"))[T.RESPONSE_MASK]
    versions = T.load_batch(run.batch(step, "versions"))[ROLLOUT_VERSIONS]
    first = taken.items[0].first
    groups = sum(item.groups for item in taken.items)
    n = mask.shape[0] // groups
    return {
        "step": step,
        "samples": [[first + r // n, r % n] for r in range(mask.shape[0])],
        "versions": row_runs(versions, mask),
        "depth": int(taken.metrics["async/queue_depth"]),
    }
