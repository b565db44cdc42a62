"""Built-in templates: llama, qwen2 (QKV bias), qwen3 (q/k norm), mistral; the Mixture-of-Experts ones
(qwen3_moe, mixtral, deepseek_v3) are in `moe_templates` and the vision-language ones (qwen2_vl, qwen2_5_vl) in
`vlm_templates`, loaded with these; all are made of `decoder`'s pieces.

Megatron names are the local layer spec's; `rlstages.engines.convert.names` maps them to the Transformer Engine
spec's fused-norm names when a conversion asks for `transformer_impl="transformer_engine"`.
Known limit: Mistral's sliding window is not expressed in the Megatron config (the local spec has no
sliding-window attention), so sequences longer than `sliding_window` differ from HF.
"""

from __future__ import annotations

import importlib

import rlstages.engines.convert.moe_templates  # noqa: F401  (registers the MoE built-ins)
import rlstages.engines.convert.vlm_templates  # noqa: F401  (registers qwen2_vl, qwen2_5_vl)
from rlstages.engines.convert.decoder import (  # noqa: F401  (DECODER_CONFIG, decoder_ops: docs/new-model.md)
    DECODER_CONFIG,
    DECODER_CONSTANTS,
    NO_BIAS,
    ROTARY_BUFFERS,
    decoder_ops,
)
from rlstages.engines.convert.decoder import builtin as _builtin
from rlstages.engines.convert.template import _TEMPLATES, Template

_builtin(
    "llama",
    {**DECODER_CONFIG, "attention_bias": "add_qkv_bias", "mlp_bias": "add_bias_linear"},
    decoder_ops(qkv_bias="add_qkv_bias", linear_bias="add_bias_linear"),
    "model.layers.",
    DECODER_CONSTANTS,
    ROTARY_BUFFERS,
)
_builtin("mistral", DECODER_CONFIG, decoder_ops(), "model.layers.", {**DECODER_CONSTANTS, **NO_BIAS}, ROTARY_BUFFERS)
_builtin(
    "qwen2",
    DECODER_CONFIG,
    decoder_ops(qkv_bias="add_qkv_bias"),
    "model.layers.",
    {**DECODER_CONSTANTS, "add_bias_linear": False, "add_qkv_bias": True},
)
_builtin(
    "qwen3",
    {**DECODER_CONFIG, "attention_bias": "add_qkv_bias"},
    decoder_ops(qkv_bias="add_qkv_bias", qk_norm=True),
    "model.layers.",
    {**DECODER_CONSTANTS, "add_bias_linear": False, "qk_layernorm": True},
)


def get_template(hf_model_type: str, module: str | None = None) -> Template:
    """The registered template of `hf_model_type`; an error listing the registered ones if there is none.

    `module` (recorded in converted checkpoints) is imported first when the type is not registered yet,
    so fresh worker processes find user templates.
    """
    if hf_model_type not in _TEMPLATES and module and module != "__main__":
        importlib.import_module(module)
    try:
        return _TEMPLATES[hf_model_type]
    except KeyError:
        raise KeyError(
            f"no conversion template for model_type {hf_model_type!r}; registered: {sorted(_TEMPLATES)}. "
            "Add one with rlstages.engines.convert.register_template (docs/new-model.md)"
        ) from None


def registered_templates() -> list[str]:
    """Names of all registered templates."""
    return sorted(_TEMPLATES)
