"""The picker on a CPU takes the rows in chunks (`decode.pick_rows`) and keeps its float32 [rows, V] buffers from one
step to the next (no fresh, page-faulted allocation at every decode step): the picks and log-probs are those of the
whole batch computed at once with fresh tensors, bit for bit, with the same draws of the global RNG, for every kind
of picker."""

from __future__ import annotations

import pytest
import torch

from rlstages.engines.rollout import decode
from rlstages.engines.rollout.decode import PICK_CHUNK_BYTES, pick_rows, picker
from rlstages.engines.rollout.sampling import sample_logprobs, sample_rows, top_k_top_p

VOCAB = 49_152  # SmolLM2's: 21 rows a chunk


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "greedy"),
    [(0.7, 0, 1.0, False), (1.0, 0, 1.0, True), (0.9, 50, 0.95, False)],
    ids=["plain", "greedy", "top-k-top-p"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_picks_equal_the_whole_batchs(
    temperature: float, top_k: int, top_p: float, greedy: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    logits = (torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    logits[3, :] = float("-inf")  # a row whose mass sits on one token
    logits[3, 7] = 0.0
    pick = picker(temperature, top_k, top_p, greedy)
    assert 1 < pick_rows(logits) < logits.shape[0]  # the demo's batch is picked in chunks
    torch.manual_seed(0)
    chunked = pick(logits)
    monkeypatch.setattr(decode, "pick_rows", lambda x: x.shape[0])
    torch.manual_seed(0)
    whole = pick(logits)
    assert chunked[0].dtype == whole[0].dtype and chunked[1].dtype == torch.float32
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])
    assert chunked[0][3].item() == 7 and chunked[1][3].item() == 0.0
    torch.manual_seed(0)
    fresh = _fresh_tensors(logits, temperature, top_k, top_p, greedy)  # the picker before its buffers
    assert torch.equal(chunked[0], fresh[0]) and torch.equal(chunked[1], fresh[1])


def _fresh_tensors(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    scaled = logits.float() / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    if greedy:
        ids = scaled.argmax(-1)
    elif top_k <= 0 and top_p >= 1.0:
        ids = sample_logprobs(logprobs)
    else:
        ids = sample_rows(top_k_top_p(scaled, top_k, top_p))
    return ids, logprobs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def test_the_buffers_are_kept_between_steps_and_grow_with_the_rows() -> None:
    pick = picker(0.7, 0, 1.0, False)
    pick((torch.randn(8, 1_000)).to(torch.bfloat16))
    kept = pick._buffers
    assert kept is not None and kept.shape == (3, 8, 1_000) and kept.dtype == torch.float32
    pick(torch.randn(5, 1_000).to(torch.bfloat16))  # fewer rows (some finished): the same buffers
    assert pick._buffers is kept
    pick(torch.randn(12, 1_000).to(torch.bfloat16))  # more rows (admitted): grown once
    assert pick._buffers is not kept and pick._buffers.shape == (3, 12, 1_000)


def test_a_chunk_of_rows_stays_under_the_bound() -> None:
    for vocab in (1_000, VOCAB, 151_936, PICK_CHUNK_BYTES):  # the last: one row is over the bound, still one row
        rows = pick_rows(torch.empty(0, vocab))
        assert rows >= 1 and (rows == 1 or rows * vocab * 4 <= PICK_CHUNK_BYTES)
    assert pick_rows(torch.empty(64, VOCAB, device="meta")) == 64  # not a CPU: no chunks
