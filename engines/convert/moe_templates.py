"""Built-in Mixture-of-Experts templates: qwen3_moe, mixtral (and deepseek_v3, with Multi-head Latent Attention).

Names are megatron-core's local layer spec with `SequentialMLP` experts: the router is
`decoder.layers.N.mlp.router.weight` and routed expert E is `decoder.layers.N.mlp.experts.local_experts.E.
linear_fc1.weight` (gate and up stacked, as a dense fc1) and `...linear_fc2.weight`; under expert parallelism
E is the local index on its EP rank (`sharding.split_ep`). HF names are the on-disk layout (one tensor per
expert: `mlp.experts.E.{gate,up,down}_proj.weight`), which is what `save_pretrained` writes and vLLM loads;
transformers >= 5 fuses them in memory (`rlstages.engines.models.moe_layout` converts).
Routing maps onto megatron-core's router: softmax-then-top-k without renormalisation is
`moe_router_pre_softmax=True`; top-k then renormalised (norm_topk_prob, Mixtral) is the default
(`moe_router_pre_softmax=False`: softmax over the top-k logits, the same probabilities).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlstages.engines.convert.decoder import DECODER_CONFIG, DECODER_CONSTANTS, ROTARY_BUFFERS, decoder_ops
from rlstages.engines.convert.decoder import builtin as _builtin
from rlstages.engines.convert.ops import Rename, Stack, WeightOp

ROUTER = ".mlp.router.weight"
LOCAL_FC1 = ".mlp.experts.local_experts.{}.linear_fc1.weight"
LOCAL_FC2 = ".mlp.experts.local_experts.{}.linear_fc2.weight"

MOE_CONFIG: dict[str, str] = {
    "num_experts": "num_moe_experts",
    "num_local_experts": "num_moe_experts",
    "n_routed_experts": "num_moe_experts",
    "num_experts_per_tok": "moe_router_topk",
    "moe_intermediate_size": "moe_ffn_hidden_size",
    "router_aux_loss_coef": "moe_aux_loss_coeff",
}
MOE_CONSTANTS: dict[str, object] = {
    **DECODER_CONSTANTS,
    "add_bias_linear": False,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_grouped_gemm": False,
}


def expert_ops(
    block: str = ".mlp", gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
) -> list[WeightOp]:
    """Router and per-expert SwiGLU ops of an MoE block (`block` is the HF module holding `gate` and `experts`)."""
    expert = f"{block}.experts.{{}}."
    return [
        Rename(f"{block}.gate.weight", ROUTER, layers="moe"),
        Stack([f"{expert}{gate}.weight", f"{expert}{up}.weight"], LOCAL_FC1, layers="moe"),
        Rename(f"{expert}{down}.weight", LOCAL_FC2, layers="moe"),
    ]


def moe_layer_freq(pattern: list[int]) -> int | list[int]:
    """Megatron's `moe_layer_freq`: 1 when every layer is MoE, else the per-layer 0/1 list."""
    return 1 if all(pattern) else pattern


def _qwen3_moe(hf: Mapping[str, Any]) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    pattern = [0 if (i in dense or (i + 1) % step) else 1 for i in range(layers)]
    return {
        "moe_router_pre_softmax": not bool(hf.get("norm_topk_prob", False)),
        "moe_layer_freq": moe_layer_freq(pattern),
    }


