"""Streaming generation on the vLLM rollout engine (partial rollouts, issue 51): the same stream interface as the HF
engine's (`streaming.StreamingMixin`: start_stream / submit / pump / in_flight / set_policy_version / stop_stream),
built on vLLM's own continuous batching and its pause API.

- Rows are requests of `LLM.llm_engine` (`add_request`, one sample each, its own seed); `pump` resumes the scheduler
  (`LLM.wake_up(tags=["scheduling"])`), collects up to `max_steps` of `LLMEngine.step()`'s outputs (DELTA: each
  output carries the new tokens and their log-probs), and pauses it again keeping the requests and their KV
  (`LLM.sleep(level=0, mode="keep")`, vLLM's `pause_scheduler`): between two pumps the engine is frozen, as the HF
  stream is, so a weight update lands between two pumps.
- A weight update interrupts the rows in flight: before any weights are loaded (`update_weights`,
  `receive_weight_group`, and before `generate`, `sleep`) every request is aborted by the pause API
  (`LLM.sleep(level=0, mode="abort")`), the aborted requests' last outputs are drained, and each unfinished row waits
  to be resubmitted as a new request: prompt + its tokens so far, the remaining budget, a fresh seed. vLLM prefills
  that prefix under whatever weights are loaded then, so the KV is recomputed: a continued row's next tokens are
  the new policy's exactly (tests/engines/rollout/test_vllm_rollout.py). `kv_on_update: keep` is not offered (refused).
- Every token keeps the policy version its request was submitted under (`policy_version`, set by the sync) and its
  behaviour log-prob (vLLM's `processed_logprobs`, as in `generate`).

Stop strings are passed to vLLM and cut again on the finished row's text (a stop string straddling an interruption
is found there). Non-goal: multi-turn and image prompts (refused), as for the HF stream.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlstages.engines.rollout.batching import format_prompts, truncate_response
from rlstages.engines.rollout.streaming import FinishedGroup, GroupRequest
from rlstages.engines.types import SamplingParams

_SERIALS = itertools.count()


@dataclass
class _Row:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    parts: int = 0  # requests this row has been submitted as
    interrupted: int = 0  # weight updates it lived through


@dataclass
class _VStream:
    sampling: SamplingParams
    seed: int
    rows: dict[tuple[int, int], _Row] = field(default_factory=dict)  # (group, sample) -> row, until its group ends
    pending: deque[tuple[int, int]] = field(default_factory=deque)  # rows to (re)submit, in order
    live: dict[str, tuple[tuple[int, int], int]] = field(default_factory=dict)  # request id -> (row, its version)
    done: dict[int, set[int]] = field(default_factory=dict)  # group -> finished samples
    sizes: dict[int, int] = field(default_factory=dict)  # group -> n
    serial: int = field(default_factory=lambda: next(_SERIALS))  # request ids unique across streams
    ready: list[FinishedGroup] = field(default_factory=list)  # groups finished while interrupting, for the next pump


_QUIESCE = (
    "update_weights",
    "receive_weight_group",
    "generate",
    "sleep",
)  # the engine's methods that interrupt the stream first


def _interrupting(method: Callable[..., Any], resume: bool) -> Callable[..., Any]:
    """`method`, preceded by an interruption of the stream (and, with `resume`, the scheduler running again)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._interrupt()
        if resume:
            self._resume()
        return method(self, *args, **kwargs)

    return wrapper


def wrap_quiescing(cls: type, names: tuple[str, ...]) -> None:
    """Wrap `cls`'s own methods `names` (those that need the engine idle) so each interrupts the stream first;
    `generate` and `sleep` also let the scheduler run again. The vLLM and SGLang streams' `__init_subclass__`."""
    for name in names:
        setattr(cls, name, _interrupting(getattr(cls, name), resume=name in ("generate", "sleep")))


