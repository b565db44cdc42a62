"""Built-in vision-language templates: qwen2_vl and qwen2_5_vl (the model-support guide's custom-component example).

The language part is a Qwen2 decoder whose config sits in the HF config's `text_config` (transformers >= 5; older
checkpoints keep the same keys at the top level, read when `text_config` lacks them), with M-RoPE
(`position_embedding_type: mrope`, `mrope_section` from the rope parameters). The vision tower and its merger
(projector) are renamed whole, `visual.{}` -> `vision_model.{}`, and built by the template's model class
(`rlstages.engines.megatron.vlm_model`) from transformers' own vision module. Placement: `vision_model.*` is a
top-level name, so it lives on the first pipeline stage only (`sharding.LayerMap.place`), and the tp rule
`vision_model.*: replicated` keeps it whole on every TP rank. Both HF namings map: the checkpoint's (`visual.*`,
`model.layers.*`, `model.embed_tokens`, `model.norm`, `lm_head`) and the in-memory one (`model.visual.*`,
`model.language_model.*`), through `hf_name_prefixes`; exports use the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlstages.engines.convert.decoder import DECODER_CONFIG, DECODER_CONSTANTS, decoder_ops
from rlstages.engines.convert.decoder import builtin as _builtin
from rlstages.engines.convert.ops import Rename
from rlstages.engines.convert.template import lookup

VISION_PREFIX = "vision_model."
VLM_MODEL_CLS = "rlstages.engines.megatron.vlm_model:QwenVLModel"
# text_config's keys first (the first HF key present wins), then the same keys at the top level
VLM_CONFIG: dict[str, str] = {
    **{f"text_config.{k}": v for k, v in DECODER_CONFIG.items()},
    **DECODER_CONFIG,
}
VLM_CONSTANTS: dict[str, object] = {
    **DECODER_CONSTANTS,
    "position_embedding_type": "mrope",
    "add_bias_linear": False,
    "add_qkv_bias": True,
}
IN_MEMORY_NAMES = {"model.visual.": "visual.", "model.language_model.": "model."}


def rope_parameters(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language part's rope parameters (`text_config.rope_parameters`, else the older `rope_scaling`)."""
    for key in ("text_config.rope_parameters", "text_config.rope_scaling", "rope_parameters", "rope_scaling"):
        found = lookup(hf, key)
        if isinstance(found, Mapping) and found.get("mrope_section"):
            return found
    return {}


def _mrope(hf: Mapping[str, Any]) -> dict[str, Any]:
    params = rope_parameters(hf)
    section = params.get("mrope_section")
    if not section or len(section) != 3:
        raise ValueError(
            f"{hf.get('model_type')}: text_config.rope_parameters.mrope_section must list 3 sections (temporal, "
            f"height, width), got {section!r}"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope", None):
        raise ValueError(f"{hf.get('model_type')}: rope_type={rope_type!r} is not supported with M-RoPE (default)")
    return {"mrope_section": [int(s) for s in section]}


def vlm_ops() -> list:
    """The Qwen2 decoder's ops plus the vision tower renamed whole."""
    return [*decoder_ops(qkv_bias="add_qkv_bias"), Rename("visual.{}", VISION_PREFIX + "{}")]


for _model_type in ("qwen2_vl", "qwen2_5_vl"):
    _builtin(
        _model_type,
        VLM_CONFIG,
        vlm_ops(),
        "model.layers.",
        VLM_CONSTANTS,
        mcore_model_cls=VLM_MODEL_CLS,
        tp_rules={VISION_PREFIX + "*": "replicated"},
        derive_mcore_config=_mrope,
        hf_name_prefixes=IN_MEMORY_NAMES,
    )
