"""What to change when the fullest rank does not fit: verl's troubleshooting rows as concrete config overrides."""

from __future__ import annotations

from rlstages.configs.run import RunConfig
from rlstages.engines.memory_models.backends import rollout_memory, training_memory
from rlstages.engines.memory_models.gpus import GIB
from rlstages.engines.memory_models.result import MemoryPlan


def advice(cfg: RunConfig, result: MemoryPlan) -> list[str]:
    """Concrete config changes when the fullest rank does not fit (verl's troubleshooting row "OOM: enable
    parameter offload, raise OFFLOAD_FRACTION"), in the order they free the most for the least speed."""
    if result.fits is not False:
        return []
    full, actor = result.fullest, cfg.actor
    tips: list[str] = []
    g = full.gpu
    memory = training_memory(actor)
    tips += memory.offload_advice(actor, full)
    if g.get("activations", 0) > 0.2 * full.peak and not actor.gradient_checkpointing:
        tips.append(f"actor.gradient_checkpointing=true (activations are {g['activations'] / GIB:.1f} GiB)")
    if actor.dynamic_batching:
        tips.append(f"actor.max_tokens_per_micro_batch={max(1, actor.max_tokens_per_micro_batch // 2)} (halves them)")
    else:
        tips.append(f"actor.micro_batch_size={max(1, actor.micro_batch_size // 2)} (halves them)")
    if full.peak_phase != "train":
        tips += rollout_memory(cfg.rollout).advice(cfg.rollout)
    return tips + memory.parallel_advice(actor)
