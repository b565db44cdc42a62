"""vLLM's side of an image prompt: the engine arguments of a vision-language model and each prompt's
`TokensPrompt` (one image pad per image, which vLLM's Qwen2-VL processor expands again; the images as PIL)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlstages.engines.models.vision import VIDEO_PAD
from rlstages.engines.rollout.vision_inputs import collapse_image_pads, open_image
from rlstages.engines.types import Prompt


def check_model_tokens(path: Path, tokenizer: Any) -> None:
    """The model's tokenizer has the video pad token, which vLLM's Qwen2-VL processor looks up even with no video
    (a model without it fails in the engine's start-up): refused by the pre-flight (the registry entry's
    `image_check`), naming the token."""
    if VIDEO_PAD not in tokenizer.get_vocab():
        raise ValueError(
            f"model.path: {path}'s tokenizer has no {VIDEO_PAD} token, which vLLM's Qwen2-VL processor needs "
            "(rollout.backend: vllm); use rollout.backend: hf, or a tokenizer with it (a smollm2-vl model built "
            "before 2026-11-27: delete its directory and it is built again with it)"
        )


def image_engine_kwargs(max_images: int, pixels: tuple[int | None, int | None]) -> dict[str, Any]:
    """`vllm.LLM` arguments of a vision-language model: at most `max_images` images and no video per prompt, and
    the image processor's pixel bounds (`data.image_min_pixels` / `image_max_pixels`) when set."""
    out: dict[str, Any] = {"limit_mm_per_prompt": {"image": max_images, "video": 0}}
    bounds = {k: v for k, v in zip(("min_pixels", "max_pixels"), pixels, strict=True) if v is not None}
    if bounds:
        out["mm_processor_kwargs"] = bounds
    return out


def open_prompt_images(prompts: Sequence[Prompt]) -> list[list[Any]]:
    """Each prompt's images as RGB PIL images, opened once for both the image processor and vLLM."""
    return [[open_image(b) for b in p.images] for p in prompts]


def image_request(prompt: Prompt, ids: list[int], image_id: int, images: list[Any]) -> dict[str, Any]:
    """One prompt as a vLLM `TokensPrompt` (a typed dict): its ids with one image pad per image (vLLM expands each
    to the image's pads again) and its `images` (`open_prompt_images`); a prompt without images is its ids alone."""
    if not prompt.images:
        return {"prompt_token_ids": ids}
    return {"prompt_token_ids": collapse_image_pads(ids, image_id), "multi_modal_data": {"image": images}}
