"""What the python tool's isolation tests share (test_tools_isolation.py, test_tools_isolation_layers.py): the
`backend` fixture (each case against bubblewrap and the fallback launcher) and `run_code` with the defaults."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from rlstages.engines.tools.sandbox_run import SandboxLimits, run_python

ROOT = os.geteuid() == 0


_BACKEND = ["auto"]


@pytest.fixture(params=["bwrap", "launcher"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each attack against both backends: bubblewrap and the fallback launcher (`jail.py`)."""
    _BACKEND[0] = request.param
    yield request.param
    _BACKEND[0] = "auto"


def run_code(code: str, **limits) -> object:
    """Run with the defaults (isolation required; the backend under test), generous time limits (the machine
    may be loaded)."""
    limits = {"timeout_s": 30.0, "cpu_s": 20, "isolation_backend": _BACKEND[0], **limits}
    return asyncio.run(run_python(code, SandboxLimits(**limits)))
