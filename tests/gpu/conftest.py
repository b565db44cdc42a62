"""Fixtures of the `gpu` tests: a GRPO batch sampled on the CPU (the same rows for every device) and trainer
settings per backend. These tests import only torch, transformers, tensordict, safetensors, pydantic (and
deepspeed / megatron-core where a test needs them): no Ray, Prefect or MLflow, so `scripts/gpu_check.sh` runs
them on a bare GPU machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from gpu_helpers import CONFIGS, LR, sample_grpo_batch

from rlstages.configs.training import OptimConfig
from rlstages.engines.training.settings import TrainerSettings


@pytest.fixture(scope="module")
def batch(tiny_model_dir: Path):
    """16 sampled rows (4 prompts x 4) with GRPO advantages, sampled on the CPU."""
    return sample_grpo_batch(tiny_model_dir)


@pytest.fixture(scope="module")
def settings() -> Callable[..., TrainerSettings]:
    """`settings(path, backend, dtype=..., **options)`: an actor's settings (4 rows per micro-batch)."""

    def make(path: Path, backend: str = "torch", dtype: str = "float32", **options) -> TrainerSettings:
        options.setdefault("micro_batch_size", 4)
        train = CONFIGS[backend](optim=OptimConfig(lr=LR, total_steps=10), **options)
        return TrainerSettings(str(path), train=train, dtype=dtype)  # type: ignore[arg-type]

    return make
