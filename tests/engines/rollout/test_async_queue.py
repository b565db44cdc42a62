"""The asynchronous rollout queue (engines/rollout/async_queue.py) under fake engines: several rollout workers of
different speeds generating groups of long-tailed (Pareto) lengths on a virtual clock, a trainer of random update
times, with and without partial rollouts (tokens stamped with the version current when each was generated). For
every seed and eta: no token lags more than eta, every group is trained exactly once, and the lengths trained are
the lengths generated; the bound is reached (the test can see a violation), and a broken admission is refused
loudly. One run with real threads covers the lock. CPU, seconds."""

from __future__ import annotations

import bisect
import heapq
import random
import threading
import time
from collections import Counter

import pytest

from rlstages.engines.rollout.async_queue import QueueItem, RolloutQueue, StalenessViolation, lag_metrics


def simulate(seed: int, eta: int, partial: bool, b: int = 4, steps: int = 12, workers: int = 3) -> dict:
    """One run on a virtual clock; returns what was generated, what was trained and the batches' metrics."""
    rng = random.Random(seed)
    queue = RolloutQueue(b, eta)
    speed = [rng.uniform(0.5, 2.0) for _ in range(workers)]  # time per token of each worker
    times, versions = [0.0], [0]  # version history of the rollout engines
    events: list[tuple[float, int, str, tuple]] = [(0.0, i, "free", (w,)) for i, w in enumerate(range(workers))]
    heapq.heapify(events)
    order, idle, generated, finished, trained, metrics = workers, set(), {}, [], [], []
    state = {"step": 1, "busy": False}

    def push(t: float, kind: str, data: tuple) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind, data))

    def version_at(t: float) -> int:
        return versions[bisect.bisect_right(times, t) - 1]

    def trainer_try(t: float) -> None:
        if state["busy"] or state["step"] > steps:
            return
        batch = queue.take(state["step"])
        if batch is None:
            return
        trained.extend((item.first, length) for item in batch.items for length in item.lengths)
        metrics.append(batch.metrics)
        state["busy"] = True
        push(t + rng.uniform(1.0, 40.0), "updated", (state["step"],))
        state["step"] += 1

    while events:
        t, _, kind, data = heapq.heappop(events)
        if kind == "free":
            (w,) = data
            if queue.state()["admitted"] < steps * b and queue.admissible() > 0:
                first = queue.start(1)
                length = min(int(rng.paretovariate(1.2) * 4), 200)  # long-tailed reply lengths
                generated[first] = length
                push(t + length * speed[w], "done", (w, first, length, t))
            else:
                idle.add(w)
        elif kind == "done":
            w, first, length, t0 = data
            stamps = [version_at(t0 + (i + 1) * speed[w]) if partial else version_at(t0) for i in range(length)]
            interrupted = int(len(set(stamps)) > 1)
            queue.put(QueueItem(first, 1, dict(Counter(stamps)), [length], interrupted=interrupted))
            finished.append(first)
            push(t, "free", (w,))
            trainer_try(t)
        else:  # the update of step k finished and its weights reached the rollout engines
            (k,) = data
            queue.publish(k)
            times.append(t)
            versions.append(k)
            state["busy"] = False
            for w in sorted(idle):
                push(t, "free", (w,))
            idle.clear()
            trainer_try(t)
    return {"generated": generated, "finished": finished, "trained": trained, "metrics": metrics, "queue": queue}


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_lag_bounded_nothing_lost_nothing_twice(eta: int, partial: bool) -> None:
    worst, out_of_order, mixed = 0, False, 0
    for seed in range(12):
        run = simulate(seed, eta, partial)
        assert len(run["metrics"]) == 12  # the run completes
        trained_ids = [first for first, _ in run["trained"]]
        assert trained_ids == list(range(48))  # each group once, batches in admission order
        assert sorted(length for _, length in run["trained"]) == sorted(run["generated"].values())
        assert all(m["async/lag_max"] <= eta for m in run["metrics"])
        assert all(abs(sum(m[f"async/lag_hist/{lag}"] for lag in range(eta + 1)) - 1) < 1e-9 for m in run["metrics"])
        worst = max(worst, *(m["async/lag_max"] for m in run["metrics"]))
        out_of_order |= run["finished"] != sorted(run["finished"])
        mixed += sum(m["async/interrupted_sequences"] for m in run["metrics"])
        assert run["queue"].state() == {"version": 12, "admitted": 48, "consumed": 48, "running": 0, "queued": 0}
    assert worst == eta  # the bound is reached: a lag one higher would have been seen
    assert out_of_order  # groups finished out of admission order, and still trained in it
    assert (mixed > 0) == (partial and eta > 0)  # partial rollouts give mixed-version sequences


def test_eta_zero_is_synchronous() -> None:
    """eta 0: a group starts only once the weights it will be trained against are in the rollout engines."""
    queue = RolloutQueue(groups_per_step=2, max_staleness=0)
    assert queue.admissible() == 2
    queue.start(2)
    assert queue.admissible() == 0
    queue.put(QueueItem(0, 2, {0: 10}, [4, 6]))
    assert queue.admissible() == 0  # finished, not yet trained: step 2's prompts wait for version 1
    batch = queue.take(1)
    assert batch is not None and batch.metrics["async/lag_max"] == 0 and queue.admissible() == 0
    queue.publish(1)
    assert queue.admissible() == 2


def test_a_broken_admission_is_refused_loudly() -> None:
    """Tokens two versions old in a run with eta 1 stop the update (the check is not a metric only)."""
    with pytest.raises(StalenessViolation, match="max 2 > eta=1"):
        lag_metrics([QueueItem(0, 1, {0: 5, 2: 3})], trainer_version=2, eta=1)
    queue = RolloutQueue(groups_per_step=1, max_staleness=1)
    with pytest.raises(ValueError, match="cannot start 3 groups"):
        queue.start(3)
    queue.start(1)
    queue.put(QueueItem(0, 1, {0: 1}))
    with pytest.raises(ValueError, match="put twice"):
        queue.put(QueueItem(0, 1, {0: 1}))


def test_threads() -> None:
    """Three generating threads and a training thread on a real clock: the same properties under the lock."""
    queue, b, steps, eta = RolloutQueue(3, 1), 3, 6, 1
    generated, trained, lags = [], [], []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while queue.state()["admitted"] < b * steps:
            try:
                first = queue.start(1)
            except ValueError:
                time.sleep(0.001)
                continue
            version, length = queue.state()["version"], rng.randint(1, 30)
            time.sleep(length * 2e-4)
            with lock:
                generated.append(length)
            queue.put(QueueItem(first, 1, {version: length}, [length]))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for th in threads:
        th.start()
    for step in range(1, steps + 1):
        while (batch := queue.take(step)) is None:
            time.sleep(0.001)
        trained.extend(length for item in batch.items for length in item.lengths)
        lags.append(batch.metrics["async/lag_max"])
        time.sleep(0.005)
        queue.publish(step)
    for th in threads:
        th.join(timeout=10)
    assert sorted(trained) == sorted(generated) and len(trained) == b * steps and max(lags) <= eta
