"""The HF rollout's decode loop: sampling with a KV cache that drops each row as soon as it ends.

transformers' `generate` keeps every row in the batch until the longest is done, so a batch whose replies
average 20 of 48 tokens spends most of its decode steps on finished rows (the demo: 12-16% of rows reach the
limit, so every batch runs all 48 steps). Here a finished row leaves the batch and the cache at once, and the
log-prob of each sampled token is read from the same distribution it was drawn from. The prefill computes
each prompt token once (`prefill`): a group's n samples share their prompt's, and all prompts share the
prefix they have in common (the chat template's system turn). The demo's 64 rows: 7.9 s a step, 12.7 before.

Continuous batching (new prompts taking the slots finished rows free) builds on these pieces in `slots`, and
the static-cache steps that decode there in `fast_step` and `compiled_step`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlstages.engines.rollout.sampling import sample_logprobs, sample_rows, top_k_top_p

# (logits [n, V] of the live rows) -> (picked token ids [n], their log-probs [n])
Picker = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Decoded:
    """Per row: the sampled ids (ending with an EOS id unless cut at the limit or a stop string) and their
    log-probs."""

    ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class FusedPick:
    """What a compiled decode step needs to pick the next token itself: the temperature and greedy (plain
    sampling only: no top-k / top-p)."""

    scale: float
    greedy: bool


# On a CPU the picker's float32 temporaries ([rows, V] each: the widened logits, their log-softmax, the running
# sums) live in buffers it keeps from one decode step to the next (`_Pick._scratch`), filled a chunk of rows of at
# most this many bytes at a time (a chunk's three stay in the cache). Fresh at every step, each was an allocation
# that jemalloc (the workers' allocator, `cluster.heap`) mapped from the OS anew and page-faulted in: the pick of the
# demo's 64 x 49k rows took 10.7 ms a step that way against 3.5 ms now. With the fast step's logits left in bf16 too,
# the demo's rollout (64 rows x 48 tokens, 2 threads, native-bf16 EPYC, A/B interleaved): 2.25-2.36 s against
# 2.81-2.99 under jemalloc, 2.31-2.54 against 2.92-3.03 under glibc; the same tokens and log-probs, bit for bit.
PICK_CHUNK_BYTES = 4 << 20


def pick_rows(logits: torch.Tensor) -> int:
    """How many rows of `logits` [n, V] the picker takes at once: all of them on a GPU, else as many as keep a
    float32 temporary under PICK_CHUNK_BYTES (at least one). Rows are independent: the picks are the same."""
    if logits.device.type != "cpu":
        return logits.shape[0]
    return max(1, PICK_CHUNK_BYTES // (4 * logits.shape[-1]))


class _Pick:
    """A `Picker` with `fused`: its `FusedPick` where a compiled step may sample for it, else None."""

    def __init__(self, temperature: float, top_k: int, top_p: float, greedy: bool) -> None:
        self.scale = temperature if temperature > 0 else 1.0
        self.top_k, self.top_p, self.greedy = top_k, top_p, greedy
        self.plain = top_k <= 0 and top_p >= 1.0
        self.fused = FusedPick(self.scale, greedy) if greedy or self.plain else None
        self._buffers: torch.Tensor | None = None  # `_scratch`: [3, rows, V] float32, CPU

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = pick_rows(logits)
        if rows >= logits.shape[0]:
            return self._pick(logits)
        picked = [self._pick(part) for part in logits.split(rows)]  # rows in order: the same draws, the same picks
        return torch.cat([ids for ids, _ in picked]), torch.cat([lp for _, lp in picked])

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scratch = self._scratch(logits) if self.fused is not None else None
        if scratch is None:
            scaled = logits.float() / self.scale
            logprobs = torch.log_softmax(scaled, dim=-1)
        else:  # the same values, in buffers kept from the last step: no fresh [rows, V] allocation on a CPU
            scaled = scratch[0].copy_(logits).div_(self.scale)
            logprobs = torch._log_softmax(scaled, -1, False, out=scratch[1])
        if self.greedy:
            ids = scaled.argmax(-1)
        elif self.plain:  # the distribution sampled is the one whose log-probs are reported: one softmax serves both
            ids = sample_logprobs(logprobs, None if scratch is None else scratch[2])
        else:
            ids = sample_rows(top_k_top_p(scaled, self.top_k, self.top_p))
        return ids, logprobs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    def _scratch(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Three float32 [rows, V] buffers (scaled logits, log-probs, running sums) for `logits` on a CPU, kept
        between calls (grown when a chunk has more rows); None elsewhere (a GPU's caching allocator reuses blocks) and
        for logits that require grad (an eager step outside no_grad)."""
        if logits.device.type != "cpu" or logits.requires_grad:  # (out= tensors take no autograd graph)
            return None
        rows, vocab = logits.shape
        buf = self._buffers
        if buf is None or buf.shape[1] < rows or buf.shape[2] != vocab:
            buf = self._buffers = torch.empty(3, rows, vocab, dtype=torch.float32)
        return buf[:, :rows]


