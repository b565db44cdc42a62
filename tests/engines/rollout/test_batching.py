"""Rollout batches from several engines joined into one (`types.concat` over data-parallel ranks): each rank's batch
is as wide as its own longest prompt and reply, so the join pads them first; the result equals the batch built
from all rows at once, bit for bit. CPU, instant."""

from __future__ import annotations

import pytest
import torch

from rlstages.engines import types as T
from rlstages.engines.rollout.batching import build_rollout_batch
from rlstages.engines.types import Prompt

PAD = 7
PROMPTS = [Prompt("a", "1+1=", "2"), Prompt("b", "12+30=", "42"), Prompt("c", "3+4=", "7")]
IDS = [[1, 2, 3], [4, 5, 6, 8, 9], [2, 3]]  # prompt widths 3, 5, 2
REPLIES = [[10, 11], [12], [13, 14, 15, 16], [17], [18, 19, 20], [21, 22]]  # n = 2: reply widths 2, 4 | 3 | 2
LOGPROBS = [[-0.5 * (i + j + 1) for j in range(len(r))] for i, r in enumerate(REPLIES)]


def batch(first: int, last: int):  # noqa: ANN201
    rows = slice(2 * first, 2 * last)
    replies, texts, versions = REPLIES[rows], [str(r) for r in REPLIES[rows]], [[3] * len(r) for r in REPLIES[rows]]
    return build_rollout_batch(PROMPTS[first:last], IDS[first:last], replies, LOGPROBS[rows], texts, 2, PAD, versions)


def test_batches_of_other_widths_join_as_if_built_together() -> None:
    whole, parts = batch(0, 3), [batch(0, 1), batch(1, 2), batch(2, 3)]
    assert {p[T.PROMPT_IDS].shape[1] for p in parts} == {3, 5, 2}  # (the old concat raised on these)
    joined = T.concat(parts)
    assert sorted(T.tensor_keys(joined)) == sorted(T.tensor_keys(whole))
    for key in T.tensor_keys(whole):
        assert torch.equal(joined[key], whole[key]), key
    assert T.get_rows(joined, "uid") == T.get_rows(whole, "uid")


def test_a_field_without_a_padding_rule_is_refused() -> None:
    a, b = batch(0, 1), batch(1, 2)
    a["extra"], b["extra"] = torch.zeros(2, 3), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="'extra'"):
        T.concat([a, b])
