"""Context parallelism for the Megatron backend: each CP rank runs a load-balanced part of every sequence.

megatron-core splits attention over CP ranks only inside Transformer Engine's attention (its local attention
asserts CP = 1), and TE's context-parallel attention takes a causal mask, not an arbitrary padding mask. So a
left-padded micro-batch is first right-aligned per row (real tokens first: the causal mask then never lets a
real token see a pad), padded to a multiple of 2 x CP, and cut into 2 x CP chunks; rank r keeps chunks r and
2 x CP - 1 - r (megatron's load balancing for causal attention). The last stage all-gathers the outputs over
the CP group (with autograd), puts the chunks back in order and undoes the alignment, so the backend's loss and
log-prob readout see the [B, S, ...] output they see without CP. Every CP rank computes the same loss on the
gathered output: the all-gather's backward sums the CP copies (x CP), which the backend's 1 / (DP x CP)
gradient scaling takes out again.

Written against megatron-core 0.16's API; not run here (no Transformer Engine on this machine): the pre-flight
and `parallel.Layout.check` refuse CP > 1 without it. Non-goal: packed (THD) sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CPInputs:
    """One CP rank's share of a micro-batch, and how to put the full output back together."""

    input_ids: torch.Tensor  # [B, 2 x S / (2 x CP)] this rank's two chunks
    position_ids: torch.Tensor
    shifts: torch.Tensor  # [B] left-padding per row (the right-alignment roll)
    seq_len: int  # padded full length (a multiple of 2 x CP)


def rank_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices CP rank `rank` keeps out of 2 x `cp` (megatron's causal load balancing)."""
    return rank, 2 * cp - 1 - rank


def _roll_rows(t: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Roll each row of [B, S, ...] left by its shift (pads at the end); a negative shift rolls back."""
    seq = t.shape[1]
    index = (torch.arange(seq, device=t.device)[None, :] + shifts[:, None]) % seq
    index = index.view(*index.shape, *([1] * (t.dim() - 2))).expand_as(t)
    return torch.gather(t, 1, index)


def split_for_rank(
    ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, cp: int, rank: int, multiple: int = 1
) -> CPInputs:
    """Right-align the rows, pad to a multiple of 2 x CP (x `multiple`), keep this rank's two chunks."""
    shifts = (~valid).int().argmin(dim=1)  # leading pads per row (left padding)
    ids, pos = _roll_rows(ids, shifts), _roll_rows(pos, shifts)
    pad = -ids.shape[1] % (2 * cp * multiple)
    if pad:
        ids = torch.nn.functional.pad(ids, (0, pad))
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)], dim=1)
    seq_len = ids.shape[1]
    chunk = seq_len // (2 * cp)
    keep = [slice(c * chunk, (c + 1) * chunk) for c in rank_chunks(cp, rank)]
    return CPInputs(
        torch.cat([ids[:, s] for s in keep], dim=1), torch.cat([pos[:, s] for s in keep], dim=1), shifts, seq_len
    )


def gather_output(local: torch.Tensor, inputs: CPInputs, width: int, group: object) -> torch.Tensor:
    """[B, 2 x chunk, ...] of every CP rank -> the full [B, width, ...] output in the original (left-padded)
    token order (`width`: the length before `split_for_rank`); differentiable (the backward reduce-scatters)."""
    from torch.distributed.nn.functional import all_gather

    return reassemble(list(all_gather(local.contiguous(), group=group)), inputs, width)


def reassemble(parts: list[torch.Tensor], inputs: CPInputs, width: int) -> torch.Tensor:
    """Every CP rank's [B, 2 x chunk, ...] (by rank) -> [B, width, ...] in the original left-padded order."""
    cp = len(parts)
    chunk = inputs.seq_len // (2 * cp)
    ordered: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = rank_chunks(cp, rank)
        ordered[first], ordered[second] = part[:, :chunk], part[:, chunk:]
    full = torch.cat([t for t in ordered if t is not None], dim=1)[:, :width]  # drop the 2 x CP padding
    return _roll_rows(full, -inputs.shifts)
