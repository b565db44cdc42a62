"""The pieces every built-in template is made of (the Llama-style decoder's config map, constants and weight
ops, and `builtin`, which registers a template unless the user registered one first): imported by the dense
templates (`templates`) and the MoE ones (`moe_templates`), which import nothing of each other's.
"""

from __future__ import annotations

from typing import Any

from rlstages.engines.convert.ops import QKV, QKVBias, Rename, Stack, WeightOp
from rlstages.engines.convert.template import _TEMPLATES, register_template

# HF config key -> Megatron config field; for a field listed twice the first HF key present wins.
DECODER_CONFIG: dict[str, str] = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups",
    "intermediate_size": "ffn_hidden_size",
    "head_dim": "kv_channels",
    "rms_norm_eps": "layernorm_epsilon",
    "attention_dropout": "attention_dropout",
    "hidden_act": "activation_func",
    "rope_parameters.rope_theta": "rotary_base",
    "rope_theta": "rotary_base",
    "max_position_embeddings": "max_sequence_length",
    "vocab_size": "padded_vocab_size",
    "tie_word_embeddings": "share_embeddings_and_output_weights",
}

DECODER_CONSTANTS: dict[str, object] = {
    "normalization": "RMSNorm",
    "gated_linear_unit": True,
    "position_embedding_type": "rope",
    "rotary_percent": 1.0,
    "hidden_dropout": 0.0,
}

ATTN = ".self_attn."


def decoder_ops(
    *,
    qkv_bias: str | None = None,
    qk_norm: bool = False,
    linear_bias: str | None = None,
    mlp_layers: str | None = None,
) -> list[WeightOp]:
    """The ops of a Llama-style decoder; `qkv_bias`/`linear_bias` name the config flags that enable biases;
    `mlp_layers="dense"` limits the dense MLP to the dense layers of an MoE model."""
    ops: list[WeightOp] = [
        Rename("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        Rename("model.norm.weight", "decoder.final_layernorm.weight"),
        Rename("lm_head.weight", "output_layer.weight"),
        Rename(".input_layernorm.weight", ".input_layernorm.weight"),
        QKV([f"{ATTN}{p}_proj.weight" for p in "qkv"], ".self_attention.linear_qkv.weight"),
        Rename(f"{ATTN}o_proj.weight", ".self_attention.linear_proj.weight"),
        Rename(".post_attention_layernorm.weight", ".pre_mlp_layernorm.weight"),
        Stack([".mlp.gate_proj.weight", ".mlp.up_proj.weight"], ".mlp.linear_fc1.weight", layers=mlp_layers),
        Rename(".mlp.down_proj.weight", ".mlp.linear_fc2.weight", layers=mlp_layers),
    ]
    if qkv_bias:
        ops.append(QKVBias([f"{ATTN}{p}_proj.bias" for p in "qkv"], ".self_attention.linear_qkv.bias", when=qkv_bias))
    if linear_bias:
        ops += [
            Rename(f"{ATTN}o_proj.bias", ".self_attention.linear_proj.bias", when=linear_bias),
            Stack([".mlp.gate_proj.bias", ".mlp.up_proj.bias"], ".mlp.linear_fc1.bias", when=linear_bias),
            Rename(".mlp.down_proj.bias", ".mlp.linear_fc2.bias", when=linear_bias),
        ]
    if qk_norm:
        ops += [
            Rename(f"{ATTN}q_norm.weight", ".self_attention.q_layernorm.weight"),
            Rename(f"{ATTN}k_norm.weight", ".self_attention.k_layernorm.weight"),
        ]
    return ops


ROTARY_BUFFERS = [f"{ATTN}rotary_emb.inv_freq"]  # saved by old Llama checkpoints; recomputed by Megatron
NO_BIAS = {"add_bias_linear": False, "add_qkv_bias": False}


def builtin(hf_model_type: str, *args: Any, **kwargs: Any) -> None:
    """Register a built-in template; a user template registered before the built-ins were loaded keeps
    precedence."""
    # A user template registered before the built-ins were loaded keeps precedence.
    if hf_model_type not in _TEMPLATES:
        register_template(hf_model_type, *args, **kwargs)
