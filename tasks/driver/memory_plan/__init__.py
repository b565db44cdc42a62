"""Memory plan before launch: bytes per rank of each role from the model's sizes and the parallel layout.

Per rank of the actor (and critic, reference, rollout): parameters, gradients, optimizer states (by backend,
dtype, distributed-optimizer / ZeRO sharding over DP, offload fraction), activations of one micro-batch (tokens,
recompute, sequence / context parallel, the micro-batches 1F1B keeps in flight on each pipeline stage), the
logits, the rollout engine's share (vLLM / SGLang reserve their memory fraction of the GPU; the HF engine its
weights and KV cache), the weight-sync buckets, and the host memory offload takes. Layers are placed on stages as
the Megatron engine does (`MegatronTrainingConfig.stage_layers`, uneven first / last stages), routed experts split
over EP and their width over ETP. A pure computation: no torch, no Prefect, no MLflow.

Accounting (docs/production.md, "Memory plan"): Megatron keeps bf16 weights, fp32 gradients
(`grad_reduce_in_fp32`) and Adam's fp32 master weights + two moments (12 B/param, 8 with fp32 weights), split over
the data-parallel ranks by the distributed optimizer (experts over the expert-data-parallel ranks); DeepSpeed ZeRO
splits the optimizer (stage >= 1), gradients (>= 2) and weights (3); the torch backend keeps AdamW moments in the
weights' dtype, nothing split. Activations count the tensors one transformer layer saves per token for backward
(norm inputs, Q/K/V and the attention output with a fused attention kernel, the SwiGLU gate / up / activation /
product, each routed copy of a token for MoE), in the activation dtype. Phases of a colocated GPU: train (weights +
gradients + optimizer + activations), rollout (the engine's reservation + whatever offload leaves on the GPU),
weight sync (weights + rollout weights + one bucket); the GPU's peak is the largest.

Here, what takes the whole RunConfig: `dims` (the run's model sizes), `rank` (one rank's bytes by component),
`advice` (what to change when it does not fit), `build` (`plan`: every rank, the phases of a colocated GPU, host
memory per node). Each backend's memory model and the pieces it needs are an engines matter, named by the
backend's registry entry (`rlstages.engines.memory_models`: `backends`, `gpus` (the GPU table), `model` (the
model's sizes), `layout` (TP / PP / EP / DP and the layers per stage), `result` (the plan's types)).
"""

from __future__ import annotations

from rlstages.engines.memory_models.gpus import GIB, GPUS, GPUS_PER_NODE, MIB
from rlstages.engines.memory_models.layout import Layout
from rlstages.engines.memory_models.model import DTYPE_BYTES, ModelDims
from rlstages.engines.memory_models.result import MemoryPlan, RankMemory
from rlstages.tasks.driver.memory_plan.advice import advice
from rlstages.tasks.driver.memory_plan.build import SYNC_BUCKET_BYTES, plan
from rlstages.tasks.driver.memory_plan.dims import PUBLISHED, load_dims
from rlstages.tasks.driver.memory_plan.rank import (
    DEFAULT_PROMPT_TOKENS,
    StateBytes,
    micro_batch_tokens,
    reference_options,
    sequence_tokens,
    state_bytes,
)

__all__ = [
    "DEFAULT_PROMPT_TOKENS",
    "DTYPE_BYTES",
    "GIB",
    "GPUS",
    "GPUS_PER_NODE",
    "MIB",
    "PUBLISHED",
    "SYNC_BUCKET_BYTES",
    "Layout",
    "MemoryPlan",
    "ModelDims",
    "RankMemory",
    "StateBytes",
    "advice",
    "load_dims",
    "micro_batch_tokens",
    "plan",
    "reference_options",
    "sequence_tokens",
    "state_bytes",
]
