"""The engine Protocols: what every backend of a kind implements. No logic lives here.

Engines are plain classes (no Ray decorators); `runtime.actor_group` makes them Ray actors from outside,
and unit tests run them in-process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from rlstages.engines.types import Prompt, SamplingParams

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates n samples per prompt with per-token log-probs, and takes new weights in place."""

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, seed: int) -> TensorDict:
        """Sample `sampling.n` responses per prompt; returns a batch with the fields of `rlstages.engines.types`."""
        ...

    def update_weights(self, named_tensors: NamedTensors) -> None:
        """Load HF-named tensors in place (streamed; a subset of the weights is allowed)."""
        ...

    def sleep(self) -> None:
        """Free the engine's memory while the trainer runs (colocated mode)."""
        ...

    def wake(self) -> None:
        """Restore what `sleep` freed."""
        ...


@runtime_checkable
class TrainingEngine(Protocol):
    """Holds a trainable model (actor or critic) and its optimizer."""

    def logprobs(self, batch: TensorDict, temperature: float = 1.0) -> TensorDict:
        """Teacher-forced log-probs (and entropy) of `response_ids`: a batch with `logprobs`, `entropy` [B, T]."""
        ...

    def values(self, batch: TensorDict) -> torch.Tensor:
        """Critic values [B, T] of the response tokens."""
        ...

    def train_step(self, batch: TensorDict) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches on `batch`; returns metrics (pg_loss, grad_norm, lr, ...)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one at a time (gathered across shards where the backend shards)."""
        ...

    def save(self, path: Path) -> None:
        """Model (safetensors), optimizer, scheduler and RNG states, so `load` continues bitwise."""
        ...

    def load(self, path: Path) -> None:
        """Restore what `save` wrote."""
        ...


@runtime_checkable
class WeightConverter(Protocol):
    """Maps between HF names/layouts and a backend's own (e.g. Megatron-Core), in both directions."""

    def to_backend(self, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        """HF -> backend, streamed."""
        ...

    def to_hf(self, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        """Backend -> HF, streamed."""
        ...
