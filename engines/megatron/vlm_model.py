"""Qwen2-VL / Qwen2.5-VL on Megatron-Core: a `GPTModel` subclass holding the vision tower (the model-support guide's
custom-component recipe; the `qwen2_vl` / `qwen2_5_vl` templates name it as their `mcore_model_cls`).

The vision tower and its merger (projector) are transformers' own modules (`Qwen2VisionTransformerPretrainedModel`,
`Qwen2_5_VisionTransformerPretrainedModel`) built from the HF config's `vision_config`, so their math is HF's. Only
the first pipeline stage (`pre_process`) builds one, whole on every TP rank (the templates' placement rule): each TP
rank runs it on the same pixels and gets the same image embeddings. They replace the decoder input's rows at the
image-token positions, in row order (pixel values and grids are the micro-batch's rows' concatenated, the order
transformers fills image tokens in); later stages receive hidden states as usual. M-RoPE is megatron-core's own
(`position_embedding_type: mrope`, `mrope_section`): `position_ids` are the [3, B, S] positions the batch carries.
Sequence and context parallelism are not handled (the decoder input would be this rank's slice of the sequence):
refused here and in the pre-flight. megatron-core is imported when the class is first used (`QwenVLModel` is built
lazily on attribute access).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from rlstages.engines.convert.spec import ConversionSpec

NO_SEQUENCE_SPLIT = (
    "megatron backend with a vision-language model: sequence_parallel and context_parallel_size > 1 are not "
    "supported (image embeddings are written into the full sequence of each rank); turn them off"
)


def vision_tower(hf_config: Mapping[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """The vision tower (transformers' own, with its merger) of a Qwen2-VL / Qwen2.5-VL HF config dict, random."""
    from transformers import AutoConfig

    model_type = str(hf_config["model_type"])
    config = AutoConfig.for_model(model_type, **{k: v for k, v in hf_config.items() if k != "model_type"})
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Tower
    elif model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as Tower
    else:
        raise ValueError(f"vision tower: model_type {model_type!r} is not qwen2_vl or qwen2_5_vl")
    return Tower._from_config(config.vision_config, dtype=dtype)


def fill_image_tokens(
    embeddings: torch.Tensor, input_ids: torch.Tensor, image_embeds: torch.Tensor, image_token_id: int
) -> torch.Tensor:
    """The decoder input [S, B, H] with its image-token positions replaced by `image_embeds` [N, H], filled in row
    order (row 0's image tokens first, as transformers' `masked_scatter` on [B, S, H]); out of place."""
    mask = input_ids == image_token_id  # [B, S]
    found = int(mask.sum())
    if found != image_embeds.shape[0]:
        raise ValueError(
            f"image tokens and image features do not match: {found} image tokens in the micro-batch, "
            f"{image_embeds.shape[0]} image embeddings from its pixel values"
        )
    rows = embeddings.transpose(0, 1)  # [B, S, H]
    rows = rows.masked_scatter(mask[..., None].to(rows.device), image_embeds.to(rows.dtype))
    return rows.transpose(0, 1).contiguous()


@functools.cache
def _model_class() -> type:
    from megatron.core.models.gpt import GPTModel

    class QwenVLModel(GPTModel):
        """GPTModel plus, on the first pipeline stage, the vision tower whose image embeddings fill the image
        tokens' rows of the decoder input; M-RoPE positions [3, B, S]."""

        def __init__(self, *args: Any, hf_config: Mapping[str, Any], **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.config.sequence_parallel or self.config.context_parallel_size > 1:
                raise NotImplementedError(NO_SEQUENCE_SPLIT)
            self.image_token_id = int(hf_config["image_token_id"])
            if self.pre_process:
                self.vision_model = vision_tower(hf_config, self.config.params_dtype)

        @classmethod
        def spec_kwargs(cls, spec: ConversionSpec) -> dict[str, Any]:
            """What `gpt.build_gpt_model` passes besides GPTModel's own arguments: the HF config."""
            return {"hf_config": spec.hf_config}

        def image_embeddings(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
            """The merged image embeddings [N, H] of the concatenated pixel values (transformers' vision tower)."""
            dtype = next(self.vision_model.parameters()).dtype
            return self.vision_model(pixel_values.to(dtype), grid_thw=image_grid_thw).pooler_output

        def forward(  # type: ignore[override]
            self,
            input_ids: torch.Tensor,
            position_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            decoder_input: torch.Tensor | None = None,
            *args: Any,
            pixel_values: torch.Tensor | None = None,
            image_grid_thw: torch.Tensor | None = None,
            **kwargs: Any,
        ) -> torch.Tensor:
            """GPTModel's forward; on the first stage the image embeddings go into the decoder input first.
            `position_ids` are M-RoPE's [3, B, S] (a [B, S] text position is expanded to the three channels)."""
            if position_ids.dim() == 2:
                position_ids = position_ids[None].expand(3, *position_ids.shape)
            if self.pre_process and decoder_input is None and pixel_values is not None:
                embeddings = self.embedding(input_ids=input_ids, position_ids=None)
                image = self.image_embeddings(pixel_values, image_grid_thw)
                decoder_input = fill_image_tokens(embeddings, input_ids, image, self.image_token_id)
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)

    QwenVLModel.__module__ = __name__
    QwenVLModel.__qualname__ = "QwenVLModel"
    return QwenVLModel


def __getattr__(name: str) -> Any:
    if name == "QwenVLModel":  # the templates' "rlstages.engines.megatron.vlm_model:QwenVLModel"
        return _model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