def picker(temperature: float, top_k: int, top_p: float, greedy: bool) -> Picker:
    """Sample from softmax(logits / T) restricted by top-k / top-p (or take the argmax when `greedy`); the
    log-prob reported is of the full tempered distribution, as the trainer recomputes it."""
    return _Pick(temperature, top_k, top_p, greedy)


@torch.no_grad()
def decode(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    pick: Picker,
    stopped: Callable[[list[int]], bool] | None = None,
    limits: list[int] | None = None,
    images: Any = None,
) -> Decoded:
    """Decode left-padded prompts [B, P] up to `max_new_tokens`; a row stops at an EOS id, at its own limit
    (`limits`, multi-turn budgets) or when `stopped` (its ids so far) says so, and leaves the batch and the KV
    cache then. `images` (`vision_inputs.ImageBatch`): pixel values at the prefill, then M-RoPE positions
    [3, n, 1] (the prompt's largest + 1, + 1 a step: its rope delta carried) at each decode step."""
    rows = input_ids.shape[0]
    out = Decoded([[] for _ in range(rows)], [[] for _ in range(rows)])
    if images is None:
        cache, logits, mask = prefill(model, input_ids, attention_mask)
        position = mask.long().sum(-1)  # the next token's position: the row's real tokens so far
    else:
        cache, logits, mask = images.prefill(model, input_ids, attention_mask)
        position = images.next_positions()
    rows_live = list(range(rows))  # the batch's rows, in the cache's order (host side: no device reads for it)
    for t in range(max_new_tokens):
        ids, logprobs = pick(logits)
        # one device read per step: the tokens and their log-probs together (float64 holds every token id exactly);
        # which rows finished is decided here on the host, so no per-row or per-flag sync follows
        picked = torch.stack([ids.to(torch.float64), logprobs.to(torch.float64)]).tolist()
        keep: list[int] = []
        for i, (row, token, lp) in enumerate(zip(rows_live, picked[0], picked[1], strict=True)):
            token = int(token)
            out.ids[row].append(token)
            out.logprobs[row].append(lp)
            done = token in eos_ids
            if not done and stopped is not None and stopped(out.ids[row]):
                done = True
            if limits is not None and len(out.ids[row]) >= limits[row]:
                done = True
            if not done:
                keep.append(i)
        if t == max_new_tokens - 1 or not keep:
            break
        if len(keep) < len(rows_live):  # finished rows leave the batch and the cache
            rows_live = [rows_live[i] for i in keep]
            index = torch.tensor(keep, device=input_ids.device)
            cache.batch_select_indices(index)
            ids, mask, position = ids[index], mask[index], position[index]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        step = model(
            input_ids=ids.unsqueeze(-1),
            attention_mask=mask,
            position_ids=position.unsqueeze(-1) if images is None else position.unsqueeze(-1).expand(3, -1, -1),
            **cache_arg(model, cache),
            use_cache=True,
        )
        logits = step.logits[:, -1]
        position = position + 1
    return out


