"""A discrete-event simulation of asynchronous training on a virtual clock (heapq event loop, deterministic given
the seed): rollout workers decoding rows, the real bounded queue (`engines.rollout.async_queue.RolloutQueue`: its
admission rule, in-order batches and lag check are the ones a run uses, not a copy), the trainer and weight syncs.

Two generation schedules, the two the flows run:
- whole steps (`stream=False`, flows/async_train.py): step j's prompt groups start together once the queue admits
  all of them, spread over the workers (group g on worker g mod N, every row at once); the next step starts when
  this one has finished; sync k waits until every step admitted under version k-1 has been generated;
- a stream (`stream=True`, flows/async_partial.py): groups start one by one as the queue admits them, on the
  worker with the fewest rows that has `slots` free; with `partial_rollout` a sync holds the workers for its time
  (and a prefill per row in flight: the KV recomputed) and rows continue with the new version, without it the sync
  stops admissions and waits until every row in flight has finished.
A worker decodes at most `slots` rows at once (its KV room; None: no limit); in whole steps the rest of its rows
wait for a slot. A weight sync always holds every worker and the trainer for `sync_s`.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

from rlstages.engines.async_sim.profile import EngineProfile
from rlstages.engines.rollout.async_queue import QueueItem, RolloutQueue


@dataclass(frozen=True)
class SimConfig:
    """The pipeline simulated: batch shape, eta, fleet, schedule, how many steps."""

    groups_per_step: int
    samples_per_group: int
    max_staleness: int
    steps: int
    rollout_workers: int = 1
    partial_rollout: bool = False
    stream: bool = False
    slots: int | None = None  # rows a worker decodes at once in a stream (None: no limit)
    queue_capacity: int | None = None
    seed: int = 0


@dataclass
class SimResult:
    """What a simulated run did: throughput, lag, queue depth, idle fractions, and which groups each step trained."""

    time_s: float
    samples_per_s: float
    lag_mean: float
    lag_max: float
    queue_depth_mean: float
    queue_depth_max: float
    rollout_idle_fraction: float
    trainer_idle_fraction: float
    trained: list[list[int]] = field(default_factory=list)  # per step, the group numbers trained
    generated: list[int] = field(default_factory=list)  # group numbers in the order they finished
    step_end: list[float] = field(default_factory=list)  # when each step's sync ended
    interrupted: int = 0  # rows that spanned a weight update (partial rollouts)

    def steady_samples_per_s(self, samples_per_step: int, skip: int = 1) -> float:
        """Samples per second after the first `skip` steps (the pipeline filled), as a run's later steps show."""
        if len(self.step_end) <= skip:
            return self.samples_per_s
        start = self.step_end[skip - 1] if skip else 0.0
        return samples_per_step * (len(self.step_end) - skip) / (self.step_end[-1] - start)

    def summary(self) -> dict[str, float]:
        """The headline figures (no per-group lists)."""
        keys = ("samples_per_s", "time_s", "lag_mean", "lag_max", "queue_depth_mean", "queue_depth_max")
        figures = {k: getattr(self, k) for k in keys}
        return figures | {"rollout_idle": self.rollout_idle_fraction, "trainer_idle": self.trainer_idle_fraction}


@dataclass
class Row:
    """One reply being decoded: its group, length, where it started on its worker's token clock, its version."""

    group: int
    length: int
    start: float
    version: int


