"""The HF rollout's decode loop: sampling with a KV cache that drops each row as soon as it ends.

transformers' `generate` keeps every row in the batch until the longest is done, so a batch whose replies
average 20 of 48 tokens spends most of its decode steps on finished rows (the demo: 12-16% of rows reach the
limit, so every batch runs all 48 steps). Here a finished row leaves the batch and the cache at once, and the
log-prob of each sampled token is read from the same distribution it was drawn from.

Non-goal: continuous batching of new prompts into freed slots (vLLM/SGLang do that).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlstages.engines.rollout.sampling import sample_rows, top_k_top_p

# (logits [n, V] of the live rows) -> (picked token ids [n], their log-probs [n])
Picker = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Decoded:
    """Per row: the sampled ids (ending with an EOS id unless cut at the limit or a stop string) and their
    log-probs."""

    ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)


def picker(temperature: float, top_k: int, top_p: float, greedy: bool) -> Picker:
    """Sample from softmax(logits / T) restricted by top-k / top-p (or take the argmax when `greedy`); the
    log-prob reported is of the full tempered distribution, as the trainer recomputes it."""
    scale = temperature if temperature > 0 else 1.0

    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = logits.float() / scale
        logprobs = torch.log_softmax(scaled, dim=-1)
        ids = scaled.argmax(-1) if greedy else sample_rows(top_k_top_p(scaled, top_k, top_p))
        return ids, logprobs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    return pick


@torch.no_grad()
def decode(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    pick: Picker,
    stopped: Callable[[list[int]], bool] | None = None,
) -> Decoded:
    """Decode left-padded prompts [B, P] up to `max_new_tokens`; a row stops at an EOS id or when `stopped`
    (its ids so far) says so, and leaves the batch and the KV cache then."""
    rows = input_ids.shape[0]
    out = Decoded([[] for _ in range(rows)], [[] for _ in range(rows)])
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    step = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True, logits_to_keep=1
    )
    cache, mask = step.past_key_values, attention_mask
    live = torch.arange(rows)
    position = positions[:, -1] + 1
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
    for t in range(max_new_tokens):
        ids, logprobs = pick(step.logits[:, -1])
        done = torch.isin(ids, eos)
        for i, (row, token, lp) in enumerate(zip(live.tolist(), ids.tolist(), logprobs.tolist(), strict=True)):
            out.ids[row].append(token)
            out.logprobs[row].append(lp)
            if stopped is not None and not done[i] and stopped(out.ids[row]):
                done[i] = True
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        if bool(done.any()):  # finished rows leave the batch and the cache
            keep = (~done).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            live, ids, mask, position = live[keep], ids[keep], mask[keep], position[keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        step = model(
            input_ids=ids.unsqueeze(-1),
            attention_mask=mask,
            position_ids=position.unsqueeze(-1),
            past_key_values=cache,
            use_cache=True,
        )
        position = position + 1
    return out
