"""The never-raising runner (errors, timeouts, caps), per-tool concurrency, per-trajectory
environments and the registry's checks (allow-list, unknown names, bad classes). Parsing: test_tools_parsing.py."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlstages.configs.tools import EnvironmentSpec
from rlstages.engines.tools import (
    ToolCall,
    build_environment,
    check_environment_spec,
    parse_tool_calls,
    run_tool_call,
)
from rlstages.engines.tools.environment import ToolEnvironment
from rlstages.engines.tools.registry import import_targets

# A user module with tools and an environment, imported for real as `usertools_mod:...`.
USER_MODULE = '''
import asyncio
from rlstages.engines.tools.base import ToolResult

class Sleeper:
    name = "sleep"
    stateful = False
    in_flight = 0
    peak = 0

    def __init__(self, seconds=0.2):
        self.seconds = seconds

    def schema(self):
        return {"type": "function", "function": {"name": self.name, "parameters": {"type": "object"}}}

    async def call(self, arguments):
        type(self).in_flight += 1
        type(self).peak = max(type(self).peak, type(self).in_flight)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            type(self).in_flight -= 1
        return ToolResult(text="slept")

class Counter:
    name = "counter"

    def __init__(self):
        self.count = 0
        self.row_id = None
        self.closed = False

    def schema(self):
        return {"type": "function", "function": {"name": self.name, "parameters": {"type": "object"}}}

    async def reset(self, row, seed):
        self.count, self.row_id = 0, row["id"]

    async def call(self, arguments):
        self.count += 1
        await asyncio.sleep(0.001 * (self.row_id % 7))  # interleave the trajectories
        return ToolResult(text=f"{self.row_id}:{self.count}", reward=float(self.count))

    async def close(self):
        self.closed = True

class Raiser:
    name = "raiser"

    def schema(self):
        return {"type": "function", "function": {"name": self.name, "parameters": {"type": "object"}}}

    async def call(self, arguments):
        raise RuntimeError("boom\\nsecond line")

class Exiter:
    name = "exiter"

    def schema(self):
        return {"type": "function", "function": {"name": self.name, "parameters": {"type": "object"}}}

    async def call(self, arguments):
        raise SystemExit(3)

class BadTools:
    async def reset(self, row, seed):
        pass

    def tools(self):
        raise KeyError("no tools today")

    async def final_reward(self, response_text):
        return None

    async def close(self):
        pass

class Chatty:
    name = "chatty"
    stateful = False

    def schema(self):
        return {"type": "function", "function": {"name": self.name, "parameters": {"type": "object"}}}

    async def call(self, arguments):
        return ToolResult(text="y" * 10_000)

class NotATool:
    name = "nope"

class Guess:
    """An environment: one tool `guess`; the final reward says whether the secret was named."""

    def __init__(self, secret=7):
        self.secret, self.guesses = secret, []

    async def reset(self, row, seed):
        self.guesses = []

    def tools(self):
        env = self

        class GuessTool:
            name = "guess"

            def schema(self):
                return {"type": "function", "function": {"name": "guess", "parameters": {
                    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}

            async def call(self, arguments):
                env.guesses.append(arguments["n"])
                return ToolResult(text="higher" if arguments["n"] < env.secret else "lower or equal")

        return [GuessTool()]

    async def final_reward(self, response_text):
        return 1.0 if str(self.secret) in response_text else 0.0

    async def close(self):
        pass
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "usertools_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "usertools_mod"
    sys.modules.pop("usertools_mod", None)


def _call(name: str, args: dict | None = None) -> ToolCall:
    return ToolCall(name=name, raw_arguments=json.dumps(args or {}), arguments=args or {}, parse_error=None)


# ---- the runner ----------------------------------------------------------------------------------------


def test_malformed_and_unknown_calls_become_error_observations() -> None:
    env = build_environment(EnvironmentSpec(tools=[{"name": "calculator"}]))
    texts = {
        "invalid": "<tool_call>{bad json</tool_call>",
        "non-object": '<tool_call>{"name": "calculator", "arguments": ["1+1"]}</tool_call>',
        "unknown": '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>',
        "missing": '<tool_call>{"name": "calculator", "arguments": {"expr": "1+1"}}</tool_call>',
        "ok": '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>',
    }

    async def run() -> dict:
        await env.reset({}, 0)
        return {k: await run_tool_call(env, parse_tool_calls(t)[0], 5.0) for k, t in texts.items()}

    out = asyncio.run(run())
    assert "invalid JSON" in out["invalid"].error
    assert "JSON object" in out["non-object"].error
    assert out["unknown"].error == "unknown tool 'search'; available: calculator"
    assert "missing required argument(s) expression" in out["missing"].error
    for key in ("invalid", "non-object", "unknown", "missing"):
        assert out[key].text == f"Error: {out[key].error}"
    assert out["ok"].error is None and out["ok"].text == "42"


def test_raising_slow_and_chatty_tools_give_error_results(user_module: str) -> None:
    spec = EnvironmentSpec(
        tools=[
            {"name": f"{user_module}:Raiser"},
            {"name": f"{user_module}:Exiter"},
            {"name": f"{user_module}:Sleeper", "kwargs": {"seconds": 5.0}, "timeout_s": 0.2},
            {"name": f"{user_module}:Chatty", "max_output_chars": 100},
        ]
    )
    env = build_environment(spec)

    async def run():
        return (
            await run_tool_call(env, _call("raiser"), 5.0),
            await run_tool_call(env, _call("sleep"), 0.01),  # the tool's configured limit (0.2 s) governs
            await run_tool_call(env, _call("chatty"), 5.0),
            await run_tool_call(env, _call("chatty"), 5.0),
        )

    start = time.perf_counter()
    raised, slow, chatty, _ = asyncio.run(run())
    assert raised.error == "tool 'raiser' raised RuntimeError: boom"
    bare = ToolEnvironment([sys.modules[user_module].Sleeper(5.0)])  # no configured limits: the caller's apply
    assert asyncio.run(run_tool_call(bare, _call("sleep"), 0.1)).error == "tool 'sleep' timed out after 0.1 s"
    exited = asyncio.run(run_tool_call(env, _call("exiter"), 5.0))
    assert exited.error == "tool 'exiter' raised SystemExit: 3"
    broken = build_environment(EnvironmentSpec(environment=f"{user_module}:BadTools"))
    failed = asyncio.run(run_tool_call(broken, _call("x"), 5.0))
    assert failed.error == "tool 'x' failed (KeyError: 'no tools today')"
    assert slow.error == "tool 'sleep' timed out after 0.2 s" and 0.15 < slow.latency_s < 2.0
    assert time.perf_counter() - start < 6.0  # the 5 s sleeper was cut off, not waited for
    assert chatty.error is None and chatty.truncated and len(chatty.text) == 100
    assert chatty.text.startswith("y" * 50) and chatty.text.endswith("[truncated]")


def test_sleeping_tools_overlap_up_to_the_concurrency_limit(user_module: str) -> None:
    spec = EnvironmentSpec(tools=[{"name": f"{user_module}:Sleeper", "kwargs": {"seconds": 0.2}}], max_concurrency=16)
    envs = [build_environment(spec) for _ in range(64)]

    async def run():
        return await asyncio.gather(*(run_tool_call(env, _call("sleep"), 5.0) for env in envs))

    start = time.perf_counter()
    results = asyncio.run(run())
    elapsed = time.perf_counter() - start
    assert all(r.error is None and r.text == "slept" for r in results)
    sleeper = sys.modules[user_module].Sleeper
    assert sleeper.peak == 16  # the limit held, and was reached
    assert 0.75 < elapsed < 6.4, elapsed  # 4 waves of 0.2 s; serial would be 12.8 s
    assert all(0.19 < r.latency_s < 2.0 for r in results)  # latency excludes the wait for the semaphore


def test_64_stateful_environments_share_no_state(user_module: str) -> None:
    spec = EnvironmentSpec(tools=[{"name": f"{user_module}:Counter"}, {"name": "calculator"}])
    envs = [build_environment(spec) for _ in range(64)]

    async def trajectory(i: int, env):
        await env.reset({"id": i}, seed=i)
        texts = [(await run_tool_call(env, _call("counter"), 5.0)).text for _ in range(3)]
        await env.close()
        return texts

    async def run():
        return await asyncio.gather(*(trajectory(i, env) for i, env in enumerate(envs)))

    out = asyncio.run(run())
    assert out == [[f"{i}:1", f"{i}:2", f"{i}:3"] for i in range(64)]
    counters = [env.tools()[0] for env in envs]
    assert len({id(c) for c in counters}) == 64 and all(c.closed for c in counters)
    calculators = {id(env.tools()[1]) for env in envs}
    assert len(calculators) == 1  # stateless: built once, shared


def test_user_environment_class_with_its_tools_and_final_reward(user_module: str) -> None:
    spec = EnvironmentSpec(environment=f"{user_module}:Guess", kwargs={"secret": 5}, timeout_s=1.0)
    check_environment_spec(spec)
    env = build_environment(spec)

    async def run():
        await env.reset({"prompt": "guess"}, 0)
        low = await run_tool_call(env, _call("guess", {"n": 3}), 5.0)
        bad = await run_tool_call(env, _call("guess", {}), 5.0)
        return low, bad, await env.final_reward("it is 5"), await env.final_reward("it is 4")

    low, bad, hit, miss = asyncio.run(run())
    assert low.text == "higher" and bad.error and "missing required" in bad.error
    assert (hit, miss) == (1.0, 0.0)


# ---- config and registry -------------------------------------------------------------------------------


def test_unknown_tool_name_is_one_line() -> None:
    with pytest.raises(ValueError) as info:
        check_environment_spec(EnvironmentSpec(tools=[{"name": "calculater"}]), field="rollout.env")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("rollout.env.tools.0.name: unknown tool 'calculater'; built in: calculator, python")


def test_user_class_off_the_allow_list_is_refused(user_module: str) -> None:
    spec = EnvironmentSpec(tools=[{"name": "calculator"}, {"name": f"{user_module}:Counter"}])
    assert import_targets(spec) == [("environment.tools.1.name", user_module)]
    with pytest.raises(ValueError, match=rf"^environment.tools.1.name: module '{user_module}' is not on this") as info:
        check_environment_spec(spec, allowed_imports=("my_rewards",))
    assert f"--allow-import {user_module}" in str(info.value)
    check_environment_spec(spec, allowed_imports=(user_module,))  # on the list: fine
    check_environment_spec(spec)  # outside a deployment: no list
    env_spec = EnvironmentSpec(environment=f"{user_module}:Guess")
    with pytest.raises(ValueError, match="environment.environment: module 'usertools_mod' is not on"):
        check_environment_spec(env_spec, allowed_imports=())


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ({"tools": [{"name": "no_such_mod:Tool"}]}, "cannot import module 'no_such_mod' (ModuleNotFoundError"),
        ({"tools": [{"name": "{mod}:Missing"}]}, "has no attribute 'Missing'"),
        ({"tools": [{"name": "{mod}:NotATool"}]}, "NotATool is not a tool (lacks schema, call)"),
        ({"tools": [{"name": "{mod}:Sleeper", "kwargs": {"secs": 1}}]}, "Sleeper does not accept kwargs ['secs']"),
        ({"tools": [{"name": "python", "kwargs": {"memory": 1}}]}, "PythonSandbox does not accept kwargs"),
        ({"tools": [{"name": "json:dumps"}]}, "'json:dumps' is not a class"),
        (
            {"tools": [{"name": "python", "kwargs": {"python": "/no/such"}}]},
            "environment.tools.0.kwargs: python: '/no/such' is not an executable file",
        ),
        ({"environment": "{mod}:Counter"}, "Counter is not an environment (lacks tools, final_reward)"),
    ],
)
def test_bad_classes_are_one_line_errors(user_module: str, spec: dict, error: str) -> None:
    raw = json.loads(json.dumps(spec).replace("{mod}", user_module))
    with pytest.raises(ValueError) as info:
        check_environment_spec(EnvironmentSpec(**raw))
    assert error in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        ({}, "needs at least one entry in tools"),
        ({"tools": [{"name": "calculator"}, {"name": "calculator"}]}, "calculator given twice"),
        ({"environment": "mymod.Env"}, "expected 'default' or 'package.module:Class'"),
        ({"environment": "m:E", "tools": [{"name": "calculator"}]}, "tools are for environment 'default'"),
        ({"tools": [{"name": "calculator"}], "kwargs": {"a": 1}}, "kwargs are for a 'package.module:Class'"),
        ({"tools": [{"name": "calculator", "timeout": 3}]}, "Extra inputs are not permitted"),
        ({"tools": [{"name": "calculator", "max_concurrency": 0}]}, "greater than or equal to 1"),
    ],
)
def test_environment_spec_validation(raw: dict, error: str) -> None:
    with pytest.raises(ValidationError, match=error.replace("(", r"\(").replace(")", r"\)")):
        EnvironmentSpec(**raw)


def test_spec_limits_reach_the_environment() -> None:
    spec = EnvironmentSpec(
        tools=[{"name": "calculator", "timeout_s": 2.0}, {"name": "python", "max_output_chars": 500}],
        max_concurrency=3,
    )
    env = build_environment(spec)
    calc, py = env.limits_for("calculator"), env.limits_for("python")
    assert (calc.timeout_s, calc.max_concurrency, calc.max_output_chars) == (2.0, 3, 4000)
    assert (py.timeout_s, py.max_concurrency, py.max_output_chars) == (10.0, 3, 500)
    assert [t.schema()["function"]["name"] for t in env.tools()] == ["calculator", "python"]
