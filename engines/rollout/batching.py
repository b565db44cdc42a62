"""Shared by every rollout backend: prompt formatting and the assembly of a rollout batch.

All backends return the same contract (`rlstages.engines.types`): rows grouped by prompt (prompt 0's n samples
first), left-padded prompts, right-padded responses, `response_mask` over the generated tokens up to and
including EOS, and the sampled tokens' log-probs.

Non-goal: sampling itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlstages.engines import types as T
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.types import Prompt


def chat_messages(prompt: Prompt, system_prompt: str | None) -> list[dict[str, str]]:
    """The chat turns of a prompt: its own messages (verl's `prompt` column) or one user turn of its text;
    `system_prompt` is put first unless the messages already start with a system turn."""
    messages = [dict(m) for m in prompt.messages] or [{"role": "user", "content": prompt.text}]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def format_prompts(
    tokenizer: Any, prompts: Sequence[Prompt], apply_chat_template: bool, system_prompt: str | None
) -> list[list[int]]:
    """Token ids of each prompt: the chat template with a generation prompt when asked and available
    (chat messages without a template are joined by newlines)."""
    out: list[list[int]] = []
    for p in prompts:
        text, special = prompt_text(tokenizer, p, apply_chat_template, system_prompt)
        out.append(list(tokenizer(text, add_special_tokens=special)["input_ids"]))
    return out


def prompt_text(
    tokenizer: Any, prompt: Prompt, apply_chat_template: bool, system_prompt: str | None
) -> tuple[str, bool]:
    """The text of a prompt as `format_prompts` tokenizes it, and whether the tokenizer adds its special tokens."""
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        messages = chat_messages(prompt, system_prompt)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False
    return ("\n".join(m["content"] for m in prompt.messages) if prompt.messages else prompt.text), True


def truncate_response(
    ids: Sequence[int], logprobs: Sequence[float], eos_ids: set[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """Cut a sampled continuation after its first EOS (kept) and at `max_new_tokens`."""
    ids, logprobs = list(ids)[:max_new_tokens], list(logprobs)[:max_new_tokens]
    for i, tok in enumerate(ids):
        if tok in eos_ids:
            return ids[: i + 1], logprobs[: i + 1]
    return ids, logprobs


def build_rollout_batch(
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    texts: Sequence[str],
    n: int,
    pad_id: int,
    versions: Sequence[Sequence[int]] | None = None,
) -> TensorDict:
    """Assemble the rollout batch; `responses`, `logprobs`, `texts` (and each token's policy `versions`, 0 for
    every token where not given) are ordered prompt-major (n per prompt)."""
    if len(responses) != len(prompts) * n:
        raise ValueError(
            f"expected {len(prompts) * n} responses ({len(prompts)} prompts x n={n}), got {len(responses)}"
        )
    rep_prompts = [prompt_ids[i // n] for i in range(len(responses))]
    prompt_t = T.pad_left(rep_prompts, pad_id)
    width = max((len(r) for r in responses), default=0)
    width = max(width, 1)
    response_t = T.pad_right(responses, pad_id, width)
    response_mask = torch.zeros(len(responses), width, dtype=torch.float32)
    lp = torch.zeros(len(responses), width, dtype=torch.float32)
    version_t = torch.zeros(len(responses), width, dtype=torch.int64)
    for i, (r, lps) in enumerate(zip(responses, logprobs, strict=True)):
        response_mask[i, : len(r)] = 1.0
        lp[i, : len(lps)] = torch.as_tensor(list(lps), dtype=torch.float32)
        if versions is not None:
            version_t[i, : len(versions[i])] = torch.as_tensor(list(versions[i]), dtype=torch.int64)
    prompt_mask = (
        torch.arange(prompt_t.shape[1]) >= (prompt_t.shape[1] - torch.tensor([len(p) for p in rep_prompts]))[:, None]
    ).long()
    attention = torch.cat([prompt_mask, response_mask.long()], dim=1)
    tensors = {
        T.PROMPT_IDS: prompt_t,
        T.RESPONSE_IDS: response_t,
        T.ATTENTION_MASK: attention,
        T.POSITION_IDS: T.position_ids_from_mask(attention),
        T.RESPONSE_MASK: response_mask,
        T.ROLLOUT_LOGPROBS: lp,
        T.ROLLOUT_VERSIONS: version_t,
    }
    rows = {
        "uid": [prompts[i // n].uid for i in range(len(responses))],
        "prompt": [prompts[i // n].text for i in range(len(responses))],
        "response": list(texts),
        "ground_truth": [prompts[i // n].ground_truth for i in range(len(responses))],
        "data_source": [prompts[i // n].data_source for i in range(len(responses))],
        "extra_info": [prompts[i // n].extra_info for i in range(len(responses))],
    }
    return T.make_batch(tensors, rows)
