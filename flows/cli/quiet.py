"""Without --debug a command's failure is one line: Prefect's error records (tracebacks) are dropped."""

from __future__ import annotations

import logging
import os


class _NoTracebacks(logging.Filter):
    """Without --debug a failed run is our one-line error: Prefect's ERROR records (with tracebacks) are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR and not record.exc_info


def quiet_prefect(debug: bool) -> None:
    """Prefect logs at WARNING and, without --debug, drops its error records (our one line says it)."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if debug else "WARNING")
    if debug:
        return
    logging.getLogger("ray").setLevel(logging.WARNING)
    import prefect  # noqa: F401 - configures its logging handlers, which get the filter below

    quiet = _NoTracebacks()
    for name in ("prefect", "prefect.flow_runs", "prefect.task_runs", "prefect.engine", "prefect.runner"):
        logger = logging.getLogger(name)
        logger.addFilter(quiet)
        for handler in logger.handlers:
            handler.addFilter(quiet)


def one_line(message: object) -> str:
    """A message on one line (its lines joined with '; ')."""
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
