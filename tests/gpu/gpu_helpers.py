"""Helpers of the `gpu` tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlstages.configs.training import DeepSpeedTrainingConfig, MegatronTrainingConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.runtime.device import DEVICE_ENV
from rlstages.engines.types import Prompt, SamplingParams

PROMPTS = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
LR = 1e-4
CONFIGS = {"torch": TorchTrainingConfig, "deepspeed": DeepSpeedTrainingConfig, "megatron": MegatronTrainingConfig}


def snapshot(named) -> dict[str, torch.Tensor]:
    """Weights by name, copied to the CPU."""
    return {k: v.detach().float().cpu().clone() for k, v in named}


def masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest |a - b| where `mask` is set."""
    return float(((a.float().cpu() - b.float().cpu()).abs() * mask.cpu()).max())


def sample_grpo_batch(model_dir: Path):
    """16 sampled rows (4 prompts x 4) of `model_dir` with GRPO advantages, sampled on the CPU (the same rows
    for every device)."""
    from rlstages.engines.rollout.hf_rollout import HFRolloutEngine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DEVICE_ENV, "cpu")
        rollout = HFRolloutEngine(model_dir, dtype="float32", apply_chat_template=False)
        b = rollout.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=8), seed=3)
    token = A.outcome_to_token_rewards((torch.arange(16) % 3 == 0).float(), b[T.RESPONSE_MASK])
    b[T.ADVANTAGES], b[T.RETURNS] = A.compute_advantages("grpo", token, b[T.RESPONSE_MASK], T.get_rows(b, "uid"))
    b[T.VALUES] = torch.zeros_like(b[T.ADVANTAGES])
    return b
