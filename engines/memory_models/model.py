"""The model's sizes the plan needs (`ModelDims`, from an HF config.json's keys: dense, Qwen3-MoE / Mixtral experts,
DeepSeek MLA), its parameter counts and the tensors a layer saves per token for backward; the run's model is read
by `rlstages.tasks.driver.memory_plan.dims.load_dims`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
        """From an HF config.json's keys (a vision-language model's `text_config`: its language model; the vision
        tower, a few percent of the weights, is not counted)."""
        if isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg, **cfg["text_config"], "model_type": cfg.get("model_type")}
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0
        width = cfg.get("moe_intermediate_size") or 0
        if cfg.get("model_type") == "mixtral":
            width = cfg["intermediate_size"]
        dense: tuple[int, ...] = ()
        mla: tuple[int, int, int, int, int] | None = None
        shared = 0
        if cfg.get("model_type") == "deepseek_v3":
            dense = tuple(range(cfg.get("first_k_dense_replace", 0)))
            shared = (cfg.get("n_shared_experts") or 0) * width
            keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            q_lora, kv_lora, nope, rope, v = (int(cfg.get(k) or 0) for k in keys)
            mla = (q_lora, kv_lora, nope, rope, v)
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
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") in ("qwen2", "qwen2_vl", "qwen2_5_vl"))),
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
