"""Plain-torch training engine: actor, critic (value head) or frozen reference, the CPU default.

One process holds the model. `train_step` runs PPO epochs x mini-batches x micro-batches with gradient
accumulation normalised by the mini-batch's global token/sequence counts, so the accumulated gradient
equals the mini-batch loss's gradient exactly. State saves without pickle (`state_io`).

Non-goal: sharding (that is the DeepSpeed and Megatron backends).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file
from tensordict import TensorDict

from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.models import load_causal_lm, lora, torch_dtype
from rlstages.engines.runtime.weight_sync import Bucket, bucketize
from rlstages.engines.training import ppo_step as P
from rlstages.engines.training import state_io
from rlstages.engines.training.microbatch import by_length, micro_batches

Role = Literal["actor", "critic", "reference"]


@dataclass(frozen=True)
class OptimParams:
    """AdamW and the LR schedule, in optimizer steps."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    total_steps: int = 1


@dataclass(frozen=True)
class BatchingParams:
    """How a training batch is cut: epochs, mini-batches per step, micro-batch size or token budget."""

    ppo_epochs: int = 1
    num_mini_batches: int = 1
    micro_batch_size: int = 8
    dynamic_batching: bool = False
    max_tokens_per_micro_batch: int = 4096
    bf16_autocast: bool = False
    gradient_checkpointing: bool = False


