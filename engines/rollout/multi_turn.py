"""The multi-turn rollout loop: policy turns and tool observations, token in / token out, under budgets.

A step's trajectories advance in rounds: every live trajectory's context goes to the engine in one batch
(`TurnGenerator`: ids in, sampled ids and log-probs out, each row with its own `max_tokens`), then the tool
calls of every trajectory run concurrently (asyncio; a tool that sleeps overlaps the others, each environment
limits its tools' concurrency). Rounds keep a step replayable: the same seed gives the same batches, so the
same samples and the same trajectories when the `generate` task is retried.

Each trajectory has its own environment (`reset(row, seed)` ... `close()`). Budgets: `max_turns` policy
turns; `max_response_tokens` over the whole response (policy and observation tokens); each turn's
`max_tokens = min(per_turn_max_tokens, what is left)` (and what the context window leaves); a tool's output
is cut to `tool_output_max_tokens`. An `assistant_prefill` (e.g. `<tool_call>`) is put after the first
turn's generation prompt as template glue (mask 0, counted in the response budget); that turn's text, parsed
for calls, is the prefill's and the sampled tokens' together. A malformed call, an unknown tool or a failing
tool becomes an error observation (masked, counted); an exception in an environment ends that trajectory
with `stop_reason` "error", never the step.

Non-goal: the model's decode loop (`decode`, vLLM); what the tools do (`rlstages.engines.tools`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from rlstages.engines.rollout.chat_render import ChatRenderer, TemplateError
from rlstages.engines.rollout.trajectory import Segment, ToolCallRecord, Trajectory
from rlstages.engines.types import Prompt

if TYPE_CHECKING:
    from rlstages.engines.tools import Environment

R = TypeVar("R")

# (contexts, max_tokens per row) -> per row (sampled ids, their log-probs); a row ends at EOS or its limit
TurnGenerator = Callable[[list[list[int]], list[int]], list[tuple[list[int], list[float]]]]


@dataclass(frozen=True)
class Budgets:
    """The limits of one trajectory."""

    max_turns: int = 4
    max_response_tokens: int = 256
    per_turn_max_tokens: int = 64
    tool_output_max_tokens: int = 64
    tool_timeout_s: float = 10.0
    max_context_tokens: int = 0  # the model's window; 0: no limit beyond the budgets
    not_prefix_preserving: Literal["refuse", "new_row"] = "refuse"

    def turn_max_tokens(self, used: int, context: int) -> int:
        """This turn's max_tokens: min(per-turn cap, the trajectory's tokens left, the window left)."""
        left = min(self.per_turn_max_tokens, self.max_response_tokens - used)
        if self.max_context_tokens:
            left = min(left, self.max_context_tokens - context)
        return max(left, 0)


@dataclass(frozen=True)
class ToolHooks:
    """The tool layer's functions (`rlstages.engines.tools`), passed in so the loop can be driven by any."""

    parse_tool_calls: Callable[[str], list[Any]]
    run_tool_call: Callable[[Any, Any, float], Coroutine[Any, Any, Any]]


