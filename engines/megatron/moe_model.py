"""Megatron-Core config and layer specs of the Mixture-of-Experts (and Multi-head Latent Attention) templates.

What `gpt.make_transformer_config` / `gpt.build_gpt_model` add for a ConversionSpec whose template is MoE
(`num_moe_experts`) or MLA (`multi_latent_attention`): the config class (`MLATransformerConfig` for MLA), the
expert-parallel size and CPU-safe MoE flags, and the decoder block spec that follows `moe_layer_freq` (dense
and MoE layers mixed, e.g. DeepSeek-V3's first dense layers). Dense specs never reach this module.
megatron-core is imported inside the functions. Non-goal: process groups, the token dispatcher's choice for
training (the trainer overrides `moe_token_dispatcher_type`), router losses.
"""

from __future__ import annotations

import functools
from typing import Any

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


def moe_config_kwargs(spec: ConversionSpec, cuda: bool) -> dict[str, Any]:
    """TransformerConfig fields an MoE / MLA spec adds to the dense ones: EP size, dispatcher default, CPU-safe
    flags; for MLA the RoPE base (MLA's attention builds its own rotary embedding from the config)."""
    out: dict[str, Any] = {}
    if spec.mcore.get("multi_latent_attention"):
        out.update({k: spec.mcore[k] for k in ("rotary_base", "rotary_percent") if k in spec.mcore})
    if not spec.num_experts:
        return out
    out |= {
        "expert_model_parallel_size": spec.ep,
        "expert_tensor_parallel_size": spec.expert_tp,
        "moe_token_dispatcher_type": "alltoall" if spec.ep > 1 and cuda else "allgather",
    }
    if not cuda:  # the worker's device (megatron-core's set-up recorded it)
        out.update(MOE_CPU_SAFE)
    return out


def block_spec(spec: ConversionSpec, config: Any, vp_stage: int | None = None) -> Any:
    """This pipeline stage's decoder block spec (dense/MoE per `moe_layer_freq`, MLA attention if set)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=spec.transformer_impl == "transformer_engine",
        normalization=spec.mcore.get("normalization"),
        vp_stage=vp_stage,
    )
    if spec.mcore.get("multi_latent_attention") and spec.transformer_impl == "local":
        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = local_mla_attention_class()
    return block


@functools.cache
def local_mla_attention_class() -> type:
    """megatron-core's local `DotProductAttention` taking MLA's separate key and value head sizes.

    MLA passes `k_channels` (qk_head_dim + rope dim) and `v_channels`; 0.16's local attention accepts neither
    (only Transformer Engine's does), though its math only needs the output width set to heads x v_channels.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kw: Any):
            super().__init__(*args, **kw)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return LocalMLADotProductAttention


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
    """Without Transformer Engine, give megatron-core's MoE utils the `None` it tests for, and tell its MLA module
    that TE is absent (0.16 imports placeholder TE classes without failing, so its `HAVE_TE` reads True and an
    `isinstance(..., TELinear)` check raises); idempotent, a no-op when TE is installed."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        return
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    for name in _TE_OPTIONAL:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    multi_latent_attention.HAVE_TE = False


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
