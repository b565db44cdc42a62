"""The virtual clock of `rlstages replay` (issue 52): a recorded schedule (`tasks/driver/async_schedule.py`) turned
into turns, so that the replayed run's generation thread and flow act on the queue and the engines in exactly the
recorded order, whatever the real latencies.

    with clock.turn("trainer", "take", check) as event:   # waits until every event before it was replayed
        ...do what the event records...                      # (the replayed run records it again, see `expect`)

Each actor (rollout, trainer) walks its own events in order; asking for a kind other than its next one means the
replay diverged (ReplayDiverged, naming the file and the line). The replayed run writes its own schedule, and each
line it writes is compared with the recorded line of the same `seq` (`expect`): same events, same samples, same
per-token versions, same interrupt points, or it stops. On an engine that is not bitwise-stable (`bitwise=False`:
vLLM's batching), the tokens and so the lengths may differ: there the comparison drops the token counts (each
row's sequence of versions, the interrupted rows and the finished groups must still match).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

POLL_S = 0.02


class ReplayDiverged(RuntimeError):
    """The replayed run did something the schedule did not record (or in another order)."""


class ReplayClock:
    """Turns over a recorded schedule's events (module docstring)."""

    def __init__(self, path: Path, events: list[dict[str, Any]], bitwise: bool = True) -> None:
        """`events` as `read_schedule(path)` returned them (checked); `bitwise`: compare token counts too."""
        self.path, self.events, self.bitwise = path, events, bitwise
        self.cursor = 0
        self.mine: dict[str, list[int]] = {}
        for i, e in enumerate(events):
            self.mine.setdefault(e["actor"], []).append(i)
        self.next: dict[str, int] = dict.fromkeys(self.mine, 0)
        self.changed = threading.Condition()

    def peek(self, actor: str) -> dict[str, Any] | None:
        """`actor`'s next recorded event (None when it has none left)."""
        own, at = self.mine.get(actor, []), self.next.get(actor, 0)
        return self.events[own[at]] if at < len(own) else None

    @contextmanager
    def turn(self, actor: str, kind: str, check: Callable[[], None] = lambda: None) -> Iterator[dict[str, Any]]:
        """Wait until `actor`'s next event (which must be a `kind`) is the clock's, yield it; the clock moves on
        when the block ends. `check` runs while waiting (raise there to stop: the other side failed)."""
        event = self.peek(actor)
        if event is None or event["kind"] != kind:
            got = "nothing" if event is None else f"line {event['seq'] + 1} ({event['kind']})"
            raise ReplayDiverged(f"{self.path}: the replay's {actor} did a {kind!r} where the schedule has {got}")
        with self.changed:
            while self.cursor != event["seq"]:
                check()
                self.changed.wait(POLL_S)
        try:
            yield event
        finally:
            with self.changed:
                self.cursor = event["seq"] + 1
                self.next[actor] += 1
                self.changed.notify_all()

    def expect(self, event: dict[str, Any]) -> None:
        """The replayed run wrote `event`: refuse it unless it is the recorded line of the same `seq`."""
        seq = event["seq"]
        recorded = self.events[seq] if seq < len(self.events) else None
        if recorded is not None and not self.bitwise:
            event, recorded = schedule_only(event), schedule_only(recorded)
        if recorded != event:
            fields = sorted(k for k in set(event) | set(recorded or {}) if (recorded or {}).get(k) != event.get(k))
            raise ReplayDiverged(
                f"{self.path} line {seq + 1}: the replay wrote {summary(event, fields)} where the schedule has "
                f"{summary(recorded, fields) if recorded else 'nothing'}"
            )


def schedule_only(event: dict[str, Any]) -> dict[str, Any]:
    """An event without its token counts (what a non-bitwise engine cannot reproduce): each row's versions as
    the sequence of versions only, interrupted rows without their token counts."""
    out = dict(event)
    if "versions" in out:
        out["versions"] = [[v for v, _ in runs] for runs in out["versions"]]
    if "in_flight" in out:
        out["in_flight"] = [row[:2] for row in out["in_flight"]]
    return out


def summary(event: dict[str, Any], fields: list[str]) -> str:
    """An event's kind and the named fields, shortened (error messages)."""
    parts = [f"{k}={str(event.get(k))[:80]}" for k in fields[:3]]
    return f"{event.get('kind')} ({', '.join(parts)})"
