"""One rank's bytes by component: weights, gradients and optimizer states (by backend, dtype, sharding over DP,
offload), activations of the micro-batches in flight, the logits, the rollout engine's share, the host memory offload
takes; and the reference engine's options as the run builds them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rlstages.configs.rollout import SGLangRolloutConfig, VLLMRolloutConfig, rollout_tp
from rlstages.configs.run import RunConfig
from rlstages.configs.training import DeepSpeedTrainingConfig, MegatronTrainingConfig, TorchTrainingConfig
from rlstages.engines.memory_plan.layout import Layout, stage_params
from rlstages.engines.memory_plan.model import DTYPE_BYTES, ModelDims
from rlstages.engines.memory_plan.result import RankMemory

DEFAULT_PROMPT_TOKENS = 512  # prompt length assumed when data.max_prompt_length is unset
# DeepSpeed's default reduce_bucket_size (elements): ZeRO's contiguous-gradient bucket, allocated whole whatever
# the model's size (ZeRO-1/2: during backward; ZeRO-3: from start-up on), in the gradients' dtype.
ZERO_BUCKET_ELEMENTS = 500_000_000


def micro_batch_tokens(cfg: RunConfig, train: Any) -> int:
    """Tokens in one micro-batch: the dynamic-batching cap, else rows x (prompt + response) tokens."""
    if train.dynamic_batching:
        return train.max_tokens_per_micro_batch
    return train.micro_batch_size * sequence_tokens(cfg)


def sequence_tokens(cfg: RunConfig) -> int:
    """Prompt + response tokens of one row (prompt: data.max_prompt_length, else DEFAULT_PROMPT_TOKENS)."""
    prompt = cfg.data.max_prompt_length or DEFAULT_PROMPT_TOKENS
    return prompt + cfg.rollout.max_new_tokens


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each training state and how they are split over DP."""

    weight: int
    grad: int
    optim: int
    shard_weight: bool = False
    shard_grad: bool = False
    shard_optim: bool = False


def state_bytes(train: Any, dtype: str) -> StateBytes:
    """Weights, gradients and optimizer states per parameter, by backend and dtype."""
    w = DTYPE_BYTES[dtype]
    if isinstance(train, MegatronTrainingConfig):  # fp32 main grads; fp32 master + Adam moments
        return StateBytes(w, 4, 12 if w < 4 else 8, shard_optim=train.use_distributed_optimizer)
    if isinstance(train, DeepSpeedTrainingConfig):  # measured: tests/engines/plan_check.py
        # ZeRO keeps an fp32 copy of the weights for the step even when they are fp32 (12 B with the moments) and
        # gives it an fp32 gradient; ZeRO-3 also keeps the gradient partition in the weights' dtype
        stage = train.zero_stage
        grads = 4 + (w if stage >= 3 else 0)
        return StateBytes(w, grads, 12, stage >= 3, stage >= 2, stage >= 1)
    moments = 2 * w  # torch AdamW: moments in the weights' dtype (torchao's bf16 moments likewise)
    return StateBytes(w, w, moments)


def _activations(cfg: RunConfig, train: Any, dims: ModelDims, lay: Layout, stage: int, act_bytes: int) -> float:
    tokens = micro_batch_tokens(cfg, train) / lay.cp
    first = sum(lay.stages[:stage])
    layers = range(first, first + lay.stages[stage])
    per_layer = [dims.saved_per_token(i, lay.tp, lay.sequence_parallel) * tokens * act_bytes for i in layers]
    if not per_layer:
        return 0.0
    if train.gradient_checkpointing:  # full recompute: each layer's input, and one layer's saved tensors
        split = lay.tp if lay.sequence_parallel else 1
        stored = len(per_layer) * tokens * dims.hidden * act_bytes / split + max(per_layer)
    else:
        stored = sum(per_layer)
    micro_batches = max(1, math.ceil(cfg.mini_batch_prompts * cfg.rollout.n / max(1, train.micro_batch_size)))
    in_flight = min(lay.pp - stage, micro_batches) if lay.pp > 1 else 1
    return stored * in_flight


def _logits(cfg: RunConfig, train: Any, dims: ModelDims, lay: Layout) -> float:
    """fp32 log-softmax of one micro-batch's logits, split over TP (last stage): every position under Megatron,
    only the response's under torch / DeepSpeed (`logits_to_keep`)."""
    tokens = micro_batch_tokens(cfg, train) / lay.cp
    if not isinstance(train, MegatronTrainingConfig):
        tokens = tokens * cfg.rollout.max_new_tokens / sequence_tokens(cfg)
    return tokens * dims.vocab / lay.tp * 4


