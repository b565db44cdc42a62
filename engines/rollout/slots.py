"""Continuous batching for the HF rollout: a fixed number of slots, rows admitted into the slots that finished
rows free, each sampled token stamped with the policy version that produced it and its log-prob.

One engine for the synchronous rollout (`HFRolloutEngine.generate` keeps the batch full from its pending rows)
and the asynchronous one (issue 51's streaming methods admit groups as they come and update the weights between
steps: `on_weights_updated` recomputes the live rows' KV cache under the new weights, or keeps it, recorded).

The live rows are kept in admission order (a finished row leaves, the others close up): sampling draws one
uniform per live row in that order, so the same admissions in the same order with the same seed give the same
tokens bitwise. The KV cache of the live rows is right-aligned: every live row's last fed token sits in the last
column, a newly admitted row's prefill is left-padded (masked) to the cache's width, and columns masked for
every row are trimmed. The decode step is pluggable (`DecodeStep`): `HFStep` is the eager transformers forward
over a `DynamicCache` (every architecture: the fallback); `fast_step` builds the static-cache one.

Non-goal: multi-turn and image prompts (they keep `decode.decode`); paged attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from rlstages.engines.rollout.decode import Picker, cache_arg, left_pad, prefill

KvOnUpdate = Literal["recompute", "keep"]


@dataclass(frozen=True)
class RowRequest:
    """One row to decode: the caller's key for it, its prompt's token ids and its limit of new tokens."""

    key: Any
    prompt_ids: list[int]
    limit: int


@dataclass
class SlotRow:
    """A row's state: its sampled ids, their log-probs and policy versions; `interrupted`: weight updates it
    lived through; `kv_kept`: those of them that kept the old weights' KV cache (`on_weights_updated(kv="keep")`)."""

    key: Any
    prompt_ids: list[int]
    limit: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    interrupted: int = 0
    kv_kept: int = 0


