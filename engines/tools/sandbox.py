"""The `python` tool: `{"code": ...}` runs in the sandbox of `sandbox_run.py` (its own process, isolated, limited
and killed as a group; see there), and its output with notes comes back as the tool's result."""

from __future__ import annotations

import logging
from typing import Any

from rlstages.engines.tools.base import ToolResult
from rlstages.engines.tools.sandbox_run import SandboxLimits, SandboxRun, check_limits, run_python

logger = logging.getLogger(__name__)


class PythonSandbox:
    """The `python` tool: `{"code": "print(6 * 7)"}` -> its stdout/stderr; stateless (each call a fresh process)."""

    name = "python"
    stateful = False

    def __init__(
        self,
        timeout_s: float = 5.0,
        cpu_s: int = 5,
        memory_mb: int = 1024,
        max_file_mb: int = 16,
        max_processes: int = 64,
        max_open_files: int = 64,
        max_output_bytes: int = 65536,
        isolate_network: bool = True,
        require_network_isolation: bool = False,
        python: str | None = None,
        user: str | None = None,
        require_isolation: bool = True,
        ro_binds: list[str] | tuple[str, ...] = (),
        scratch_mb: int = 64,
        isolation_backend: str = "auto",
    ) -> None:
        """Limits of each call (see `SandboxLimits`; checked here); keep `timeout_s` below the tool's timeout."""
        if not isinstance(require_isolation, bool):
            raise ValueError(f"require_isolation: expected true or false, got {require_isolation!r}")
        self.limits = SandboxLimits(
            timeout_s=timeout_s,
            cpu_s=cpu_s,
            memory_mb=memory_mb,
            max_file_mb=max_file_mb,
            max_processes=max_processes,
            max_open_files=max_open_files,
            max_output_bytes=max_output_bytes,
            isolate_network=isolate_network,
            require_network_isolation=require_network_isolation,
            python=python,
            user=user,
            require_isolation=require_isolation,
            ro_binds=tuple(ro_binds),
            scratch_mb=scratch_mb,
            isolation_backend=isolation_backend,
        )
        check_limits(self.limits)

    def schema(self) -> dict[str, Any]:
        """OpenAI-style function schema."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": (
                    "Run a Python 3 program in a sandbox (no network, limited time and memory); "
                    "returns what it prints (stdout and stderr)."
                ),
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "the program; print the result"}},
                    "required": ["code"],
                },
            },
        }

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run `arguments["code"]`; limits hit and non-zero exits come back as error results with the output."""
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult(text="Error: code must be a string", error="code must be a string")
        return observation(await run_python(code, self.limits), self.limits)


_warned_network = False


def observation(run: SandboxRun, limits: SandboxLimits) -> ToolResult:
    """The tool's result for a run: its output, then notes (cut output, isolation asked for but off, the error)."""
    global _warned_network
    text = run.output
    if run.truncated:
        text += f"\n[output cut at {limits.max_output_bytes} bytes]"
    if limits.isolate_network and run.refused is None and not run.network.startswith("on"):
        text += f"\n[sandbox: network isolation {run.network}]"
        if not _warned_network:
            logger.warning("python sandbox: network isolation %s", run.network)
            _warned_network = True
    error = run.error
    if error is not None:
        text += ("\n" if text else "") + f"Error: {error}"
    return ToolResult(text=text, error=error, truncated=run.truncated)
