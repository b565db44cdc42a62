"""Streaming generation on the SGLang rollout engine (partial rollouts, issue 51): the stream interface of
`streaming.StreamingMixin`, on SGLang's own continuous batching and its pause API. WRITTEN, NOT RUN: SGLang has no
CPU build; the calls follow SGLang's `Engine` API (sgl-project/sglang, python/sglang/srt/entrypoints/engine.py and
its tokenizer manager: `async_generate(..., stream=True, rid=...)`, `pause_generation(mode)` with modes "abort",
"retract", "in_place", `continue_generation()`), the way `vllm_streaming.py` does it on vLLM (which ran here).

- Each row is one streamed SGLang request (`async_generate(input_ids=..., return_logprob=True, stream=True)`, one
  sample, its own `sampling_seed`), consumed by an asyncio task on the engine's own event loop (`Engine.loop`).
  `pump` resumes the scheduler (`continue_generation`), runs that loop for a slice (`PUMP_SLICE_S` per step asked
  for, or until a row finishes), then freezes the scheduler with its requests and KV in place
  (`pause_generation(mode="in_place")`): between two pumps nothing decodes, as in the HF and vLLM streams.
- A weight update interrupts the rows: `pause_generation(mode="abort")` aborts every request (their streams end
  with finish_reason "abort"), the tasks are drained, and each unfinished row is resubmitted as a new request of
  prompt + its tokens so far with the rest of its budget: SGLang prefills that prefix under the new weights (the
  radix cache is flushed by `update_weights`), so the KV is recomputed. `kv_on_update: keep` is refused.
- Every token keeps the policy version its request was submitted under and its behaviour log-prob
  (`meta_info["output_token_logprobs"]`, cumulative per chunk in SGLang's default non-incremental streaming).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from rlstages.engines.rollout.batching import format_prompts
from rlstages.engines.rollout.streaming import FinishedGroup, GroupRequest
from rlstages.engines.rollout.vllm_streaming import (
    finish_group,
    new_stream,
    row_done,
    rows_in_flight,
    stream_rows,
    unfinished_rows,
    wrap_quiescing,
)
from rlstages.engines.types import SamplingParams

PUMP_SLICE_S = 0.02  # event-loop time per decode step asked for (SGLang's scheduler decodes on its own)


_QUIESCE = (
    "update_weights",
    "begin_weight_group_update",
    "generate",
    "sleep",
)  # the engine's methods that interrupt the stream first


class SGLangStreamingMixin:
    """The stream methods of `SGLangRolloutEngine` (module docstring)."""

    engine: Any
    tokenizer: Any
    eos_ids: set[int]
    pad_id: int
    apply_chat_template: bool
    system_prompt: str | None
    image_model: Any
    vision_ids: list[int]
    policy_version: int = 0
    _sstream: Any = None
    _tasks: dict[str, asyncio.Task[Any]]
    _paused: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The engine's own methods that need the engine idle (it defines them, so they come first in the MRO) are
        wrapped here: each interrupts the stream first (`generate` and `sleep` also let the scheduler run again)."""
        super().__init_subclass__(**kwargs)
        wrap_quiescing(cls, _QUIESCE)

    def start_stream(self, sampling: SamplingParams, seed: int) -> None:
        """A fresh stream (anything in flight aborted and dropped)."""
        if self.image_model is not None:
            raise ValueError("streaming generation takes text prompts only (no images)")
        self.stop_stream()
        self._sstream, self._tasks = new_stream(sampling, seed), {}

    def submit(self, groups: list[GroupRequest]) -> None:
        """Queue these groups' rows; they become SGLang requests at the next pump."""
        stream = self._live()
        ids = format_prompts(self.tokenizer, [g.prompt for g in groups], self.apply_chat_template, self.system_prompt)
        stream_rows(stream, groups, ids)

    def pump(self, max_steps: int = 1) -> list[FinishedGroup]:
        """Resume SGLang, let its requests decode for a slice, freeze them again; the groups finished."""
        stream = self._live()
        self.wake()  # type: ignore[attr-defined]
        self._submit_pending(stream)
        self._resume()
        loop = self.engine.loop
        try:
            if self._tasks:
                loop.run_until_complete(
                    asyncio.wait(
                        list(self._tasks.values()), timeout=PUMP_SLICE_S * max_steps, return_when="FIRST_COMPLETED"
                    )
                )
        finally:
            self.engine.pause_generation(mode="in_place")
            self._paused = True
        finished, stream.ready = stream.ready, []
        return finished + self._collect(stream)

    def in_flight(self) -> int:
        """Rows submitted and not yet handed back by a pump."""
        return rows_in_flight(self._sstream)

    def in_flight_rows(self) -> list[tuple[int, int, int]]:
        """The rows a weight update interrupts (group, sample, tokens so far): the schedule records them."""
        return unfinished_rows(self._sstream)

    def set_policy_version(self, version: int, kv_on_update: str = "recompute") -> None:
        """Weights now at policy `version`: the interrupted rows continue from their prefix, prefilled anew."""
        if kv_on_update != "recompute":
            raise ValueError(
                f"kv_on_update={kv_on_update}: the SGLang stream resubmits interrupted rows (KV recomputed); only "
                "kv_on_update: recompute is possible (keep: rollout.backend hf)"
            )
        self._interrupt()
        stream = self._sstream
        if stream is not None and version != self.policy_version:
            for key in stream.pending:
                stream.rows[key].interrupted += bool(stream.rows[key].ids)
        self.policy_version = version

    def stop_stream(self) -> None:
        """Abort whatever is in flight and drop the stream; the scheduler runs again for `generate`."""
        self._interrupt()
        self._sstream = None
        self._resume()

    def _live(self) -> Any:
        if self._sstream is None:
            raise RuntimeError("no stream: call start_stream first")
        return self._sstream

    def _resume(self) -> None:
        if self._paused:
            self.engine.continue_generation()
            self._paused = False

    def _submit_pending(self, stream: Any) -> None:
        """Each waiting row as a streamed request: prompt + tokens so far, the rest of the budget, its own seed."""
        while stream.pending:
            key = stream.pending.popleft()
            row = stream.rows[key]
            params = request_params(stream.sampling, hash((stream.seed, key, row.parts)) % 2**63, self.vision_ids)
            params["max_new_tokens"] = stream.sampling.max_new_tokens - len(row.ids)
            rid = f"rls-stream-{stream.serial}-{key[0]}-{key[1]}-{row.parts}"
            row.parts += 1
            stream.live[rid] = (key, self.policy_version)
            chunks = self.engine.async_generate(
                input_ids=row.prompt_ids + row.ids, sampling_params=params, return_logprob=True, stream=True, rid=rid
            )
            self._tasks[rid] = self.engine.loop.create_task(_last_chunk(chunks))

    def _collect(self, stream: Any) -> list[FinishedGroup]:
        """The finished requests' tokens into their rows; aborted ones set aside; the groups completed."""
        finished: list[FinishedGroup] = []
        for rid in [r for r, task in self._tasks.items() if task.done()]:
            out = self._tasks.pop(rid).result()
            key, version = stream.live.pop(rid)
            entries = out["meta_info"].get("output_token_logprobs") or []
            row = stream.rows[key]
            row.ids += [int(e[1]) for e in entries]
            row.logprobs += [float(e[0]) for e in entries]
            row.versions += [version] * len(entries)
            reason = (out["meta_info"].get("finish_reason") or {}).get("type")
            if reason == "abort" and not row_done(row, self.eos_ids, stream.sampling.max_new_tokens):
                stream.pending.append(key)
                continue
            group = key[0]
            stream.done[group].add(key[1])
            if len(stream.done[group]) == stream.sizes[group]:
                finished.append(finish_group(stream, group, self.tokenizer, self.eos_ids, self.pad_id))
        return finished

    def _interrupt(self) -> None:
        """Abort every request of the stream (`pause_generation(mode="abort")`) and drain the streams; the unfinished
        rows wait to be resubmitted. SGLang is left paused."""
        stream = self._sstream
        if stream is None or not self._tasks:
            return
        self._resume()  # an in-place pause is lifted so the abort reaches the frozen requests
        self.engine.pause_generation(mode="abort")
        self._paused = True
        waiting = list(stream.pending)
        stream.pending.clear()
        self.engine.loop.run_until_complete(asyncio.wait(list(self._tasks.values())))
        stream.ready += self._collect(stream)  # rows that ended just before the abort: kept for the next pump
        stream.pending = deque(sorted(stream.pending))
        stream.pending.extend(waiting)


def request_params(sampling: SamplingParams, seed: int, banned: list[int] | tuple[int, ...] = ()) -> dict[str, Any]:
    """One request's `sampling_params` dict for `sglang.Engine.generate` (one sample per request); `banned` token
    ids (a VLM's vision tokens) get a -100 logit bias."""
    out: dict[str, Any] = {
        "n": 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # SGLang: -1 disables
        "max_new_tokens": sampling.max_new_tokens,
        "stop": list(sampling.stop) or None,
        "sampling_seed": seed,
    }
    if banned:
        out["logit_bias"] = {str(t): -100.0 for t in banned}
    return out


async def _last_chunk(chunks: Any) -> dict[str, Any]:
    """The last chunk of a streamed SGLang request (cumulative: all its tokens and log-probs, its finish reason)."""
    last: dict[str, Any] = {}
    async for chunk in await chunks:
        last = chunk
    return last
