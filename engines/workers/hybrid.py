"""The hybrid engine: a trainer and a rollout engine in one process (verl's colocated hybrid engine).

Where the trainer's weights are in the rollout's dtype and the backend keeps them (`StepBackend.keeps_weights`:
the torch backend), the rollout engine holds the trainer's own tensors (`adopt_weights`): one copy of the
weights in the process, and a sync that copies nothing. Otherwise each keeps its own model in its own dtype;
weight sync is an in-process, tensor-by-tensor copy from the trainer's HF-named weights into the rollout model
(cast on the fly), with no serialisation, and the rollout sleeps (frees its weights) while the trainer works.
Methods delegate explicitly, so Ray sees every one of them on the actor handle. Both engines compute on the
worker's device (`runtime.device.worker_device`): on a GPU the one copy of the weights lives there, generation
frees its KV cache when it returns, and the cached blocks of each phase go back before the other starts.

On a GPU, with a rollout engine that frees its own memory while asleep (vLLM sleep mode, SGLang's memory saver),
the trainer's parameters and optimizer state leave the GPU while the engine generates and come back before the
trainer's next call (`workers.offload`); the sync pushes from the trainer's GPU tensors by CUDA IPC.

Non-goal: resharding between different parallel layouts (one rank holds whole models here).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlstages.engines.imports import import_object
from rlstages.engines.runtime.device import free_cached, worker_device
from rlstages.engines.runtime.heap import release_freed_pages
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.types import Bucket, NamedTensors, Prompt, SamplingParams
from rlstages.engines.workers.offload import hybrid_offload


class HybridEngine:
    """Rollout + trainer on the same worker; `sync_local` moves the weights without leaving the process."""

    def __init__(self, trainer: str, trainer_kwargs: dict[str, Any], rollout: str, rollout_kwargs: dict[str, Any]):
        self.device = worker_device()  # the worker starts here: its trainer and rollout engine get this device
        self.trainer = _build(trainer, trainer_kwargs, self.device)
        self.rollout = _build(rollout, rollout_kwargs, self.device)
        self.shares_weights = False
        if getattr(getattr(self.trainer, "backend", None), "keeps_weights", False) and hasattr(
            self.rollout, "adopt_weights"
        ):  # the rollout's own copy is dropped at once where the trainer's tensors can serve
            rest = self.rollout.adopt_weights(self.trainer.named_weights())
            self.rollout.update_weights(rest)
            self.shares_weights = not rest
        self.offload = None if self.shares_weights else hybrid_offload(self.trainer, self.rollout)
        if not self.shares_weights and hasattr(self.trainer, "shares_device"):
            self.trainer.shares_device = True  # the rollout's own weights and KV cache need the update's blocks
        elif self.shares_weights and hasattr(self.rollout, "shares_device"):
            # one process, one caching allocator: the KV cache's blocks serve the update as they are, unless
            # another process (a reference, a critic) shares the GPU
            self.rollout.shares_device = bool(getattr(self.trainer, "shares_device", True))

    # ---- rollout side -----------------------------------------------------------------------------------------
    def generate(self, prompts: list[Prompt], sampling: SamplingParams, seed: int) -> TensorDict:
        """Sample with the rollout engine (the trainer's GPU memory handed to it where it is offloaded)."""
        if self.offload is not None:
            self.offload.offload()
        release_freed_pages()  # the update's freed pages go back: not kept beside the rollout's copy and cache
        return self.rollout.generate(prompts, sampling, seed)

    def update_weights(self, named_tensors: NamedTensors) -> None:
        """Load named tensors into the rollout engine."""
        self.rollout.update_weights(named_tensors)

    def sleep(self) -> None:
        """Free the rollout engine's weights while the trainer works (nothing to free where they are the
        trainer's)."""
        if not self.shares_weights:
            self.rollout.sleep()
            free_cached(self.device)

    def wake(self) -> None:
        """Re-allocate the rollout engine's weights (filled by the next sync; taken from the trainer at once
        where they are shared)."""
        if self.shares_weights:
            self.sync_local()
        else:
            self.rollout.wake()

    def sync_local(self) -> dict[str, float]:
        """Trainer -> rollout inside this process, one tensor at a time."""
        start = time.perf_counter()
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in self._trainer().named_weights():
                count += 1
                yield item

        if self.shares_weights:  # the rollout takes the trainer's tensors; copies only those of another dtype
            rest = self.rollout.adopt_weights(counted())
            if rest:
                self.rollout.wake()
                self.rollout.update_weights(rest)
            copied = len(rest)
        else:
            if not getattr(self.rollout, "wakes_weights_alone", False):  # vLLM, SGLang: the weights, not the KV cache
                self.rollout.wake()
            self.rollout.update_weights(counted())
            copied = count
        return {
            "sync/buckets": 0.0,
            "sync/tensors": float(count),
            "sync/copied_tensors": float(copied),
            "timing/sync_weights_s": time.perf_counter() - start,
        }

    # ---- trainer side -----------------------------------------------------------------------------------------
    def _trainer(self) -> Any:
        """The trainer, its memory back on its device if it was offloaded for generation."""
        if self.offload is not None:
            self.offload.reload()
        return self.trainer

    def logprobs(self, batch: TensorDict, temperature: float | None = None, base: bool = False) -> TensorDict:
        """Teacher-forced log-probs with the trainer (`base`: its frozen LoRA base, the reference policy)."""
        if base:
            return self._trainer().logprobs(batch, temperature, base=True)
        return self._trainer().logprobs(batch, temperature)

    def values(self, batch: TensorDict) -> torch.Tensor:
        """Critic values with the trainer."""
        return self._trainer().values(batch)

    def train_step(self, batch: TensorDict) -> dict[str, float]:
        """One training step of the trainer."""
        return self._trainer().train_step(batch)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's HF-named weights."""
        return self._trainer().named_weights()

    def weight_buckets(self, bucket_bytes: int, dtype: str) -> Iterator[Bucket]:
        """The trainer's weights in encoded buckets (to sync other rollout workers)."""
        yield from self._trainer().weight_buckets(bucket_bytes, dtype)

    def save(self, path: Path) -> None:
        """Checkpoint the trainer (the rollout is rebuilt from it by a sync)."""
        self._trainer().save(path)

    def load(self, path: Path) -> None:
        """Restore the trainer."""
        self._trainer().load(path)

    def save_pretrained(self, path: Path, tokenizer_from: Path | None = None) -> None:
        """Export the trainer's weights as an HF directory."""
        self._trainer().save_pretrained(path, tokenizer_from)


def _build(engine: str, kwargs: dict[str, Any], device: torch.device) -> Any:
    """The engine `engine` ("module:Class") on this worker's `device`, where its constructor takes one."""
    cls = import_object(engine)
    takes_device = "device" in inspect.signature(cls).parameters
    return cls(**kwargs, **({"device": device} if takes_device else {}))
