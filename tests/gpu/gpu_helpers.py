"""Helpers of the `gpu` tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch

from rlstages.configs.training import DeepSpeedTrainingConfig, MegatronTrainingConfig, TorchTrainingConfig
from rlstages.engines.types import Prompt

PROMPTS = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
LR = 1e-4
CONFIGS = {"torch": TorchTrainingConfig, "deepspeed": DeepSpeedTrainingConfig, "megatron": MegatronTrainingConfig}


def snapshot(named) -> dict[str, torch.Tensor]:
    """Weights by name, copied to the CPU."""
    return {k: v.detach().float().cpu().clone() for k, v in named}


def masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest |a - b| where `mask` is set."""
    return float(((a.float().cpu() - b.float().cpu()).abs() * mask.cpu()).max())
