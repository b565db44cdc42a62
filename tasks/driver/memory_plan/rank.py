"""One rank's bytes by component: weights, gradients and optimizer states (by backend, dtype, sharding over DP,
offload), activations of the micro-batches in flight, the logits, the rollout engine's share, the host memory offload
takes; and the reference engine's options as the run builds them."""

from __future__ import annotations

import math
from typing import Any

from rlstages.configs.rollout import rollout_tp
from rlstages.configs.run import RunConfig
from rlstages.engines.memory_models.backends import StateBytes, rollout_memory, training_memory
from rlstages.engines.memory_models.layout import Layout, stage_params
from rlstages.engines.memory_models.model import DTYPE_BYTES, ModelDims
from rlstages.engines.memory_models.result import RankMemory
from rlstages.engines.registry import TrainingOptions
from rlstages.engines.registry import reference_options as _reference_options

DEFAULT_PROMPT_TOKENS = 512  # prompt length assumed when data.max_prompt_length is unset


def micro_batch_tokens(cfg: RunConfig, train: Any, role: str = "actor") -> int:
    """Tokens one micro-batch has in flight: the dynamic-batching cap, else rows x (prompt + response) tokens.
    Under `share_prompt_forward` the cap (or the rows) counts responses alone and the mini-batch's prompts, forwarded
    once and kept until the step's backward, come on top."""
    if shares_prompts(train, role):
        return response_tokens(cfg, train) + cfg.mini_batch_prompts * prompt_tokens(cfg)
    if train.dynamic_batching:
        return train.max_tokens_per_micro_batch
    return train.micro_batch_size * sequence_tokens(cfg)


def shares_prompts(train: Any, role: str) -> bool:
    """Each prompt goes through the model once a step (`share_prompt_forward`; a critic reads every row whole)."""
    return bool(getattr(train, "share_prompt_forward", False)) and role != "critic"


def response_tokens(cfg: RunConfig, train: Any) -> int:
    """Response tokens of one micro-batch under `share_prompt_forward`: the cap, else rows x the response's budget."""
    if train.dynamic_batching:
        return train.max_tokens_per_micro_batch
    return train.micro_batch_size * cfg.rollout.response_budget


def prompt_tokens(cfg: RunConfig) -> int:
    """Tokens of one prompt: data.max_prompt_length, else DEFAULT_PROMPT_TOKENS."""
    return cfg.data.max_prompt_length or DEFAULT_PROMPT_TOKENS


def sequence_tokens(cfg: RunConfig) -> int:
    """Prompt + response tokens of one row (prompt: data.max_prompt_length, else DEFAULT_PROMPT_TOKENS)."""
    return prompt_tokens(cfg) + cfg.rollout.response_budget


def state_bytes(train: Any, dtype: str) -> StateBytes:
    """Weights, gradients and optimizer states per parameter, by backend (its memory model) and dtype."""
    return training_memory(train).state_bytes(train, dtype)


def _activations(
    cfg: RunConfig, role: str, train: Any, dims: ModelDims, lay: Layout, stage: int, act_bytes: int
) -> float:
    tokens = micro_batch_tokens(cfg, train, role) / lay.cp
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


def _logits(cfg: RunConfig, role: str, train: Any, dims: ModelDims, lay: Layout) -> float:
    """fp32 log-softmax of one micro-batch's logits, split over TP (last stage): every position under Megatron,
    only the response's under torch / DeepSpeed (`logits_to_keep`)."""
    if shares_prompts(train, role):  # the prompts' positions are never part of the logits
        tokens = response_tokens(cfg, train) / lay.cp
    else:
        tokens = micro_batch_tokens(cfg, train, role) / lay.cp
        if not training_memory(train).full_logits:
            tokens = tokens * cfg.rollout.response_budget / sequence_tokens(cfg)
    return tokens * dims.vocab / lay.tp * 4


def rollout_gpu(cfg: RunConfig, dims: ModelDims, capacity: int | None) -> tuple[float, float]:
    """(the rollout engine's GPU bytes per GPU, its weights per GPU)."""
    ro = cfg.rollout
    weights = dims.total_params() * DTYPE_BYTES[ro.dtype] / rollout_tp(ro)
    reserved = rollout_memory(ro).reserved(ro)
    if reserved is not None and capacity is not None:
        return reserved * capacity, weights
    rows = ro.batch_size  # sequences per generate call
    kv_width = 2 * dims.kv_heads * dims.head_dim if dims.mla is None else dims.mla[1] + dims.mla[3]
    kv = rows * sequence_tokens(cfg) * dims.layers * kv_width * DTYPE_BYTES[ro.dtype] / rollout_tp(ro)
    return weights + kv, weights


def training_rank(
    cfg: RunConfig, role: str, train: Any, dims: ModelDims, lay: Layout, stage: int, trainable: bool
) -> RankMemory:
    """The bytes of one rank of pipeline stage `stage` of `role` (trainable: with gradients, optimizer states and
    activations; else weights and logits only), on the GPU and, where offloaded, in host memory."""
    memory = training_memory(train)
    sb = memory.state_bytes(train, cfg.model.dtype)
    dense, experts, layers = stage_params(dims, lay, stage)
    dp_dense = max(1, lay.dp)

    def split(per: int, sharded: bool) -> float:
        if not sharded:
            return (dense + experts) * per
        return dense * per / dp_dense + experts * per / lay.edp

    gpu: dict[str, float] = {"weights": split(sb.weight, sb.shard_weight)}
    cpu: dict[str, float] = {}
    off = memory.offload(train)
    last = stage == lay.pp - 1
    if trainable and cfg.model.lora is None:
        grads, optim = split(sb.grad, sb.shard_grad), split(sb.optim, sb.shard_optim)
        gpu["grads"] = grads
        gpu["optimizer"] = optim * (1 - off.optimizer)
        if memory.bucket_elements(train):
            gpu["buckets"] = memory.bucket_elements(train) * sb.weight
        if off.optimizer:  # the offloaded states, and an fp32 copy of their gradients for the host step
            cpu["optimizer"] = (optim + split(4, sb.shard_optim)) * off.optimizer
        if off.grads:
            cpu["grads"] = grads
        act_bytes = 2 if (cfg.model.dtype != "float32" or train.bf16_autocast) else 4
        gpu["activations"] = _activations(cfg, role, train, dims, lay, stage, act_bytes)
    gpu["logits"] = _logits(cfg, role, train, dims, lay) if last else 0.0
    if off.params:
        cpu["weights"] = gpu["weights"]
    return RankMemory(role, stage, layers, dense + experts, gpu, {}, cpu)


def reference_options(cfg: RunConfig) -> TrainingOptions:
    """The reference engine's options as the run builds them (`engines.registry.reference_options`)."""
    ref = cfg.reference
    return _reference_options(cfg.actor, ref.backend, ref.micro_batch_size, ref.num_workers)