class MultiTurnRunner:
    """Runs a step's trajectories: `generate` samples turns, `new_environment` gives each its own env."""

    def __init__(
        self,
        renderer: ChatRenderer,
        generate: TurnGenerator,
        new_environment: Callable[[], Environment],
        hooks: ToolHooks,
        budgets: Budgets,
        eos_ids: set[int],
        assistant_prefill: str = "",
    ) -> None:
        self.renderer = renderer
        self.generate = generate
        self.new_environment = new_environment
        self.hooks = hooks
        self.budgets = budgets
        self.eos_ids = set(eos_ids)
        self.prefill_ids = prefill_ids(renderer, assistant_prefill, self.eos_ids, budgets.max_response_tokens)
        self.new_rows = not renderer.prefix_preserving()
        if self.new_rows and budgets.not_prefix_preserving == "refuse":
            raise TemplateError(
                "rollout.multi_turn: the chat template is not prefix-preserving (it rewrites earlier turns); "
                "set rollout.multi_turn.template_not_prefix_preserving=new_row to start a new training row per turn"
            )

    def run(self, prompts: Sequence[Prompt], n: int, seed: int) -> list[Trajectory]:
        """`n` trajectories per prompt, prompt-major, seeded (`seed` + the sample's index for its env)."""
        return run_sync(self.arun(prompts, n, seed))

    async def arun(self, prompts: Sequence[Prompt], n: int, seed: int) -> list[Trajectory]:
        """`run` inside an event loop."""
        pairs = [(p, k) for p in prompts for k in range(n)]
        envs = [self.new_environment() for _ in pairs]
        starts = [self._start(p, k, env, seed + i) for i, ((p, k), env) in enumerate(zip(pairs, envs, strict=True))]
        trajs = await asyncio.gather(*starts)
        live = [(t, env) for t, env in zip(trajs, envs, strict=True) if not t.stop_reason]
        try:
            while live:
                live = await self._round(live)
            await asyncio.gather(*(self._finish(t, env) for t, env in zip(trajs, envs, strict=True)))
        finally:
            await asyncio.gather(*(_close(env) for env in envs))
        return list(trajs)

    async def _start(self, prompt: Prompt, sample: int, env: Environment, seed: int) -> Trajectory:
        messages = [dict(m) for m in prompt.messages] or [{"role": "user", "content": prompt.text}]
        traj = Trajectory(prompt, sample, [Segment([])], messages)
        try:
            row: dict[str, Any] = {"uid": prompt.uid, "prompt": prompt.text, "ground_truth": prompt.ground_truth}
            row["messages"], row["data_source"], row["extra_info"] = messages, prompt.data_source, prompt.extra_info
            await env.reset(row, seed)
            traj.tools = [t.schema() for t in env.tools()]
            traj.messages = self.renderer.messages_with_tools(messages, traj.tools)  # a new row renders these again
            traj.segments = [Segment(self.renderer.prompt_ids(messages, traj.tools))]
            if self.prefill_ids:  # template glue the first turn continues from: in the trajectory, mask 0
                traj.current.add("prefill", 1, self.prefill_ids)
        except Exception as exc:  # noqa: BLE001  # a failing environment ends its trajectory, not the step
            traj.stop_reason, traj.error = "error", f"reset: {type(exc).__name__}: {exc}"
        return traj

    async def _round(self, live: list[tuple[Trajectory, Environment]]) -> list[tuple[Trajectory, Environment]]:
        """One policy turn for every live trajectory (one engine batch), then their tool calls concurrently."""
        b = self.budgets
        asking, limits = [], []
        for traj, env in live:
            context = traj.current.context()
            limit = b.turn_max_tokens(traj.response_tokens(), len(context))
            if limit <= 0:
                traj.stop_reason = (
                    "context" if b.max_context_tokens and len(context) >= b.max_context_tokens else "length"
                )
                continue
            asking.append((traj, env))
            limits.append(limit)
        outputs = self.generate([t.current.context() for t, _ in asking], limits) if asking else []
        acting = []
        for (traj, env), limit, (ids, logprobs) in zip(asking, limits, outputs, strict=True):
            ids, logprobs = list(ids)[:limit], list(logprobs)[:limit]
            traj.turns += 1
            traj.current.add("assistant", traj.turns, ids, logprobs)
            turn_ids = self.prefill_ids + ids if traj.turns == 1 else ids  # the prefill is the turn's start
            text = self.renderer.tokenizer.decode(turn_ids, skip_special_tokens=True)
            traj.final_text = text
            traj.messages.append({"role": "assistant", "content": text})
            traj.turn_rewards.append(0.0)
            if not ids or ids[-1] not in self.eos_ids:  # cut at a limit: no turn boundary to continue from
                window = b.max_context_tokens and len(traj.current.context()) >= b.max_context_tokens
                traj.stop_reason = "context" if window else "length"
                continue
            calls = self.hooks.parse_tool_calls(text)
            if not calls:
                traj.stop_reason = "done"
            elif traj.turns >= b.max_turns:
                traj.stop_reason = "max_turns"
            else:
                acting.append((traj, env, calls))
        await asyncio.gather(*(self._act(traj, env, calls) for traj, env, calls in acting))
        return [(t, env) for t, env, _ in acting if not t.stop_reason]

    async def _act(self, traj: Trajectory, env: Environment, calls: list[Any]) -> None:
        """Run a turn's calls (concurrently) and append their observation, or stop when it does not fit."""
        results = await asyncio.gather(*(self.hooks.run_tool_call(env, c, self.budgets.tool_timeout_s) for c in calls))
        tool_messages = []
        for call, result in zip(calls, results, strict=True):
            text, cut = self._cap(result.text if result.error is None or result.text else f"error: {result.error}")
            traj.tool_calls.append(
                ToolCallRecord(
                    traj.turns,
                    call.name,
                    call.raw_arguments,
                    call.arguments is not None and call.parse_error is None,
                    result.error,
                    float(result.latency_s),
                    bool(result.truncated or cut),
                )
            )
            if result.reward is not None:
                traj.turn_rewards[-1] += float(result.reward)
            tool_messages.append({"role": "tool", "content": text, "name": call.name})
        traj.messages.extend(tool_messages)
        if self.new_rows:  # the template rewrites history: the next turn is a new row over the whole conversation
            prompt = self.renderer.conversation_ids(traj.messages)  # the tool schemas are in its system turn
            if len(prompt) + 1 > (self.budgets.max_context_tokens or len(prompt) + 2):
                traj.stop_reason = "context"
                return
            traj.segments.append(Segment(prompt))
            return
        obs = self.renderer.observation_ids(tool_messages)
        if traj.response_tokens() + len(obs) >= self.budgets.max_response_tokens:
            traj.stop_reason = "length"  # no room for the observation and a reply to it
            return
        traj.current.add("observation", traj.turns, obs)

    def _cap(self, text: str) -> tuple[str, bool]:
        """A tool's output cut to `tool_output_max_tokens` tokens (the tokenizer's), and whether it was cut."""
        tok = self.renderer.tokenizer
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.budgets.tool_output_max_tokens:
            return text, False
        return tok.decode(ids[: self.budgets.tool_output_max_tokens], skip_special_tokens=True) + " [truncated]", True

    async def _finish(self, traj: Trajectory, env: Environment) -> None:
        if traj.error is not None:
            return
        try:
            reward = await env.final_reward(traj.final_text)
            traj.env_reward = None if reward is None else float(reward)
        except Exception as exc:  # noqa: BLE001  # counted as an error trajectory; the reward functions score it
            traj.error = f"final_reward: {type(exc).__name__}: {exc}"


