"""The PPO update loop, written once: `PPOTrainer` implements `rlstages.engines.base.TrainingEngine` for every
training backend by driving a `StepBackend` (torch, DeepSpeed, Megatron; `engines.registry.TRAINING_BACKENDS`).

`train_step` runs PPO epochs x mini-batches x micro-batches. Each mini-batch is one optimizer step whose
micro-batch losses are normalised by the mini-batch's global token/sequence counts, so the accumulated
gradient equals the mini-batch loss's gradient whatever the micro-batching. The losses are `ppo_step`'s
(`actor_loss`, `critic_loss`); the backend only runs the micro-batches forward/backward and steps.

Non-goals: anything backend-specific (sharding, pipelines, offload, checkpoint formats live in the backends).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from rlstages.engines import types as T
from rlstages.engines.base import Readout, StepBackend
from rlstages.engines.imports import import_object
from rlstages.engines.registry import training_backend
from rlstages.engines.runtime import device as D
from rlstages.engines.runtime.compile_time import COMPILE_METRIC, compile_seconds
from rlstages.engines.sync.buckets import bucketize
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.training import flops as F
from rlstages.engines.training import ppo_step as P
from rlstages.engines.training.microbatch import by_length, micro_batches
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Bucket

PERF = "perf/"  # train_step's measured metrics (throughput, MFU, memory): they differ between identical steps


def without_perf(metrics: dict[str, float]) -> dict[str, float]:
    """A train step's metrics without the measured `perf/*` ones: what a repeated (resumed) step reproduces."""
    return {k: v for k, v in metrics.items() if not k.startswith(PERF)}


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