def _mixtral(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {"moe_ffn_hidden_size": hf["intermediate_size"], "moe_router_pre_softmax": False}


_builtin(
    "qwen3_moe",
    {**DECODER_CONFIG, "attention_bias": "add_qkv_bias", **MOE_CONFIG},
    decoder_ops(qkv_bias="add_qkv_bias", qk_norm=True, mlp_layers="dense") + expert_ops(),
    "model.layers.",
    {**MOE_CONSTANTS, "qk_layernorm": True},
    derive_mcore_config=_qwen3_moe,
)
_builtin(
    "mixtral",
    {**DECODER_CONFIG, **MOE_CONFIG},
    decoder_ops(mlp_layers="dense") + expert_ops(".block_sparse_moe", "w1", "w3", "w2"),
    "model.layers.",
    {**MOE_CONSTANTS, "add_qkv_bias": False},
    ROTARY_BUFFERS,
    derive_mcore_config=_mixtral,
)


ATTN = ".self_attn."
MLA = ".self_attention."


def mla_ops() -> list[WeightOp]:
    """DeepSeek-V3's Multi-head Latent Attention: q/kv down- and up-projections with their norms (local spec)."""
    return [
        Rename(f"{ATTN}q_a_proj.weight", f"{MLA}linear_q_down_proj.weight"),
        Rename(f"{ATTN}q_a_layernorm.weight", f"{MLA}q_layernorm.weight"),
        Rename(f"{ATTN}q_b_proj.weight", f"{MLA}linear_q_up_proj.weight"),
        Rename(f"{ATTN}kv_a_proj_with_mqa.weight", f"{MLA}linear_kv_down_proj.weight"),
        Rename(f"{ATTN}kv_a_layernorm.weight", f"{MLA}kv_layernorm.weight"),
        Rename(f"{ATTN}kv_b_proj.weight", f"{MLA}linear_kv_up_proj.weight"),
        Rename(f"{ATTN}o_proj.weight", f"{MLA}linear_proj.weight"),
    ]


def deepseek_ops() -> list[WeightOp]:
    """Embedding, norms, MLA, the first dense layers' MLP, and the MoE layers' router (with its score-correction
    bias), routed experts and shared experts."""
    return [
        Rename("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        Rename("model.norm.weight", "decoder.final_layernorm.weight"),
        Rename("lm_head.weight", "output_layer.weight"),
        Rename(".input_layernorm.weight", ".input_layernorm.weight"),
        Rename(".post_attention_layernorm.weight", ".pre_mlp_layernorm.weight"),
        *mla_ops(),
        Stack([".mlp.gate_proj.weight", ".mlp.up_proj.weight"], ".mlp.linear_fc1.weight", layers="dense"),
        Rename(".mlp.down_proj.weight", ".mlp.linear_fc2.weight", layers="dense"),
        *expert_ops(),
        Rename(".mlp.gate.e_score_correction_bias", ".mlp.router.expert_bias", layers="moe"),
        Stack(
            [".mlp.shared_experts.gate_proj.weight", ".mlp.shared_experts.up_proj.weight"],
            ".mlp.shared_experts.linear_fc1.weight",
            layers="moe",
        ),
        Rename(".mlp.shared_experts.down_proj.weight", ".mlp.shared_experts.linear_fc2.weight", layers="moe"),
    ]


_YARN = {  # HF rope_parameters key -> MLATransformerConfig field
    "factor": "rotary_scaling_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}


def _deepseek_v3(hf: Mapping[str, Any]) -> dict[str, Any]:
    if not hf.get("q_lora_rank"):
        raise ValueError("deepseek_v3: q_lora_rank=null (queries without a low-rank projection) is not supported")
    if not hf.get("rope_interleave", True):
        raise ValueError("deepseek_v3: rope_interleave=false; megatron-core's MLA applies RoPE interleaved")
    topk = int(hf["num_experts_per_tok"])
    if topk > 1 and not hf.get("norm_topk_prob", True):
        raise ValueError("deepseek_v3: norm_topk_prob=false; megatron-core renormalises sigmoid top-k scores")
    layers = int(hf["num_hidden_layers"])
    first_dense = min(int(hf.get("first_k_dense_replace") or 0), layers)
    out: dict[str, Any] = {
        "multi_latent_attention": True,
        "qk_layernorm": True,  # the local spec builds q_layernorm / kv_layernorm only with it
        "q_lora_rank": hf["q_lora_rank"],
        "kv_lora_rank": hf["kv_lora_rank"],
        "qk_head_dim": hf["qk_nope_head_dim"],
        "qk_pos_emb_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
        "moe_layer_freq": moe_layer_freq([0] * first_dense + [1] * (layers - first_dense)),
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
        "moe_router_dtype": "fp32",  # HF routes in float32 whatever the model dtype
    }
    if hf.get("n_shared_experts"):
        out["moe_shared_expert_intermediate_size"] = int(hf["n_shared_experts"]) * int(hf["moe_intermediate_size"])
    groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if groups > 1:
        if topk // group_topk != 2:
            raise ValueError(
                f"deepseek_v3: num_experts_per_tok / topk_group = {topk}/{group_topk}; megatron-core scores a group "
                "by its top (topk/topk_group) experts and HF by its top 2, which agree only when that ratio is 2"
            )
        out.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in (None, "default"):
        out["rope_type"] = "rope"
    elif rope_type == "yarn":
        out["rope_type"] = "yarn"
        out.update({field: rope[key] for key, field in _YARN.items() if rope.get(key) is not None})
    else:
        raise ValueError(f"deepseek_v3: rope_type={rope_type!r} is not supported (default, yarn)")
    return out


_DEEPSEEK_CONFIG = {k: v for k, v in {**DECODER_CONFIG, **MOE_CONFIG}.items() if k != "head_dim"}

_builtin(
    "deepseek_v3",
    _DEEPSEEK_CONFIG,
    deepseek_ops(),
    "model.layers.",
    {**MOE_CONSTANTS, "add_qkv_bias": False},
    ROTARY_BUFFERS,
    derive_mcore_config=_deepseek_v3,
)
