"""Splitting a batch for training: mini-batches by whole prompt groups, rows sorted by length, micro-batches
by count or token budget (dynamic batching), and trimming each micro-batch to its real length.

Non-goal: cross-rank balancing (each data-parallel rank gets its rows from the actor group).
"""

from __future__ import annotations

import torch

from rlstages.engines import types as T
from rlstages.engines.tensordict_import import TensorDict


def mini_batches(batch: TensorDict, num: int) -> list[TensorDict]:
    """`num` contiguous mini-batches; rows are prompt-major, so contiguous chunks keep groups whole."""
    return T.chunk_for_ranks(batch, num)


def seq_lengths(batch: TensorDict, prompt_once: bool = False) -> torch.Tensor:
    """Real tokens each row puts through the model: prompt + response, or the response alone where each prompt
    goes through once for the whole step (`prompt_once`: the torch backend's `share_prompt_forward`)."""
    mask = batch[T.ATTENTION_MASK]
    return (mask[:, batch[T.PROMPT_IDS].shape[1] :] if prompt_once else mask).sum(-1)


def by_length(batch: TensorDict, prompt_once: bool = False) -> tuple[TensorDict, torch.Tensor]:
    """Rows sorted by real length (stable; `seq_lengths`) and the permutation that restores the original order:
    consecutive micro-batches then hold similar lengths, so trimming removes most padding."""
    order = torch.argsort(seq_lengths(batch, prompt_once), stable=True)
    return batch[order], torch.argsort(order)


def micro_batches(
    batch: TensorDict, size: int, dynamic: bool = False, max_tokens: int = 4096, prompt_once: bool = False
) -> list[TensorDict]:
    """Fixed-size micro-batches, or (dynamic) consecutive rows packed so the padded tokens they put through the
    model stay within budget (`prompt_once`: their responses', the prompts going through once for the step)."""
    rows = batch.batch_size[0]
    if not dynamic:
        return [trim(batch[i : i + size]) for i in range(0, rows, size)]
    lengths = seq_lengths(batch, prompt_once).tolist()
    out, start, longest = [], 0, 0
    for i, length in enumerate(lengths):
        longest_if = max(longest, int(length))
        if i > start and longest_if * (i - start + 1) > max_tokens:
            out.append(trim(batch[start:i]))
            start, longest_if = i, int(length)
        longest = longest_if
    if start < rows:
        out.append(trim(batch[start:rows]))
    return out


def trim(mb: TensorDict) -> TensorDict:
    """Drop columns that are padding in every row: left prompt padding and right response padding."""
    prompt_len = mb[T.PROMPT_IDS].shape[1]
    prompt_mask = mb[T.ATTENTION_MASK][:, :prompt_len]
    first = int((prompt_mask.sum(0) > 0).nonzero().min()) if prompt_mask.any() else prompt_len
    # the response's real tokens (attention), not the loss mask: a multi-turn row's mask has holes (observations)
    resp_len = int(mb[T.ATTENTION_MASK][:, prompt_len:].sum(-1).max().item()) if mb.batch_size[0] else 0
    resp_len = max(resp_len, 1)
    out = mb.clone(False)
    for key in list(out.keys()):
        value = out.get(key)
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        width = value.shape[1]
        if key == T.PROMPT_IDS:
            out.set(key, value[:, first:])
        elif key == T.ROPE_POSITION_IDS:  # [B, 3, P+T]: the same columns, on the last dimension
            out.set(key, torch.cat([value[..., first:prompt_len], value[..., prompt_len : prompt_len + resp_len]], -1))
        elif key in (T.ATTENTION_MASK, T.POSITION_IDS):
            out.set(key, torch.cat([value[:, first:prompt_len], value[:, prompt_len : prompt_len + resp_len]], 1))
        elif width == mb[T.RESPONSE_IDS].shape[1]:
            out.set(key, value[:, :resp_len])
    return out
