"""`trainer.mode: async` with `trainer.async.partial_rollout: true`: generation never waits for a weight update.

    generation thread:  admit groups (eta) -> submit -> pump a few decode steps -> finished groups -> a step's
                        batch complete: save it, queue.put                      (while the engines are not synced)
    flow (per step k):  queue.take(k) -> ... -> update -> hold the engines -> sync -> set_policy_version(k) ->
                        publish(k) -> release

Prompt groups are admitted one by one as the queue allows (every token they produce is trained within eta
versions; the queue checks it at every batch) and stream through the rollout engines' slots
(`engines/rollout/streaming.py`). The sync does not wait for them: it takes the engines between two pumps, the
rows in flight are interrupted, continue under the new weights (KV recomputed, or kept: `kv_on_update`), and a
trajectory spanning the update carries both versions, token by token. Which token gets which version depends on
when the syncs land, so two live partial-rollout runs differ; the schedule records where each sync landed (which
rows were in flight, with how many tokens) and every pump between, and `rlstages replay` re-executes those calls in
that order (`_follow`): the same tokens, the same versions, bit for bit on the HF backend on CPU.

A rollout worker that dies mid-stream (Ray, rollout workers of their own) does not stop the run: the other ranks go
on, and at the flow's next point where the trainer's weights are a known version -- waiting for a batch (the
engines' version), or just before a sync (the version about to be synced) -- a fresh worker takes the dead rank's
place, gets those weights (`tasks/fleet.push_weights`), and the groups the dead one had in flight are submitted to it
again (`_restart`). Their partial tokens are regenerated, not kept: they lived in the dead worker's memory (the
driver sees a group only when it finishes), so no checkpoint is reloaded and nothing is counted twice; the
regenerated tokens carry the fresh worker's (newer) version, so the lag bound still holds. A run with a restart
records it in the schedule (`restart`) and is not replayable (the death's timing is not reproducible).
"""

from __future__ import annotations

import threading
import time

from rlstages.configs import RunConfig
from rlstages.engines.registry import rollout_backend
from rlstages.engines.workers.elastic import replace_rank
from rlstages.flows.async_train import POLL_S, AsyncFeed
from rlstages.flows.stages import Metrics, Stages
from rlstages.tasks.driver.async_replay import ReplayClock, ReplayDiverged
from rlstages.tasks.driver.async_schedule import ScheduleError, read_schedule
from rlstages.tasks.driver.async_stream import FinishedGroup, Streams
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.faults import maybe_fail
from rlstages.tasks.driver.workers import get_workers
from rlstages.tasks.fleet import elastic, joiner_id, push_weights
from rlstages.tasks.policies import WorkerLost, stage_logger
from rlstages.tasks.rollout import sampling
from rlstages.tasks.stage_workers import stage_workers

PUMP_STEPS = 4  # decode steps per pump: how long a sync may wait for the engines


