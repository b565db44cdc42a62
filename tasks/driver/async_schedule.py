"""The schedule of an async run (`trainer.mode: async`, issue 52): every event that decides what the run computes,
in the order it happened, appended to `<run dir>/schedule.jsonl` (one JSON object a line, flushed and fsynced),
so that `rlstages replay` can impose the same order on a virtual clock (`tasks/driver/async_replay.py`).

Every line has `seq` (0, 1, 2, ...: the virtual clock), `kind` and `actor` (`rollout`: the generation thread,
`trainer`: the flow). Kinds (new ones may be added, e.g. an elastic fleet's `join` / `leave`; a reader skips
kinds it does not know only if it is told to):

    start    the feed (re)started: eta, partial, kv_on_update, groups per step, n, seeds, backend, start_step
    admit    prompt groups [first, first + groups) admitted by the queue, under rollout `version`
    pump     `calls` consecutive stream pumps of `steps` decode steps each; the groups they `finished`, in order
    put      step `step`'s groups [first, first + groups) finished and queued
    take     update `step` took its batch: `samples` [[group, member], ...] in row order (group g = prompt g mod B
             of step g // B + 1), `versions` each row's per-token policy versions as runs [[version, count], ...],
             `depth` the queue depth
    sync     before weight sync `version` (after update `version`): the rows `in_flight` [[group, member, tokens]]
             interrupted by it (partial rollouts; [] without)
    publish  the rollout engines have policy `version`; the queue admits what it allows
    hold     the flow used the rollout engines (`why`: evaluate) between two pumps
    end      the feed stopped

Writes happen under one lock together with the action they record (`atomic`), so the file's order is the order in
which the queue and the engines saw them. Non-goal: the rows themselves (they stay in the step directories).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rlstages.configs import RunConfig
from rlstages.engines.registry import rollout_backend
from rlstages.tasks.driver.async_replay import ReplayClock
from rlstages.tasks.driver.context import RunHandle, derive_seed

SCHEDULE = "schedule.jsonl"
FORMAT = 1
KINDS = ("start", "admit", "pump", "put", "take", "sync", "publish", "hold", "restart", "end")


class ScheduleError(ValueError):
    """A schedule file that cannot be replayed: names the file, the line and what was expected."""


class Schedule:
    """Appends events to a run's schedule file (module docstring); `atomic()` holds the writing lock around an
    action and its record. Consecutive pumps are kept in memory and written as one `pump` line before the next
    event (or at `close`)."""

    def __init__(self, path: Path, clock: ReplayClock | None = None) -> None:
        """Append to `path` (created if missing); `seq` continues after its last line. With a replay `clock`,
        every line written must equal the recorded line of the same `seq` (`ReplayClock.expect`)."""
        self.path, self.clock = path, clock
        self.lock = threading.RLock()
        self.seq = len(path.read_text().splitlines()) if path.is_file() else 0
        self._pumps: dict[str, Any] | None = None
        self._file = path.open("a", encoding="utf-8")

    @contextmanager
    def atomic(self) -> Iterator[Schedule]:
        """Hold the writing lock: an action done inside and its `record` are one step of the clock."""
        with self.lock:
            yield self

    def record(self, actor: str, kind: str, **fields: Any) -> None:
        """Append one event (and the pumps before it)."""
        with self.lock:
            self._flush_pumps()
            self._write({"kind": kind, "actor": actor, **fields})

    def pumped(self, steps: int, finished: list[int]) -> None:
        """One stream pump of `steps` decode steps that finished these groups (coalesced with the pumps before)."""
        with self.lock:
            if self._pumps is None or self._pumps["steps"] != steps:
                self._flush_pumps()
                self._pumps = {"kind": "pump", "actor": "rollout", "steps": steps, "calls": 0, "finished": []}
            self._pumps["calls"] += 1
            self._pumps["finished"] += finished

    def close(self) -> None:
        """Write what is pending and close the file."""
        with self.lock:
            self._flush_pumps()
            self._file.close()

    def _flush_pumps(self) -> None:
        if self._pumps is not None:
            pumps, self._pumps = self._pumps, None
            self._write(pumps)

    def _write(self, event: dict[str, Any]) -> None:
        event = json.loads(json.dumps({"seq": self.seq, **event}))  # as a reader will see it (lists, str keys)
        if self.clock is not None:
            self.clock.expect(event)
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.seq += 1


def open_schedule(cfg: RunConfig, run: RunHandle, start_step: int, ranks: int, pump_steps: int,
                  clock: ReplayClock | None = None) -> Schedule:  # fmt: skip
    """The run's schedule, its `start` event written: the settings and seeds that decide what it computes
    (generation seeds per step: derive_seed(seed, step, "generate"); a stream's per rank, recorded)."""
    a, seed = cfg.trainer.async_, cfg.trainer.seed
    schedule = Schedule(run.path / SCHEDULE, clock)
    schedule.record(
        "trainer",
        "start",
        format=FORMAT,
        start_step=start_step,
        eta=a.max_staleness,
        partial=a.partial_rollout,
        kv_on_update=a.kv_on_update,
        queue_capacity=a.queue_capacity,
        groups_per_step=cfg.data.prompts_per_step,
        n=cfg.rollout.n,
        total_steps=cfg.trainer.total_steps,
        backend=cfg.rollout.backend,
        bitwise_replay=rollout_backend(cfg.rollout.backend).bitwise_replay,
        pump_steps=pump_steps if a.partial_rollout else 0,
        seed=seed,
        stream_seeds=[derive_seed(seed, start_step + 1, f"stream-{r}") for r in range(ranks)]
        if a.partial_rollout
        else [],
    )
    return schedule


def row_runs(versions: torch.Tensor, mask: torch.Tensor) -> list[list[list[int]]]:
    """Each row's per-token policy versions (response tokens only) as runs [[version, count], ...]."""
    out = []
    for row, m in zip(versions.tolist(), mask.tolist(), strict=True):
        runs: list[list[int]] = []
        for v, keep in zip(row, m, strict=True):
            if not keep:
                continue
            if runs and runs[-1][0] == v:
                runs[-1][1] += 1
            else:
                runs.append([int(v), 1])
        out.append(runs)
    return out


def read_schedule(path: Path) -> list[dict[str, Any]]:
    """A schedule file's events, checked (`check_schedule`); ScheduleError names the file and the line."""
    if not path.is_file():
        raise ScheduleError(f"{path}: no schedule file (only runs with trainer.mode: async record one)")
    events = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ScheduleError(f"{path} line {i}: not JSON ({exc.msg})") from None
        if not isinstance(event, dict) or event.get("seq") != i - 1 or event.get("kind") not in KINDS:
            raise ScheduleError(f"{path} line {i}: expected {{'seq': {i - 1}, 'kind': one of {list(KINDS)}, ...}}")
        events.append(event)
    check_schedule(path, events)
    return events


def check_schedule(path: Path, events: list[dict[str, Any]]) -> None:
    """Refuse a schedule that cannot be replayed as one run: one `start` first, one `end` last, and every update's
    samples exactly the groups the queue gave it (B groups x n members, in order, each sample once)."""
    starts = [i for i, e in enumerate(events) if e["kind"] == "start"]
    if starts != [0]:
        where = f"line {starts[1] + 1}" if len(starts) > 1 else "line 1"
        raise ScheduleError(
            f"{path} {where}: expected exactly one 'start' event, first (a resumed or recovered run is not "
            "replayable: replay covers one uninterrupted run)"
        )
    if restart := next((i for i, e in enumerate(events) if e["kind"] == "restart"), None):
        raise ScheduleError(
            f"{path} line {restart + 1}: a rollout worker died and was restarted during this run; its timing is not "
            "reproducible, so the run is not replayable"
        )
    if events[-1]["kind"] != "end":
        raise ScheduleError(f"{path} line {len(events)}: the run did not end (no 'end' event): nothing to replay")
    head = events[0]
    b, n = int(head["groups_per_step"]), int(head["n"])
    for i, e in enumerate(events, 1):
        if e["kind"] != "take":
            continue
        step = int(e["step"])
        expected = [[g, m] for g in range((step - 1) * b, step * b) for m in range(n)]
        samples = e.get("samples", [])
        missing = [s for s in expected if s not in samples]
        if missing:
            raise ScheduleError(
                f"{path} line {i} (take, step {step}): sample {missing[0]} (group, member) missing; expected "
                f"groups {expected[0][0]}..{expected[-1][0]} x members 0..{n - 1}"
            )
        if samples != expected or len(e.get("versions", [])) != len(expected):
            raise ScheduleError(
                f"{path} line {i} (take, step {step}): expected samples {expected[0]}..{expected[-1]} in row "
                "order, each once, and one versions entry per sample"
            )