class VLLMStreamingMixin:
    """The stream methods of `VLLMRolloutEngine` (module docstring); the engine's own methods that touch weights or
    the scheduler interrupt the stream first."""

    llm: Any
    tokenizer: Any
    eos_ids: set[int]
    pad_id: int
    apply_chat_template: bool
    system_prompt: str | None
    multi_turn: Any
    image_model: Any
    policy_version: int = 0
    _vstream: _VStream | None = None
    _paused: bool = False  # the stream paused vLLM's scheduler (between two pumps, or after an interruption)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The engine's own methods that need the engine idle (it defines them, so they come first in the MRO) are
        wrapped here: each interrupts the stream first (`generate` and `sleep` also let the scheduler run again)."""
        super().__init_subclass__(**kwargs)
        wrap_quiescing(cls, _QUIESCE)

    def start_stream(self, sampling: SamplingParams, seed: int) -> None:
        """A fresh stream (anything in flight is aborted and dropped), sampling with `sampling`, seeds from `seed`."""
        if self.multi_turn is not None or self.image_model is not None:
            raise ValueError("streaming generation takes text prompts only (no multi-turn, no images)")
        self.stop_stream()
        self._vstream = new_stream(sampling, seed)

    def submit(self, groups: list[GroupRequest]) -> None:
        """Queue these groups' rows (sample-major within a group); they become vLLM requests at the next pump."""
        stream = self._live()
        ids = format_prompts(self.tokenizer, [g.prompt for g in groups], self.apply_chat_template, self.system_prompt)
        stream_rows(stream, groups, ids)

    def pump(self, max_steps: int = 1) -> list[FinishedGroup]:
        """Resume vLLM, take up to `max_steps` engine steps' outputs, pause it again (requests and KV kept); the
        groups whose every row has finished, in the order they finished."""
        stream = self._live()
        self.wake()  # type: ignore[attr-defined]  # what `sleep` freed
        finished, stream.ready = stream.ready, []
        self._submit_pending(stream)
        self._resume()
        try:
            for _ in range(max_steps):
                if not stream.live:
                    break
                for out in self.llm.llm_engine.step():
                    finished += self._take(stream, out)
        finally:
            self.llm.sleep(level=0, mode="keep")
            self._paused = True
        return finished

    def in_flight(self) -> int:
        """Rows submitted and not yet handed back (waiting to be submitted, requests in vLLM, finished groups that
        the next pump returns)."""
        return rows_in_flight(self._vstream)

    def in_flight_rows(self) -> list[tuple[int, int, int]]:
        """The rows a weight update interrupts (group, sample, tokens so far): the schedule records them."""
        return unfinished_rows(self._vstream)

    def set_policy_version(self, version: int, kv_on_update: str = "recompute") -> None:
        """The weights were just updated to policy `version`: later requests carry it; the rows interrupted by the
        update (aborted before it) continue from their tokens so far, prefilled under the new weights."""
        if kv_on_update != "recompute":
            raise ValueError(
                f"kv_on_update={kv_on_update}: the vLLM stream continues interrupted rows by resubmitting prompt + "
                "tokens so far (KV recomputed); only kv_on_update: recompute is possible (keep: rollout.backend hf)"
            )
        self._interrupt()  # no-op when the weights came through update_weights (it interrupted already)
        stream = self._vstream
        if stream is not None and version != self.policy_version:
            for key in stream.pending:
                row = stream.rows[key]
                row.interrupted += bool(row.ids)
        self.policy_version = version

    def stop_stream(self) -> None:
        """Abort whatever is in flight and drop the stream; the scheduler runs again for `generate`."""
        self._interrupt()
        self._vstream = None
        self._resume()

    def _live(self) -> _VStream:
        if self._vstream is None:
            raise RuntimeError("no stream: call start_stream first")
        return self._vstream

    def _resume(self) -> None:
        if self._paused:
            self.llm.wake_up(tags=["scheduling"])
            self._paused = False

    def _submit_pending(self, stream: _VStream) -> None:
        """Each waiting row as a vLLM request: prompt + tokens so far, the rest of the budget, a seed of its own."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        s = stream.sampling
        while stream.pending:
            key = stream.pending.popleft()
            row = stream.rows[key]
            params = VSamplingParams(
                n=1,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                max_tokens=s.max_new_tokens - len(row.ids),
                stop=list(s.stop) or None,
                logprobs=0,
                seed=hash((stream.seed, key, row.parts)) % 2**63,  # ints and tuples of ints hash the same every run
                detokenize=bool(s.stop),
                output_kind=RequestOutputKind.DELTA,  # each step's new tokens only
            )
            rid = f"rls-stream-{stream.serial}-{key[0]}-{key[1]}-{row.parts}"  # outputs carry this id
            self.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=row.prompt_ids + row.ids), params)
            row.parts += 1
            stream.live[rid] = (key, self.policy_version)

    def _take(self, stream: _VStream, out: Any) -> list[FinishedGroup]:
        """One request's new tokens; a finished row (its group too, once complete), or an aborted one set aside."""
        if out.request_id not in stream.live:
            return []
        key, version = stream.live[out.request_id]
        row, sample = stream.rows[key], out.outputs[0]
        new = list(sample.token_ids)
        row.ids += new
        row.logprobs += [float(sample.logprobs[t][tok].logprob) for t, tok in enumerate(new)]
        row.versions += [version] * len(new)
        if not out.finished:
            return []
        del stream.live[out.request_id]
        if sample.finish_reason == "abort" and not row_done(row, self.eos_ids, stream.sampling.max_new_tokens):
            stream.pending.append(key)  # interrupted: resubmitted at the next pump
            return []
        group = key[0]
        stream.done[group].add(key[1])
        if len(stream.done[group]) < stream.sizes[group]:
            return []
        return [finish_group(stream, group, self.tokenizer, self.eos_ids, self.pad_id)]

    def _interrupt(self) -> None:
        """Abort every request of the stream through vLLM's pause API and drain their last outputs; the unfinished
        rows wait (in their order) to be resubmitted. vLLM is left paused."""
        stream = self._vstream
        if stream is None or not stream.live:
            return
        self.llm.sleep(level=0, mode="abort")
        self._paused = True
        waiting = list(stream.pending)
        stream.pending.clear()
        while stream.live:
            for out in self.llm.llm_engine.step():
                stream.ready += self._take(stream, out)  # rows that ended just before the abort: kept
        stream.pending = deque(sorted(stream.pending))  # the interrupted rows first, then those not yet submitted
        stream.pending.extend(waiting)


