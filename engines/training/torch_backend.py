"""Plain-torch step backend: one process holds the HF model and its AdamW; the CPU default.

`PPOTrainer` (engines/training/core.py) drives it; this module only forwards micro-batches, backpropagates,
steps the optimizer and saves state without pickle (`state_io`). `build_model` and `hf_forward` are shared
with the DeepSpeed backend, which wraps the same HF model.

Non-goal: sharding (that is the DeepSpeed and Megatron backends).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rlstages.configs.training import TorchTrainingConfig, TrainingConfig
from rlstages.engines.base import OnOutput, Readout
from rlstages.engines.models import lean_layers, load_causal_lm, lora, moe_layout, torch_dtype
from rlstages.engines.models.grouped_attention import use_grouped_eager
from rlstages.engines.models.vision import param_groups
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.training import ppo_step as P
from rlstages.engines.training import state_io
from rlstages.engines.training.fp32_matmul import use_fp32_kernel, wants_fp32_kernel
from rlstages.engines.training.grad_accumulation import accumulate_in_place
from rlstages.engines.training.optim import adamw, lr_scheduler
from rlstages.engines.training.settings import Role, TrainerSettings

log = logging.getLogger(__name__)


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


def prepare_model(model: Any, settings: TrainerSettings) -> None:
    """Train mode (with activation checkpointing if asked) for a trainable role; frozen eval mode for the reference."""
    if not settings.trainable:
        model.requires_grad_(False).eval()
        return
    if settings.train.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()


def optimizer_params(model: Any, params: Any, settings: TrainerSettings) -> Any:
    """What the optimizer steps: `params`, or by part (a vision-language model's `actor.freeze` parts left out
    and frozen, `optim.group_lr` per part) when either is set; shared by the torch and DeepSpeed backends."""
    if not (settings.train.freeze or settings.optim.group_lr):
        return params
    group_lr = {str(k): v for k, v in settings.optim.group_lr.items()}
    return param_groups(model, list(params), settings.train.freeze, group_lr, settings.optim.lr)


def hf_forward(
    model: Any, mb: TensorDict, readout: Readout, train: TrainingConfig, prompts: P.SharedPrompts | None = None
) -> tuple[torch.Tensor, ...]:
    """The `readout` of one micro-batch through an HF model (or a wrapper that calls it), as `train` (the role's
    training config) says (bf16 autocast); `prompts`: the step's prompts, already forwarded."""
    if readout.values:
        return (P.value_forward(model, mb, train.bf16_autocast),)
    return P.causal_lm_forward(model, mb, readout.temperature, train.bf16_autocast, readout.entropy_grad, prompts)


