"""Megatron-Core training backend, the optimizer: megatron's optimizer built from our `OptimConfig`, one
step with the torch backend's semantics, and the state fix-ups its checkpointing needs with torch AdamW.

Without Transformer Engine or Apex (this CPU machine) megatron-core 0.16 falls back to torch AdamW inside
its FP32 / distributed optimizer wrappers; the calls that hard-code CUDA run under `cuda_as_cpu()`.
Non-goals: the LR scheduler object (the backend sets each step's LR from `training.optim.lr_lambda`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from rlstages.configs.training import OptimConfig
from rlstages.engines.megatron import cuda_shim

# dist_checkpointing format of the distributed optimizer: "fully_reshardable" keeps each parameter's Adam state in
# model space under the parameter's own sharded key (routed experts by their global index), so it loads under
# another EP (and TP / PP / DP) size; without a "chained_<i>." prefix, EP>1's dense + expert chain and EP=1's
# single optimizer name their tensors alike (`fit_loaded_state` fits the rest). 0.16's default
# ("fully_sharded_model_space") cannot be saved any more; "dp_reshardable" reshards over DP only.
# `..._mem_efficient`: the state is gathered over gloo (host memory) onto DP rank 0 only, not all-gathered on GPUs.
OPTIM_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
    "distrib_optim_fully_reshardable_mem_efficient": True,
}


PART_ATTR = "rlstages_part_{}"  # a parameter attribute naming its part of a vision-language model (`vlm_model.tag`)


def build_optimizer(
    models: list[Any], optim: OptimConfig, dtype: torch.dtype, distributed: bool, offload: bool, fraction: float
) -> Any:
    """`get_megatron_optimizer` (Adam, decoupled weight decay on every parameter as the torch backend) over
    DDP-wrapped chunks; `offload` -> megatron's CPU optimizer offload of `fraction` of the states (the caller
    asks it on a GPU worker only). `optim.group_lr` gives the parameters tagged with a part (`PART_ATTR`) their
    own param group, its `max_lr` that part's rate (`optimizer_step` scales each group by max_lr / lr)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.optimizer_config import ParamKey

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
        optimizer_cpu_offload=offload,
        optimizer_offload_fraction=fraction if offload else 0.0,
    )
    overrides = {ParamKey(attr=PART_ATTR.format(part)): {"max_lr": lr} for part, lr in optim.group_lr.items()}
    with cuda_shim.cuda_as_cpu():  # no weight-decay exemptions for biases / norms (not the default overrides)
        return get_megatron_optimizer(config, models, config_overrides=overrides)


