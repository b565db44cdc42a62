"""A multi-turn trajectory, token in / token out, and its rows in the batch contract.

A trajectory keeps the exact ids the engine was fed and sampled: the prompt, then the response as policy
turns and observations in engine order. `loss_mask` is 1 only on the tokens this policy sampled (each turn's
end-of-turn token included) and 0 on observations (tool results, template glue); the rollout log-probs are 0
there. In the batch, `response_mask` is the loss mask (every loss, KL, entropy and advantage reads it) and
`attention_mask` covers every real token; the outcome score lands on the last policy token because
`outcome_to_token_rewards` takes the mask's last 1. The rest (spans, tool calls, turn rewards, the stop
reason) travels as the per-row JSON field `trajectory`.

Non-goal: generating (`multi_turn`); parsing tool calls (`rlstages.engines.tools`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rlstages.engines import types as T
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.types import Prompt

TRAJECTORY = "trajectory"  # the per-row JSON field of a multi-turn batch
STOP_REASONS = ("done", "length", "max_turns", "context", "error")


@dataclass
class Span:
    """Tokens [start, end) of the response that one turn's role wrote (policy or observation)."""

    # "assistant" (sampled, mask 1), "observation" (tool results and template glue, mask 0) or "prefill" (the
    # configured start of the first policy turn, mask 0)
    role: str
    turn: int
    start: int
    end: int


@dataclass
class ToolCallRecord:
    """One tool call as the loop ran it."""

    turn: int
    name: str
    raw_arguments: str
    parsed: bool
    error: str | None
    latency_s: float
    truncated: bool


@dataclass
class Segment:
    """One training row: its prompt ids and response ids with the loss mask and rollout log-probs."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)

    def context(self) -> list[int]:
        """What the engine is fed next: the prompt and the response so far."""
        return self.prompt_ids + self.response_ids

    def add(self, role: str, turn: int, ids: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        """Append a turn's ids: sampled (with log-probs, mask 1) or an observation (mask 0, log-prob 0)."""
        start = len(self.response_ids)
        self.response_ids.extend(int(i) for i in ids)
        sampled = logprobs is not None
        self.loss_mask.extend([1 if sampled else 0] * len(ids))
        self.logprobs.extend([float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids))
        self.spans.append(Span(role, turn, start, len(self.response_ids)))


@dataclass
class Trajectory:
    """One sample's turns; `segments` has one row unless the template forced a new row per turn."""

    prompt: Prompt
    sample: int
    segments: list[Segment]
    messages: list[dict[str, Any]] = field(default_factory=list)  # for display; never re-tokenized
    tools: list[dict[str, Any]] = field(default_factory=list)  # the environment's tool schemas
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turns: int = 0
    stop_reason: str = ""
    final_text: str = ""  # the last policy turn's text: what the reward functions score
    env_reward: float | None = None
    error: str | None = None

    @property
    def current(self) -> Segment:
        """The row being extended."""
        return self.segments[-1]

    def response_tokens(self) -> int:
        """Response tokens so far over every row (the trajectory's budget counts them all)."""
        return sum(len(s.response_ids) for s in self.segments)

    def info(self, segment: int, decode: Callable[[list[int]], str]) -> dict[str, Any]:
        """The per-row JSON record (spans of that row, the trajectory's calls, rewards and stop reason, and the
        row decoded span by span for display)."""
        row = self.segments[segment]
        parts = [f"[prompt]{decode(row.prompt_ids)}[/prompt]"]
        for span in row.spans:
            tag = {"assistant": "policy", "prefill": "prefill"}.get(span.role, "obs")
            parts.append(f"[{tag}]{decode(row.response_ids[span.start : span.end])}[/{tag}]")
        return {
            "decoded": "".join(parts),
            "segment": segment,
            "segments": len(self.segments),
            "turns": self.turns,
            "stop_reason": self.stop_reason,
            "spans": [asdict(s) for s in self.segments[segment].spans],
            "tool_calls": [asdict(c) for c in self.tool_calls],
            "turn_rewards": self.turn_rewards,
            "env_reward": self.env_reward,
            "error": self.error,
        }