def prefill_ids(renderer: ChatRenderer, prefill: str, eos_ids: set[int], max_response_tokens: int) -> list[int]:
    """The ids of `rollout.multi_turn.assistant_prefill` (encoded once, on its own); a prefill holding an
    end-of-turn token or leaving no room for the policy in `max_response_tokens` is refused (ValueError)."""
    ids = renderer.encode(prefill) if prefill else []
    if any(i in eos_ids for i in ids):
        raise ValueError(
            f"rollout.multi_turn.assistant_prefill {prefill!r} holds an end-of-turn token: the first turn would "
            "end inside the prefill; expected the text the turn starts with"
        )
    if ids and len(ids) + 1 > max_response_tokens:
        raise ValueError(
            f"rollout.multi_turn.assistant_prefill is {len(ids)} tokens, which leaves no room in "
            f"max_response_tokens ({max_response_tokens}); shorten it or raise the budget"
        )
    return ids


async def _close(env: Environment) -> None:
    try:
        await env.close()
    except Exception:  # noqa: BLE001, S110  # closing is best effort: the trajectory is already recorded
        pass


def run_sync(coro: Coroutine[Any, Any, R]) -> R:
    """Run a coroutine to completion from synchronous code, in a fresh thread when a loop is already running
    (a Ray async actor, a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def build_runner(
    settings: Any, tokenizer: Any, eos_ids: set[int], system_prompt: str | None, generate: TurnGenerator, window: int
) -> MultiTurnRunner:
    """The runner of `rollout.multi_turn` (a `MultiTurnConfig` or its dict) over an engine's `generate`:
    environments from its `environment` spec, tool calls parsed and run by `rlstages.engines.tools`."""
    from rlstages.configs.rollout import MultiTurnConfig
    from rlstages.engines import tools

    cfg = settings if isinstance(settings, MultiTurnConfig) else MultiTurnConfig.model_validate(settings)
    spec = cfg.environment
    if spec is None:
        raise ValueError(
            "rollout.multi_turn.environment: expected an environment spec (e.g. tools: [{name: calculator}])"
        )
    budgets = Budgets(
        max_turns=cfg.max_turns,
        max_response_tokens=cfg.max_response_tokens,
        per_turn_max_tokens=cfg.per_turn_max_tokens,
        tool_output_max_tokens=cfg.tool_output_max_tokens,
        tool_timeout_s=spec.timeout_s,
        max_context_tokens=window,
        not_prefix_preserving=cfg.template_not_prefix_preserving,
    )
    hooks = ToolHooks(tools.parse_tool_calls, tools.run_tool_call)
    renderer = ChatRenderer(tokenizer, eos_ids, system_prompt)
    return MultiTurnRunner(
        renderer, generate, lambda: tools.build_environment(spec), hooks, budgets, eos_ids, cfg.assistant_prefill
    )


def multi_turn_enabled(settings: Any) -> bool:
    """Whether a `rollout.multi_turn` section (model, dict or None) turns multi-turn rollouts on."""
    if not settings:
        return False
    return bool(settings.get("enabled") if isinstance(settings, dict) else getattr(settings, "enabled", False))
