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

from rlstages.engines.convert.ops import Rename, Stack, WeightOp
from rlstages.engines.convert.templates import (
    DECODER_CONFIG,
    DECODER_CONSTANTS,
    ROTARY_BUFFERS,
    _builtin,
    decoder_ops,
)

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
