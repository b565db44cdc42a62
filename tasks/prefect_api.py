"""The Prefect API when it is away for longer than its client's retries (PREFECT_CLIENT_MAX_RETRIES: 5 by
default, about a minute of backoff).

Prefect 3 reports task-run states as events (`emit_task_run_state_change_event`), sent by a background
worker whose websocket client keeps every unconfirmed event and sends them again, in order, on its next
connection: task states survive an outage by themselves. What does call the API from the flow's thread is
handled here: the run's artifacts (progress, evaluation tables, profiles) are best effort and skipped while
the API is known to be away, and the end of a run waits for the API before the flow returns, so the engine's
final state (Completed / Failed) gets through and the flow run does not stay Running.

Prefect's temporary server (a run with no PREFECT_API_URL) is a child of the run's process, so a signal to the run's
whole process group reaches it too: a Ctrl-C at the terminal, `timeout`, `kill -- -PGID`, a systemd unit's stop.
It stopped at once, and the run, stopping, could not record its Cancelled state and waited minutes on the API that
was gone. `start_temporary_server` starts it with SIGINT blocked, as Ray starts its own processes (the mask is
inherited across fork and exec; uvicorn's handlers do not unblock it), so a Ctrl-C is the run's alone; a SIGTERM
to the group still ends it (Prefect stops it with one), and `wait_until_answering` starts it again, on its port and
database, for the run to record its end.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from rlstages.engines.utils import start_in_thread

log = logging.getLogger("rlstages.prefect_api")
SKIP_FOR_S = 60.0  # after a failed call, later artifacts are skipped this long (each would block on retries)
_away_since: list[float] = []
_starting: list[Future[None]] = []  # a start of the temporary server begun in the background


def answering() -> bool:
    """Whether the Prefect API answers its health check now (Prefect's own client: its URL and auth; asked once,
    without the client's retries, so a caller's wait stays bounded)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}), get_client(sync_client=True) as client:
        return client.api_healthcheck() is None


def _temporary_server() -> Any:
    """Prefect's temporary server of this process (the instance its clients use), or None where PREFECT_API_URL
    names a server."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    return None if PREFECT_API_URL.value() else SubprocessASGIServer()


def start_temporary_server_in_background() -> None:
    """Begin `start_temporary_server` in a thread, so the server's ~3 s start overlaps the caller's own (Ray's,
    the model's build); the next `start_temporary_server` waits for it. Nothing where one would not start."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value() or _starting:  # the server's module (~2 s to import) is imported in the thread
        return
    _starting.append(start_in_thread(_start_now, "prefect-temporary-server"))  # in Prefect's settings context


def start_temporary_server() -> None:
    """Start the temporary server the run would start on its first API call, with SIGINT blocked in it; nothing
    where PREFECT_API_URL names a server or the temporary one runs. A start begun in the background is waited
    for (where it failed, the server is started here again, which raises its error)."""
    if _starting:
        try:
            _starting.pop().result()
        except Exception as exc:  # noqa: BLE001 - started again below: its own error, if it fails again, is raised
            log.warning(f"Prefect's temporary server did not start in the background ({exc}); starting it now")
    _start_now()


def _start_now() -> None:
    server = _temporary_server()
    if server is None or server.running:
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        server.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a Ctrl-C meanwhile is delivered here, now


def restart_temporary_server() -> bool:
    """Start the temporary server again where its process has ended (on its port and database, so the clients'
    address and the flow run's record still hold); True when it did."""
    server = _temporary_server()
    process = getattr(server, "server_process", None)
    if server is None or process is None or process.poll() is None:
        return False
    log.warning("Prefect's temporary server ended with the run's signal; starting it again to record the run's end")
    server.running = False
    start_temporary_server()
    return True


def wait_until_answering(timeout: float) -> bool:
    """Wait up to `timeout` seconds for the Prefect API (the flow run's final state is sent after this), starting
    the temporary server again where it has ended, before or during the wait (`restart_temporary_server`: a signal
    to the process group stops it slowly on a loaded machine); True when it answers."""
    restart_temporary_server()
    deadline = time.monotonic() + timeout
    said = False
    while not answering():
        if time.monotonic() >= deadline:
            log.warning(f"the Prefect API did not answer within {timeout:g} s; the flow run's final state is lost")
            return False
        if not said:
            log.warning("the Prefect API does not answer; waiting for it to report the flow run's final state")
            said = True
        time.sleep(1.0)
        restart_temporary_server()
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