class Worker:
    """A rollout worker: rows decoding at once, a token clock (`mark`: token steps done), holds (prefill, sync)."""

    def __init__(self, profile: EngineProfile) -> None:
        self.p = profile
        self.rows: list[tuple[float, int, Row]] = []  # (finish mark, tie, row), a heap
        self.mark, self.last, self.hold, self.idle, self.epoch = 0.0, 0.0, 0.0, 0.0, 0
        self.versions: list[tuple[float, int]] = [(0.0, 0)]  # (mark, version from there on)
        self.backlog: deque[tuple[int, int]] = deque()  # (group, length) of rows waiting for a slot

    def advance(self, now: float) -> None:
        """Run the clock to `now`: token steps while not held, idle time while empty."""
        start = max(self.last, self.hold)
        if now > start:
            if self.rows:
                self.mark += (now - start) / self.p.decode_step_s(len(self.rows))
            else:
                self.idle += now - start
        self.last = max(self.last, now)

    def next_finish(self, now: float) -> float | None:
        """When the next row finishes at the current number of rows (None: no rows)."""
        if not self.rows:
            return None
        return max(now, self.hold) + max(self.rows[0][0] - self.mark, 0.0) * self.p.decode_step_s(len(self.rows))

    def hold_for(self, now: float, seconds: float) -> None:
        """Busy for `seconds` more from now (prefill, sync): no token steps meanwhile."""
        self.advance(now)
        self.hold = max(now, self.hold) + seconds

    def tokens_by_version(self, row: Row) -> tuple[dict[int, int], bool]:
        """A finished row's tokens per policy version (the versions its worker had while decoding it), and
        whether it spans a weight update."""
        out: dict[int, int] = {}
        end = row.start + row.length
        bounds = [(m, v) for m, v in self.versions if row.start < m < end]
        edges = [row.start, *(m for m, _ in bounds), end]
        versions = [row.version, *(v for _, v in bounds)]
        assigned = 0
        for i, version in enumerate(versions):
            n = row.length - assigned if i == len(versions) - 1 else round(edges[i + 1]) - round(edges[i])
            n = max(0, min(n, row.length - assigned))
            if n:
                out[version] = out.get(version, 0) + n
            assigned += n
        return out, len(bounds) > 0


