"""Tools and environments for multi-turn rollouts: contract, Hermes call parsing, a never-raising runner with
per-tool timeouts, concurrency limits and output caps, a registry (`calculator`, `python`, `module:Class`),
a calculator and a sandboxed Python executor.

Importing this package imports no torch and no ML library.
"""

from rlstages.engines.tools.base import Environment, Tool, ToolCall, ToolLimits, ToolResult
from rlstages.engines.tools.parsing import parse_tool_calls
from rlstages.engines.tools.registry import build_environment, check_environment_spec
from rlstages.engines.tools.runner import run_tool_call

__all__ = [
    "Environment",
    "Tool",
    "ToolCall",
    "ToolLimits",
    "ToolResult",
    "build_environment",
    "check_environment_spec",
    "parse_tool_calls",
    "run_tool_call",
]