class PartialFeed(AsyncFeed):
    """The async feed with partial rollouts (module docstring): groups streamed, syncs between two pumps."""

    elastic_fleet = False  # the streams are per rank: a fixed fleet (a lost worker: the flow's recovery)
    PUMP_STEPS = PUMP_STEPS

    def __init__(
        self, s: Stages, cfg: RunConfig, run: RunHandle, start_step: int, clock: ReplayClock | None = None
    ) -> None:
        """Start the rollout streams at the checkpoint's version, then generation (`AsyncFeed`)."""
        rollout = stage_workers(cfg, run, "generate").rollout
        dead = (WorkerLost,) if elastic(cfg) and clock is None else ()  # Ray, rollout workers of their own: restart
        self.streams = Streams(cfg, run, rollout, sampling(cfg), start_step, dead)
        self.wanted = threading.Event()  # the flow waits for the engines: generation steps aside
        self.holding = False  # the flow holds the engines (between before_sync and synced)
        self.finished: dict[int, list[FinishedGroup]] = {}
        self.started: dict[int, float] = {}
        self.unused_s = 0.0  # time the engines had nothing to decode (waiting for admission) since the last batch
        super().__init__(s, cfg, run, start_step, clock)

    def _ranks(self) -> int:
        return self.streams.ranks

    def _produce(self, first_step: int) -> None:
        """Admit, submit and pump until every step's groups have been queued."""
        if self.clock is not None:
            return self._follow()
        b = self.groups
        next_group, end, flying = (first_step - 1) * b, self.total * b, 0
        try:
            while not self.stopping.is_set():
                if self.wanted.is_set() or not self.engines.acquire(timeout=POLL_S):
                    time.sleep(POLL_S / 4)
                    continue
                try:
                    admit = min(self.queue.admissible(), end - next_group)
                    with self.schedule.atomic():
                        groups = [self.queue.start(1) for _ in range(admit)]
                        if groups:
                            version = self.queue.state()["version"]
                            self.schedule.record("rollout", "admit", first=groups[0], groups=admit, version=version)
                    assert groups == list(range(next_group, next_group + admit)), groups
                    for g in groups:
                        self.started.setdefault(g // b + 1, time.perf_counter())
                    if groups:
                        self.streams.submit(groups)
                        self._faults(groups)
                    next_group, flying = next_group + admit, flying + admit
                    done = self.streams.pump(PUMP_STEPS) if flying else []
                    if flying:
                        self.schedule.pumped(PUMP_STEPS, [g.group for g in done])
                finally:
                    self.engines.release()
                flying -= len(done)
                for group in done:
                    self._collect(group)
                if self.streams.lost:  # the flow restarts the dead ranks at its next safe point
                    self.stopping.wait(POLL_S)
                if not flying and next_group >= end:
                    return
                if not flying and not groups:  # nothing to decode until the queue admits more
                    start = time.perf_counter()
                    self.stopping.wait(POLL_S)
                    self.unused_s += time.perf_counter() - start
        except BaseException as exc:  # the flow raises it at its next wait (a WorkerLost replays as usual)
            with self.changed:
                self.error = exc
                self.changed.notify_all()

    def _faults(self, groups: list[int]) -> None:
        """`RLSTAGES_FAULTS` for `generate@N`, once step N's first group is streaming (tests: a rollout worker
        killed mid-stream, `kill-rollout`)."""
        for g in groups:
            if g % self.groups == 0:
                maybe_fail(self.run, "generate", g // self.groups + 1, get_workers(self.run))

    def _follow(self) -> None:
        """Replay: admit and pump exactly as the schedule recorded, each at its turn (the syncs take theirs)."""
        assert self.clock is not None
        try:
            while (event := self.clock.peek("rollout")) is not None:
                done: list[FinishedGroup] = []
                if event["kind"] == "admit":
                    with self._turn("rollout", "admit"), self.engines, self.schedule.atomic():
                        groups = [self.queue.start(1) for _ in range(int(event["groups"]))]
                        version = self.queue.state()["version"]
                        self.schedule.record("rollout", "admit", first=groups[0], groups=len(groups), version=version)
                        for g in groups:
                            self.started.setdefault(g // self.groups + 1, time.perf_counter())
                        self.streams.submit(groups)
                elif event["kind"] == "pump":
                    with self._turn("rollout", "pump"), self.engines:
                        for _ in range(int(event["calls"])):
                            finished = self.streams.pump(int(event["steps"]))
                            self.schedule.pumped(int(event["steps"]), [g.group for g in finished])
                            done += finished
                else:
                    raise ReplayDiverged(f"{self.clock.path} line {event['seq'] + 1}: a {event['kind']!r} comes "
                                         "before the pump that should lead to it")  # fmt: skip
                for group in done:
                    self._collect(group)
        except BaseException as exc:  # the flow raises it at its next wait
            with self.changed:
                self.error = exc
                self.changed.notify_all()

    def _collect(self, group: FinishedGroup) -> None:
        """A finished group; its step's batch saved and queued once all of the step's groups have finished."""
        step = group.group // self.groups + 1
        self.finished.setdefault(step, []).append(group)
        if len(self.finished[step]) < self.groups:
            return
        self.idle[step], self.unused_s = self.unused_s, 0.0  # engines empty since the last batch was queued
        self._put(self.streams.assemble(step, self.finished.pop(step), self.started.pop(step)), step)
        with self.changed:
            self.generated = max(self.generated, step)
            self.changed.notify_all()

    def _hold(self) -> None:
        self.wanted.set()
        while not self.engines.acquire(timeout=POLL_S):
            self._raise()
        self.wanted.clear()
        self.holding = True

    def _let_go(self) -> None:
        if self.holding:
            self.holding = False
            self.engines.release()

    def _tend(self, version: int) -> None:
        """Waiting for a batch (the trainer's weights are the engines' `version`): restart lost ranks."""
        if self.streams.lost:
            self._hold()
            try:
                self._restart(version)
            finally:
                self._let_go()

    def _restart(self, version: int) -> None:
        """The engines held, the trainer's weights policy `version`: a fresh worker in every lost rank's place,
        with those weights, its groups in flight submitted again (module docstring); recorded as `restart`."""
        group = get_workers(self.run).rollout
        timeout = float(self.cfg.cluster.rendezvous_timeout_seconds)
        for rank in sorted(self.streams.lost):
            try:
                handle = replace_rank(group, rank, joiner_id(), timeout)
                push_weights(self.cfg, self.run, handle, version)
                again = self.streams.restarted(rank, version)
            except Exception as exc:  # no fresh worker: the flow's recovery (rebuild from the last checkpoint)
                raise WorkerLost(f"rollout rank {rank} died mid-stream and could not be restarted: {exc}") from exc
            self.schedule.record("trainer", "restart", rank=rank, version=version, resubmitted=again)
            stage_logger().warning(f"rollout rank {rank} died mid-stream: restarted with policy {version}, "
                                   f"{len(again)} prompt groups submitted again")  # fmt: skip

    def before_sync(self, step: int) -> Metrics:
        """Take the engines between two pumps (the rows in flight wait, they are not finished first), restart lost
        ranks (with the weights about to be synced); the rows in flight, interrupted by this sync, recorded with
        their token counts."""
        start = time.perf_counter()
        with self._turn("trainer", "sync"):
            self._hold()
            if self.streams.lost:
                self._restart(step)
            self.schedule.record("trainer", "sync", version=step, in_flight=self.streams.in_flight())
        waited = time.perf_counter() - start
        self.waited += waited
        return {"timing/wait_generation_s": waited}

    def synced(self, step: int, step_s: float) -> Metrics:
        """The engines have policy `step`: the interrupted rows continue under it; admit what it allows."""
        try:
            self.streams.updated(step)
        finally:
            self._let_go()
        return super().synced(step, step_s)

    def _take_engines(self) -> None:
        self._hold()

    def _free_engines(self) -> None:
        self._let_go()

    def close(self, wait: bool = True) -> None:
        """Stop generating, drop the streams (what was in flight is generated again by the next feed)."""
        self.stopping.set()
        self._let_go()
        if wait:
            self.thread.join()
            self.streams.stop()
        self._end_schedule(wait)
        self.queue.kill()


def start_feed(s: Stages, cfg: RunConfig, run: RunHandle, start_step: int) -> AsyncFeed | None:
    """The async feed of `trainer.mode: async` (None in the other modes): with partial rollouts the streaming one
    above, else whole-step generation (flows/async_train.py)."""
    if cfg.trainer.mode != "async":
        return None
    clock = None
    if (path := cfg.trainer.async_.replay) is not None:  # `rlstages replay`: the recorded order, not the clock's
        clock = ReplayClock(path, read_schedule(path), rollout_backend(cfg.rollout.backend).bitwise_replay)
        if clock.events[0]["start_step"] != start_step:
            raise ScheduleError(f"{path} line 1: the run started after step {clock.events[0]['start_step']}, "
                                f"this one after {start_step}: replay needs the same start")  # fmt: skip
    if cfg.trainer.async_.partial_rollout:
        return PartialFeed(s, cfg, run, start_step, clock)
    return AsyncFeed(s, cfg, run, start_step, clock)
