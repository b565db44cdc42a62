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
    cdf = torch.softmax(logits.float(), dim=-1).cumsum_(dim=-1)
    u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
    impossible = logits.gather(-1, picked.unsqueeze(-1)).squeeze(-1) == float("-inf")  # u rounded up to the total
    if cdf.is_cuda:  # no host read of `impossible` per step: a sync that stalls the decode loop on a GPU
        return torch.where(impossible, logits.argmax(-1), picked)
    return torch.where(impossible, logits.argmax(-1), picked) if impossible.any() else picked


def sample_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """One token per row from log-probabilities [n, V] (a log-softmax already computed: no second softmax), by
    inverse CDF with one uniform per row as `sample_rows` (a token of probability 0 that rounding picks is
    replaced by the row's argmax: on a GPU with no host read, on a CPU only where one was picked)."""
    cdf = logprobs.exp().cumsum_(dim=-1)
    u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
    impossible = logprobs.gather(-1, picked.unsqueeze(-1)).squeeze(-1) == float("-inf")
    if cdf.is_cuda:  # as `sample_rows`; on a CPU the argmax pass over [n, V] (~3 % of a decode step) only if needed
        return torch.where(impossible, logprobs.argmax(-1), picked)
    return torch.where(impossible, logprobs.argmax(-1), picked) if impossible.any() else picked
