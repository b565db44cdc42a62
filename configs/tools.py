"""Tools and environments for multi-turn rollouts: built-in tool names or `module:Class`, with per-tool limits.

`environment: default` builds one environment per trajectory from `tools`; `environment: package.module:Class`
builds the user's class with `kwargs` (its tools get the environment-wide limits). User modules must be on
the deployment's import allow-list (`rlstages deploy --allow-import`), like user reward functions.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rlstages.configs.base import StrictModel


class ToolSpec(StrictModel):
    """One tool: a built-in (`calculator`, `python`) or `package.module:Class`, built with `kwargs`.

    Limits left unset take the environment's (`timeout_s`, `max_concurrency`, `max_output_chars`)."""

    name: str = Field(min_length=1)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(default=None, gt=0.0, description="Wall-clock limit of one call.")
    max_concurrency: int | None = Field(default=None, ge=1, description="Concurrent calls per rollout worker.")
    max_output_chars: int | None = Field(default=None, ge=16, description="Observation cap in characters.")


class EnvironmentSpec(StrictModel):
    """Which environment each trajectory gets: `default` (made of `tools`) or `package.module:Class`."""

    environment: str = Field(default="default", min_length=1)
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to the environment class.")
    tools: tuple[ToolSpec, ...] = ()
    timeout_s: float = Field(default=10.0, gt=0.0, description="Default wall-clock limit of one tool call.")
    max_concurrency: int = Field(default=16, ge=1, description="Default concurrent calls of a tool per worker.")
    max_output_chars: int = Field(default=4000, ge=16, description="Default observation cap in characters.")

    @model_validator(mode="after")
    def _tools_match_environment(self) -> EnvironmentSpec:
        if self.environment == "default":
            if not self.tools:
                raise ValueError("environment 'default' needs at least one entry in tools (e.g. [{name: calculator}])")
            if self.kwargs:
                raise ValueError("kwargs are for a 'package.module:Class' environment; give tool kwargs in tools")
            names = [t.name for t in self.tools]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"tools: {', '.join(dup)} given twice; each tool once")
        elif ":" not in self.environment:
            raise ValueError(f"environment: expected 'default' or 'package.module:Class', got {self.environment!r}")
        elif self.tools:
            raise ValueError(
                "tools are for environment 'default'; a 'package.module:Class' environment brings its own "
                "(limits: timeout_s, max_concurrency, max_output_chars)"
            )
        return self