def optimizer_step(optimizer: Any, optim: OptimConfig, lr: float) -> float:
    """Set the LR `lr`, clip at `grad_clip`, update unless the global grad norm is non-finite (the torch
    backend's rule); returns the pre-clip norm. Gradients must be reduced already."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for group in optimizer.param_groups:  # a part's group (`optim.group_lr`): its own rate, on the same schedule
        scale = group.get("max_lr", optim.lr) / optim.lr
        group["lr"] = lr if scale == 1.0 else lr * scale
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


@contextlib.contextmanager
def _overriding(method: str, overrides: list[tuple[Any, Any]]) -> Iterator[None]:
    """Each object's `method` replaced by its own function while inside; the class's method again on exit."""
    for target, function in overrides:
        setattr(target, method, function)
    try:
        yield
    finally:
        for target, _ in overrides:
            delattr(target, method)


def _holds_params(inner: Any) -> bool:
    return any(group["params"] for group in inner.param_groups)


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


@contextlib.contextmanager
def steps_for_empty_optimizers(optimizer: Any) -> Iterator[None]:
    """While a state dict is built: megatron-core gives every rank the same param groups, so a pipeline stage without
    experts (DeepSeek-V3's dense first layers) holds an expert optimizer with no parameters; without Apex or
    Transformer Engine its distributed optimizer reads Adam's step from the per-parameter state, which an empty one
    lacks. It reports its siblings' step (they all step together). Undone on exit."""
    inners = _inner_optimizers(optimizer)
    steps = [float(state["step"]) for inner in inners for state in inner.state.values() if "step" in state]
    step = max(steps, default=0.0)

    def reporting_step(original: Any) -> Any:
        return lambda: {**original(), "state": {0: {"step": torch.tensor(step)}}}  # "state" is never saved from here

    empty = [(inner, reporting_step(inner.state_dict)) for inner in inners if not _holds_params(inner)]
    with _overriding("state_dict", empty):
        yield


@contextlib.contextmanager
def keep_adam_steps(optimizer: Any) -> Iterator[None]:
    """During a fully-reshardable load: megatron-core 0.16 copies every key of torch AdamW's state from the
    checkpoint, which holds no per-parameter `step` (it keeps the step in the param groups and has just set
    it); each distributed optimizer keeps its own `step` for the copy. Undone on exit."""
    subs = [
        s for s in getattr(optimizer, "chained_optimizers", [optimizer]) if hasattr(s, "model_param_group_index_map")
    ]

    def keeping_step(sub: Any) -> Any:
        original = sub._set_main_param_and_optimizer_states

        def set_states(model_param: Any, tensors: dict) -> None:
            group, order = sub.model_param_group_index_map[model_param]
            current = sub.optimizer.state[sub.optimizer.param_groups[group]["params"][order]]
            original(model_param, {**{k: v for k, v in current.items() if k not in tensors}, **tensors})

        return set_states

    with _overriding("_set_main_param_and_optimizer_states", [(sub, keeping_step(sub)) for sub in subs]):
        yield


def fit_loaded_state(optimizer: Any, loaded: dict) -> Any:
    """The loaded optimizer state in this optimizer's shape when the checkpoint was saved under another expert
    parallel size: EP>1 chains a dense and an expert optimizer (state keyed 0, 1), EP=1 has one. The per-parameter
    tensors already came in this optimizer's shape (model space); the rest (param groups) is this optimizer's own
    with the saved Adam step. The loaded dict is this optimizer's structure (a chain: keys 0, 1) with the saver's
    common state merged in (a single optimizer's: "optimizer", ...; a chain's: 0, 1), so that tells them apart."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    chained = len(subs) > 1
    saved_chained = "optimizer" not in loaded if chained else any(isinstance(k, int) for k in loaded)
    if saved_chained == chained:
        return loaded
    saved = [loaded[k] for k in loaded if isinstance(k, int)] if saved_chained else [loaded]
    steps = {g["step"] for s in saved for g in s["optimizer"]["param_groups"] if "step" in g}
    if len(steps) != 1:
        raise ValueError(f"optimizer checkpoint: expected one Adam step over its optimizers, found {sorted(steps)}")
    step = steps.pop()
    if chained:  # an optimizer holding no parameters on this rank (a stage without experts) loaded no tensors
        param_states = [loaded[i]["param_state"] if _holds_params(s.optimizer) else {} for i, s in enumerate(subs)]
    else:
        param_states = [loaded["param_state"]]
    fitted = []
    with steps_for_empty_optimizers(optimizer):
        owns = [sub.state_dict() for sub in subs]
    for own, param_state in zip(owns, param_states, strict=True):
        for group in own["optimizer"]["param_groups"]:
            group["step"] = step
        fitted.append({**own, "param_state": param_state, "param_state_sharding_type": "fully_reshardable"})
    return fitted[0] if len(fitted) == 1 else dict(enumerate(fitted))


def restore_adam_steps(optimizer: Any) -> None:
    """After a load: megatron-core 0.16's distributed optimizer restores Adam's step into the param groups
    (FusedAdam's place); torch AdamW keeps it per parameter, so copy it there."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                state = inner.state.get(p, {})
                if "exp_avg" in state:
                    state["step"] = torch.tensor(float(group["step"]))
