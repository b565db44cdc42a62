"""Token sampling for the HF rollout: top-k / top-p filtering and an inverse-CDF draw per row.

Non-goal: penalties (repetition, presence); the rollout's sampling knobs are temperature, top-k and top-p.
"""

from __future__ import annotations

import torch


def top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with everything outside the top-k and the top-p nucleus set to -inf (0 / 1.0 turn each off)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample_rows(logits: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(logits) by inverse CDF: one uniform per row, where torch.multinomial (what
    transformers' sampler calls) draws exponential noise over the whole vocabulary (65 ms per 64 x 49k step here,
    a fifth of the demo's generation). Uses torch's global RNG, so `torch.manual_seed` makes it repeatable."""
    return _draw(torch.softmax(logits.float(), dim=-1).cumsum_(dim=-1), logits)


def sample_logprobs(logprobs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from log-probabilities [n, V] (a log-softmax already computed: no second softmax), by
    inverse CDF with one uniform per row as `sample_rows`; `out` (float32 [n, V]) holds the running sums."""
    return _draw(torch.exp(logprobs, out=out).cumsum_(dim=-1), logprobs)


def _draw(cdf: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The column where one uniform per row falls in the running sums `cdf` [n, V] of the probabilities whose
    logits or log-probs are `scores`. A token of probability 0 (-inf in `scores`) that rounding picks (u rounded
    up to the total) is replaced by the row's argmax: on a GPU with no host read of which rows (a sync that stalls
    the decode loop), on a CPU only where one was picked (the argmax pass over [n, V] is ~3 % of a decode step)."""
    u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
    impossible = scores.gather(-1, picked.unsqueeze(-1)).squeeze(-1) == float("-inf")
    if cdf.is_cuda:
        return torch.where(impossible, scores.argmax(-1), picked)
    return torch.where(impossible, scores.argmax(-1), picked) if impossible.any() else picked
