"""Qwen2-VL / Qwen2.5-VL on Megatron-Core: a `GPTModel` subclass holding the vision tower (the model-support guide's
custom-component recipe; the `qwen2_vl` / `qwen2_5_vl` templates name it as their `mcore_model_cls`).

The vision tower and its merger (projector) are transformers' own modules (`Qwen2VisionTransformerPretrainedModel`,
`Qwen2_5_VisionTransformerPretrainedModel`) built from the HF config's `vision_config`, so their math is HF's. Only
the first pipeline stage (`pre_process`) builds one, whole on every TP rank (the templates' placement rule): each TP
rank runs it on the same pixels and gets the same image embeddings. They replace the decoder input's rows at the
image-token positions, in row order (pixel values and grids are the micro-batch's rows' concatenated, the order
transformers fills image tokens in); later stages receive hidden states as usual. Under sequence parallelism the
decoder input is this TP rank's slice of the sequence: only the image tokens inside it are filled, and the vision
tower's parameters are tagged `sequence_parallel` so megatron-core's `finalize_model_grads` sums their gradients
(each rank's part) over the TP group. M-RoPE is megatron-core's own (`position_embedding_type: mrope`,
`mrope_section`): `position_ids` are the [3, B, S] positions the batch carries. Context parallelism (Transformer
Engine only) is refused. megatron-core is imported when the class is first used (`QwenVLModel` is built lazily on
attribute access).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlstages.engines.convert.spec import ConversionSpec
from rlstages.engines.convert.vlm_templates import VISION_PREFIX

NO_CONTEXT_PARALLEL = (
    "megatron backend with a vision-language model: context_parallel_size > 1 is not supported (the image tokens of "
    "a context-parallel rank's two sequence chunks are not filled); use 1"
)


def vision_tower(hf_config: Mapping[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """The vision tower (transformers' own, with its merger) of a Qwen2-VL / Qwen2.5-VL HF config dict, random."""
    from transformers import AutoConfig

    model_type = str(hf_config["model_type"])
    config = AutoConfig.for_model(model_type, **{k: v for k, v in hf_config.items() if k != "model_type"})
    tower: Any
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as tower
    elif model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as tower
    else:
        raise ValueError(f"vision tower: model_type {model_type!r} is not qwen2_vl or qwen2_5_vl")
    return tower._from_config(config.vision_config, dtype=dtype)


def fill_image_tokens(
    embeddings: torch.Tensor,
    input_ids: torch.Tensor,
    image_embeds: torch.Tensor,
    image_token_id: int,
    start: int = 0,
) -> torch.Tensor:
    """The decoder input `embeddings` [s, B, H] (sequence positions start..start+s of `input_ids` [B, S]: this rank's
    slice under sequence parallelism) with its image-token rows replaced by their rows of `image_embeds` [N, H], the
    embeddings of all N image tokens of the micro-batch in row order (row 0's first, as transformers'
    `masked_scatter` on [B, S, H]); out of place."""
    mask = input_ids == image_token_id  # [B, S]
    found = int(mask.sum())
    if found != image_embeds.shape[0]:
        raise ValueError(
            f"image tokens and image features do not match: {found} image tokens in the micro-batch, "
            f"{image_embeds.shape[0]} image embeddings from its pixel values"
        )
    index = mask.flatten().cumsum(0).view_as(mask) - 1  # each image token's row in image_embeds
    end = start + embeddings.shape[0]
    local = mask[:, start:end]
    rows = embeddings.transpose(0, 1)  # [B, s, H]
    picked = image_embeds[index[:, start:end][local]].to(rows.dtype)
    rows = rows.masked_scatter(local[..., None].to(rows.device), picked)
    return rows.transpose(0, 1).contiguous()


def component(name: str) -> str:
    """The part a Megatron parameter belongs to (`vision.component`'s on Megatron names): `vision_model.merger.*` is
    the projector, the rest of `vision_model.*` the vision tower, everything else the language model."""
    name = name.removeprefix("module.")
    if name.startswith(VISION_PREFIX + "merger."):
        return "projector"
    return "vision_tower" if name.startswith(VISION_PREFIX) else "language_model"


def split_parts(chunks: list[Any], freeze: Sequence[str]) -> None:
    """Before megatron's DDP and optimizer are built: tag every parameter with its part (`optim.PART_ATTR`, which
    `optim.build_optimizer` groups by for per-part learning rates) and stop the gradient of the parts in `freeze`
    (DDP and the optimizer then leave them out)."""
    from rlstages.engines.megatron.optim import PART_ATTR

    for chunk in chunks:
        for name, param in chunk.named_parameters():
            part = component(name)
            setattr(param, PART_ATTR.format(part), True)
            if part in freeze:
                param.requires_grad_(False)


@functools.cache
def _model_class() -> type:
    from megatron.core.models.gpt import GPTModel

    class QwenVLModel(GPTModel):
        """GPTModel plus, on the first pipeline stage, the vision tower whose image embeddings fill the image
        tokens' rows of the decoder input; M-RoPE positions [3, B, S]."""

        def __init__(self, *args: Any, hf_config: Mapping[str, Any], **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.config.context_parallel_size > 1:
                raise NotImplementedError(NO_CONTEXT_PARALLEL)
            self.image_token_id = int(hf_config["image_token_id"])
            if self.pre_process:
                self.vision_model = vision_tower(hf_config, self.config.params_dtype)
                for param in self.vision_model.parameters():  # each TP rank's gradient is its slice's part: summed
                    param.sequence_parallel = self.config.sequence_parallel  # type: ignore[attr-defined]

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
            if self.pre_process and decoder_input is None and pixel_values is not None and image_grid_thw is not None:
                embeddings = self.embedding(input_ids=input_ids, position_ids=None)  # this rank's slice under SP
                start = self.pg_collection.tp.rank() * embeddings.shape[0] if self.config.sequence_parallel else 0
                image = self.image_embeddings(pixel_values, image_grid_thw)
                decoder_input = fill_image_tokens(embeddings, input_ids, image, self.image_token_id, start)
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)

    QwenVLModel.__module__ = __name__
    QwenVLModel.__qualname__ = "QwenVLModel"
    return QwenVLModel


def __getattr__(name: str) -> Any:
    if name == "QwenVLModel":  # the templates' "rlstages.engines.megatron.vlm_model:QwenVLModel"
        return _model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