class Simulation:
    """One simulated run (module docstring); `run()` returns its `SimResult`."""

    def __init__(self, profile: EngineProfile, cfg: SimConfig) -> None:
        if cfg.partial_rollout and not cfg.stream:
            raise ValueError("partial_rollout needs stream=True (flows/async_partial.py streams groups)")
        self.p, self.c = profile, cfg
        self.rng = random.Random(cfg.seed)
        self.queue = RolloutQueue(cfg.groups_per_step, cfg.max_staleness, cfg.queue_capacity)
        self.workers = [Worker(profile) for _ in range(cfg.rollout_workers)]
        self.events: list[tuple[float, int, str, int]] = []
        self.tie = itertools.count()
        self.total_groups = cfg.steps * cfg.groups_per_step
        self.pending: dict[int, list] = {}  # group -> [rows left, version tokens, lengths, interrupted]
        self.step_groups: dict[int, list[int]] = {}  # whole steps: step -> groups still decoding
        self.admitted_step, self.generated_step, self.generating = 0, 0, False
        self.capacity = self.queue.capacity
        self.ahead = min(cfg.max_staleness, self.capacity // cfg.groups_per_step)
        self.k, self.state, self.waiting_since, self.trainer_idle, self.draining = 1, "batch", 0.0, 0.0, False
        self.trained: list[list[int]] = []
        self.generated: list[int] = []
        self.lag_tokens = self.lag_sum = 0.0
        self.lag_max = 0.0
        self.depths: list[float] = []
        self.end = 0.0
        self.step_ends: list[float] = []
        self.interrupted = 0
        self.changed, self.room, self.admitted = True, 0, 0  # queue touched since last looked; admissible; started

    def schedule(self, at: float, kind: str, arg: int = 0) -> None:
        """An event at virtual time `at`."""
        heapq.heappush(self.events, (at, next(self.tie), kind, arg))

    def reschedule(self, wid: int, now: float) -> None:
        """Worker `wid`'s next row completion (older ones of it become stale)."""
        w = self.workers[wid]
        w.epoch += 1
        if (at := w.next_finish(now)) is not None:
            self.schedule(at, f"worker:{w.epoch}", wid)

    def start_group(self, group: int, wid: int, now: float) -> None:
        """Group `group`'s rows go to worker `wid` (lengths drawn now), and start as its slots allow."""
        w = self.workers[wid]
        w.backlog.extend((group, self.p.lengths.sample(self.rng)) for _ in range(self.c.samples_per_group))
        self.pending[group] = [self.c.samples_per_group, {}, [], 0]
        self.fill(wid, now)

    def fill(self, wid: int, now: float) -> None:
        """Start waiting rows on worker `wid` while it has free slots (prefill first), with the weights it has."""
        w = self.workers[wid]
        started = 0
        version = w.versions[-1][1]  # the queue's version, or the newer one during a sync
        while w.backlog and (self.c.slots is None or len(w.rows) < self.c.slots):
            group, length = w.backlog.popleft()
            heapq.heappush(w.rows, (w.mark + length, next(self.tie), Row(group, length, w.mark, version)))
            started += 1
        if started:
            w.hold_for(now, self.p.prefill_s * started)
        self.reschedule(wid, now)

    def admit(self, now: float) -> None:
        """Start what the queue admits now (whole steps, or groups into free slots)."""
        b, n = self.c.groups_per_step, self.c.samples_per_group
        if not self.c.stream:
            if self.generating or self.admitted_step >= self.c.steps or self.queue.admissible() < b:
                return
            first = self.queue.start(b)
            self.admitted_step += 1
            self.generating = True
            self.step_groups[self.admitted_step] = list(range(first, first + b))
            for g in range(first, first + b):
                self.start_group(g, (g - first) % len(self.workers), now)
            return
        if self.changed:  # the queue's admission changes only at a put, a take or a publish
            self.room = self.queue.admissible()
        while not self.draining and self.admitted < self.total_groups and self.room > 0:
            free = [
                (len(w.rows), i)
                for i, w in enumerate(self.workers)
                if self.c.slots is None or len(w.rows) + len(w.backlog) + n <= max(self.c.slots, n) or not w.rows
            ]
            if not free:
                return
            self.start_group(self.queue.start(1), min(free)[1], now)
            self.admitted += 1
            self.room -= 1  # both of the rule's terms fall by one group

    def finish_rows(self, wid: int, now: float) -> None:
        """Worker `wid` reached its next finish mark: its finished rows complete, groups go to the queue."""
        w = self.workers[wid]
        w.advance(now)
        w.mark = max(w.mark, w.rows[0][0])
        while w.rows and w.rows[0][0] <= w.mark + 1e-9:
            row = heapq.heappop(w.rows)[2]
            tokens, spans = w.tokens_by_version(row)
            left = self.pending[row.group]
            left[0] -= 1
            for v, t in tokens.items():
                left[1][v] = left[1].get(v, 0) + t
            left[2].append(row.length)
            left[3] += int(spans)
            self.interrupted += int(spans)
            if left[0] == 0:
                self.group_done(row.group, now)
        self.fill(wid, now)

    def group_done(self, group: int, now: float) -> None:
        """A group finished: queued at once (stream), or with the rest of its step (whole steps)."""
        rows, tokens, lengths, interrupted = self.pending[group]
        self.generated.append(group)
        if self.c.stream:
            del self.pending[group]
            self.queue.put(QueueItem(group, 1, tokens, lengths, interrupted=interrupted, finished_at=now))
            self.changed = True
            return
        step = self.admitted_step
        if any(self.pending[g][0] for g in self.step_groups[step]):
            return
        merged: dict[int, int] = {}
        all_lengths: list[int] = []
        for g in self.step_groups.pop(step):
            for v, t in self.pending[g][1].items():
                merged[v] = merged.get(v, 0) + t
            all_lengths.extend(self.pending.pop(g)[2])
        self.queue.put(QueueItem(step_first(step, self.c.groups_per_step), self.c.groups_per_step, merged,
                                 all_lengths, finished_at=now))  # fmt: skip
        self.generating, self.generated_step = False, step
        self.changed = True

    def trainer(self, now: float) -> bool:
        """Move the trainer on if it can (take its batch; start the sync); True if it did."""
        if self.state == "batch":
            batch = self.queue.take(self.k)
            if batch is None:
                return False
            self.trainer_idle += now - self.waiting_since
            self.record(batch.items, batch.metrics)
            tokens = sum(sum(item.lengths) for item in batch.items)
            self.state = "train"
            self.schedule(now + self.p.train_s(tokens), "trained")
            return True
        if self.state == "before_sync" and self.sync_ready():
            self.trainer_idle += now - self.waiting_since
            self.state = "sync"
            for wid, w in enumerate(self.workers):
                recompute = self.p.prefill_s * len(w.rows) if self.c.partial_rollout else 0.0
                w.hold_for(now, self.p.sync_s + recompute)
                w.versions.append((w.mark, self.k))
                self.reschedule(wid, now)
            self.schedule(now + self.p.sync_s, "synced")
            return True
        return False

    def sync_ready(self) -> bool:
        """Whether sync k may start: no generation may see its weights change (unless partial rollouts)."""
        if self.c.partial_rollout:
            return True
        if self.c.stream:
            return not any(w.rows or w.backlog for w in self.workers)
        return self.generated_step >= min(self.k + self.ahead, self.c.steps)

    def record(self, items: list[QueueItem], metrics: dict[str, float]) -> None:
        """A batch taken: its groups, lag and queue depth."""
        self.trained.append([g for item in items for g in range(item.first, item.first + item.groups)])
        tokens = metrics["async/tokens"]
        self.lag_tokens += tokens
        self.lag_sum += metrics["async/lag_mean"] * tokens
        self.lag_max = max(self.lag_max, metrics["async/lag_max"])
        self.depths.append(metrics["async/queue_depth"])

    def on_event(self, now: float, kind: str, arg: int) -> None:
        """Handle one event."""
        if kind.startswith("worker:"):
            if int(kind.split(":")[1]) == self.workers[arg].epoch:
                self.finish_rows(arg, now)
        elif kind in ("trained", "synced"):
            self.changed = True
        if kind == "trained":
            self.state, self.waiting_since = "before_sync", now
            self.draining = self.c.stream and not self.c.partial_rollout
        elif kind == "synced":
            self.queue.publish(self.k)
            self.draining = False
            self.end = now
            self.step_ends.append(now)
            self.k += 1
            self.state, self.waiting_since = "batch", now

    def run(self) -> SimResult:
        """Run until the last step's sync; the result."""
        now = 0.0
        self.admit(now)
        while self.k <= self.c.steps:
            while self.changed and self.trainer(now):
                pass
            self.admit(now)
            self.changed = False
            if not self.events:
                raise RuntimeError(f"simulation stuck at step {self.k} (state {self.state}) at t={now:.3f}")
            now, _, kind, arg = heapq.heappop(self.events)
            self.on_event(now, kind, arg)
        for w in self.workers:
            w.advance(self.end)
        rollout_idle = sum(min(w.idle, self.end) for w in self.workers) / (len(self.workers) * self.end)
        samples = self.c.steps * self.c.groups_per_step * self.c.samples_per_group
        return SimResult(
            time_s=self.end,
            samples_per_s=samples / self.end,
            lag_mean=self.lag_sum / max(self.lag_tokens, 1.0),
            lag_max=self.lag_max,
            queue_depth_mean=sum(self.depths) / len(self.depths),
            queue_depth_max=max(self.depths),
            rollout_idle_fraction=rollout_idle,
            trainer_idle_fraction=self.trainer_idle / self.end,
            trained=self.trained,
            generated=self.generated,
            step_end=self.step_ends,
            interrupted=self.interrupted,
        )


def step_first(step: int, groups_per_step: int) -> int:
    """The first group number of (1-based) step `step`."""
    return (step - 1) * groups_per_step


def simulate(profile: EngineProfile, cfg: SimConfig) -> SimResult:
    """Simulate `cfg.steps` steps of asynchronous training with these latencies (deterministic given cfg.seed)."""
    return Simulation(profile, cfg).run()
