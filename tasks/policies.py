"""Retry and timeout policy of the stage tasks: which failures are worth a retry, and how the flow learns
that a worker died.

Transient faults (timeouts, lost connections, transient I/O) are retried in place with exponential
backoff and jitter. A dead Ray worker is not: its state is gone, so the stage raises `WorkerLost` and the
flow rebuilds the workers from the last committed checkpoint and replays. Config, shape and programming
errors are never retried.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from rlstages.configs.stages import StagePolicy

F = TypeVar("F")


class WorkerLost(RuntimeError):
    """A Ray worker died mid-stage; the flow restores the last checkpoint and replays from there."""


_NEVER = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    AssertionError,
    NotImplementedError,
    ImportError,
    FileNotFoundError,
    PermissionError,
)
_TRANSIENT_ERRNO = {errno.EAGAIN, errno.EBUSY, errno.ECONNRESET, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EIO}


def is_transient(exc: BaseException | None) -> bool:
    """True for failures a retry can fix: timeouts, connection loss, transient I/O, Ray object loss."""
    if exc is None or isinstance(exc, WorkerLost):
        return False
    cause = root_cause(exc)
    if isinstance(cause, TimeoutError | ConnectionError):
        return True
    if isinstance(cause, _NEVER):
        return False
    if isinstance(cause, OSError):
        return cause.errno in _TRANSIENT_ERRNO or cause.errno is None
    name = type(cause).__name__
    return name in {"GetTimeoutError", "ObjectLostError", "RaySystemError", "OwnerDiedError", "TransientError"}


def root_cause(exc: BaseException) -> BaseException:
    """The user exception inside a RayTaskError, else the exception itself."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def is_worker_death(exc: BaseException) -> bool:
    """True when a Ray actor died (its process is gone), as opposed to raising."""
    return type(exc).__name__ in {"RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError"}


def stage_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The Prefect run logger of the current task or flow run (shown in the UI), else a plain logger."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("rlstages")


def retry_condition(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: retry only transient faults (and say which it was in the run log)."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - we classify whatever the stage raised
        transient = is_transient(exc)
        verdict = "transient: retried" if transient else "not transient: not retried"
        if isinstance(exc, WorkerLost):
            verdict = "worker lost: the flow recovers from the last checkpoint"
        stage_logger().warning(f"{task_run.name} failed ({type(exc).__name__}: {exc}); {verdict}")
        return transient
    return False


_FAILED_STAGE: dict[str, str] = {}


def record_failure(task: Any, task_run: Any, state: Any) -> None:
    """Prefect `on_failure` hook: remember which stage failed last in this flow run (for the MLflow tags)."""
    _FAILED_STAGE[str(task_run.flow_run_id)] = task.name


def failed_stage(flow_run_id: str | None) -> str | None:
    """The stage whose failure ended this flow run, if a stage failed."""
    return _FAILED_STAGE.get(str(flow_run_id)) if flow_run_id else None


def backoff_delays(policy: StagePolicy) -> list[float]:
    """One delay per retry: delay x factor^i."""
    return [policy.retry_delay_seconds * policy.backoff_factor**i for i in range(policy.retries)]


def with_policy(stage: F, policy: StagePolicy) -> F:
    """A copy of a Prefect task carrying the stage's retries, backoff, jitter, timeout and retry condition."""
    options: dict[str, Any] = {
        "retries": policy.retries,
        "retry_delay_seconds": backoff_delays(policy) or 0,
        "retry_jitter_factor": policy.jitter_factor or None,
        "timeout_seconds": policy.timeout_seconds,
        "retry_condition_fn": retry_condition,
        "on_failure": [record_failure],
    }
    return stage.with_options(**options)  # type: ignore[attr-defined,no-any-return]


def guard_workers(call: Callable[[], Any]) -> Any:
    """Run a worker call, turning a dead actor into `WorkerLost` (handled by the flow, not retried here)."""
    try:
        return call()
    except Exception as exc:
        if is_worker_death(exc):
            raise WorkerLost(f"a Ray worker died: {exc}") from exc
        raise