class PPOTrainer:
    """An actor, critic or frozen reference on one rank of any training backend."""

    def __init__(self, settings: TrainerSettings, device: torch.device | None = None) -> None:
        self.settings = settings
        self.temperature = settings.temperature
        torch.manual_seed(settings.seed)
        backend_cls = import_object(training_backend(settings.backend).step, f"{settings.role}.backend")
        D.set_env_defaults(getattr(backend_cls, "cuda_env", {}))  # before CUDA starts (Megatron-Core's)
        # the worker's device: resolved here where the worker starts (a hybrid worker passes its own), passed down
        self.device = device if device is not None else D.worker_device()
        self.backend: StepBackend = backend_cls(replace(settings, device=str(self.device)))  # device passed down
        self.steps_done = 0
        self.shares_device = settings.shares_device  # the hybrid engine sets it where its rollout has own memory
        self.model_config = _hf_config(settings.model_path)  # for the FLOP count of `perf/mfu`

    # ---- forward passes -------------------------------------------------------------------------------------
    @property
    def _prompt_once(self) -> bool:
        """Whether each prompt goes through the model once per step (the torch backend's `share_prompt_forward`;
        not the critic's values), so a row's cost in a micro-batch is its response alone."""
        return bool(getattr(self.settings.train, "share_prompt_forward", False)) and self.settings.role != "critic"

    def _micro(self, batch: TensorDict) -> list[TensorDict]:
        t = self.settings.train
        return micro_batches(
            batch, t.micro_batch_size, t.dynamic_batching, t.max_tokens_per_micro_batch, self._prompt_once
        )

    def _forward(self, batch: TensorDict, readout: Readout) -> list[torch.Tensor] | None:
        """Each output of `readout` over the whole batch, [B, T] in row order (None where outputs are not here)."""
        width = batch[T.RESPONSE_IDS].shape[1]
        rows, restore = by_length(D.to_device(batch, self.device), self._prompt_once)
        cols: list[list[torch.Tensor]] = []

        def collect(mb: TensorDict, out: tuple[torch.Tensor, ...]) -> None:
            cols.append([P.pad_cols(x, width) for x in out])

        with torch.no_grad(), self.backend.resident(train=False):
            self.backend.run(self._micro(rows), readout, collect, train=False)
        self._release_cache()
        if not self.backend.outputs_here:
            return None
        n = 1 if readout.values else 2
        out = [torch.cat([c[i] for c in cols])[restore] if cols else torch.zeros(0, width) for i in range(n)]
        return D.to_host(out)  # results leave the worker through Ray: never as CUDA tensors

    def logprobs(self, batch: TensorDict, temperature: float | None = None, base: bool = False) -> TensorDict | None:
        """Teacher-forced log-probs and entropy of the response tokens, [B, T] each (padded to the batch);
        `base`: under the frozen base (LoRA adapter disabled), i.e. the reference policy."""
        if temperature is not None:
            self.temperature = temperature
        out = self._forward(batch, Readout(temperature=self.temperature, base=base))
        if out is None:
            return None
        return TensorDict({"logprobs": out[0], "entropy": out[1]}, batch_size=batch.batch_size)

    def values(self, batch: TensorDict) -> torch.Tensor | None:
        """Critic values of the response tokens, [B, T]."""
        if self.settings.role != "critic":
            raise RuntimeError(f"values() needs role='critic', this engine is the {self.settings.role}")
        out = self._forward(batch, Readout(values=True))
        return None if out is None else out[0]

    # ---- training -------------------------------------------------------------------------------------------
    def train_step(self, batch: TensorDict) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches; returns averaged metrics (actor or critic names) and this
        rank's `perf/*` (tokens/s, MFU where the device's peak is known, GPU memory peaks)."""
        s = self.settings
        if not s.trainable:
            raise RuntimeError("the reference engine is frozen: train_step is not available")
        D.reset_peak_memory(self.device)
        start, compiled = time.perf_counter(), compile_seconds()
        batch = D.to_device(batch, self.device)
        with self.backend.resident(train=True):
            out = P.epochs_loop(batch, s.train.ppo_epochs, s.num_mini_batches, self._mini_step, self._prompt_once)
        D.synchronize(self.device)
        out.update(self._perf(batch, time.perf_counter() - start))
        out[COMPILE_METRIC] = compile_seconds() - compiled  # one-off (first steps): the ETA leaves it out
        self._release_cache()  # the update's activations and gradients' blocks, before generation
        self.steps_done += 1
        out["lr"] = self.backend.lr()
        return out

    def _release_cache(self) -> None:
        """Hand the allocator's cached blocks back to the GPU where another engine needs them (`shares_device`);
        a trainer alone on its GPU keeps them for the next step."""
        if self.shares_device:
            D.free_cached(self.device)

    def _perf(self, batch: TensorDict, seconds: float) -> dict[str, float]:
        """`perf/throughput` (real tokens per second per device: this rank's rows shared by the ranks of its
        model-parallel group), `perf/mfu` (model FLOPs of those tokens over the device's bf16 peak; absent where
        it is unknown, the CPU included) and the GPU memory peaks."""
        train = self.settings.train
        shared_by = getattr(train, "tensor_model_parallel_size", 1) * getattr(train, "pipeline_model_parallel_size", 1)
        lens = batch[T.ATTENTION_MASK].sum(-1).tolist()
        perf = {f"{PERF}throughput": sum(lens) / max(seconds, 1e-9) / shared_by}
        low_precision = self.settings.dtype in ("bfloat16", "float16") or train.bf16_autocast
        if self.model_config is not None:
            flops = F.step_flops(self.model_config, lens, train.ppo_epochs) / shared_by
            mfu = F.mfu(flops, seconds, D.device_name(self.device), low_precision)
            if mfu is not None:
                perf[f"{PERF}mfu"] = mfu
        perf.update({PERF + k: v for k, v in D.device_memory_stats(self.device).items()})
        return perf

    def _mini_step(self, mini: TensorDict, check_sync: bool) -> dict[str, float]:
        """One optimizer step: every micro-batch's loss backpropagated, then clip and step once."""
        s = self.settings
        norm = P.global_counts(mini)
        critic = s.role == "critic"
        acc: dict[str, P.Scalar] = {}

        def loss_of(mb: TensorDict, out: tuple[torch.Tensor, ...]) -> torch.Tensor:
            if critic:
                loss, metrics = P.critic_loss(out[0], mb, s.cliprange_value, s.loss.loss_agg_mode, norm)
            else:
                loss, metrics = P.actor_loss(out[0], out[1], mb, s.loss, norm, check_sync)
            P.accumulate(acc, metrics, P.scalar(mb[T.RESPONSE_MASK].sum() / norm["global_tokens"]))  # no sync
            return loss

        readout = Readout(values=critic, temperature=self.temperature, entropy_grad=bool(s.loss.entropy_coeff))
        self.backend.run(self._micro(mini), readout, loss_of, train=True)
        shared = self.backend.share(P.floats(acc))  # the micro-batches' metrics read once, after the backward
        shared["grad_norm"] = self.backend.optimizer_step()
        return shared

    # ---- weights and state ----------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one at a time (a collective where the backend shards: every rank iterates)."""
        return self.backend.named_weights()

    def weight_buckets(self, bucket_bytes: int, dtype: str) -> Iterator[Bucket]:
        """`named_weights` in encoded buckets for streaming to rollout engines (a generator for Ray). Ranks that
        are not the weight source take part in the gathers and yield nothing."""
        stream = self.backend.named_weights()
        if not self.backend.is_weight_source:
            for _ in stream:
                pass
            return
        yield from bucketize(stream, bucket_bytes, dtype)

    def save_pretrained(self, path: Path, tokenizer_from: Path | None = None) -> None:
        """An HF directory (config, safetensors, tokenizer, and a vision-language model's image processor) of the
        current weights, for export; call on every rank."""
        if self.backend.save_hf(Path(path)) and tokenizer_from is not None:
            from rlstages.engines.models import load_tokenizer

            load_tokenizer(tokenizer_from).save_pretrained(str(path))
            for name in PROCESSOR_FILES:  # the image processor travels with the weights that were trained with it
                if (Path(tokenizer_from) / name).is_file():
                    shutil.copyfile(Path(tokenizer_from) / name, Path(path) / name)

    def save(self, path: Path) -> None:
        """Model, optimizer, scheduler and RNG states in the backend's format, so `load` continues bitwise."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(path, self.steps_done)

    def load(self, path: Path) -> None:
        """Restore what `save` wrote."""
        steps = self.backend.load(Path(path))
        if steps is not None:
            self.steps_done = steps


def _hf_config(model_path: str | Path) -> dict[str, Any] | None:
    """The model's HF config.json when it has what the FLOP count reads (a decoder), else None (no MFU)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)  # multimodal wrappers keep the decoder's numbers there
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    return config if all(k in config for k in needed) else None
