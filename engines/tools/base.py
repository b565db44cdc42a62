"""The tool contract: a parsed call, a tool's result, the `Tool` and `Environment` protocols, and per-tool limits.

A trajectory gets its own `Environment` (`reset` with the dataset row and a seed, `tools`, `final_reward`,
`close`); its tools are called through `rlstages.engines.tools.runner.run_tool_call`, which never raises.

Non-goals: parsing (`parsing.py`), running calls (`runner.py`), building environments from config (`registry.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from the policy's text; `arguments` is None when `raw_arguments` is not a JSON object."""

    name: str
    raw_arguments: str
    arguments: dict[str, Any] | None
    parse_error: str | None  # why parsing failed, else None


@dataclass(frozen=True)
class ToolResult:
    """What a call returned: the observation text (already capped in characters) and how it went."""

    text: str
    error: str | None = None  # set when the call failed: malformed, unknown tool, exception, timeout
    reward: float | None = None
    latency_s: float = 0.0
    truncated: bool = False


@dataclass(frozen=True)
class ToolLimits:
    """How one tool is run: wall-clock timeout, concurrent calls per worker process, observation size."""

    timeout_s: float = 10.0
    max_concurrency: int = 16
    max_output_chars: int = 4000


@runtime_checkable
class Tool(Protocol):
    """A callable tool. A class may set `stateful = False` to be built once and shared by all trajectories
    (default: built per trajectory); a stateful tool may define `async reset(row, seed)` and `async close()`."""

    name: str

    def schema(self) -> dict[str, Any]:
        """OpenAI-style `{"type": "function", "function": {"name", "description", "parameters"}}`."""
        ...

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run once with parsed arguments; may raise (the runner turns it into an error result)."""
        ...


@runtime_checkable
class Environment(Protocol):
    """The world of one trajectory: reset per row, its tools, an optional final reward, then closed."""

    async def reset(self, row: dict[str, Any], seed: int) -> None:
        """Start a trajectory for this dataset row (its prompt, ground truth, extra columns)."""
        ...

    def tools(self) -> list[Tool]:
        """The tools the policy may call in this trajectory (their schemas go into the prompt)."""
        ...

    async def final_reward(self, response_text: str) -> float | None:
        """The outcome reward for the whole response; None lets the configured reward functions score it."""
        ...

    async def close(self) -> None:
        """Release what `reset` acquired; called once per trajectory, also after errors."""
        ...
