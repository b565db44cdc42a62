"""A sandboxed Python executor (work in progress: see the `tools` branch)."""

from __future__ import annotations

from typing import Any

from rlstages.engines.tools.base import ToolResult


class PythonSandbox:
    """The `python` tool: runs `{"code": ...}` in a separate, limited process."""

    name = "python"
    stateful = False

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s

    def schema(self) -> dict[str, Any]:
        """OpenAI-style function schema."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Run a Python program; its stdout and stderr are returned.",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string"}},
                    "required": ["code"],
                },
            },
        }

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Not implemented yet."""
        return ToolResult(text="Error: the python sandbox is not built yet", error="not built yet")
