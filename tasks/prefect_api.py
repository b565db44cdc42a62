"""The Prefect API when it is away for longer than its client's retries (PREFECT_CLIENT_MAX_RETRIES: 5 by
default, about a minute of backoff).

Prefect 3 reports task-run states as events (`emit_task_run_state_change_event`), sent by a background
worker whose websocket client keeps every unconfirmed event and sends them again, in order, on its next
connection: task states survive an outage by themselves. What does call the API from the flow's thread is
handled here: the run's artifacts (progress, evaluation tables, profiles) are best effort and skipped while
the API is known to be away, and the end of a run waits for the API before the flow returns, so the engine's
final state (Completed / Failed) gets through and the flow run does not stay Running.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rlstages.prefect_api")
SKIP_FOR_S = 60.0  # after a failed call, later artifacts are skipped this long (each would block on retries)
_away_since: list[float] = []


def answering() -> bool:
    """Whether the Prefect API answers its health check now (Prefect's own client: its URL and auth; asked once,
    without the client's retries, so a caller's wait stays bounded)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}), get_client(sync_client=True) as client:
        return client.api_healthcheck() is None


def wait_until_answering(timeout: float) -> bool:
    """Wait up to `timeout` seconds for the Prefect API (the flow run's final state is sent after this); True
    when it answers."""
    deadline = time.monotonic() + timeout
    said = False
    while not answering():
        if time.monotonic() >= deadline:
            log.warning(f"the Prefect API did not answer within {timeout:g} s; the flow run's final state is lost")
            return False
        if not said:
            log.warning("the Prefect API does not answer; waiting for it to report the flow run's final state")
            said = True
        time.sleep(2.0)
    _away_since.clear()
    return True


def best_effort(call: Callable[[], Any], what: str) -> Any:
    """Run a Prefect API call that must never stop training (an artifact); None when the API is away."""
    if _away_since and time.monotonic() - _away_since[-1] < SKIP_FOR_S:
        return None
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - any client error: the run goes on without this artifact
        _away_since[:] = [time.monotonic()]
        log.warning(f"Prefect API: {what} not recorded ({type(exc).__name__}: {str(exc)[:200]}); training goes on")
        return None
    _away_since.clear()
    return result
