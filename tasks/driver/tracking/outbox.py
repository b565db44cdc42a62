"""The outbox: a background thread that sends the journal (`journal.Journal`) to MLflow in order, so an MLflow
server gone for longer than its client's retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES, ..._BACKOFF_FACTOR,
..._TIMEOUT) stops nothing: training keeps journaling, the thread tries again with its own backoff and sends
the backlog, oldest first, once the server answers.

Exactly once: an entry is marked `attempted` before its request and `sent` after; an `attempted` metrics entry
(the server may have stored it before the connection dropped) is looked up in the metric's history (same step,
same timestamp) and sent only if it is not there. Tags, tables, artifacts and the run's end are idempotent.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag
from mlflow.exceptions import RestException

from rlstages.tasks.driver.tracking.journal import Entry, Journal

log = logging.getLogger("rlstages.tracking")
MAX_BACKOFF_S = 15.0


def rejected(exc: BaseException) -> bool:
    """Whether the server answered and refused the call (4xx: sending it again cannot help); anything else
    (refused connection, timeout, 5xx after the client's retries) means the server is away: try later."""
    if isinstance(exc, RestException):
        code = exc.get_http_status_code()
        return 400 <= code < 500 and code not in (408, 429)
    return False


class Outbox:
    """Sends one run directory's journal to the tracking URI from a daemon thread."""

    def __init__(self, journal: Journal, uri: str) -> None:
        self.journal, self.uri = journal, uri
        self.client = MlflowClient(tracking_uri=uri)
        self.down_since: float | None = None  # when the first failed send of the current outage happened
        self.last_error = ""
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="rlstages-tracking-outbox", daemon=True)
        self._thread.start()

    def post(self, run_id: str, kind: str, payload: dict[str, Any], step: int | None = None) -> None:
        """Journal a call (durably, now) and wake the sender."""
        self.journal.append(run_id, kind, payload, step)
        self._wake.set()

    def flush(self, timeout: float, while_down: bool = True) -> int:
        """Wait until everything journaled is sent, at most `timeout` seconds (with `while_down=False`, stop
        waiting as soon as a send has failed: the server is away). Returns how many entries are still unsent."""
        deadline = time.monotonic() + timeout
        self._wake.set()
        while True:
            unsent = self.journal.count_unsent()
            if unsent == 0 or time.monotonic() >= deadline or (not while_down and self.down_since is not None):
                return unsent
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the sender thread (what is unsent stays journaled for the next run)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        failures = 0
        while not self._stop:
            if self._send_all():
                failures = 0
                self._wake.wait()
            else:
                failures += 1
                self._wake.wait(min(MAX_BACKOFF_S, 0.5 * 2**failures))
            self._wake.clear()

    def _send_all(self) -> bool:
        """Send every unsent entry in order; False when the server is away (the rest waits)."""
        while not self._stop:
            batch = self.journal.unsent()
            if not batch:
                if self.down_since is not None:
                    log.warning(f"MLflow at {self.uri} answers again; the journaled backlog is sent")
                self.down_since = None
                return True
            for entry in batch:
                try:
                    self._send(entry)
                except Exception as exc:  # noqa: BLE001 - classified below; the thread must never die
                    if rejected(exc):
                        log.warning(f"MLflow refused a journaled {entry.kind} call (kept, not resent): {exc}")
                        self.journal.mark(entry, "rejected")
                        continue
                    if self.down_since is None:
                        self.down_since = time.monotonic()
                        log.warning(
                            f"MLflow at {self.uri} does not answer ({type(exc).__name__}); training goes on, "
                            f"tracking is journaled in {self.journal.dir} and sent when it answers"
                        )
                    self.last_error = f"{type(exc).__name__}: {exc}"[:500]
                    return False
                self.journal.mark(entry, "sent")
        return True

    def _send(self, e: Entry) -> None:
        c, p = self.client, e.payload
        if e.kind in ("metrics", "eval"):
            if e.state == "attempted" and self._stored(e):
                return
            self.journal.mark(e, "attempted")
            c.log_batch(e.run_id, metrics=[Metric(k, v, ts, step) for k, v, ts, step in p["metrics"]])
        elif e.kind == "tags":
            c.log_batch(e.run_id, tags=[RunTag(k, v) for k, v in p["tags"].items()])
        elif e.kind == "table":
            c.log_table(e.run_id, data=p["data"], artifact_file=p["artifact_file"])
        elif e.kind == "artifact":
            path = Path(p["path"])
            if path.is_dir():
                c.log_artifacts(e.run_id, str(path), p["dir"])
            elif path.exists():
                c.log_artifact(e.run_id, str(path), p["dir"])
        elif e.kind == "terminate":
            c.set_terminated(e.run_id, status=p["status"], end_time=p["end_time"])
        else:
            raise ValueError(f"unknown journal entry kind {e.kind!r}")

    def _stored(self, e: Entry) -> bool:
        """Whether the server already holds an attempted metrics entry (its first metric at that step and time)."""
        key, _, ts, step = e.payload["metrics"][0]
        return any(m.step == step and m.timestamp == ts for m in self.client.get_metric_history(e.run_id, key))


_OPEN: dict[str, Outbox] = {}
_ENDED: dict[str, Journal] = {}  # journals of runs whose outbox stopped: still read (plots, the summary)


def open_outbox(run_id: str, run_dir: Path, uri: str) -> Outbox:
    """The outbox of `run_id`'s journal in `run_dir` (one per run and process; reopened by a resumed run)."""
    box = _OPEN.get(run_id)
    if box is None or box.journal.dir != run_dir / "tracking" or box.uri != uri:
        if box is not None:
            box.close()
        ended = _ENDED.pop(run_id, None)
        journal = ended if ended is not None and ended.dir == run_dir / "tracking" else Journal(run_dir)
        box = _OPEN[run_id] = Outbox(journal, uri)
    return box


def outbox_of(run_id: str) -> Outbox | None:
    """The open outbox of a run, None when the run logs directly (no run directory given) or has ended."""
    return _OPEN.get(run_id)


def journal_of(run_id: str) -> Journal | None:
    """The journal of a run started in this process (open or ended), for reading."""
    box = _OPEN.get(run_id)
    return box.journal if box is not None else _ENDED.get(run_id)


def close_outbox(run_id: str) -> None:
    """Stop a run's sender thread (what is unsent stays journaled; the journal stays readable)."""
    box = _OPEN.pop(run_id, None)
    if box is not None:
        box.close()
        _ENDED[run_id] = box.journal
