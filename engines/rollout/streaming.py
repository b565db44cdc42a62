"""Streaming generation on the HF rollout engine (partial rollouts, issue 51): prompt groups are submitted as they
are admitted, decoded together in one long-lived `slots.SlotDecoder`, and handed back as each group finishes; a
weight update between two pumps interrupts the sequences in flight, which continue under the new weights (their KV
cache recomputed by default) -- every token keeps the policy version that produced it and its behaviour log-prob.

    engine.start_stream(sampling, seed)        # one stream per run (or recovery)
    engine.submit([GroupRequest(7, prompt, n)])
    engine.pump(4)                             # <= 4 decode steps; the groups that finished since
    engine.update_weights(...)                 # the sync, between two pumps
    engine.set_policy_version(k, "recompute")  # the live rows continue under version k

A mixin of `HFRolloutEngine` (its model, tokenizer, batch size, picker and stop checks). The stream decodes with the
eager step (`slots.HFStep`, every architecture); the static-cache fast step is for the synchronous `generate`.
Non-goal: multi-turn and image prompts (refused); vLLM / SGLang streaming.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rlstages.engines.rollout.batching import format_prompts
from rlstages.engines.rollout.decode import Picker
from rlstages.engines.rollout.slots import HFStep, KvOnUpdate, RowRequest, SlotDecoder, SlotRow
from rlstages.engines.types import Prompt, SamplingParams


@dataclass(frozen=True)
class GroupRequest:
    """One prompt group to generate: the caller's group number, its prompt and how many samples (`n`)."""

    group: int
    prompt: Prompt
    n: int


@dataclass
class FinishedGroup:
    """A finished group's rows, in sample order: prompt ids, sampled ids, their log-probs and policy versions, the
    decoded texts (stop strings applied), and how many of its rows lived through a weight update."""

    group: int
    prompt_ids: list[int]
    ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    texts: list[str]
    interrupted: int
    pad_id: int


@dataclass
class _Stream:
    decoder: SlotDecoder
    pick: Picker
    sampling: SamplingParams
    pending: deque[RowRequest] = field(default_factory=deque)
    rows: dict[int, dict[int, SlotRow]] = field(default_factory=dict)  # group -> sample -> finished row
    sizes: dict[int, int] = field(default_factory=dict)  # group -> n
    prompts: dict[int, list[int]] = field(default_factory=dict)  # group -> prompt ids


class StreamingMixin:
    """`start_stream` / `submit` / `pump` / `in_flight` / `set_policy_version` on an `HFRolloutEngine`."""

    model: Any
    device: torch.device
    tokenizer: Any
    batch_size: int
    apply_chat_template: bool
    system_prompt: str | None
    eos_ids: set[int]
    pad_id: int
    policy_version: int
    multi_turn: Any
    image_processor: Any
    _stream: _Stream | None = None

    def start_stream(self, sampling: SamplingParams, seed: int) -> None:
        """A fresh stream (anything in flight is dropped): `batch_size` slots, this sampling, torch seeded."""
        if self.multi_turn is not None or self.image_processor is not None:
            raise ValueError("streaming generation takes text prompts only (no multi-turn, no images)")
        torch.manual_seed(seed)
        step = HFStep(self.model, self.device)
        stopped = self._stop_check(sampling.stop)  # type: ignore[attr-defined]
        decoder = SlotDecoder(self.batch_size, step, self.eos_ids, stopped, version=self.policy_version)
        self._stream = _Stream(decoder, self._picker(sampling), sampling)  # type: ignore[attr-defined]

    def submit(self, groups: list[GroupRequest]) -> None:
        """Queue these groups' rows (sample-major within a group); they enter slots as slots free up."""
        stream = self._live()
        ids = format_prompts(self.tokenizer, [g.prompt for g in groups], self.apply_chat_template, self.system_prompt)
        limit = stream.sampling.max_new_tokens
        for g, prompt_ids in zip(groups, ids, strict=True):
            if g.group in stream.sizes:
                raise ValueError(f"submit: group {g.group} is already in flight")
            stream.sizes[g.group], stream.prompts[g.group], stream.rows[g.group] = g.n, prompt_ids, {}
            stream.pending.extend(RowRequest((g.group, i), prompt_ids, limit) for i in range(g.n))

    @torch.no_grad()
    def pump(self, max_steps: int = 1) -> list[FinishedGroup]:
        """Up to `max_steps` decode steps (free slots refilled from the submitted rows before each); the groups
        whose every row has finished, in the order they finished."""
        stream = self._live()
        decoder, done = stream.decoder, []
        for _ in range(max_steps):
            free = decoder.free_slots()
            if stream.pending and free:
                decoder.admit([stream.pending.popleft() for _ in range(min(free, len(stream.pending)))])
            if not decoder.rows:
                break
            for row in decoder.step(stream.pick):
                group, sample = row.key
                stream.rows[group][sample] = row
                if len(stream.rows[group]) == stream.sizes[group]:
                    done.append(self._finish(stream, group))
        return done

    def in_flight(self) -> int:
        """Rows submitted and not yet finished (pending or decoding)."""
        stream = self._stream
        if stream is None:
            return 0
        return len(stream.pending) + len(stream.decoder.rows)

    def in_flight_rows(self) -> list[tuple[int, int, int]]:
        """The rows decoding now (group, sample, tokens so far), in slot order: what a weight update interrupts."""
        stream = self._stream
        if stream is None:
            return []
        return [(int(r.key[0]), int(r.key[1]), len(r.ids)) for r in stream.decoder.rows]

    def set_policy_version(self, version: int, kv_on_update: KvOnUpdate = "recompute") -> None:
        """The weights were just updated to policy `version`: later tokens carry it, and the rows in flight
        continue under the new weights (`SlotDecoder.on_weights_updated`: KV recomputed, or kept)."""
        self.policy_version = version
        if self._stream is not None:
            self._stream.decoder.on_weights_updated(version, kv_on_update)

    def stop_stream(self) -> None:
        """Drop the stream and whatever is in flight in it."""
        self._stream = None

    def _live(self) -> _Stream:
        if self._stream is None:
            raise RuntimeError("no stream: call start_stream first")
        return self._stream

    def _finish(self, stream: _Stream, group: int) -> FinishedGroup:
        rows = stream.rows.pop(group)
        n, prompt_ids = stream.sizes.pop(group), stream.prompts.pop(group)
        out = [rows[i] for i in range(n)]
        ids, lps = [r.ids for r in out], [r.logprobs for r in out]
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in ids]
        ids, lps, texts = self._apply_stop(ids, lps, texts, stream.sampling.stop)  # type: ignore[attr-defined]
        versions = [r.versions[: len(i)] for r, i in zip(out, ids, strict=True)]
        interrupted = sum(r.interrupted > 0 for r in out)
        return FinishedGroup(group, prompt_ids, ids, lps, versions, texts, interrupted, self.pad_id)


def stamp_version(engine: Any, version: int) -> None:
    """Run inside a rollout worker after each weight sync (and at start with the checkpoint's step): the engine's
    `policy_version`, stamped on every token it samples from now on, is `version`. The engine may sit inside a
    hybrid worker (`.rollout`); an engine without versions (vLLM, SGLang) is left alone."""
    target = getattr(engine, "rollout", engine)
    if hasattr(target, "policy_version"):
        target.policy_version = version
