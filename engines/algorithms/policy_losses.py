"""Per-token policy-gradient losses selectable by name: PPO-clip (vanilla), GSPO, CISPO, Clip-Cov, KL-Cov.

Each returns the [B, T] per-token loss L (before rollout IS weights and aggregation, which `policy_loss`
applies) and its detached metrics pg_clipfrac, pg_clipfrac_lower, ppo_kl. Inputs: old = log pi_old,
logp = log pi_theta, adv = A, m = response mask (float). Padding and empty masks give finite values.

Non-goal: aggregation, entropy and KL terms (`policy_loss`).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from rlstages.engines.algorithms.advantages import masked_mean, masked_sum

PolicyLossName = Literal["vanilla", "gspo", "cispo", "clip_cov", "kl_cov"]
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLossName)
Metrics = dict[str, Tensor]
_LOG_CLAMP = 20.0


def _log_ratio(old: Tensor, logp: Tensor) -> Tensor:
    return torch.clamp(logp - old, -_LOG_CLAMP, _LOG_CLAMP)


def _zero(m: Tensor) -> Tensor:
    return torch.zeros((), dtype=m.dtype, device=m.device)


def vanilla(
    old: Tensor, logp: Tensor, adv: Tensor, m: Tensor, low: float, high: float, clip_c: float | None
) -> tuple[Tensor, Metrics]:
    """PPO-clip (Schulman et al. 2017, arXiv:1707.06347, Eq. 7) with DAPO clip-higher and dual clip.

    rho = exp(clamp(logp - old, -20, 20)); L = max(-A*rho, -A*clip(rho, 1-low, 1+high)); for A < 0 the dual
    clip (Ye et al. 2020, arXiv:1912.09729) takes min(L, -A*c).
    """
    log_ratio = _log_ratio(old, logp)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    clipfrac_lower = _zero(m)
    if clip_c is not None:
        dual = -adv * clip_c
        negative = adv < 0
        clipfrac_lower = masked_mean(((loss > dual) & negative).to(m.dtype), m)
        loss = torch.where(negative, torch.minimum(loss, dual), loss)
    return loss, {
        "pg_clipfrac": masked_mean((clipped > unclipped).to(m.dtype), m),
        "pg_clipfrac_lower": clipfrac_lower,
        "ppo_kl": masked_mean(-log_ratio, m),
    }


def gspo(old: Tensor, logp: Tensor, adv: Tensor, m: Tensor, low: float, high: float) -> tuple[Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071, Eq. 5-7): the clipped surrogate on the sequence ratio.

    s_i = exp((1/|y_i|) sum_t (logp - old)), the length-normalised likelihood ratio of response i; every token
    carries s_i,t = sg(s_i) * pi(y_t) / sg(pi(y_t)) (equal value, per-token gradient; log clamped at 10), and
    L = max(-A*s_i,t, -A*clip(s_i,t, 1-low, 1+high)). The paper's ranges are tiny (3e-4, 4e-4) because s_i is a
    geometric mean. No dual clip. The paper averages tokens per sequence: loss_agg_mode seq-mean-token-mean.
    """
    delta = torch.where(m != 0, logp - old, torch.zeros_like(logp))
    seq_log_ratio = masked_sum(delta, m, dim=-1) / m.sum(-1).clamp(min=1.0)
    log_s = torch.clamp(logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    unclipped = -adv * s
    clipped = -adv * torch.clamp(s, 1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), {
        "pg_clipfrac": masked_mean((clipped > unclipped).to(m.dtype), m),
        "pg_clipfrac_lower": _zero(m),
        "ppo_kl": masked_mean(-_log_ratio(old, logp), m),
    }


def cispo(old: Tensor, logp: Tensor, adv: Tensor, m: Tensor, low: float, high: float) -> tuple[Tensor, Metrics]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, Eq. 4-5): clip the importance weight, never drop a token's gradient.

    L = -sg(clip(rho, 1-low, 1+high)) * A * logp with rho = exp(clamp(logp - old, -20, 20)): the gradient is
    -clip(rho)*A*grad(logp), so tokens outside the band still learn, with a bounded weight (the paper sets no
    lower bound, low >= 1, and tunes only `high`). pg_clipfrac = fraction of tokens whose weight was clipped.
    """
    log_ratio = _log_ratio(old, logp)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high).detach()
    return -weight * adv * logp, {
        "pg_clipfrac": masked_mean((weight != ratio.detach()).to(m.dtype), m),
        "pg_clipfrac_lower": _zero(m),
        "ppo_kl": masked_mean(-log_ratio, m),
    }


def token_covariance(logp: Tensor, adv: Tensor, m: Tensor) -> Tensor:
    """Cov_t = (logp_t - mean(logp)) * (A_t - mean(A)), means over the mask (Cui et al. 2025, Eq. 11), detached."""
    lp, a = logp.detach(), adv.detach()
    return (lp - masked_mean(lp, m)) * (a - masked_mean(a, m))


def clip_cov(
    old: Tensor,
    logp: Tensor,
    adv: Tensor,
    m: Tensor,
    low: float,
    high: float,
    ratio: float,
    lb: float,
    ub: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Metrics]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617, Eq. 12).

    PPO-clip without dual clip, except that max(1, int(ratio * N)) tokens drawn at random from those with
    lb < Cov_t < ub (and not already clipped by PPO) lose their gradient (their loss is zeroed): the tokens
    whose high covariance drives entropy collapse. pg_clipfrac = fraction of tokens so detached.
    """
    log_ratio = _log_ratio(old, logp)
    rho = torch.exp(log_ratio)
    unclipped = -adv * rho
    clipped = -adv * torch.clamp(rho, 1.0 - low, 1.0 + high)
    valid = m != 0
    cov = token_covariance(logp, adv, m)
    candidates = torch.nonzero(valid & ~(clipped > unclipped) & (cov > lb) & (cov < ub))
    count = max(int(ratio * int(valid.sum())), 1)
    perm = torch.randperm(len(candidates), generator=generator)[:count].to(candidates.device)
    chosen = candidates[perm]
    keep = torch.ones_like(logp)
    keep[chosen[:, 0], chosen[:, 1]] = 0.0
    return torch.maximum(unclipped, clipped) * keep, {
        "pg_clipfrac": masked_mean((keep == 0).to(m.dtype), m),
        "pg_clipfrac_lower": _zero(m),
        "ppo_kl": masked_mean(-log_ratio, m),
    }


