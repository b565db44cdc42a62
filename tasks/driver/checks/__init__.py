"""The checks of the pre-flight (`rlstages.tasks.driver.preflight`), by subject: the config and what it names
(`config`), the cluster's resources (`resources`); the data's checks live with the data
(`tasks.driver.data.checks`). Each check takes the RunConfig, raises `PreflightError` (one line: the field or file,
and what was expected) and may return warnings."""

from __future__ import annotations

from collections.abc import Callable

from rlstages.configs import RunConfig

Check = Callable[[RunConfig], "list[str] | None"]


class PreflightError(ValueError):
    """An input a run cannot start with; the message names the field or file and what was expected."""
