"""Built-in tool names -> import paths (resolved lazily), user tools and environments as `package.module:Class`,
and the checks the pre-flight runs before anything starts.

A user class is named in YAML as `package.module:Class`; in a deployment its module must be on the
deploy-time import allow-list (`rlstages deploy --allow-import`), the same rule as user reward functions.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from rlstages.configs.tools import EnvironmentSpec, ToolSpec
from rlstages.engines.imports import ImportTargetError, check_allowed, import_object
from rlstages.engines.tools.base import Environment, Tool, ToolLimits
from rlstages.engines.tools.environment import LimitedEnvironment, ToolEnvironment

TOOLS: dict[str, str] = {
    "calculator": "rlstages.engines.tools.calculator:Calculator",
    "python": "rlstages.engines.tools.sandbox:PythonSandbox",
}

_TOOL_METHODS = ("schema", "call")
_ENV_METHODS = ("reset", "tools", "final_reward", "close")
_SHARED: dict[tuple[str, str], Tool] = {}  # stateless tools, one per (target, kwargs) per process


def _target(name: str, field: str) -> str:
    """The `module:Class` path of a built-in name or a user path; a one-line ValueError for unknown names."""
    if ":" in name:
        return name
    if name not in TOOLS:
        raise ValueError(
            f"{field}: unknown tool {name!r}; built in: {', '.join(sorted(TOOLS))} (or give 'package.module:Class')"
        )
    return TOOLS[name]


def import_class(target: str, field: str) -> type:
    """Import `package.module:Class` (`engines.imports.import_object`); every failure is a one-line
    ImportTargetError (a ValueError) naming the field."""
    obj = import_object(target, field, expected="Class")
    if not inspect.isclass(obj):
        raise ImportTargetError(f"{field}: {target!r} is not a class")
    return obj


def _check_class(cls: type, methods: tuple[str, ...], kwargs: dict[str, Any], what: str, field: str) -> None:
    """The class has the protocol's methods and accepts `kwargs` (checked by signature, nothing is built)."""
    lacking = [m for m in methods if not callable(getattr(cls, m, None))]
    if lacking:
        raise ValueError(f"{field}: {cls.__name__} is not {what} (lacks {', '.join(lacking)})")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{field}: {cls.__name__} does not accept kwargs {sorted(kwargs)} ({exc})") from None
    except ValueError:
        pass  # no signature to check (a C type); building will tell


def import_targets(spec: EnvironmentSpec, field: str = "environment") -> list[tuple[str, str]]:
    """(field, module) of every user module the spec asks workers to import (built-ins excluded)."""
    out = []
    if spec.environment != "default":
        out.append((f"{field}.environment", spec.environment.partition(":")[0]))
    for i, tool in enumerate(spec.tools):
        if ":" in tool.name:
            out.append((f"{field}.tools.{i}.name", tool.name.partition(":")[0]))
    return out


def check_environment_spec(
    spec: EnvironmentSpec, allowed_imports: tuple[str, ...] | None = None, field: str = "environment"
) -> None:
    """Refuse, in one line naming the field, a user module off the allow-list (when there is one), an unknown
    tool name, a class that does not import, lacks the protocol's methods or rejects its kwargs. Builds nothing."""
    check_allowed(import_targets(spec, field), allowed_imports)  # the deployment's one allow-list rule
    if spec.environment != "default":
        where = f"{field}.environment"
        cls = import_class(spec.environment, where)
        _check_class(cls, _ENV_METHODS, spec.kwargs, "an environment", where)
        return
    for i, tool in enumerate(spec.tools):
        where = f"{field}.tools.{i}.name"
        cls = import_class(_target(tool.name, where), where)
        _check_class(cls, _TOOL_METHODS, tool.kwargs, "a tool", where)
        if ":" not in tool.name:  # a built-in is cheap to build and checks its kwargs' values
            try:
                cls(**tool.kwargs)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{field}.tools.{i}.kwargs: {str(exc).splitlines()[0]}") from None


def isolation_label(spec: EnvironmentSpec | None) -> str:
    """How the environment's `python` tool runs its programs, for the trajectory table: "isolated",
    "UNISOLATED (require_isolation: false)", or "" (no python tool)."""
    if spec is None or spec.environment != "default":
        return ""
    for tool in spec.tools:
        if tool.name == "python":
            return (
                "UNISOLATED (require_isolation: false)"
                if tool.kwargs.get("require_isolation", True) is False
                else "isolated"
            )
    return ""


def _limits(spec: EnvironmentSpec, tool: ToolSpec | None = None) -> ToolLimits:
    """A tool's limits: its own where set, else the environment's."""

    def pick(own: Any, default: Any) -> Any:
        return default if own is None else own

    return ToolLimits(
        timeout_s=pick(tool and tool.timeout_s, spec.timeout_s),
        max_concurrency=pick(tool and tool.max_concurrency, spec.max_concurrency),
        max_output_chars=pick(tool and tool.max_output_chars, spec.max_output_chars),
    )


def build_tool(tool: ToolSpec, field: str = "tools") -> Tool:
    """The tool instance: shared per process when its class says `stateful = False`, else a fresh one."""
    target = _target(tool.name, field)
    cls = import_class(target, field)
    if getattr(cls, "stateful", True):
        return cls(**tool.kwargs)
    key = (target, json.dumps(tool.kwargs, sort_keys=True, default=repr))
    if key not in _SHARED:
        _SHARED[key] = cls(**tool.kwargs)
    return _SHARED[key]


def build_environment(spec: EnvironmentSpec) -> Environment:
    """A fresh environment for one trajectory (stateless tools shared, everything else new)."""
    if spec.environment != "default":
        cls = import_class(spec.environment, "environment.environment")
        return LimitedEnvironment(cls(**spec.kwargs), _limits(spec))
    tools = [build_tool(t, f"environment.tools.{i}.name") for i, t in enumerate(spec.tools)]
    limits = {inst.name: _limits(spec, t) for inst, t in zip(tools, spec.tools, strict=True)}
    return ToolEnvironment(tools, limits)