def attention_impl(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The transformers attention to run: `sdpa` becomes flash-attention 2 where it can run (installed, CUDA,
    bf16/fp16 weights); otherwise as configured."""
    from rlstages.engines.registry import has_module

    fast = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and has_module("flash_attn")
    return "flash_attention_2" if requested == "sdpa" and fast else requested


def fuse_on_device(model: Any, device: torch.device) -> None:
    """Route the model's decoder element-wise work to compiled kernels where its device compiles them (a GPU),
    elsewhere to the eager functions that keep less for the backward (`fused_layers`), logging what was routed."""
    from rlstages.engines.models import fused_layers

    counts = fused_layers.fuse_elementwise(model)
    if device.type in fused_layers.KERNELS.devices and fused_layers.KERNELS.enabled:
        working = fused_layers.probe(device, next(model.parameters()).dtype) if any(counts.values()) else []
        log.info("fused element-wise kernels for training: %s (compiled: %s)", counts, working)
    else:
        log.info("lean element-wise autograd for training: %s", counts)


class TorchBackend:
    """A model and its optimizer in one process, on the worker's device (`runtime.device.worker_device`: its
    GPU, else the CPU), with the optimizer states beside the parameters; implements
    `rlstages.engines.base.StepBackend`."""

    outputs_here = True
    is_weight_source = True

    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings
        self.device = settings.resolved_device()
        self.model = build_model(settings.model_path, settings.role, settings.dtype, settings.model_type)
        self.model.to(self.device)
        if isinstance(settings.train, TorchTrainingConfig):
            dtype = next(self.model.parameters()).dtype
            self.model.set_attn_implementation(attention_impl(settings.train.attention, self.device, dtype))
        prepare_model(self.model, settings)
        if settings.trainable and getattr(settings.train, "fuse_elementwise", False):
            fuse_on_device(self.model, self.device)
        self.fp32_matmul = isinstance(settings.train, TorchTrainingConfig) and wants_fp32_kernel(
            settings.train.fp32_matmul,
            settings.dtype == "bfloat16" or settings.train.bf16_autocast,
            next(self.model.parameters()).device,
        )
        if not self.fp32_matmul:  # the fp32 kernel's attention is its own (fp32_matmul.use_fp32_attention)
            use_grouped_eager(self.model)
        if settings.lora is not None and settings.role == "actor":  # adapters on a frozen base (models/lora.py)
            self.model = lora.wrap_lora(self.model, settings.lora).to(self.device)
        if self.fp32_matmul:  # after LoRA: its adapters' fp32 weights under bf16 autocast would take the bf16 GEMM
            use_fp32_kernel(self.model)
        fuse_grads = getattr(settings.train, "gradient_accumulation_fusion", False)
        if settings.trainable and settings.lora is None and fuse_grads:
            log.info("weight gradients summed in place: %s", accumulate_in_place(self.model))
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if settings.trainable:
            stochastic = bool(getattr(settings.train, "bf16_stochastic_round", False))
            params = optimizer_params(self.model, lora.trainable_parameters(self.model), settings)
            self.optimizer = adamw(params, settings.optim, stochastic, settings.seed)
            self.scheduler = lr_scheduler(self.optimizer, settings.optim, settings.optim_steps)

    @property
    def keeps_weights(self) -> bool:
        """`named_weights` yields the model's own parameters, except under LoRA (merged copies, made per sync)."""
        return self.settings.lora is None or self.settings.role != "actor"

    def run(self, mbs: list[TensorDict], readout: Readout, on_output: OnOutput, train: bool) -> None:
        """Forward (and backward) each micro-batch in turn."""
        if train:
            assert self.optimizer is not None
            self.optimizer.zero_grad(set_to_none=True)
        share = bool(getattr(self.settings.train, "share_prompt_forward", False)) and not readout.values and bool(mbs)
        with lora.forward_as(self.model, readout.base), lean_layers.remade_when_saved():
            prompts = P.SharedPrompts(self.model, mbs, self.settings.train.bf16_autocast) if share else None
            for mb in mbs:
                loss = on_output(mb, hf_forward(self.model, mb, readout, self.settings.train, prompts))
                if train:
                    assert loss is not None
                    loss.backward()
            if train and prompts is not None:  # the prompts' part of the gradient, once for the whole step
                prompts.backward()

    def resident(self, train: bool) -> contextlib.AbstractContextManager[None]:
        """Nothing to bring back: the model never leaves."""
        return contextlib.nullcontext()

    def share(self, metrics: dict[str, float]) -> dict[str, float]:
        """One process: its metrics are the metrics."""
        return metrics

    def optimizer_step(self) -> float:
        """Clip to `grad_clip`, step unless the norm is non-finite, free the gradients, advance the schedule."""
        assert self.optimizer is not None and self.scheduler is not None
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.optim.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # generation reuses the gradients' memory until the next step
        self.scheduler.step()
        return float(grad_norm)

    def lr(self) -> float:
        """The scheduler's current LR."""
        assert self.scheduler is not None
        return float(self.scheduler.get_last_lr()[0])

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors of the model, one at a time (tied weights under every name HF uses; merged W + BA
        under LoRA), in the checkpoint's on-disk layout: MoE experts one tensor per expert, as vLLM loads them."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        yield from moe_layout.disk_named_weights(base, lora.named_weights(self.model))

    def save_hf(self, path: Path) -> bool:
        """`save_pretrained` of the model (config + safetensors)."""
        lora.save_pretrained(self.model, path)  # under LoRA: merged weights, and the adapter in path/adapter
        return True

    def save(self, path: Path, steps_done: int) -> None:
        """Model, optimizer, scheduler and RNG states (safetensors + JSON)."""
        state = lora.trainable_state(self.model)  # the adapter under LoRA
        for alias in state_io.tied_aliases(state):  # a tied weight once (`load` finds it missing and tied)
            del state[alias]
        state_io.save_tensors(state, path / state_io.MODEL_FILE)
        if self.optimizer is not None and self.scheduler is not None:
            state_io.save_optimizer(self.optimizer, path / state_io.OPTIM_FILE)
            extra = {
                "scheduler": self.scheduler.state_dict(),
                "steps_done": steps_done,
                "optim": self.settings.optim_record(),
            }
            state_io.atomic_write_text(path / state_io.EXTRA_FILE, json.dumps(extra, default=_no_callables))
        state_io.save_rng(path / state_io.RNG_FILE)

    def load(self, path: Path) -> int | None:
        """Restore what `save` wrote."""
        weights = load_file(str(path / state_io.MODEL_FILE))
        missing, unexpected = lora.load_trainable_state(self.model, weights)
        tied = set(missing) & set(state_io.tied_aliases(lora.trainable_state(self.model)))
        if set(missing) - tied or unexpected:
            missing = [k for k in missing if k not in tied]
            raise ValueError(
                f"{path}: checkpoint does not match the model (missing {missing}, unexpected {unexpected})"
            )
        steps = None
        if self.optimizer is not None and self.scheduler is not None:
            state_io.load_optimizer(self.optimizer, path / state_io.OPTIM_FILE)
            extra = json.loads((path / state_io.EXTRA_FILE).read_text())
            self.scheduler.load_state_dict(extra["scheduler"])
            steps = int(extra["steps_done"])
        state_io.load_rng(path / state_io.RNG_FILE, self.device)
        return steps


def _no_callables(obj: Any) -> Any:
    """JSON for what the scheduler's state holds beside numbers: a tensor LR as its float."""
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    return None if callable(obj) else str(obj)
