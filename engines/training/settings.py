"""What a training engine is built from: one frozen object made once from the config (`tasks.driver.specs`).

It holds the config's own pieces (the role's `configs.training` options, with its `OptimConfig`, and the
algorithm's loss knobs) plus the few run-level numbers they lack; the derived numbers (how many optimizer
steps the LR schedule spans) are computed here and nowhere else.

Non-goal: reading a RunConfig (engines never import `configs.run`; the task layer builds this).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlstages.configs.training import OptimConfig, TorchTrainingConfig, TrainingConfig
from rlstages.engines.algorithms import PolicyLossParams

Role = Literal["actor", "critic", "reference"]


@dataclass(frozen=True)
class TrainerSettings:
    """A training engine's inputs: the model, its role, the role's training config and the PPO loss knobs."""

    model_path: str
    role: Role = "actor"
    train: TrainingConfig = field(default_factory=TorchTrainingConfig)
    loss: PolicyLossParams = field(default_factory=PolicyLossParams)
    num_mini_batches: int = 1  # optimizer steps per epoch of a train step
    train_steps: int = 1  # trainer steps the LR schedule spans when `optim.total_steps` is unset
    cliprange_value: float = 0.5
    temperature: float = 1.0
    dtype: str = "float32"
    model_type: str | None = None
    seed: int = 0
    converted_path: str | None = None  # a pre-converted checkpoint of the model (Megatron), None = convert here
    lora: dict[str, Any] | None = None  # LoRA adapters on the actor (`configs.model.LoraConfig` dumped), torch only
    # another engine (a colocated rollout, reference or critic in another process) uses this GPU: the trainer hands
    # its cached blocks back after each forward/update (`empty_cache`); alone on its GPU it keeps them (no
    # re-allocation, no device sync per update)
    shares_device: bool = False
    device: str | None = None  # where this worker computes, resolved once by `PPOTrainer` (`runtime.device`)

    def resolved_device(self) -> torch.device:
        """`device`, which `PPOTrainer` sets (the worker's, resolved where it started); a backend is built by it."""
        if not self.device:
            raise ValueError("TrainerSettings.device is unset: a step backend is built by PPOTrainer, which sets it")
        return torch.device(self.device)

    @property
    def backend(self) -> str:
        """The training backend's registry name (`engines.registry.TRAINING_BACKENDS`)."""
        return self.train.backend

    @property
    def optim(self) -> OptimConfig:
        """AdamW and its LR schedule."""
        return self.train.optim

    @property
    def trainable(self) -> bool:
        """False for the frozen reference: no optimizer, no `train_step`."""
        return self.role != "reference"

    @property
    def optim_steps(self) -> int:
        """Optimizer steps the LR schedule spans: trainer steps x PPO epochs x mini-batches."""
        steps = self.optim.total_steps or self.train_steps
        return steps * self.train.ppo_epochs * self.num_mini_batches

    def optim_record(self) -> dict[str, Any]:
        """The optimizer options as checkpoints record them (`total_steps` in optimizer steps)."""
        return {**self.optim.model_dump(), "total_steps": self.optim_steps}
