"""Per-token log-probs and entropy from logits, in float32 or wider (what every trainer backend reads).

Non-goal: computing the logits (the backends' forward passes).
"""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(z) over the last dim, logsumexp(z) - sum softmax(z)*z, in float32 or wider."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature) gathered at `labels` ([..., V] -> [...]), in float32 or wider.

    Dividing by the rollout temperature makes trainer log-probs match the sampler's (verl does the same).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        z = z / temperature
    picked = torch.gather(z, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)
