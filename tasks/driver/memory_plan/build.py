"""The plan of a run config: every distinct rank of each role, the phases of a colocated GPU (train, reference
log-probs, rollout, weight sync) and the host memory of the fullest node."""

from __future__ import annotations

import math
from typing import Any

from rlstages.configs.run import RunConfig
from rlstages.engines.memory_models.backends import layout_of, rollout_memory, training_memory
from rlstages.engines.memory_models.gpus import GPUS_PER_NODE, capacity
from rlstages.engines.memory_models.layout import Layout
from rlstages.engines.memory_models.result import MemoryPlan, RankMemory
from rlstages.tasks.driver.memory_plan.advice import advice
from rlstages.tasks.driver.memory_plan.dims import load_dims
from rlstages.tasks.driver.memory_plan.rank import prompt_tokens, reference_options, rollout_gpu, training_rank

SYNC_BUCKET_BYTES = 256 << 20  # tasks/rollout.BUCKET_BYTES: one bucket in flight per trainer -> rollout transfer


def _phases(cfg: RunConfig, rank: RankMemory, train: Any, rollout: tuple[float, float], ref: RankMemory | None) -> None:
    """Train / reference / rollout / sync phases of one actor GPU; colocated roles share it (rollout engines
    sleep while the trainers work when they can, the reference keeps its weights)."""
    g = rank.gpu
    memory = training_memory(train)
    off = memory.offload(train)
    resident = 0.0 if off.params else g["weights"]
    resident += 0.0 if off.grads else g.get("grads", 0.0)
    resident += g.get("optimizer", 0.0)
    if memory.bucket_resident(train):
        resident += g.get("buckets", 0.0)  # ZeRO-3 keeps its gradient bucket from start-up on
    ref_weights = ref.gpu["weights"] if ref is not None and cfg.cluster.colocate else 0.0
    if ref_weights:
        g["reference"] = ref_weights
    engine, engine_weights = rollout
    bucket = min(SYNC_BUCKET_BYTES, engine_weights)  # a bucket holds at most the whole model
    sleeps = rollout_memory(cfg.rollout).sleeps(cfg.rollout)
    asleep = 0.0 if sleeps or not cfg.cluster.colocate else engine
    rank.phases["train"] = g["weights"] + g.get("grads", 0.0) + g.get("optimizer", 0.0) + g.get("activations", 0.0)
    rank.phases["train"] += g.get("buckets", 0.0)
    rank.phases["train"] += g["logits"] + ref_weights + asleep
    if ref_weights and ref is not None:
        rank.phases["reference"] = resident + ref_weights + ref.gpu["logits"] + asleep
    if cfg.cluster.colocate:
        g["rollout_engine"] = engine
        g["sync_bucket"] = bucket
        rank.phases["rollout"] = resident + ref_weights + engine
        rank.phases["sync"] = g["weights"] + ref_weights + engine_weights + bucket + asleep


def plan(
    cfg: RunConfig, hf_config: dict[str, Any] | None = None, gpu: str | None = None, measure_prompts: bool = False
) -> MemoryPlan:
    """The memory plan of `cfg` (model sizes from `hf_config`, else configs/published_models.json) against the
    GPU named `gpu` (a key of GPUS; None: no fit check). Prompts: data.max_prompt_length, else (`measure_prompts`)
    the data's longest where it can be measured here, else DEFAULT_PROMPT_TOKENS."""
    cfg, prompts_from = _with_prompt_length(cfg, measure_prompts)
    dims, source = load_dims(cfg, hf_config)
    size = capacity(gpu)
    rollout = rollout_gpu(cfg, dims, size)
    actor = cfg.actor
    lay = layout_of(actor, actor.num_workers, dims)
    refs: list[RankMemory] = []
    if cfg.uses_reference:
        ref_train = reference_options(cfg)
        ref_lay = layout_of(ref_train, ref_train.num_workers, dims)
        refs = [training_rank(cfg, "reference", ref_train, dims, ref_lay, s, False) for s in range(ref_lay.pp)]
    ranks: list[RankMemory] = []
    for stage in range(lay.pp):
        rank = training_rank(cfg, "actor", actor, dims, lay, stage, trainable=True)
        _phases(cfg, rank, actor, rollout, refs[min(stage, len(refs) - 1)] if refs else None)
        ranks.append(rank)
    if cfg.critic is not None:
        crit_lay = layout_of(cfg.critic, cfg.critic.num_workers, dims)
        ranks.extend(training_rank(cfg, "critic", cfg.critic, dims, crit_lay, s, True) for s in range(crit_lay.pp))
    ranks.extend(refs)
    if not cfg.cluster.colocate:
        ranks.append(RankMemory("rollout", 0, dims.layers, 0, {"rollout_engine": rollout[0]}, {}, {}))
    node_cpu, nodes = _node_host(cfg, ranks, lay)
    result = MemoryPlan(dims, source, ranks, gpu, size, node_cpu, nodes, [], prompt_tokens(cfg), prompts_from)
    result.advice = advice(cfg, result)
    return result


def _with_prompt_length(cfg: RunConfig, measure: bool) -> tuple[RunConfig, str]:
    """`cfg` with the prompt length the plan uses, and where it comes from."""
    if cfg.data.max_prompt_length is not None:
        return cfg, "data.max_prompt_length"
    assumed = "assumed: data.max_prompt_length unset"
    if not measure:
        return cfg, assumed
    from rlstages.tasks.driver.data.loading import longest_prompt  # the data's modules only where asked

    longest = longest_prompt(cfg)
    if longest is None:
        return cfg, assumed
    data = cfg.data.model_copy(update={"max_prompt_length": longest})
    return cfg.model_copy(update={"data": data}), "the data's longest prompt, measured"


def _node_host(cfg: RunConfig, ranks: list[RankMemory], lay: Layout) -> tuple[float, int]:
    """Host bytes of the fullest node (ranks in megatron's order: TP fastest, PP slowest) and the node count."""
    by_stage = {r.stage: r.host for r in ranks if r.role == "actor"}
    per_stage_ranks = lay.world // max(1, lay.pp)
    hosts = [by_stage.get(rank // per_stage_ranks, 0.0) for rank in range(lay.world)]
    nodes = max(1, math.ceil(max(cfg.cluster.num_gpus, 1) / GPUS_PER_NODE)) if cfg.cluster.num_gpus else 1
    per_node = max(1, math.ceil(lay.world / nodes))
    node_sums = [sum(hosts[i : i + per_node]) for i in range(0, lay.world, per_node)]
    return max(node_sums, default=0.0), nodes