def rollout_gpu(cfg: RunConfig, dims: ModelDims, capacity: int | None) -> tuple[float, float]:
    """(the rollout engine's GPU bytes per GPU, its weights per GPU)."""
    ro = cfg.rollout
    weights = dims.total_params() * DTYPE_BYTES[ro.dtype] / rollout_tp(ro)
    if isinstance(ro, VLLMRolloutConfig) and capacity is not None:
        return ro.gpu_memory_utilization * capacity, weights
    if isinstance(ro, SGLangRolloutConfig) and capacity is not None:
        return ro.mem_fraction_static * capacity, weights
    rows = ro.batch_size  # sequences per generate call
    kv_width = 2 * dims.kv_heads * dims.head_dim if dims.mla is None else dims.mla[1] + dims.mla[3]
    kv = rows * sequence_tokens(cfg) * dims.layers * kv_width * DTYPE_BYTES[ro.dtype] / rollout_tp(ro)
    return weights + kv, weights


def training_rank(
    cfg: RunConfig, role: str, train: Any, dims: ModelDims, lay: Layout, stage: int, trainable: bool
) -> RankMemory:
    """The bytes of one rank of pipeline stage `stage` of `role` (trainable: with gradients, optimizer states and
    activations; else weights and logits only), on the GPU and, where offloaded, in host memory."""
    sb = state_bytes(train, cfg.model.dtype)
    dense, experts, layers = stage_params(dims, lay, stage)
    dp_dense = max(1, lay.dp)

    def split(per: int, sharded: bool) -> float:
        if not sharded:
            return (dense + experts) * per
        return dense * per / dp_dense + experts * per / lay.edp

    gpu: dict[str, float] = {"weights": split(sb.weight, sb.shard_weight)}
    cpu: dict[str, float] = {}
    mega = isinstance(train, MegatronTrainingConfig)
    last = stage == lay.pp - 1
    if trainable and cfg.model.lora is None:
        grads, optim = split(sb.grad, sb.shard_grad), split(sb.optim, sb.shard_optim)
        offloaded = 0.0
        if mega and train.optimizer_offload:
            offloaded = train.offload_fraction
        elif isinstance(train, DeepSpeedTrainingConfig) and train.offload_optimizer:
            offloaded = 1.0
        gpu["grads"] = grads
        gpu["optimizer"] = optim * (1 - offloaded)
        if isinstance(train, DeepSpeedTrainingConfig) and train.zero_stage >= 1:
            gpu["buckets"] = ZERO_BUCKET_ELEMENTS * sb.weight
        if offloaded:  # the offloaded states, and an fp32 copy of their gradients for the host step
            cpu["optimizer"] = (optim + split(4, sb.shard_optim)) * offloaded
        if mega and train.grad_offload:
            cpu["grads"] = grads
        act_bytes = 2 if (cfg.model.dtype != "float32" or train.bf16_autocast) else 4
        gpu["activations"] = _activations(cfg, train, dims, lay, stage, act_bytes)
    gpu["logits"] = _logits(cfg, train, dims, lay) if last else 0.0
    if (mega and train.param_offload) or (isinstance(train, DeepSpeedTrainingConfig) and train.offload_param):
        cpu["weights"] = gpu["weights"]
    return RankMemory(role, stage, layers, dense + experts, gpu, {}, cpu)


def reference_options(cfg: RunConfig) -> Any:
    """The reference engine's options as tasks/driver/specs.trainer_settings builds them: the actor's batching at the
    reference backend's defaults (no offload), its micro-batch size, and a Megatron actor's layout."""
    common = cfg.actor.model_dump(include=set(TorchTrainingConfig.model_fields) - {"backend"})
    common.update(micro_batch_size=cfg.reference.micro_batch_size, num_workers=cfg.reference.num_workers)
    backends = {"torch": TorchTrainingConfig, "deepspeed": DeepSpeedTrainingConfig, "megatron": MegatronTrainingConfig}
    if cfg.reference.backend == "megatron" and isinstance(cfg.actor, MegatronTrainingConfig):
        layout = set(MegatronTrainingConfig.model_fields) - set(TorchTrainingConfig.model_fields)
        layout -= {"param_offload", "grad_offload", "optimizer_offload", "offload_fraction", "sequence_parallel"}
        layout -= {"use_distributed_optimizer"}
        common.update(cfg.actor.model_dump(include=layout))
    return backends[cfg.reference.backend].model_validate(common)
