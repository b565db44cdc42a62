"""Loss aggregation: a [B, T] per-token loss to a scalar, by mode (verl's `agg_loss`).

Non-goal: the losses themselves (`policy_loss`, `value_loss`).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from rlstages.engines.algorithms.advantages import _float_mask, masked_sum

LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
Count = float | Tensor  # a normaliser: Python number or an all-reduced scalar tensor


def _safe_div(num: Tensor, den: Count) -> Tensor:
    """Divide, giving 0 where `den` <= 0, with finite gradients in both branches."""
    den_t = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    positive = den_t > 0
    quotient = num / torch.where(positive, den_t, torch.ones_like(den_t))
    return torch.where(positive, quotient, torch.zeros_like(quotient))


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    loss_scale_factor: float | None = None,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    dp_size: int = 1,
) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar (verl 0.9.1 `agg_loss`; DAPO §3.3, Dr.GRPO arXiv:2503.20783).

    token-mean: sum(L*m) / N_tokens. token-sum (verl 0.9.1): sum(L*m) * dp_size, no normaliser (the
    DP scale undoes DDP's gradient averaging, so the update is the global sum). seq-mean-token-sum:
    sum_i S_i / N_seqs with S_i = sum_t L*m over rows with >= 1 token. seq-mean-token-mean:
    sum_i (S_i / n_i) / N_seqs. seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (default T,
    the padded length). N_* default to local counts; pass the mini-batch totals as `global_tokens` /
    `global_seqs` so micro-batch losses sum to the mini-batch loss (scaling the normalised modes by the DP
    world size, if DDP averages gradients, is the caller's job; `dp_size` scales token-sum only).
    Deviation from verl: zero tokens (or a zero normaliser) gives 0, not NaN.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {list(LOSS_AGG_MODES)}")
    m = _float_mask(mask, loss_mat)
    if mode == "token-sum":
        return masked_sum(loss_mat, m) * dp_size
    if mode == "token-mean":
        return _safe_div(masked_sum(loss_mat, m), m.sum() if global_tokens is None else global_tokens)
    tokens = m.sum(dim=-1)
    seq_sum = masked_sum(loss_mat, m, dim=-1)
    per_seq = _safe_div(seq_sum, tokens) if mode == "seq-mean-token-mean" else seq_sum
    valid = tokens > 0
    total = torch.where(valid, per_seq, torch.zeros_like(per_seq)).sum()
    loss = _safe_div(total, valid.sum() if global_seqs is None else global_seqs)
    if mode == "seq-mean-token-sum-norm":
        loss = _safe_div(loss, loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss
