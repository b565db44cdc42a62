"""Environments built from config: the default one made of a list of tools, and a wrapper giving a user
environment the configured limits.

Stateless tools (class attribute `stateful = False`) are built once per worker process and shared by all
trajectories; every other tool is built afresh for each trajectory, so no state leaks between them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlstages.engines.tools.base import Environment, Tool, ToolLimits


class ToolEnvironment:
    """One trajectory's environment made of tools; `final_reward` is None (the reward functions score)."""

    def __init__(self, tools: list[Tool], limits: Mapping[str, ToolLimits] | None = None) -> None:
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"two tools share a name: {names}")
        self._tools = list(tools)
        self._limits = dict(limits or {})
        self.row: dict[str, Any] = {}
        self.seed = 0

    async def reset(self, row: dict[str, Any], seed: int) -> None:
        """Keep the row and seed; reset each tool that has `reset(row, seed)`."""
        self.row, self.seed = dict(row), seed
        for tool in self._tools:
            reset = getattr(tool, "reset", None)
            if reset is not None and getattr(tool, "stateful", True):
                await reset(row, seed)

    def tools(self) -> list[Tool]:
        """The tools, in configured order."""
        return list(self._tools)

    def limits_for(self, name: str) -> ToolLimits | None:
        """The configured limits of tool `name` (None: the caller's defaults)."""
        return self._limits.get(name)

    async def final_reward(self, response_text: str) -> float | None:
        """None: the configured reward functions score the response."""
        return None

    async def close(self) -> None:
        """Close each per-trajectory tool that has `close()`."""
        for tool in self._tools:
            close = getattr(tool, "close", None)
            if close is not None and getattr(tool, "stateful", True):
                await close()


class LimitedEnvironment:
    """A user environment seen through the configured limits (the same for each of its tools)."""

    def __init__(self, inner: Environment, limits: ToolLimits) -> None:
        self.inner = inner
        self._limits = limits

    async def reset(self, row: dict[str, Any], seed: int) -> None:
        """Delegated."""
        await self.inner.reset(row, seed)

    def tools(self) -> list[Tool]:
        """Delegated."""
        return list(self.inner.tools())

    def limits_for(self, name: str) -> ToolLimits | None:
        """The environment-wide limits."""
        return self._limits

    async def final_reward(self, response_text: str) -> float | None:
        """Delegated."""
        return await self.inner.final_reward(response_text)

    async def close(self) -> None:
        """Delegated."""
        await self.inner.close()
