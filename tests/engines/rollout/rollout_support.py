"""Shared checks of the HF rollout engine's tests (not a test module)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def assert_greedy_as_generate(engine: Any, texts: Sequence[str], batch: Any, new_tokens: int = 10) -> None:
    """Each row of `batch` (greedy, one row per text, at most `new_tokens`) is what transformers' `generate` decodes
    greedily from that text: the same tokens, cut only at the limit or after an EOS id of the engine."""
    for row, text in enumerate(texts):
        ids = engine.tokenizer(text)["input_ids"]
        with torch.no_grad():
            ref = engine.model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0
            )[0, len(ids) :].tolist()
        got = batch["response_ids"][row][batch["response_mask"][row].bool()].tolist()
        assert got == ref[: len(got)] and (len(got) == new_tokens or got[-1] in engine.eos_ids), (row, got, ref)
