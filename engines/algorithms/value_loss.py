"""The critic's clipped value loss (PPO2).

Non-goal: computing returns (`advantages.compute_gae`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlstages.engines.algorithms.advantages import _float_mask, masked_mean
from rlstages.engines.algorithms.aggregation import Count, agg_loss


def value_loss(
    vpreds: Tensor,
    returns: Tensor,
    old_values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss (PPO2 baselines; Engstrom et al. 2020, arXiv:2005.12729): 0.5*agg(max(u, c)).

    u = (v - R)^2, c = (clip(v, V_old - eps, V_old + eps) - R)^2. Returns (loss, clipfrac) with
    clipfrac = masked mean of [c > u] (detached).
    """
    m = _float_mask(response_mask, vpreds)
    vpreds_clipped = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpreds_clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped, clipped), m, loss_agg_mode, None, global_tokens, global_seqs)
    return loss, masked_mean((clipped > unclipped).to(m.dtype), m).detach()