def lr_lambda(params: OptimParams) -> Any:
    """Linear warm-up, then constant or cosine decay to `min_lr_ratio`."""

    def factor(step: int) -> float:
        if params.warmup_steps and step < params.warmup_steps:
            return (step + 1) / params.warmup_steps
        if params.schedule == "constant":
            return 1.0
        span = max(1, params.total_steps - params.warmup_steps)
        progress = min(1.0, (step - params.warmup_steps) / span)
        return params.min_lr_ratio + (1 - params.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_model(model_path: str | Path, role: Role, dtype: str, model_type: str | None) -> Any:
    """The causal LM of an actor/reference, or for a critic the same backbone with a fresh scalar value head
    (token classification, 1 label, seeded; head dropout off so values are deterministic)."""
    if role != "critic":
        return load_causal_lm(model_path, dtype, model_type)
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(str(model_path), local_files_only=True, num_labels=1)
    config.classifier_dropout = 0.0
    torch.manual_seed(0)
    return AutoModelForTokenClassification.from_pretrained(
        str(model_path), config=config, dtype=torch_dtype(dtype), local_files_only=True, use_safetensors=True
    )


class TorchTrainingEngine:
    """A model and its optimizer in one process; implements `rlstages.engines.base.TrainingEngine`."""

    def __init__(
        self,
        model_path: str | Path,
        role: Role = "actor",
        optim: OptimParams = OptimParams(),
        batching: BatchingParams = BatchingParams(),
        loss: A.PolicyLossParams = A.PolicyLossParams(),
        cliprange_value: float = 0.5,
        temperature: float = 1.0,
        dtype: str = "float32",
        model_type: str | None = None,
        seed: int = 0,
        lora_params: dict[str, Any] | None = None,
    ) -> None:
        torch.manual_seed(seed)
        self.role, self.batching, self.loss, self.temperature = role, batching, loss, temperature
        self.cliprange_value = cliprange_value
        self.model = build_model(model_path, role, dtype, model_type)
        if batching.gradient_checkpointing and role != "reference":
            self.model.gradient_checkpointing_enable()
        if lora_params is not None and role == "actor":  # LoRA hook: adapters on a frozen base (models/lora.py)
            self.model = lora.wrap_lora(self.model, lora_params)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if role == "reference":
            self.model.requires_grad_(False).eval()
        else:
            self.model.train()
            self.optimizer = torch.optim.AdamW(
                lora.trainable_parameters(self.model),
                lr=optim.lr,
                betas=optim.betas,
                eps=optim.eps,
                weight_decay=optim.weight_decay,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim))
        self.optim = optim
        self.steps_done = 0

    # ---- forward passes -------------------------------------------------------------------------------------
    def _forward(self, mb: TensorDict, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return P.causal_lm_forward(self.model, mb, self.temperature, self.batching.bf16_autocast, entropy_grad)

    def _values(self, mb: TensorDict) -> torch.Tensor:
        return P.value_forward(self.model, mb, self.batching.bf16_autocast)

    def _micro(self, batch: TensorDict, size: int) -> list[TensorDict]:
        b = self.batching
        return micro_batches(batch, size, b.dynamic_batching, b.max_tokens_per_micro_batch)

    @torch.no_grad()
    def logprobs(self, batch: TensorDict, temperature: float | None = None, base: bool = False) -> TensorDict:
        """Teacher-forced log-probs and entropy of the response tokens, [B, T] each (padded to the batch);
        `base`: under the frozen base (LoRA adapter disabled), i.e. the reference policy."""
        if temperature is not None:
            self.temperature = temperature
        width = batch[T.RESPONSE_IDS].shape[1]
        rows, restore = by_length(batch)
        logps, ents = [], []
        with lora.forward_as(self.model, base):
            for mb in self._micro(rows, self.batching.micro_batch_size):
                lp, ent = self._forward(mb)
                logps.append(P.pad_cols(lp, width))
                ents.append(P.pad_cols(ent, width))
        out = {"logprobs": torch.cat(logps)[restore], "entropy": torch.cat(ents)[restore]}
        return TensorDict(out, batch_size=batch.batch_size)

    @torch.no_grad()
    def values(self, batch: TensorDict) -> torch.Tensor:
        """Critic values of the response tokens, [B, T]."""
        width = batch[T.RESPONSE_IDS].shape[1]
        rows, restore = by_length(batch)
        return torch.cat(
            [P.pad_cols(self._values(mb), width) for mb in self._micro(rows, self.batching.micro_batch_size)]
        )[restore]

    # ---- training -------------------------------------------------------------------------------------------
    def train_step(self, batch: TensorDict) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches; returns averaged metrics (actor or critic names)."""
        if self.optimizer is None or self.scheduler is None:
            raise RuntimeError("the reference engine is frozen: train_step is not available")
        out = P.epochs_loop(batch, self.batching.ppo_epochs, self.batching.num_mini_batches, self._mini_step)
        self.steps_done += 1
        out["lr"] = self.scheduler.get_last_lr()[0]
        return out

    def _mini_step(self, mini: TensorDict, check_sync: bool) -> dict[str, float]:
        assert self.optimizer is not None and self.scheduler is not None
        norm = P.global_counts(mini)
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, float] = {}
        for mb in self._micro(mini, self.batching.micro_batch_size):
            if self.role == "critic":
                loss, metrics = P.critic_loss(self._values(mb), mb, self.cliprange_value, self.loss.loss_agg_mode, norm)
            else:
                logp, entropy = self._forward(mb, entropy_grad=bool(self.loss.entropy_coeff))
                loss, metrics = P.actor_loss(logp, entropy, mb, self.loss, norm, check_sync)
            loss.backward()
            P.accumulate(acc, metrics, float(mb[T.RESPONSE_MASK].sum() / norm["global_tokens"]))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.scheduler.step()
        acc["grad_norm"] = float(grad_norm)
        return acc

    # ---- weights and state ----------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors of the model, one at a time (tied weights under every name HF uses)."""
        yield from lora.named_weights(self.model)  # merged W + BA under LoRA

    def weight_buckets(self, bucket_bytes: int, dtype: str) -> Iterator[Bucket]:
        """`named_weights` in encoded buckets for streaming to rollout engines (a generator for Ray)."""
        yield from bucketize(self.named_weights(), bucket_bytes, dtype)

    def save_pretrained(self, path: Path, tokenizer_from: Path | None = None) -> None:
        """An HF directory (config, safetensors, tokenizer) of the current weights, for export."""
        lora.save_pretrained(self.model, path)  # under LoRA: merged weights, and the adapter in path/adapter
        if tokenizer_from is not None:
            from rlstages.engines.models import load_tokenizer

            load_tokenizer(tokenizer_from).save_pretrained(str(path))

    def save(self, path: Path) -> None:
        """Model, optimizer, scheduler and RNG states (safetensors + JSON), so `load` continues bitwise."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state_io.save_tensors(lora.trainable_state(self.model), path / state_io.MODEL_FILE)  # adapter under LoRA
        if self.optimizer is not None and self.scheduler is not None:
            state_io.save_optimizer(self.optimizer, path / state_io.OPTIM_FILE)
            extra = {
                "scheduler": self.scheduler.state_dict(),
                "steps_done": self.steps_done,
                "optim": asdict(self.optim),
            }
            state_io.atomic_write_text(path / state_io.EXTRA_FILE, json.dumps(extra, default=_no_callables))
        state_io.save_rng(path / state_io.RNG_FILE)

    def load(self, path: Path) -> None:
        """Restore what `save` wrote."""
        path = Path(path)
        weights = load_file(str(path / state_io.MODEL_FILE))
        missing, unexpected = lora.load_trainable_state(self.model, weights)
        tied = {k for k in missing if k.endswith("lm_head.weight")}
        if set(missing) - tied or unexpected:
            raise ValueError(
                f"{path}: checkpoint does not match the model (missing {missing}, unexpected {unexpected})"
            )
        if self.optimizer is not None and self.scheduler is not None:
            state_io.load_optimizer(self.optimizer, path / state_io.OPTIM_FILE)
            extra = json.loads((path / state_io.EXTRA_FILE).read_text())
            self.scheduler.load_state_dict(extra["scheduler"])
            self.steps_done = int(extra["steps_done"])
        state_io.load_rng(path / state_io.RNG_FILE)


def _no_callables(obj: Any) -> Any:
    return None if callable(obj) else str(obj)