def new_stream(sampling: SamplingParams, seed: int) -> _VStream:
    """An empty stream's bookkeeping (shared with the SGLang stream)."""
    return _VStream(sampling, seed)


def stream_rows(stream: _VStream, groups: list[GroupRequest], prompt_ids: list[list[int]]) -> None:
    """The groups' rows (sample-major), waiting to be submitted; a group already in flight is refused."""
    for g, ids in zip(groups, prompt_ids, strict=True):
        if g.group in stream.sizes:
            raise ValueError(f"submit: group {g.group} is already in flight")
        stream.sizes[g.group], stream.done[g.group] = g.n, set()
        for i in range(g.n):
            stream.rows[(g.group, i)] = _Row(list(ids))
            stream.pending.append((g.group, i))


def rows_in_flight(stream: _VStream | None) -> int:
    """Rows submitted to `stream` and not yet handed back by a pump."""
    if stream is None:
        return 0
    return len(stream.pending) + len(stream.live) + sum(len(g.ids) for g in stream.ready)


def unfinished_rows(stream: _VStream | None) -> list[tuple[int, int, int]]:
    """The rows a weight update would interrupt now (group, sample, tokens so far), in (group, sample) order:
    unfinished rows that are requests in the engine or have tokens (not those only queued, never started)."""
    if stream is None:
        return []
    live = {key for key, _ in stream.live.values()}
    return sorted(
        (g, m, len(r.ids))
        for (g, m), r in stream.rows.items()
        if m not in stream.done.get(g, set()) and ((g, m) in live or r.ids)
    )


def row_done(row: _Row, eos_ids: set[int], limit: int) -> bool:
    """Whether a row has ended (EOS, or its token budget), whatever its last request's finish reason says."""
    return bool(row.ids) and row.ids[-1] in eos_ids or len(row.ids) >= limit


def finish_group(stream: _VStream, group: int, tokenizer: Any, eos_ids: set[int], pad_id: int) -> FinishedGroup:
    """A finished group's rows in sample order, cut after EOS and stop strings, with their versions."""
    n, stop, limit = stream.sizes.pop(group), stream.sampling.stop, stream.sampling.max_new_tokens
    stream.done.pop(group)
    rows = [stream.rows.pop((group, i)) for i in range(n)]
    ids, lps, versions, texts = [], [], [], []
    for row in rows:
        cut, cut_lps = truncate_response(row.ids, row.logprobs, eos_ids, limit)
        cut, cut_lps, text = _cut_at_stop(tokenizer, cut, cut_lps, stop)
        ids.append(cut)
        lps.append(cut_lps)
        versions.append(row.versions[: len(cut)])
        texts.append(text)
    interrupted = sum(r.interrupted > 0 for r in rows)
    return FinishedGroup(group, rows[0].prompt_ids, ids, lps, versions, texts, interrupted, pad_id)


def _cut_at_stop(
    tokenizer: Any, ids: list[int], lps: list[float], stop: tuple[str, ...]
) -> tuple[list[int], list[float], str]:
    """The row cut after the first token at which a stop string has appeared, and its text."""
    text = str(tokenizer.decode(ids, skip_special_tokens=True))
    if stop and any(s in text for s in stop):
        for k in range(1, len(ids) + 1):
            part = str(tokenizer.decode(ids[:k], skip_special_tokens=True))
            if any(s in part for s in stop):
                return ids[:k], lps[:k], part
    return ids, lps, text
