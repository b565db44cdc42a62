"""Megatron-Core config and layer specs of the Mixture-of-Experts (and Multi-head Latent Attention) templates.

What `gpt.make_transformer_config` / `gpt.build_gpt_model` add for a ConversionSpec whose template is MoE
(`num_moe_experts`) or MLA (`multi_latent_attention`): the config class (`MLATransformerConfig` for MLA), the
expert-parallel size and CPU-safe MoE flags, and the decoder block spec that follows `moe_layer_freq` (dense
and MoE layers mixed, e.g. DeepSeek-V3's first dense layers). Dense specs never reach this module.
megatron-core is imported inside the functions. Non-goal: process groups, the token dispatcher's choice for
training (the trainer overrides `moe_token_dispatcher_type`), router losses.
"""

from __future__ import annotations

from typing import Any

import torch

from rlstages.engines.convert.spec import ConversionSpec

# Fusions/kernels that need CUDA (TE, apex, grouped GEMM); off on CPU. "alltoall" is the dispatcher Megatron
# recommends with EP; on CPU it runs over gloo (see README's support matrix for what ran).
MOE_CPU_SAFE: dict[str, Any] = {"moe_permute_fusion": False, "moe_grouped_gemm": False}


def is_moe_or_mla(spec: ConversionSpec) -> bool:
    """Whether the spec needs this module (MoE experts or Multi-head Latent Attention)."""
    return bool(spec.num_experts or spec.mcore.get("multi_latent_attention"))


def transformer_config_class(spec: ConversionSpec) -> type:
    """megatron-core's `MLATransformerConfig` for MLA models, else `TransformerConfig`."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if spec.mcore.get("multi_latent_attention") else TransformerConfig


def moe_config_kwargs(spec: ConversionSpec) -> dict[str, Any]:
    """TransformerConfig fields an MoE spec adds to the dense ones: EP size, dispatcher default, CPU-safe flags."""
    if not spec.num_experts:
        return {}
    out: dict[str, Any] = {
        "expert_model_parallel_size": spec.ep,
        "moe_token_dispatcher_type": "alltoall" if spec.ep > 1 and torch.cuda.is_available() else "allgather",
    }
    if not torch.cuda.is_available():
        out.update(MOE_CPU_SAFE)
    return out


def block_spec(spec: ConversionSpec, config: Any, vp_stage: int | None = None) -> Any:
    """This pipeline stage's decoder block spec (dense/MoE per `moe_layer_freq`, MLA attention if set)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=spec.transformer_impl == "transformer_engine",
        normalization=spec.mcore.get("normalization"),
        vp_stage=vp_stage,
    )


# Names megatron-core 0.16's moe_utils imports from Transformer Engine inside a try block, then tests against
# None (`if te_general_gemm is not None`) without defining them when TE is absent: a NameError in the router.
_TE_OPTIONAL = (
    "te_general_gemm",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
)


def define_missing_te_symbols() -> None:
    """Without Transformer Engine, give megatron-core's MoE utils the `None` it tests for; idempotent."""
    from megatron.core.transformer.moe import moe_utils

    for name in _TE_OPTIONAL:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def build_moe_gpt_model(spec: ConversionSpec, config: Any, model_cls: type, pre: bool, post: bool, stage: Any) -> Any:
    """The GPTModel of an MoE / MLA spec for this rank's stage (called by `gpt.build_gpt_model`)."""
    define_missing_te_symbols()
    return model_cls(
        config=config,
        transformer_layer_spec=block_spec(spec, config, stage),
        pre_process=pre,
        post_process=post,
        vp_stage=stage,
        **spec.gpt_model_kwargs(),
    )
