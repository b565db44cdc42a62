"""The engine Protocols: what every backend of a kind implements, with the signatures the tasks call.
No logic lives here; `tests/engines/test_protocols.py` checks every registered class against its Protocol.

Engines are plain classes (no Ray decorators); `workers.actor_group` makes them Ray actors from outside,
and unit tests run them in-process. A training engine is one `training.core.PPOTrainer` driving a
`StepBackend` (torch, DeepSpeed, Megatron): the update loop is written once, a backend only runs
micro-batches and steps its optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from rlstages.engines.score_result import ScoreResult
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.types import Bucket, NamedTensors, Prompt, SamplingParams


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
class GroupReceiver(Protocol):
    """A rollout engine whose weights live in processes of its own (vLLM's workers): in split placement those
    processes join the trainer's broadcast group and load the buckets themselves
    (`rlstages.engines.sync.collective`). Engines without these methods receive in their actor."""

    def weight_group_size(self) -> int:
        """How many processes this engine adds to a sync group (they take consecutive ranks)."""
        ...

    def join_weight_group(
        self, name: str, addr: str, port: int, rank: int, world: int, timeout: float, shm_path: str | None, host: str
    ) -> None:
        """Its processes join the group `name` (store at `addr:port`) from `rank` on; `host`: this node's address."""
        ...

    def receive_weight_group(self, name: str) -> int:
        """Receive one sync's buckets (waking the engine first); returns the number of tensors loaded."""
        ...

    def leave_weight_group(self, name: str) -> None:
        """Forget the group `name` (its peers were replaced)."""
        ...


@runtime_checkable
class BucketReceiver(Protocol):
    """A rollout engine that forms the trainer's broadcast group with its own API and loads flat buckets whose
    layout the source sends it through Ray (SGLang: `init_weights_update_group`,
    `update_weights_from_distributed(load_format="flattened_bucket")`; `rlstages.engines.sync.collective.flat`)."""

    def weight_group_size(self) -> int:
        """How many processes this engine adds to a sync group (they take consecutive ranks)."""
        ...

    def join_weight_group(
        self, name: str, addr: str, port: int, rank: int, world: int, timeout: float, shm_path: str | None, host: str
    ) -> None:
        """Its processes join the group `name` hosted by the source at `addr:port`, from `rank` on."""
        ...

    def begin_weight_group_update(self, name: str) -> None:
        """Wake and open a weight-update session before a round."""
        ...

    def receive_weight_bucket(self, name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
        """Receive one flat bucket broadcast on group `name` (tensors end to end, in `names` order) and load it."""
        ...

    def end_weight_group_update(self, name: str) -> None:
        """Close the session after the last bucket (post-processing, cache flush)."""
        ...

    def leave_weight_group(self, name: str) -> None:
        """Forget the group `name` (its peers were replaced)."""
        ...


@runtime_checkable
class TrainingEngine(Protocol):
    """Holds a trainable model (actor or critic) and its optimizer, or a frozen reference.

    With several ranks (sharded or pipelined backends) every rank calls every method at once; methods that
    return data return None (or yield nothing) on ranks that do not hold the result."""

    def logprobs(self, batch: TensorDict, temperature: float | None = None, base: bool = False) -> TensorDict | None:
        """Teacher-forced log-probs (and entropy) of `response_ids`: a batch with `logprobs`, `entropy` [B, T].
        `temperature` replaces the engine's (None keeps it); `base` reads the frozen base under LoRA."""
        ...

    def values(self, batch: TensorDict) -> torch.Tensor | None:
        """Critic values [B, T] of the response tokens."""
        ...

    def train_step(self, batch: TensorDict) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches on `batch`; returns metrics (pg_loss, grad_norm, lr, ...)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one at a time (gathered across shards where the backend shards)."""
        ...

    def weight_buckets(self, bucket_bytes: int, dtype: str) -> Iterator[Bucket]:
        """`named_weights` in encoded buckets for streaming to rollout engines (a generator for Ray)."""
        ...

    def save_pretrained(self, path: Path, tokenizer_from: Path | None = None) -> None:
        """An HF directory (config, safetensors, and the tokenizer of `tokenizer_from`) of the current weights."""
        ...

    def save(self, path: Path) -> None:
        """Model (safetensors), optimizer, scheduler and RNG states, so `load` continues bitwise."""
        ...

    def load(self, path: Path) -> None:
        """Restore what `save` wrote."""
        ...


@dataclass(frozen=True)
class Readout:
    """What a training forward pass reads per micro-batch: (log-probs, entropy) [B, t] of the response
    tokens at `temperature` (entropy with a graph only if `entropy_grad`), or with `values` the critic's
    values [B, t] as a 1-tuple."""

    values: bool = False
    temperature: float = 1.0
    entropy_grad: bool = False
    base: bool = False  # under the frozen base (a LoRA adapter disabled): the reference policy


# Called once per micro-batch with its outputs (the `Readout`); returns the micro-batch's loss when training.
OnOutput = Callable[[TensorDict, tuple[torch.Tensor, ...]], torch.Tensor | None]


@runtime_checkable
class StepBackend(Protocol):
    """One rank of one training backend, driven by `training.core.PPOTrainer`: a model, its optimizer and
    their state. Built as `Backend(settings: TrainerSettings)` (the seed is already set) on the worker's device
    (`settings.resolved_device()`, resolved where the worker started: its model there; batches arrive there); a
    class attribute `cuda_env` (optional) names variables `PPOTrainer` sets before CUDA starts (Megatron:
    CUDA_DEVICE_MAX_CONNECTIONS)."""

    @property
    def outputs_here(self) -> bool:
        """This rank receives the forward outputs (Megatron: the last pipeline stage only)."""
        ...

    @property
    def is_weight_source(self) -> bool:
        """This rank yields the weight buckets and writes HF exports (the others only join the gathers)."""
        ...

    @property
    def keeps_weights(self) -> bool:
        """The tensors `named_weights` yields stay valid and are never reused as buffers, so a rollout engine in
        the same process may hold them as its own weights instead of copying them (`workers.hybrid`)."""
        ...

    def run(self, mbs: list[TensorDict], readout: Readout, on_output: OnOutput, train: bool) -> None:
        """Forward each micro-batch, hand its outputs to `on_output`; when `train`, zero the gradients first
        and backpropagate each returned loss (already normalised: gradients add up to the mini-batch's)."""
        ...

    def resident(self, train: bool) -> AbstractContextManager[None]:
        """Keep the model (and with `train` its gradients) on the device for a call (offloading backends)."""
        ...

    def share(self, metrics: dict[str, float]) -> dict[str, float]:
        """The mini-batch's metrics as every rank reports them (Megatron: the last stage's, broadcast)."""
        ...

    def optimizer_step(self) -> float:
        """Clip, step (skipped on a non-finite norm) and advance the LR schedule; returns the pre-clip norm."""
        ...

    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one at a time (a collective where the backend shards)."""
        ...

    def save_hf(self, path: Path) -> bool:
        """Write an HF config + safetensors of the current weights; True on the rank that wrote."""
        ...

    def save(self, path: Path, steps_done: int) -> None:
        """The backend's model, optimizer, schedule and RNG state under the existing directory `path`."""
        ...

    def load(self, path: Path) -> int | None:
        """Restore what `save` wrote; returns `steps_done` (None where nothing recorded it)."""
        ...


@runtime_checkable
class RewardFunctions(Protocol):
    """Scores responses with rule-based reward functions (registry name "functions")."""

    def score(self, prompts: list[str], responses: list[str], ground_truths: list[str]) -> ScoreResult:
        """Weighted scores, per-function components and metrics of each (prompt, response, ground truth)."""
        ...


@runtime_checkable
class RewardModel(Protocol):
    """Scores responses with a learned reward model (registry name "model")."""

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """One scalar reward per (prompt, response), in input order."""
        ...
