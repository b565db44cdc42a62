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
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlstages.configs.rollout import SGLangRolloutConfig, VLLMRolloutConfig, rollout_tp
from rlstages.configs.run import RunConfig
from rlstages.configs.training import DeepSpeedTrainingConfig, MegatronTrainingConfig, TorchTrainingConfig

GIB = 1 << 30
MIB = 1 << 20
# Device memory nvidia-smi reports per GPU (MiB), by the names `--gpu` takes.
GPUS: dict[str, int] = {"H20": 97871 * MIB, "H100": 81559 * MIB, "H200": 143771 * MIB, "A100-80G": 81920 * MIB}
GPUS_PER_NODE = 8
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PUBLISHED = Path(__file__).resolve().parents[1] / "configs" / "published_models.json"
SYNC_BUCKET_BYTES = 256 << 20  # tasks/rollout.BUCKET_BYTES: one bucket in flight per trainer -> rollout transfer
DEFAULT_PROMPT_TOKENS = 512  # prompt length assumed when data.max_prompt_length is unset


@dataclass(frozen=True)
class ModelDims:
    """The sizes the plan needs, read from an HF config (dense, Qwen3-MoE / Mixtral experts, DeepSeek MLA)."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    experts: int = 0
    top_k: int = 0
    expert_width: int = 0
    shared_width: int = 0
    dense_layers: tuple[int, ...] = ()
    mla: tuple[int, int, int, int, int] | None = None  # q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelDims:
        """From an HF config.json's keys."""
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0
        width = cfg.get("moe_intermediate_size") or 0
        if cfg.get("model_type") == "mixtral":
            width = cfg["intermediate_size"]
        dense: tuple[int, ...] = ()
        mla = None
        shared = 0
        if cfg.get("model_type") == "deepseek_v3":
            dense = tuple(range(cfg.get("first_k_dense_replace", 0)))
            shared = (cfg.get("n_shared_experts") or 0) * width
            keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            mla = tuple(int(cfg.get(k) or 0) for k in keys)  # type: ignore[assignment]
        elif experts:
            dense = tuple(cfg.get("mlp_only_layers") or ())
        return cls(
            model_type=str(cfg.get("model_type", "")),
            hidden=hidden,
            intermediate=cfg.get("intermediate_size", 4 * hidden),
            layers=layers,
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            vocab=cfg["vocab_size"],
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            experts=experts,
            top_k=cfg.get("num_experts_per_tok", 0) if experts else 0,
            expert_width=width if experts else 0,
            shared_width=shared,
            dense_layers=dense if experts else (),
            mla=mla,
        )

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` has routed experts."""
        return self.experts > 0 and index not in self.dense_layers

    def attention_params(self) -> int:
        """Weights of one attention block (GQA, or DeepSeek's Multi-head Latent Attention)."""
        h, a = self.hidden, self.heads
        if self.mla is not None:
            q_lora, kv_lora, nope, rope, v = self.mla
            q = (h * q_lora + q_lora + q_lora * a * (nope + rope)) if q_lora else h * a * (nope + rope)
            kv = h * (kv_lora + rope) + kv_lora + kv_lora * a * (nope + v)
            return q + kv + a * v * h
        q, kv = a * self.head_dim, self.kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        norms = 2 * self.head_dim if self.model_type.startswith("qwen3") else 0
        return h * (q + 2 * kv) + q * h + bias + norms

    def layer_dense_params(self, index: int) -> int:
        """Weights of layer `index` outside its routed experts (attention, norms, dense MLP or shared expert,
        router)."""
        h = self.hidden
        mlp = 3 * h * self.intermediate
        if self.is_moe_layer(index):
            mlp = 3 * h * self.shared_width + h * self.experts
        return self.attention_params() + mlp + 2 * h

    def expert_params(self) -> int:
        """Weights of one routed expert (SwiGLU: gate, up, down)."""
        return 3 * self.hidden * self.expert_width

    def total_params(self) -> int:
        """All weights of the model."""
        body = sum(
            self.layer_dense_params(i) + (self.experts * self.expert_params() if self.is_moe_layer(i) else 0)
            for i in range(self.layers)
        )
        return body + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def active_params(self) -> int:
        """Weights one token passes through (routed experts: top-k of them)."""
        body = sum(
            self.layer_dense_params(i) + (self.top_k * self.expert_params() if self.is_moe_layer(i) else 0)
            for i in range(self.layers)
        )
        return body + self.vocab * self.hidden * (1 if self.tied else 2)

    def saved_per_token(self, index: int, tp: int, sequence_parallel: bool) -> float:
        """Elements layer `index` saves per token for backward on one TP rank (fused attention kernel: no
        [L, L] scores)."""
        h = self.hidden
        if self.mla is not None:
            q_lora, kv_lora, nope, rope, v = self.mla
            attn = h + q_lora + kv_lora + self.heads * (2 * (nope + rope) + 2 * v)
        else:
            attn = h + 2 * self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim
        if self.is_moe_layer(index):
            mlp = h + self.top_k * (h + 4 * self.expert_width) + (h + 4 * self.shared_width if self.shared_width else 0)
        else:
            mlp = h + 4 * self.intermediate
        norms = 2 * h
        split = (attn + mlp) / tp
        return split + (norms / tp if sequence_parallel else norms)


def load_dims(cfg: RunConfig, hf_config: dict[str, Any] | None) -> tuple[ModelDims, str]:
    """The model's sizes and where they came from: the HF config given (config.json or model.tiny), else the
    published values in configs/published_models.json under the model directory's name."""
    if hf_config is not None:
        return ModelDims.from_hf(hf_config), "config.json" if cfg.model.tiny is None else "model.tiny"
    table = json.loads(PUBLISHED.read_text())
    name = Path(str(cfg.model.path)).name
    if name not in table:
        known = ", ".join(k for k in table if not k.startswith("_"))
        raise ValueError(
            f"model.path {cfg.model.path}: no config.json here and {name!r} is not in {PUBLISHED.name} "
            f"(known: {known}); give a model directory or add its sizes there"
        )
    return ModelDims.from_hf(table[name]), PUBLISHED.name


@dataclass(frozen=True)
class Layout:
    """A role's parallel layout: TP / PP / CP / EP / ETP / DP and the layers of each pipeline stage."""

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    stages: tuple[int, ...] = ()

    @property
    def dp(self) -> int:
        """Data-parallel ranks of the dense weights."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Data-parallel ranks of the expert weights."""
        return max(1, self.world // (self.ep * self.etp * self.pp))


@dataclass
class RankMemory:
    """One rank's bytes: GPU by component and phase, host memory by component."""

    role: str
    stage: int
    layers: int
    params: int
    gpu: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> float:
        """The largest phase (train, rollout, sync) on this rank's GPU."""
        return max(self.phases.values()) if self.phases else sum(self.gpu.values())

    @property
    def peak_phase(self) -> str:
        """Which phase is the largest."""
        return max(self.phases, key=self.phases.__getitem__) if self.phases else "train"

    @property
    def host(self) -> float:
        """Host bytes this rank's offload takes."""
        return sum(self.cpu.values())


@dataclass
class MemoryPlan:
    """The plan: the model's sizes, each distinct rank, the fullest, the GPU it is checked against, advice."""

    dims: ModelDims
    source: str
    ranks: list[RankMemory]
    gpu: str | None
    capacity: int | None
    node_cpu: float
    nodes: int
    advice: list[str]

    @property
    def fullest(self) -> RankMemory:
        """The rank with the largest GPU peak."""
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def fits(self) -> bool | None:
        """Whether the fullest rank fits the named GPU (None: no GPU named)."""
        return None if self.capacity is None else self.fullest.peak <= self.capacity

    def rows(self) -> list[dict[str, Any]]:
        """One dict per distinct rank, in GiB (the table `rlstages plan` prints)."""
        return [
            {
                "role": r.role,
                "stage": r.stage,
                "layers": r.layers,
                "params": r.params,
                **{k: round(v / GIB, 2) for k, v in r.gpu.items()},
                **{f"{k}_phase": round(v / GIB, 2) for k, v in r.phases.items()},
                "peak_gib": round(r.peak / GIB, 2),
                "peak_at": r.peak_phase,
                "cpu_gib": round(r.host / GIB, 2),
            }
            for r in self.ranks
        ]

    def summary(self) -> dict[str, Any]:
        """The headline figures (also appended by `config show`)."""
        full = self.fullest
        return {
            "model_params": f"{self.dims.total_params():,}",
            "active_params": f"{self.dims.active_params():,}",
            "dims_from": self.source,
            "fullest_rank": f"{full.role} stage {full.stage}",
            "gpu_peak_gib": round(full.peak / GIB, 2),
            "gpu_peak_phase": full.peak_phase,
            "gpu": self.gpu,
            "gpu_capacity_gib": None if self.capacity is None else round(self.capacity / GIB, 2),
            "fits": self.fits,
            "cpu_per_rank_gib": round(max(r.host for r in self.ranks) / GIB, 2),
            "cpu_per_node_gib": round(self.node_cpu / GIB, 2),
            "nodes": self.nodes,
        }


def _layout(train: Any, world: int, dims: ModelDims) -> Layout:
    if isinstance(train, MegatronTrainingConfig):
        sp = train.sequence_parallel or (dims.experts > 0 and train.tensor_model_parallel_size > 1)
        return Layout(
            world=world,
            tp=train.tensor_model_parallel_size,
            pp=train.pipeline_model_parallel_size,
            cp=train.context_parallel_size,
            ep=train.expert_model_parallel_size,
            etp=train.expert_tp,
            sequence_parallel=sp,
            stages=tuple(train.stage_layers(dims.layers)),
        )
    return Layout(world=world, stages=(dims.layers,))


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
    if isinstance(train, DeepSpeedTrainingConfig):
        stage = train.zero_stage
        return StateBytes(w, w, 12 if w < 4 else 8, stage >= 3, stage >= 2, stage >= 1)
    moments = 2 * w  # torch AdamW: moments in the weights' dtype (torchao's bf16 moments likewise)
    return StateBytes(w, w, moments)


def _stage_params(dims: ModelDims, lay: Layout, stage: int) -> tuple[int, int, int]:
    """(dense weights, expert weights, layers) on one rank of pipeline stage `stage`."""
    first = sum(lay.stages[:stage])
    layers = range(first, first + lay.stages[stage])
    dense = sum(dims.layer_dense_params(i) for i in layers)
    experts = sum(dims.experts // lay.ep * dims.expert_params() for i in layers if dims.is_moe_layer(i))
    embed = dims.vocab * dims.hidden
    if stage == 0:
        dense += embed
    if stage == lay.pp - 1:
        dense += dims.hidden + (embed if (not dims.tied or lay.pp > 1) else 0)
    return math.ceil(dense / lay.tp), math.ceil(experts / lay.etp), lay.stages[stage]


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


def _rollout_gpu(cfg: RunConfig, dims: ModelDims, capacity: int | None) -> tuple[float, float]:
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


def _training_rank(
    cfg: RunConfig, role: str, train: Any, dims: ModelDims, lay: Layout, stage: int, trainable: bool
) -> RankMemory:
    sb = state_bytes(train, cfg.model.dtype)
    dense, experts, layers = _stage_params(dims, lay, stage)
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
    """The reference engine's options as tasks/specs.trainer_settings builds them: the actor's batching at the
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


def _phases(cfg: RunConfig, rank: RankMemory, train: Any, rollout: tuple[float, float], ref: RankMemory | None) -> None:
    """Train / reference / rollout / sync phases of one actor GPU; colocated roles share it (rollout engines
    sleep while the trainers work when they can, the reference keeps its weights)."""
    g = rank.gpu
    mega = isinstance(train, MegatronTrainingConfig)
    resident = 0.0 if (mega and train.param_offload) else g["weights"]
    resident += 0.0 if (mega and train.grad_offload) else g.get("grads", 0.0)
    resident += g.get("optimizer", 0.0)
    ref_weights = ref.gpu["weights"] if ref is not None and cfg.cluster.colocate else 0.0
    if ref_weights:
        g["reference"] = ref_weights
    engine, engine_weights = rollout
    bucket = min(SYNC_BUCKET_BYTES, engine_weights)  # a bucket holds at most the whole model
    sleeps = getattr(cfg.rollout, "enable_sleep_mode", getattr(cfg.rollout, "enable_memory_saver", False))
    asleep = 0.0 if sleeps or not cfg.cluster.colocate else engine
    rank.phases["train"] = g["weights"] + g.get("grads", 0.0) + g.get("optimizer", 0.0) + g.get("activations", 0.0)
    rank.phases["train"] += g["logits"] + ref_weights + asleep
    if ref_weights and ref is not None:
        rank.phases["reference"] = resident + ref_weights + ref.gpu["logits"] + asleep
    if cfg.cluster.colocate:
        g["rollout_engine"] = engine
        g["sync_bucket"] = bucket
        rank.phases["rollout"] = resident + ref_weights + engine
        rank.phases["sync"] = g["weights"] + ref_weights + engine_weights + bucket + asleep


def plan(cfg: RunConfig, hf_config: dict[str, Any] | None = None, gpu: str | None = None) -> MemoryPlan:
    """The memory plan of `cfg` (model sizes from `hf_config`, else configs/published_models.json) against the
    GPU named `gpu` (a key of GPUS; None: no fit check)."""
    dims, source = load_dims(cfg, hf_config)
    if gpu is not None and gpu not in GPUS:
        raise ValueError(f"--gpu {gpu}: expected one of {', '.join(GPUS)}")
    capacity = GPUS[gpu] if gpu else None
    rollout = _rollout_gpu(cfg, dims, capacity)
    actor = cfg.actor
    lay = _layout(actor, actor.num_workers, dims)
    refs: list[RankMemory] = []
    if cfg.uses_reference:
        ref_train = reference_options(cfg)
        ref_lay = _layout(ref_train, ref_train.num_workers, dims)
        refs = [_training_rank(cfg, "reference", ref_train, dims, ref_lay, s, False) for s in range(ref_lay.pp)]
    ranks: list[RankMemory] = []
    for stage in range(lay.pp):
        rank = _training_rank(cfg, "actor", actor, dims, lay, stage, trainable=True)
        _phases(cfg, rank, actor, rollout, refs[min(stage, len(refs) - 1)] if refs else None)
        ranks.append(rank)
    if cfg.critic is not None:
        crit_lay = _layout(cfg.critic, cfg.critic.num_workers, dims)
        ranks.extend(_training_rank(cfg, "critic", cfg.critic, dims, crit_lay, s, True) for s in range(crit_lay.pp))
    ranks.extend(refs)
    if not cfg.cluster.colocate:
        ranks.append(RankMemory("rollout", 0, dims.layers, 0, {"rollout_engine": rollout[0]}, {}, {}))
    node_cpu, nodes = _node_host(cfg, ranks, lay)
    result = MemoryPlan(dims, source, ranks, gpu, capacity, node_cpu, nodes, [])
    result.advice = advice(cfg, result)
    return result


def _node_host(cfg: RunConfig, ranks: list[RankMemory], lay: Layout) -> tuple[float, int]:
    """Host bytes of the fullest node (ranks in megatron's order: TP fastest, PP slowest) and the node count."""
    by_stage = {r.stage: r.host for r in ranks if r.role == "actor"}
    per_stage_ranks = lay.world // max(1, lay.pp)
    hosts = [by_stage.get(rank // per_stage_ranks, 0.0) for rank in range(lay.world)]
    nodes = max(1, math.ceil(max(cfg.cluster.num_gpus, 1) / GPUS_PER_NODE)) if cfg.cluster.num_gpus else 1
    per_node = max(1, math.ceil(lay.world / nodes))
    node_sums = [sum(hosts[i : i + per_node]) for i in range(0, lay.world, per_node)]
    return max(node_sums, default=0.0), nodes


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