def kl_cov(old: Tensor, logp: Tensor, adv: Tensor, m: Tensor, ratio: float, coef: float) -> tuple[Tensor, Metrics]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617, Eq. 13): no clipping; a KL penalty on high-covariance tokens.

    L = -A*rho for every token, plus coef * |logp - old| on the top max(1, int(ratio * N)) tokens by Cov_t,
    which keeps the entropy-collapsing tokens near pi_old. ppo_kl here is the masked mean of |logp - old| and
    pg_clipfrac the fraction of penalised tokens.
    """
    log_ratio = _log_ratio(old, logp)
    loss = -adv * torch.exp(log_ratio)
    valid = m != 0
    n_valid = int(valid.sum())
    penalised = torch.zeros_like(valid)
    if n_valid:
        cov = torch.where(valid, token_covariance(logp, adv, m), torch.full_like(logp, -torch.inf))
        top = torch.topk(cov.reshape(-1), max(int(ratio * n_valid), 1)).indices
        penalised.view(-1)[top] = True
    loss = torch.where(penalised, loss + coef * log_ratio.abs(), loss)
    return loss, {
        "pg_clipfrac": masked_mean(penalised.to(m.dtype), m),
        "pg_clipfrac_lower": _zero(m),
        "ppo_kl": masked_mean(log_ratio.abs(), m),
    }
