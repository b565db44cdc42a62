"""The trainer's parameters and optimizer state off its GPU while a colocated inference engine generates, and back
before it trains (verl's `rollout_mode` / `trainer_mode`, NeMo-RL's refit): the engine's KV cache then has the
memory the trainer held. Used by the hybrid engine when the trainer is on CUDA and the engine frees its own
memory natively (vLLM sleep mode, SGLang's memory saver); the sync runs before the offload, while the trainer's
weights are still on the GPU, so the push reads them in place.

Only tensors found on the trainer's device move, and each goes back where it was: Adam's `step` counters stay on
the CPU, as torch keeps them unless `capturable`. Non-goal: backends that place their own memory (DeepSpeed and
Megatron-Core offload through their own options).
"""

from __future__ import annotations

from typing import Any

import torch


class TrainerOffload:
    """Moves one model and its optimizer state between its device and host memory."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.away = False
        self._moved: list[tuple[dict[str, Any], str]] = []

    def offload(self) -> None:
        """Parameters (and gradients) and optimizer state to host memory; the device's cached blocks released."""
        if self.away:
            return
        host = torch.device("cpu")
        self.model.to(host)
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad = param.grad.to(host)
        self._moved = []
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device == self.device:
                        state[key] = value.to(host)
                        self._moved.append((state, key))
        self.away = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Everything `offload` moved, back on the device."""
        if not self.away:
            return
        self.model.to(self.device)
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad = param.grad.to(self.device)
        for state, key in self._moved:
            state[key] = state[key].to(self.device)
        self._moved = []
        self.away = False


def hybrid_offload(trainer: Any, rollout: Any) -> TrainerOffload | None:
    """A `TrainerOffload` for a hybrid worker whose torch-backend trainer is on a GPU and whose rollout engine
    frees its memory itself while asleep; None otherwise (on CPU, or where the rollout holds the trainer's own
    tensors, nothing is gained by moving them)."""
    from rlstages.engines.training.torch_backend import TorchBackend

    backend = getattr(trainer, "backend", None)
    frees_itself = bool(getattr(rollout, "native_sleep", False) or getattr(rollout, "memory_saver", False))
    if not isinstance(backend, TorchBackend) or not frees_itself:
        return None
    device = next(backend.model.parameters()).device
    if device.type != "cuda":
        return None
    return TrainerOffload(backend.model, backend.optimizer, device)