def build_trajectory_batch(
    trajectories: Sequence[Trajectory], pad_id: int, decode: Callable[[list[int]], str]
) -> TensorDict:
    """The batch of a step's trajectories, one row per segment, in trajectory order (prompt-major); `decode`
    (the tokenizer's, special tokens kept) writes each row's display text."""
    rows = [(t, i, s) for t in trajectories for i, s in enumerate(t.segments)]
    prompts = [s.prompt_ids for _, _, s in rows]
    prompt_t = T.pad_left(prompts, pad_id)
    width = max([len(s.response_ids) for _, _, s in rows] + [1])
    response_t = T.pad_right([s.response_ids for _, _, s in rows], pad_id, width)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.float32)
    logprobs = torch.zeros(len(rows), width, dtype=torch.float32)
    real = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (_, _, s) in enumerate(rows):
        n = len(s.response_ids)
        loss_mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        logprobs[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        real[i, :n] = 1
    lengths = torch.tensor([len(p) for p in prompts])
    prompt_mask = (torch.arange(prompt_t.shape[1]) >= (prompt_t.shape[1] - lengths)[:, None]).long()
    attention = torch.cat([prompt_mask, real], dim=1)
    tensors = {
        T.PROMPT_IDS: prompt_t,
        T.RESPONSE_IDS: response_t,
        T.ATTENTION_MASK: attention,
        T.POSITION_IDS: T.position_ids_from_mask(attention),
        T.RESPONSE_MASK: loss_mask,
        T.ROLLOUT_LOGPROBS: logprobs,
    }
    fields = {
        "uid": [t.prompt.uid for t, _, _ in rows],
        "prompt": [t.prompt.text for t, _, _ in rows],
        "response": [t.final_text for t, _, _ in rows],
        "ground_truth": [t.prompt.ground_truth for t, _, _ in rows],
        "data_source": [t.prompt.data_source for t, _, _ in rows],
        "extra_info": [t.prompt.extra_info for t, _, _ in rows],
        TRAJECTORY: [json.dumps(t.info(i, decode)) for t, i, _ in rows],
    }
    return T.make_batch(tensors, fields)


def trajectory_infos(batch: TensorDict) -> list[dict[str, Any]] | None:
    """The per-row trajectory records of a multi-turn batch, or None for a single-turn one."""
    if TRAJECTORY not in batch.keys():
        return None
    return [json.loads(x) for x in T.get_rows(batch, TRAJECTORY)]


def rollout_metrics(batch: TensorDict) -> dict[str, float]:
    """The multi-turn metrics of a batch: tool-call frequency, failure rate, latency p95, turns, stop reasons,
    tool-output truncation rate and the fraction of response tokens the loss mask leaves out."""
    infos = trajectory_infos(batch)
    if infos is None:
        return {}
    last = [x for x in infos if x["segment"] == x["segments"] - 1]  # one record per trajectory
    calls = [c for x in last for c in x["tool_calls"]]
    latencies = sorted(c["latency_s"] for c in calls)
    real = batch[T.ATTENTION_MASK][:, batch[T.PROMPT_IDS].shape[1] :].float()
    out = {
        "tools/call_frequency": len(calls) / max(len(last), 1),
        "tools/failure_rate": sum(c["error"] is not None for c in calls) / max(len(calls), 1),
        "tools/latency_p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))] if latencies else 0.0,
        "tools/truncation_rate": sum(c["truncated"] for c in calls) / max(len(calls), 1),
        "tools/trajectories_with_call": sum(bool(x["tool_calls"]) for x in last) / max(len(last), 1),
        "rollout/turns_mean": sum(x["turns"] for x in last) / max(len(last), 1),
        "rollout/masked_token_fraction": float(1 - batch[T.RESPONSE_MASK].sum() / real.sum().clamp(min=1)),
        "rollout/rows_per_trajectory": len(infos) / max(len(last), 1),
    }
    for reason in STOP_REASONS:
        out[f"rollout/stop_{reason}"] = float(sum(x["stop_reason"] == reason for x in last))
    return out


def decoded_table(batch: TensorDict, limit: int) -> dict[str, list[Any]]:
    """Up to `limit` rows as an MLflow table: each row's prompt and response decoded span by span, policy text
    in [policy]...[/policy] and observations in [obs]...[/obs], so who wrote which tokens is visible."""
    infos = (trajectory_infos(batch) or [])[:limit]
    return {
        "uid": T.get_rows(batch, "uid")[: len(infos)],
        "stop_reason": [x["stop_reason"] for x in infos],
        "turns": [x["turns"] for x in infos],
        "tool_calls": [len(x["tool_calls"]) for x in infos],
        "tool_errors": [sum(c["error"] is not None for c in x["tool_calls"]) for x in infos],
        "trajectory": [x["decoded"] for x in infos],
    }
