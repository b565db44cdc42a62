"""Masked statistics, advantage estimators and DAPO reward shaping: pure torch on [B, T] tensors.

Numerics follow verl 0.9.1 (`core_algos.py`, `torch_functional.py`; see the project's reference notes,
section A), except that no edge case raises or yields NaN: singleton groups, all-equal groups, fully
masked rows and an all-zero batch mask all give finite values. Each deviation is stated where it happens.
Group ids (`index`) are one uid string per row; groups are formed by equality, not by position.

Non-goals: models, batching, Ray/Prefect/MLflow. Import the public names from `rlstages.engines.algorithms`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

AdvantageEstimator = Literal["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
_MEAN_EPS = 1e-8  # verl's masked_mean / masked_whiten guard


def _float_mask(mask: Tensor, like: Tensor) -> Tensor:
    """Mask as a float tensor of `like`'s dtype (bool and int masks are accepted)."""
    dtype = like.dtype if like.is_floating_point() else torch.float32
    return mask.to(dtype)


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values * mask`; values outside the mask are zeroed first, so NaN padding is harmless."""
    m = _float_mask(mask, values)
    kept = torch.where(m != 0, values, torch.zeros_like(values)) * m
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over the mask, `sum / (count + 1e-8)` as in verl; an all-zero mask gives 0, not NaN."""
    m = _float_mask(mask, values)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(values, m, dim) / (count + _MEAN_EPS)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over the mask, Bessel-corrected if `unbiased`.

    Deviation from verl: fewer than 2 valid elements returns 0 instead of raising ValueError.
    """
    m = _float_mask(mask, values)
    var = masked_mean((values - masked_mean(values, m)) ** 2, m)
    count = m.sum()
    if unbiased:
        var = var * count / (count - 1).clamp_min(1.0)
    return torch.where(count >= 2, var, torch.zeros_like(var))


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """`(values - mean) * rsqrt(var + 1e-8)` with masked statistics, applied to every position as in verl.

    Deviation from verl: an all-zero mask returns zeros (verl raises); one valid element gives var 0.
    """
    m = _float_mask(mask, values)
    mean = masked_mean(values, m)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, m) + _MEAN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m.sum() > 0, whitened, torch.zeros_like(whitened))


@torch.no_grad()
def outcome_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place each row's scalar score on its last valid response token ([B] -> [B, T]).

    Like verl's reward manager (score at `valid_length - 1`); here "last valid" is the last position
    with mask 1, so tool tokens masked inside a multi-turn response are skipped. Empty rows stay all 0.
    """
    valid = response_mask != 0
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    out = torch.zeros(valid.shape, dtype=dtype, device=scores.device)
    if valid.shape[-1] == 0:
        return out
    positions = torch.arange(valid.shape[-1], device=valid.device).expand_as(valid)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=-1)
    has_token = last >= 0
    placed = torch.where(has_token, scores.to(dtype), torch.zeros_like(scores, dtype=dtype))
    return out.scatter_(1, last.clamp_min(0).unsqueeze(1), placed.unsqueeze(1))


def _group_stats(scores: Tensor, index: Sequence[str]) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row group size, mean and unbiased std of `scores` [B], grouped by uid equality.

    Computed in float64 so an all-equal group has exactly zero deviation (float32 rounding of the mean
    would otherwise be divided by eps=1e-6 and give spurious advantages).
    """
    if len(index) != scores.shape[0]:
        raise ValueError(f"index has {len(index)} uids but the batch has {scores.shape[0]} rows")
    uid_to_group: dict[str, int] = {}
    group = torch.tensor(
        [uid_to_group.setdefault(uid, len(uid_to_group)) for uid in index],
        dtype=torch.long,
        device=scores.device,
    )
    s = scores.to(torch.float64)
    zeros = torch.zeros(len(uid_to_group), dtype=torch.float64, device=scores.device)
    count = zeros.index_add(0, group, torch.ones_like(s))
    mean = zeros.index_add(0, group, s) / count.clamp_min(1.0)
    sq_dev = zeros.index_add(0, group, (s - mean[group]) ** 2)
    std = (sq_dev / (count - 1).clamp_min(1.0)).sqrt()
    return count[group], mean[group], std[group]


@torch.no_grad()
def compute_gae(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016, arXiv:1506.02438, Eq. 16): A_t = sum_l (gamma*lam)^l delta_{t+l}.

    As in verl 0.9.1 the backward scan skips masked tokens (value and running advantage are carried
    over them), returns = raw advantages + values, and advantages are whitened over the whole batch
    (padded positions are transformed too, not zeroed). An all-zero mask gives zero advantages.
    """
    m = response_mask != 0
    next_value = token_rewards.new_zeros(token_rewards.shape[0])
    last_gae = torch.zeros_like(next_value)
    raw = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[-1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        next_value = torch.where(m[:, t], values[:, t], next_value)
        last_gae = torch.where(m[:, t], delta + gamma * lam * last_gae, last_gae)
        raw[:, t] = last_gae
    return masked_whiten(raw, response_mask), raw + values


@torch.no_grad()
def compute_grpo(
    token_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[str],
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, arXiv:2402.03300, §4.1.2): (s_i - mean_g) / (std_g + eps).

    s_i is the row sum of rewards; std is unbiased; a singleton group uses mean 0, std 1 (so A = s/(1+eps)),
    as in verl. `norm_by_std=False` is Dr.GRPO (Liu et al. 2025, arXiv:2503.20783): A = s_i - mean_g.
    Broadcast over tokens times the mask; returns equals advantages (a separate tensor, no aliasing).
    """
    scores = token_rewards.sum(dim=-1)
    count, mean, std = _group_stats(scores, index)
    single = count < 2
    adv = scores.to(torch.float64) - torch.where(single, torch.zeros_like(mean), mean)
    if norm_by_std:
        adv = adv / (torch.where(single, torch.ones_like(std), std) + eps)
    adv = adv.to(token_rewards.dtype).unsqueeze(-1) * _float_mask(response_mask, token_rewards)
    return adv, adv.clone()


@torch.no_grad()
def compute_rloo(
    token_rewards: Tensor, response_mask: Tensor, index: Sequence[str], eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): A_i = s_i - mean of the other n-1 samples of the group.

    Equals n/(n-1)*(s_i - mean_g). A singleton group keeps A = s_i, like verl's loop version (the
    vectorised verl variant returns 0 there). `eps` is unused, kept for verl's signature.
    """
    scores = token_rewards.sum(dim=-1)
    count, mean, _ = _group_stats(scores, index)
    s = scores.to(torch.float64)
    adv = torch.where(count > 1, (s - mean) * count / (count - 1).clamp_min(1.0), s)
    adv = adv.to(token_rewards.dtype).unsqueeze(-1) * _float_mask(response_mask, token_rewards)
    return adv, adv.clone()


@torch.no_grad()
def compute_reinforce_pp(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return G_t = r_t + gamma*G_{t+1}, batch-whitened.

    verl 0.9.1 mask rule: a masked token stores return 0 and carries the running return unchanged
    (its reward is ignored). advantages = whiten(G) * mask; returns = G.
    """
    m = response_mask != 0
    running = token_rewards.new_zeros(token_rewards.shape[0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[-1])):
        running = torch.where(m[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(m[:, t], running, torch.zeros_like(running))
    mask = _float_mask(response_mask, token_rewards)
    return masked_whiten(returns, mask) * mask, returns


@torch.no_grad()
def compute_reinforce_pp_baseline(
    token_rewards: Tensor, response_mask: Tensor, index: Sequence[str], eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): s_i - mean_g on every token, then batch-whitened.

    Singleton groups use mean 0 (as verl). advantages = whiten((s - mean) * mask) * mask; returns equals
    advantages. `eps` is unused (no std division), kept for verl's signature.
    """
    scores = token_rewards.sum(dim=-1)
    count, mean, _ = _group_stats(scores, index)
    centered = scores.to(torch.float64) - torch.where(count > 1, mean, torch.zeros_like(mean))
    mask = _float_mask(response_mask, token_rewards)
    adv = centered.to(token_rewards.dtype).unsqueeze(-1) * mask
    adv = masked_whiten(adv, mask) * mask
    return adv, adv.clone()


ADV_ESTIMATORS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "gae": compute_gae,
    "grpo": compute_grpo,
    "rloo": compute_rloo,
    "reinforce_pp": compute_reinforce_pp,
    "reinforce_pp_baseline": compute_reinforce_pp_baseline,
}
# Which of compute_advantages' optional inputs each estimator takes (passed by keyword).
_ESTIMATOR_INPUTS: dict[str, tuple[str, ...]] = {
    "gae": ("values", "gamma", "lam"),
    "grpo": ("index", "norm_by_std"),
    "rloo": ("index",),
    "reinforce_pp": ("gamma",),
    "reinforce_pp_baseline": ("index",),
}


def compute_advantages(
    name: str,
    token_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[str],
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
) -> tuple[Tensor, Tensor]:
    """One entry point for every estimator in `ADV_ESTIMATORS`: returns (advantages, returns), both [B, T].

    Raises:
        ValueError: if `name` is unknown, or "gae" is asked for without critic `values`.
    """
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADV_ESTIMATORS)}")
    if name == "gae" and values is None:
        raise ValueError("advantage estimator 'gae' needs critic values; pass values=[B, T] or pick 'grpo'")
    available = {"values": values, "index": index, "gamma": gamma, "lam": lam, "norm_by_std": norm_by_std}
    kwargs = {key: available[key] for key in _ESTIMATOR_INPUTS[name]}
    return ADV_ESTIMATORS[name](token_rewards=token_rewards, response_mask=response_mask, **kwargs)


@torch.no_grad()
def filter_groups(scores: Tensor, index: Sequence[str]) -> Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476, §3.2): keep-mask [B] over rows.

    False for every row of a group whose scores are all equal (it carries no GRPO signal). A singleton
    group is kept, as verl's DAPO trainer does (`std > 0 or len == 1`).
    """
    count, _, std = _group_stats(scores, index)
    return (std > 0) | (count == 1)


def overlong_penalty(response_lengths: Tensor, max_len: int, buffer_len: int, factor: float) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, §3.4), added to the score.

    With expected = max_len - buffer_len: min(-(len - expected) / buffer_len * factor, 0), so 0 up to
    `expected` and falling linearly to -factor at `max_len`.

    Raises:
        ValueError: if `buffer_len` is not positive (verl would divide by zero).
    """
    if buffer_len <= 0:
        raise ValueError(f"overlong buffer_len must be > 0, got {buffer_len}; disable the penalty instead")
    exceed = response_lengths.to(torch.float32) - (max_len - buffer_len)
    return torch.clamp(-exceed / buffer_len * factor, max=0.0)