def prefill(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The KV cache, next-token logits [B, V] and attention mask of left-padded prompts, each token computed
    once: rows with the same prompt (a group's n samples) share its prefill, and the prefix that all distinct
    prompts share (a chat template's system turn) goes through the model once (`MIN_SHARED_PREFIX` tokens or
    more). The mask may then have a gap of padding between that prefix and each prompt's own tokens."""
    cache, logits, mask, inverse = prefill_distinct(model, input_ids, attention_mask)
    if inverse is not None:  # each row takes its prompt's cache
        cache.batch_select_indices(inverse)
    return cache, logits, mask


def prefill_distinct(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, heads: dict[tuple[int, ...], Any] | None = None
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`prefill` with the KV cache left one row per distinct prompt, and the index [B] of each row's prompt in it
    (None: the rows are distinct, in their own order): a caller that copies the cache into buffers of its own
    takes the rows one layer at a time instead of expanding the whole cache first (the demo's 8 x 8 rows: a
    transient 116 MB fp32 cache at each generation's start). `heads` keeps the shared prefixes' caches for the
    caller's next calls on the same weights (its parts of one prefill): each prefix is forwarded once."""
    rows, width = input_ids.shape
    distinct, inverse = torch.unique(torch.cat([input_ids, attention_mask.long()], dim=1), dim=0, return_inverse=True)
    ids, mask = distinct[:, :width], distinct[:, width:].to(attention_mask.dtype)  # sorted rows
    if len(ids) == rows:  # no duplicates: keep the rows' own order
        ids, mask = input_ids, attention_mask
    tokens = [row[keep.bool()] for row, keep in zip(ids, mask, strict=True)]
    shared = _common_prefix(tokens)
    if shared < MIN_SHARED_PREFIX or len(tokens) < 2:
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        step = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    else:
        head_cache = _prefix_cache(model, tokens[0][:shared], heads)
        head_cache.batch_repeat_interleave(len(tokens))
        suffix_ids, suffix_mask = left_pad([t[shared:] for t in tokens], mask.dtype)
        mask = torch.cat([mask.new_ones(len(tokens), shared), suffix_mask], dim=1)
        step = model(
            input_ids=suffix_ids,
            attention_mask=mask,
            position_ids=shared + (suffix_mask.long().cumsum(-1) - 1).clamp(min=0),
            **cache_arg(model, head_cache),
            use_cache=True,
            logits_to_keep=1,
        )
    cache, logits = output_cache(step), step.logits[:, -1]
    if len(tokens) < rows:  # each row takes its prompt's logits and mask
        return cache, logits[inverse], mask[inverse], inverse
    return cache, logits, mask, None


def _prefix_cache(model: Any, prefix: torch.Tensor, heads: dict[tuple[int, ...], Any] | None) -> Any:
    """The KV cache of one forward of `prefix` alone: a copy of the one in `heads` where an earlier call computed it
    (the caller expands it in place), else computed (and a copy kept there). The same forward, so the same bits."""
    key = tuple(prefix.tolist())
    if heads is not None and key in heads:
        return copy.deepcopy(heads[key])
    cache = output_cache(model(input_ids=prefix[None], use_cache=True, logits_to_keep=1))
    if heads is not None:
        heads[key] = copy.deepcopy(cache)
    return cache


def prompt_chunks(input_ids: torch.Tensor, attention_mask: torch.Tensor, limit: int) -> list[torch.Tensor]:
    """Indices of the rows in parts of at most `limit` distinct prompts (a prompt's rows in one part), so that a
    prefill's transient cache holds at most `limit` prompts; one part (all rows, in order) where they fit."""
    keyed = torch.cat([input_ids, attention_mask.long()], dim=1)
    prompt = torch.unique(keyed, dim=0, return_inverse=True)[1]
    parts = int(prompt.max()) // limit + 1 if len(prompt) else 1
    if parts == 1:
        return [torch.arange(len(input_ids), device=input_ids.device)]
    return [(prompt // limit == p).nonzero().flatten() for p in range(parts)]


def cache_arg(model: Any, cache: Any) -> dict[str, Any]:
    """The KV cache as the model's forward takes it: `cache` (transformers 5.24 on; `past_key_values` warns
    there) or `past_key_values` (before)."""
    kind = type(model)
    if kind not in _CACHE_NAMES:
        takes = "cache" in inspect.signature(kind.forward).parameters
        _CACHE_NAMES[kind] = "cache" if takes else "past_key_values"
    return {_CACHE_NAMES[kind]: cache}


_CACHE_NAMES: dict[type, str] = {}  # per model class: the name its forward takes the KV cache by


def output_cache(out: Any) -> Any:
    """A forward's KV cache, under either name (`cache_arg`)."""
    return out["cache"] if "cache" in out else out.past_key_values


MIN_SHARED_PREFIX = 8  # shorter shared prefixes are not worth a forward of their own


def _common_prefix(tokens: list[torch.Tensor]) -> int:
    """Tokens at the start of every sequence, leaving each at least one of its own (its logits are needed)."""
    limit = min(len(t) for t in tokens) - 1
    if limit <= 0:
        return 0
    first = tokens[0][:limit]
    same = torch.stack([t[:limit] == first for t in tokens[1:]]).all(0) if len(tokens) > 1 else torch.ones_like(first)
    differs = (~same).nonzero()
    return int(differs[0]) if len(differs) else limit


def left_pad(seqs: list[torch.Tensor], mask_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences left-padded (with id 0, masked) to the longest: ids [n, L] and mask [n, L], on the sequences'
    device (a CUDA prefill concatenates them with CUDA masks)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=seqs[0].dtype, device=seqs[0].device)
    mask = torch.zeros(len(seqs), width, dtype=mask_dtype, device=seqs[0].device)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = s
        mask[i, width - len(s) :] = 1
    return ids, mask