class DecodeStep(Protocol):
    """The model side of a `SlotDecoder`: a KV cache over the live rows, in their order. `CALL_SCOPED`: nothing of
    it outlives the generate call that built it, so that call may run it under `torch.inference_mode`."""

    CALL_SCOPED: bool

    def prefill(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append rows (token ids to feed) after the live ones; returns their next-token logits [k, V]."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per live row [n]; returns the next-token logits [n, V]."""

    def select(self, keep: list[int]) -> None:
        """Keep only these live rows (indices, ascending), in that order."""

    def rewind(self) -> None:
        """Drop the last fed token of every live row from the cache (it is fed again)."""

    def clear(self) -> None:
        """Drop every row."""

    def weights_changed(self) -> None:
        """The model's weights changed in place (a step holding its own copy of them takes it again)."""


class SlotDecoder:
    """Continuous batching over `slots` rows with a `DecodeStep`; rows end at an EOS id, their limit, or when
    `stopped` (their ids so far) says so."""

    def __init__(
        self,
        slots: int,
        step: DecodeStep,
        eos_ids: set[int],
        stopped: Callable[[list[int]], bool] | None = None,
        version: int = 0,
    ) -> None:
        self.slots = slots
        self.model_step = step
        self.eos_ids = set(eos_ids)
        self.stopped = stopped
        self.version = version
        self.rows: list[SlotRow] = []
        self.logits: torch.Tensor | None = None  # the next token's logits of each live row
        # a compiled step's own picks of the next tokens (ids, log-probs), made with the logits (`forward_pick`)
        self.picked: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pending: torch.Tensor | None = None  # the logits of rows admitted after those picks

    def free_slots(self) -> int:
        """Slots not holding a live row."""
        return self.slots - len(self.rows)

    def live_rows(self) -> list[SlotRow]:
        """The live rows, in sampling order."""
        return list(self.rows)

    def admit(self, requests: Sequence[RowRequest]) -> None:
        """Prefill new rows into free slots (rows of one prompt share its prefill); never more than are free."""
        if not requests:
            return
        if len(requests) > self.free_slots():
            raise ValueError(f"admit: {len(requests)} rows for {self.free_slots()} free slots")
        if any(r.limit < 1 or not r.prompt_ids for r in requests):
            raise ValueError("admit: every row needs prompt ids and a limit of at least one token")
        logits = self.model_step.prefill([r.prompt_ids for r in requests])
        self.rows.extend(SlotRow(r.key, list(r.prompt_ids), r.limit) for r in requests)
        if self.picked is not None:  # the live rows' next tokens are picked: these rows' are picked at the step
            self.pending = logits if self.pending is None else torch.cat([self.pending, logits])
        else:
            self.logits = logits if self.logits is None else torch.cat([self.logits, logits])

    def step(self, pick: Picker) -> list[SlotRow]:
        """One decode step for every live row: a token sampled (stamped with `self.version` and its log-prob)
        for each; the rows that end leave and are returned, the others' tokens are fed to the model."""
        if not self.rows or self.logits is None:
            return []
        ids, logprobs = self._pick(pick)
        # one device read per step: tokens and log-probs together (float64 holds every token id exactly)
        picked = torch.stack([ids.to(torch.float64), logprobs.to(torch.float64)]).tolist()
        finished: list[SlotRow] = []
        keep: list[int] = []
        for i, (row, token, lp) in enumerate(zip(self.rows, picked[0], picked[1], strict=True)):
            token = int(token)
            row.ids.append(token)
            row.logprobs.append(lp)
            row.versions.append(self.version)
            done = token in self.eos_ids or len(row.ids) >= row.limit
            if not done and self.stopped is not None and self.stopped(row.ids):
                done = True
            if done:
                finished.append(row)
            else:
                keep.append(i)
        if not keep:
            self.rows, self.logits, self.picked, self.pending = [], None, None, None
            self.model_step.clear()
            return finished
        if len(keep) < len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            self.model_step.select(keep)
            ids = ids[torch.tensor(keep, device=ids.device)]
        fused = getattr(self.model_step, "forward_pick", None)  # a compiled step picks inside its forward
        self.picked = fused(ids, getattr(pick, "fused", None)) if fused is not None else None
        self.logits = self.model_step.forward(ids) if self.picked is None else ids  # (logits unread then)
        return finished

    def _pick(self, pick: Picker) -> tuple[torch.Tensor, torch.Tensor]:
        """The live rows' next tokens: the compiled step's picks (rows admitted since then picked here), else
        `pick` of the logits."""
        if self.picked is None:
            assert self.logits is not None, "a step before any prefill"
            return pick(self.logits)
        ids, logprobs = self.picked
        if self.pending is not None:
            new_ids, new_lps = pick(self.pending)
            ids, logprobs = torch.cat([ids, new_ids]), torch.cat([logprobs, new_lps])
        self.picked = self.pending = None
        return ids, logprobs

    def drain(self, pick: Picker) -> list[SlotRow]:
        """Step until no row is live; the finished rows in the order they ended."""
        out: list[SlotRow] = []
        while self.rows:
            out.extend(self.step(pick))
        return out

    def on_weights_updated(self, version: int, kv: KvOnUpdate = "recompute") -> None:
        """The model's weights changed in place: `recompute` rebuilds the live rows' KV cache by a prefill of
        prompt + tokens so far under the new weights (the next token is the new policy's exactly); `keep` keeps
        the old cache and feeds only the last token again (its next-token logits under the new weights)."""
        if kv not in ("recompute", "keep"):
            raise ValueError(f"on_weights_updated: kv must be 'recompute' or 'keep', got {kv!r}")
        self.version = version
        self.picked = self.pending = None
        self.model_step.weights_changed()
        if not self.rows:
            return
        for row in self.rows:
            row.interrupted += 1
            row.kv_kept += kv == "keep"
        if kv == "recompute":
            self.model_step.clear()
            self.logits = self.model_step.prefill([row.prompt_ids + row.ids for row in self.rows])
            return
        last = [row.ids[-1] if row.ids else row.prompt_ids[-1] for row in self.rows]
        self.model_step.rewind()
        self.logits = self.model_step.forward(torch.tensor(last, device=self._device()))

    def _device(self) -> torch.device:
        return self.logits.device if self.logits is not None else torch.device("cpu")


def run_rows(decoder: SlotDecoder, requests: Sequence[RowRequest], pick: Picker) -> dict[Any, SlotRow]:
    """Decode every request, in order, keeping the slots full: rows are admitted while slots are free and each
    step's freed slots are refilled from the pending rows before the next step. Returns the rows by key."""
    pending = list(requests)
    done: dict[Any, SlotRow] = {}
    while pending or decoder.rows:
        free = decoder.free_slots()
        if pending and free:
            decoder.admit(pending[:free])
            pending = pending[free:]
        for row in decoder.step(pick):
            done[row.key] = row
    return done


class HFStep:
    """The eager decode step: the transformers model's own forward over a `DynamicCache` of the live rows
    (right-aligned, left padding masked), with explicit positions: every architecture's fallback."""

    CALL_SCOPED = True

    def __init__(self, model: Any, device: torch.device | None = None) -> None:
        self.model = model
        self.device = device or next(model.parameters()).device
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [n, W] 1 on the cache's real columns
        self.position: torch.Tensor | None = None  # [n] the next fed token's position

    def prefill(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Prefill the rows (`decode.prefill`: shared prompts and prefixes once) and append them to the cache."""
        ids, mask = left_pad([torch.tensor(list(r), device=self.device) for r in rows], torch.long)
        cache, logits, mask = prefill(self.model, ids, mask)
        position = mask.long().sum(-1)
        if self.cache is None:
            self.cache, self.mask, self.position = cache, mask.long(), position
            return logits
        assert self.mask is not None and self.position is not None
        width, new = self.mask.shape[1], mask.shape[1]
        for old_layer, new_layer in zip(self.cache.layers, cache.layers, strict=True):
            for name in ("keys", "values"):
                a, b = getattr(old_layer, name), getattr(new_layer, name)
                setattr(old_layer, name, torch.cat([_pad_left(a, new - width), _pad_left(b, width - new)]))
        self.mask = torch.cat([_pad_left(self.mask, new - width), _pad_left(mask.long(), width - new)])
        self.position = torch.cat([self.position, position])
        return logits

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """One token per live row through the model; the cache and mask grow by one column."""
        assert self.mask is not None and self.position is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        out = self.model(
            input_ids=ids.unsqueeze(-1),
            attention_mask=self.mask,
            position_ids=self.position.unsqueeze(-1),
            **cache_arg(self.model, self.cache),
            use_cache=True,
        )
        self.position = self.position + 1
        return out.logits[:, -1]

    def select(self, keep: list[int]) -> None:
        """Keep these rows; columns now masked for every row are trimmed from the cache's left."""
        assert self.mask is not None and self.position is not None
        index = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.position = self.mask[index], self.position[index]
        used = self.mask.any(0).nonzero()
        start = int(used[0]) if len(used) else 0
        if start:
            self._trim(start, self.mask.shape[1])

    def rewind(self) -> None:
        """Drop the last column (every live row's last fed token)."""
        assert self.mask is not None and self.position is not None
        self._trim(0, self.mask.shape[1] - 1)
        self.position = self.position - 1

    def clear(self) -> None:
        """Drop every row and the cache."""
        self.cache = self.mask = self.position = None

    def weights_changed(self) -> None:
        """Nothing to do: the forward reads the model's own parameters."""

    def _trim(self, start: int, stop: int) -> None:
        assert self.mask is not None
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[..., start:stop, :], layer.values[..., start:stop, :]
        self.mask = self.mask[:, start:stop]


def _pad_left(t: torch.Tensor, extra: int) -> torch.Tensor:
    """`t` with `extra` zero columns before its sequence dimension (-2 for a cache tensor [n, H, W, D], -1 for a
    mask [n, W])."""
    if extra <= 0:
        return t
    dim = -1 if t.dim() == 2 else -2
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)
