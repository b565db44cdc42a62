"""What to change when the fullest rank does not fit: verl's troubleshooting rows as concrete config overrides."""

from __future__ import annotations

from rlstages.configs.rollout import VLLMRolloutConfig
from rlstages.configs.run import RunConfig
from rlstages.configs.training import DeepSpeedTrainingConfig, MegatronTrainingConfig
from rlstages.engines.memory_plan.gpus import GIB
from rlstages.engines.memory_plan.result import MemoryPlan


def advice(cfg: RunConfig, result: MemoryPlan) -> list[str]:
    """Concrete config changes when the fullest rank does not fit (verl's troubleshooting row "OOM: enable
    parameter offload, raise OFFLOAD_FRACTION"), in the order they free the most for the least speed."""
    if result.fits is not False:
        return []
    full, actor = result.fullest, cfg.actor
    tips: list[str] = []
    g = full.gpu
    if isinstance(actor, MegatronTrainingConfig):
        if not actor.optimizer_offload or actor.offload_fraction < 1.0:
            tips.append(
                f"actor.optimizer_offload=true actor.offload_fraction=1.0 (frees {g['optimizer'] / GIB:.1f} GiB)"
            )
        if not actor.use_distributed_optimizer:
            tips.append("actor.use_distributed_optimizer=true (optimizer states split over data-parallel ranks)")
        if full.peak_phase == "rollout" and not (actor.param_offload and actor.grad_offload):
            tips.append(
                "actor.param_offload=true actor.grad_offload=true (weights and gradients leave the GPU during rollout)"
            )
    if isinstance(actor, DeepSpeedTrainingConfig) and not actor.offload_optimizer:
        tips.append("actor.offload_optimizer=true (ZeRO's optimizer states to host memory)")
    if g.get("activations", 0) > 0.2 * full.peak and not actor.gradient_checkpointing:
        tips.append(f"actor.gradient_checkpointing=true (activations are {g['activations'] / GIB:.1f} GiB)")
    if actor.dynamic_batching:
        tips.append(f"actor.max_tokens_per_micro_batch={max(1, actor.max_tokens_per_micro_batch // 2)} (halves them)")
    else:
        tips.append(f"actor.micro_batch_size={max(1, actor.micro_batch_size // 2)} (halves them)")
    if full.peak_phase != "train" and isinstance(cfg.rollout, VLLMRolloutConfig):
        tips.append(
            f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization - 0.1:.2f} (a smaller KV cache)"
        )
    if isinstance(actor, MegatronTrainingConfig):
        tips.append(
            "raise actor.tensor_model_parallel_size, pipeline_model_parallel_size or expert_model_parallel_size "
            "(more GPUs share the weights)"
        )
    return tips
