"""Megatron-Core training backend, the optimizer: megatron's optimizer built from our `OptimConfig`, one
step with the torch backend's semantics, and the state fix-ups its checkpointing needs with torch AdamW.

Without Transformer Engine or Apex (this CPU machine) megatron-core 0.16 falls back to torch AdamW inside
its FP32 / distributed optimizer wrappers; the calls that hard-code CUDA run under `cuda_as_cpu()`.
Non-goals: the LR scheduler object (the backend sets each step's LR from `training.optim.lr_lambda`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlstages.configs.training import OptimConfig
from rlstages.engines.megatron import cuda_shim

# dist_checkpointing format of the distributed optimizer: 0.16's default ("fully_sharded_model_space")
# cannot be saved any more, "fully_reshardable" breaks on torch AdamW's per-parameter step.
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def build_optimizer(
    models: list[Any], optim: OptimConfig, dtype: torch.dtype, distributed: bool, offload: bool, fraction: float
) -> Any:
    """`get_megatron_optimizer` (Adam, decoupled weight decay on every parameter as the torch backend) over
    DDP-wrapped chunks; `offload` -> megatron's CPU optimizer offload of `fraction` of the states (GPU only)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    gpu_offload = offload and torch.cuda.is_available()
    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.grad_clip,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=distributed,
        optimizer_cpu_offload=gpu_offload,
        optimizer_offload_fraction=fraction if gpu_offload else 0.0,
    )
    with cuda_shim.cuda_as_cpu():  # config_overrides={}: no weight-decay exemptions for biases / norms
        return get_megatron_optimizer(config, models, config_overrides={})


def optimizer_step(optimizer: Any, optim: OptimConfig, lr: float) -> float:
    """Set the LR `lr`, clip at `grad_clip`, update unless the global grad norm is non-finite (the torch
    backend's rule); returns the pre-clip norm. Gradients must be reduced already."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for group in optimizer.param_groups:
        group["lr"] = lr
    with cuda_shim.cuda_as_cpu():
        if optimizer.prepare_grads():  # loss-scale overflow (never without fp16)
            return float("nan")
        grad_norm = float(optimizer.get_grad_norm())
        if not math.isfinite(grad_norm):
            return grad_norm
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = sub.get_parameters()
            if params and optim.grad_clip > 0:
                decoupled = sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                clip_grad_by_total_norm_fp32(params, optim.grad_clip, grad_norm, decoupled)
        optimizer.step_with_ready_grads()
    return grad_norm


def _inner_optimizers(optimizer: Any) -> list[Any]:
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [sub.optimizer for sub in subs if getattr(sub, "optimizer", None) is not None]


def init_adam_state(optimizer: Any) -> None:
    """Give a fresh torch AdamW its (zero) state before a load: megatron-core 0.16's distributed optimizer
    reads the per-parameter `step` while building the state dict to load into."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state.get(p):
                    zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": zeros, "exp_avg_sq": zeros.clone()}


def restore_adam_steps(optimizer: Any) -> None:
    """After a load: megatron-core 0.16's distributed optimizer restores Adam's step into the param groups
    (FusedAdam's place); torch AdamW keeps it per parameter, so copy it there."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                state = inner.state.get(p, {})
                if "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)
