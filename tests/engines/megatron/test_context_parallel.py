"""Context parallelism's sequence bookkeeping (`engines/megatron/context_parallel.py`), without Transformer
Engine: left-padded rows are right-aligned, cut into 2 x CP load-balanced chunks (rank r: chunks r and
2CP-1-r), and the ranks' outputs put back in the original order. The attention itself needs TE (not here)."""

from __future__ import annotations

import pytest
import torch

from rlstages.engines.megatron import context_parallel as CP


@pytest.mark.parametrize("cp", [2, 3])
def test_split_then_reassemble_is_the_identity(cp: int) -> None:
    valid = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    ids = torch.arange(21).view(3, 7) * valid
    pos = (valid.cumsum(1) - 1).clamp(min=0)
    parts = [CP.split_for_rank(ids, pos, valid, cp, r) for r in range(cp)]
    assert parts[0].seq_len % (2 * cp) == 0 and {p.input_ids.shape[1] for p in parts} == {parts[0].seq_len // cp}
    first = parts[0].input_ids
    assert torch.equal(first[2, :2], torch.tensor([19, 20]))  # right-aligned: real tokens first, then padding
    back = CP.reassemble([p.input_ids[..., None] for p in parts], parts[0], ids.shape[1])[..., 0]
    assert torch.equal(back, ids)
    pos_back = CP.reassemble([p.position_ids[..., None] for p in parts], parts[0], ids.shape[1])[..., 0]
    assert torch.equal(pos_back[valid], pos[valid])  # every real token keeps its position id
    assert CP.rank_chunks(cp, 0) == (0, 2 * cp - 1) and CP.rank_chunks(cp, cp - 1) == (cp - 1, cp)
