"""The optimizer and LR schedule shared by the torch and DeepSpeed backends (Megatron sets the same LR by hand).

Non-goal: Megatron's optimizer (`engines.megatron.optim`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from rlstages.configs.training import OptimConfig
from rlstages.engines.training.sr_adamw import BF16StochasticAdamW


def lr_lambda(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """LR factor of optimizer step `step`: linear warm-up, then constant or cosine decay to `min_lr_ratio`
    by `total_steps` optimizer steps (over its last `decay_steps` where set, the peak held before them)."""
    start = optim.warmup_steps
    if optim.decay_steps is not None:
        start = max(start, total_steps - optim.decay_steps)

    def factor(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant" or step < start:
            return 1.0
        span = max(1, total_steps - start)
        progress = min(1.0, (step - start) / span)
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def adamw_kwargs(optim: OptimConfig) -> dict[str, object]:
    """AdamW's constructor arguments from the config (torch's AdamW and DeepSpeed's CPU Adam take the same)."""
    return {"lr": optim.lr, "betas": optim.betas, "eps": optim.eps, "weight_decay": optim.weight_decay}


def adamw(
    params: Iterable[torch.nn.Parameter], optim: OptimConfig, bf16_stochastic_round: bool = False, seed: int = 0
) -> torch.optim.Optimizer:
    """Torch AdamW over `params`, fused: one kernel per tensor instead of foreach's lists of temporaries as
    large as the model (SmolLM2-135M: ~0.5 GB less at the step, and faster on CPU and GPU alike).
    `bf16_stochastic_round`: `sr_adamw.BF16StochasticAdamW` for bf16 weights (fp32 math per tensor, compiled
    once; moments in bf16; each new weight rounded to bf16 stochastically, unbiased, its bits from `seed`)."""
    if bf16_stochastic_round:
        return BF16StochasticAdamW(params, **adamw_kwargs(optim), seed=seed)  # type: ignore[arg-type]
    return torch.optim.AdamW(params, **adamw_kwargs(optim), fused=True)  # type: ignore[arg-type]


def lr_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule as a LambdaLR stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, total_steps))
