"""The bounded rollout queue of asynchronous training: admission control by staleness, batches in admission
order, and the per-token consumption lag of every batch taken.

A plain class (thread-safe), wrapped as a Ray actor by the tasks layer (`ray.remote(RolloutQueue)`), or used as it
is in the driver (`cluster.mode: in_process`, tests). It holds metadata only (indices, per-version token counts,
lengths, where the rows are); the rows themselves stay where the generation stage wrote them.

Counting: prompt groups are numbered 0, 1, 2, ... in the order they are admitted; update k (1-based) trains on
groups [(k-1)B, kB) (B = groups per step) with the policy of version k-1 (k-1 updates done), so a token generated
by version u lags (k-1) - u versions when it is consumed, the time it waited in the queue included. A group may
start only while accepted + running < (eta + v + 1) B (AReaL's rule; v = the newest version the rollout has), which
bounds every lag by eta whatever the latencies, and never drops a sample. Batches in admission order make a batch's
contents independent of which group finishes first: a long reply delays its own batch instead of being left for
later (no bias toward short replies), and the same admissions give the same batches.

Non-goal: generating (the caller starts groups and puts them when finished) and loading rows.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

ROLLOUT_VERSIONS = "rollout_versions"  # per-token policy version [B, T] int64 (T.ROLLOUT_VERSIONS, issue 53)


class StalenessViolation(RuntimeError):
    """A batch holds a token older than eta allows: admission control is broken; training on it would be wrong."""


@dataclass
class QueueItem:
    """Finished prompt groups [first, first + groups), put together: their tokens per policy version, their
    reply lengths (tokens per row), where their rows are (`payload`), and sequences interrupted by an update."""

    first: int
    groups: int
    version_tokens: dict[int, int]
    lengths: list[int] = field(default_factory=list)
    payload: Any = None
    interrupted: int = 0
    finished_at: float = 0.0


@dataclass
class Batch:
    """What update `step` trains on, and the metrics of its taking (lag, queue depth, time queued)."""

    step: int
    items: list[QueueItem]
    metrics: dict[str, float]


class RolloutQueue:
    """Admission, bounded storage and in-order batches of finished prompt groups (module docstring)."""

    def __init__(
        self, groups_per_step: int, max_staleness: int, capacity: int | None = None, start_step: int = 0
    ) -> None:
        """Start after `start_step` updates (a resumed run): version start_step, groups before its batches gone."""
        if groups_per_step < 1 or max_staleness < 0:
            raise ValueError(f"groups_per_step={groups_per_step} must be >= 1 and max_staleness={max_staleness} >= 0")
        self.b, self.eta = groups_per_step, max_staleness
        self.capacity = capacity if capacity is not None else (max_staleness + 1) * groups_per_step
        if self.capacity < groups_per_step:
            raise ValueError(f"queue capacity {self.capacity} is below one batch ({groups_per_step} groups)")
        self.version = start_step  # newest policy version the rollout engines have
        self.next_index = start_step * groups_per_step  # the next group admitted gets this number
        self.consumed = self.next_index  # groups before this were trained on
        self.running = 0
        self.ready: dict[int, QueueItem] = {}
        self.lock = threading.Lock()

    def admissible(self) -> int:
        """How many more prompt groups may start now (staleness bound and capacity, both)."""
        with self.lock:
            return self._admissible()

    def _admissible(self) -> int:
        by_staleness = (self.eta + self.version + 1) * self.b - (self.next_index)  # next_index = accepted + running
        queued = sum(item.groups for item in self.ready.values())
        return max(0, min(by_staleness, self.capacity - queued - self.running))

    def start(self, groups: int) -> int:
        """Admit `groups` groups now; returns the first one's number. Refuses (ValueError) past `admissible`."""
        with self.lock:
            if groups < 1 or groups > self._admissible():
                raise ValueError(f"cannot start {groups} groups: {self._admissible()} admissible now")
            first = self.next_index
            self.next_index += groups
            self.running += groups
            return first

    def put(self, item: QueueItem) -> None:
        """A finished item (started by `start`); each group number is put once."""
        with self.lock:
            if item.first in self.ready or not self.consumed <= item.first < self.next_index:
                raise ValueError(f"groups from {item.first} were not started, or were put twice")
            item.finished_at = item.finished_at or time.monotonic()
            self.running -= item.groups
            self.ready[item.first] = item

    def publish(self, version: int) -> None:
        """The rollout engines now generate with policy `version` (after a weight sync)."""
        with self.lock:
            self.version = max(self.version, version)

    def take(self, step: int) -> Batch | None:
        """Update `step`'s batch (groups [(step-1)B, step*B)) if all of it finished, else None (poll again).

        Raises:
            StalenessViolation: a token of the batch lags more than eta versions.
        """
        with self.lock:
            first, end = (step - 1) * self.b, step * self.b
            if first != self.consumed:
                raise ValueError(
                    f"batch of step {step} asked, but the next batch is step {self.consumed // self.b + 1}"
                )
            items, at = [], first
            while at < end and at in self.ready:
                items.append(self.ready[at])
                at += self.ready[at].groups
            if at < end:
                return None
            if at != end:
                raise ValueError(f"an item crosses the batch boundary of step {step} (groups up to {at})")
            depth = sum(item.groups for item in self.ready.values())
            for item in items:
                del self.ready[item.first]
            self.consumed = end
        metrics = lag_metrics(items, trainer_version=step - 1, eta=self.eta)
        now = time.monotonic()
        metrics["async/queue_depth"] = float(depth)
        metrics["async/queue_wait_s"] = max(now - item.finished_at for item in items)
        metrics["async/interrupted_sequences"] = float(sum(item.interrupted for item in items))
        return Batch(step, items, metrics)

    def state(self) -> dict[str, int]:
        """Counters (for metrics and tests): version, admitted, consumed, running, queued groups."""
        with self.lock:
            queued = sum(item.groups for item in self.ready.values())
            return {
                "version": self.version,
                "admitted": self.next_index,
                "consumed": self.consumed,
                "running": self.running,
                "queued": queued,
            }


def lag_metrics(items: list[QueueItem], trainer_version: int, eta: int) -> dict[str, float]:
    """Consumption lag of every token of a batch (trainer_version - the token's version): mean, max, and the
    fraction of tokens at each lag 0..eta (`async/lag_hist/<lag>`).

    Raises:
        StalenessViolation: a token lags more than eta, or comes from a version newer than the trainer's.
    """
    counts: Counter[int] = Counter()
    for item in items:
        for version, tokens in item.version_tokens.items():
            counts[trainer_version - int(version)] += int(tokens)
    total = sum(counts.values())
    worst = max(counts, default=0)
    if worst > eta or min(counts, default=0) < 0:
        raise StalenessViolation(
            f"update at version {trainer_version} got tokens with lags {sorted(counts)}: max {worst} > eta={eta} "
            "(or a token newer than the trainer); admission control failed, refusing to train on them"
        )
    metrics = {
        "async/lag_mean": sum(lag * n for lag, n in counts.items()) / max(total, 1),
        "async/lag_max": float(worst),
        "async/tokens": float(total),
    }
    for lag in range(eta + 1):
        metrics[f"async/lag_hist/{lag}"] = counts.get(lag, 0) / max(total, 1)
    return metrics
