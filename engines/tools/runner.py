"""Runs one parsed tool call against an environment and never raises.

Malformed calls, unknown tools, a tool that raises or runs past its timeout all become a `ToolResult` with
`error` set and an `Error: ...` observation text. Each tool has an asyncio semaphore shared by every
trajectory of the worker process (per event loop), so `max_concurrency` bounds calls of that tool across
trajectories; the wait for the semaphore is not part of the timeout nor of `latency_s`.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any

from rlstages.engines.tools.base import Environment, Tool, ToolCall, ToolLimits, ToolResult

TRUNCATION_MARK = "\n...[truncated]"

_SEMAPHORES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, int], asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


def tool_semaphore(name: str, max_concurrency: int) -> asyncio.Semaphore:
    """The semaphore of tool `name` (with this limit) in the running event loop, shared by all trajectories."""
    loop = asyncio.get_running_loop()
    table = _SEMAPHORES.setdefault(loop, {})
    key = (name, max_concurrency)
    if key not in table:
        table[key] = asyncio.Semaphore(max_concurrency)
    return table[key]


def cap_text(text: str, max_chars: int) -> tuple[str, bool]:
    """`text` cut to `max_chars` characters (a marker included); True when it was cut."""
    if len(text) <= max_chars:
        return text, False
    keep = max(0, max_chars - len(TRUNCATION_MARK))
    return (text[:keep] + TRUNCATION_MARK)[:max_chars], True


def error_result(message: str, latency_s: float = 0.0) -> ToolResult:
    """An error observation the policy can read; `error` holds the same message for the metrics."""
    return ToolResult(text=f"Error: {message}", error=message, latency_s=latency_s)


def limits_for(env: Environment, name: str, timeout_s: float) -> ToolLimits:
    """The tool's limits from an environment built from a spec, else the caller's timeout and the defaults."""
    get = getattr(env, "limits_for", None)
    limits = get(name) if callable(get) else None
    if not isinstance(limits, ToolLimits):
        return ToolLimits(timeout_s=timeout_s)
    return limits


class _ToolExit(Exception):
    """A tool's SystemExit, turned into an ordinary exception inside its task (asyncio would stop the loop)."""


async def _guarded(coro: Any) -> Any:
    try:
        return await coro
    except SystemExit as exc:
        raise _ToolExit(str(exc.code)) from None


def _find_tool(env: Environment, name: str) -> tuple[Tool | None, list[str]]:
    tools = list(env.tools())
    for tool in tools:
        if tool.name == name:
            return tool, [t.name for t in tools]
    return None, [t.name for t in tools]


def _missing_required(tool: Tool, arguments: dict[str, Any]) -> list[str]:
    """Required parameter names of the tool's schema that the call left out (the schema is trusted loosely)."""
    try:
        params = tool.schema()["function"].get("parameters", {})
        required = params.get("required", [])
    except Exception:  # a tool whose schema is broken is still callable
        return []
    return [str(k) for k in required if k not in arguments]


async def run_tool_call(env: Environment, call: ToolCall, timeout_s: float) -> ToolResult:
    """Run `call` in `env`; every failure is an error result. The time limit is the tool's configured one (an
    environment from `build_environment`), else `timeout_s`."""
    try:
        return await _run(env, call, timeout_s)
    except (Exception, SystemExit) as exc:  # the contract is "never raises" (a tool's sys.exit included)
        first = str(exc).splitlines()[0] if str(exc) else ""
        return error_result(f"tool {call.name!r} failed ({type(exc).__name__}: {first})")


async def _run(env: Environment, call: ToolCall, timeout_s: float) -> ToolResult:
    if call.parse_error is not None:
        return error_result(f"malformed tool call: {call.parse_error}")
    if call.arguments is None:
        return error_result("malformed tool call: arguments must be a JSON object")
    tool, names = _find_tool(env, call.name)
    if tool is None:
        return error_result(f"unknown tool {call.name!r}; available: {', '.join(names) or 'none'}")
    missing = _missing_required(tool, call.arguments)
    if missing:
        return error_result(f"tool {call.name!r}: missing required argument(s) {', '.join(missing)}")
    limits = limits_for(env, call.name, timeout_s)
    timeout = limits.timeout_s
    async with tool_semaphore(call.name, limits.max_concurrency):
        start = time.perf_counter()
        try:
            result = await asyncio.wait_for(_guarded(tool.call(call.arguments)), timeout)
        except TimeoutError:
            return error_result(f"tool {call.name!r} timed out after {timeout:g} s", time.perf_counter() - start)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            kind = "SystemExit" if isinstance(exc, _ToolExit) else type(exc).__name__
            return error_result(
                f"tool {call.name!r} raised {kind}: {first}"[: limits.max_output_chars],
                time.perf_counter() - start,
            )
        latency = time.perf_counter() - start
    if not isinstance(result, ToolResult):
        if isinstance(result, str):
            result = ToolResult(text=result)
        else:
            return error_result(f"tool {call.name!r} returned {type(result).__name__}, not a ToolResult", latency)
    text, cut = cap_text(str(result.text), limits.max_output_chars)
    return ToolResult(
        text=text, error=result.error, reward=result.reward, latency_s=latency, truncated=cut or result.truncated
    )
