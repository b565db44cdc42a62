"""Image prompts to model inputs: each `<image>` placeholder of a prompt's text becomes the model's vision tokens
(`<|vision_start|>`, one `<|image_pad|>` per merged patch, `<|vision_end|>`), its image goes through the model
directory's image processor (min/max pixels from `data.image_min_pixels` / `image_max_pixels`), and the
prompt's M-RoPE positions come from the model's own `get_rope_index`, once per prompt.

The result per prompt is unpadded: its token ids, its `pixel_values` / `image_grid_thw`, and its positions
[3, P]; `rope_rows` lays them out for the batch ([B, 3, P+T]: the response continues every channel by one).

Other engines: vLLM and SGLang run the model in their own processes, so `rope_model` gives them the model's class
on the meta device (its config and `get_rope_index`, no weights) for the same `encode_image_prompts`;
`collapse_image_pads` turns the expanded ids into vLLM's prompt form (one `<|image_pad|>` per image, which its
processor expands again); `add_image_fields` puts the per-row image inputs and positions into any rollout batch.

Why not `AutoProcessor`: transformers 5's Qwen2-VL processor needs a video processor, which needs torchvision
(not installed here); the image processor and the tokenizer are its two halves, the expansion rule is its own.

Non-goal: videos.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlstages.engines.models.vision import IMAGE_PAD, IMAGE_PLACEHOLDER, VISION_END, VISION_START
from rlstages.engines.rollout.batching import prompt_text
from rlstages.engines.rollout.decode import output_cache
from rlstages.engines.types import Prompt


@dataclass
class ImagePrompt:
    """One prompt ready for the model: token ids with the image tokens expanded, its image inputs, positions."""

    ids: list[int]
    inputs: dict[str, torch.Tensor]  # pixel_values [patches, C*t*p*p], image_grid_thw [images, 3]
    positions: torch.Tensor  # [3, P] M-RoPE positions


def load_image_processor(path: str | Path, min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """The image processor saved beside a model (`preprocessor_config.json`), with the configured pixel bounds."""
    from transformers import AutoImageProcessor

    kwargs: dict[str, Any] = {
        k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None
    }
    return AutoImageProcessor.from_pretrained(str(path), local_files_only=True, **kwargs)


def open_image(data: bytes) -> Any:
    """An encoded image file (PNG, JPEG, ...) as an RGB PIL image."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def image_inputs(processor: Any, images: Sequence[Any]) -> dict[str, torch.Tensor]:
    """`pixel_values` and `image_grid_thw` of a prompt's images, encoded files or PIL images already opened
    ({} for none)."""
    if not images:
        return {}
    out = processor(images=[open_image(b) if isinstance(b, bytes) else b for b in images], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}


def image_token_counts(grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """Vision tokens each image takes in the text: its patches / merge_size²."""
    return [int(g.prod()) // merge_size**2 for g in grid_thw]


def expand_images(text: str, counts: Sequence[int]) -> str:
    """Each `<image>` placeholder replaced by its image's vision tokens (the caller checked the counts agree)."""
    parts = text.split(IMAGE_PLACEHOLDER)
    out = [parts[0]]
    for n, rest in zip(counts, parts[1:], strict=True):
        out.append(VISION_START + IMAGE_PAD * n + VISION_END + rest)
    return "".join(out)


def encode_image_prompts(
    model: Any,
    tokenizer: Any,
    processor: Any,
    prompts: Sequence[Prompt],
    apply_chat_template: bool,
    system_prompt: str | None,
    opened: Sequence[Sequence[Any]] | None = None,
) -> list[ImagePrompt]:
    """Each prompt's expanded token ids, image inputs and M-RoPE positions (the model's `get_rope_index`);
    `opened`: each prompt's images as PIL images where the caller opened them already (vLLM sends them too)."""
    config = model.config
    merge = config.vision_config.spatial_merge_size
    image_id = config.image_token_id
    out = []
    for i, p in enumerate(prompts):
        inputs = image_inputs(processor, p.images if opened is None else opened[i])
        text, special = prompt_text(tokenizer, p, apply_chat_template, system_prompt)
        counts = image_token_counts(inputs["image_grid_thw"], merge) if inputs else []
        ids = list(tokenizer(expand_images(text, counts), add_special_tokens=special)["input_ids"])
        out.append(ImagePrompt(ids, inputs, rope_positions(model, ids, inputs, image_id)))
    return out


def rope_positions(model: Any, ids: list[int], inputs: dict[str, torch.Tensor], image_id: int) -> torch.Tensor:
    """M-RoPE positions [3, P] of one unpadded prompt (plain 0..P-1 on every channel without images)."""
    tokens = torch.tensor([ids])
    if not inputs:
        return torch.arange(len(ids)).expand(3, -1).clone()
    inner = model.model if hasattr(model.model, "get_rope_index") else model
    positions, _ = inner.get_rope_index(
        tokens, mm_token_type_ids=(tokens == image_id).int(), image_grid_thw=inputs["image_grid_thw"]
    )
    return positions[:, 0].cpu()


def rope_model(path: str | Path) -> Any:
    """A vision-language model's class built from its directory's config on the meta device: what
    `encode_image_prompts` reads (the config and `get_rope_index`) without weights, for engines that run the
    model in another process (vLLM, SGLang)."""
    from transformers import AutoConfig

    from rlstages.engines.models.vision import vision_model_class

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    model_cls = vision_model_class(config.model_type)
    if model_cls is None:
        raise ValueError(f"{path}: a {config.model_type} model is not a vision-language model")
    with torch.device("meta"):
        return model_cls(config)


def collapse_image_pads(ids: Sequence[int], image_id: int) -> list[int]:
    """Each image's run of `<|image_pad|>` tokens as one: the prompt form vLLM's Qwen2-VL processor takes (it
    replaces every image pad of a token prompt by that image's pads, so an expanded prompt would grow again).
    Two images never touch: `<|vision_end|><|vision_start|>` stand between their runs."""
    return [t for i, t in enumerate(ids) if t != image_id or i == 0 or ids[i - 1] != image_id]


def add_image_fields(batch: Any, rows: Sequence[ImagePrompt]) -> None:
    """A rollout batch's image side, one entry per row: the unpadded image inputs (`multi_modal_inputs`) and the
    M-RoPE positions [B, 3, P+T] (`rope_position_ids`), as the trainer reads them."""
    from rlstages.engines import types as T

    width = batch[T.PROMPT_IDS].shape[1]
    T.set_multi_modal(batch, [p.inputs for p in rows])
    batch[T.ROPE_POSITION_IDS] = rope_rows([p.positions for p in rows], width, batch[T.RESPONSE_IDS].shape[1])


def rope_rows(positions: Sequence[torch.Tensor], prompt_width: int, response_width: int) -> torch.Tensor:
    """M-RoPE positions [B, 3, P+T] of a rollout batch: each prompt's left-padded (zeros on padding) to
    `prompt_width`, the response continuing from its largest position + 1 on all three channels."""
    out = torch.zeros(len(positions), 3, prompt_width + response_width, dtype=torch.long)
    steps = torch.arange(1, response_width + 1)
    for i, pos in enumerate(positions):
        out[i, :, prompt_width - pos.shape[1] : prompt_width] = pos
        out[i, :, prompt_width:] = int(pos.max()) + steps if pos.numel() else steps - 1
    return out


def image_digest(inputs: dict[str, torch.Tensor]) -> bytes:
    """A digest of a prompt's image tensors: with its tokens, what makes two prompts the same (two prompts of the
    same text may hold different images)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(inputs):
        t = inputs[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def distinct_prompts(keys: Sequence[Any]) -> tuple[list[int], torch.Tensor]:
    """The first row of each distinct key, and each row's index among them (its prompt)."""
    index: dict[Any, int] = {}
    first: list[int] = []
    inverse = []
    for row, key in enumerate(keys):
        if key not in index:
            index[key] = len(first)
            first.append(row)
        inverse.append(index[key])
    return first, torch.tensor(inverse, dtype=torch.long)


@dataclass
class ImageBatch:
    """The image side of a left-padded batch for `decode.decode`: the M-RoPE positions [3, B, P] of every row, and
    the pixel values and grids of each distinct prompt (its tokens and images: a group's n samples are one)
    concatenated in order (the model fills the image tokens in that order); `first` is each distinct prompt's
    first row, `inverse` each row's distinct prompt."""

    inputs: dict[str, torch.Tensor]
    positions: torch.Tensor
    first: torch.Tensor
    inverse: torch.Tensor

    @classmethod
    def of(cls, prompts: Sequence[ImagePrompt], width: int, device: torch.device, share: bool = True) -> ImageBatch:
        """The batch of these prompts, left-padded to `width` tokens; `share`: rows of the same prompt and images
        are prefilled once (else every row)."""
        rows = rope_rows([p.positions for p in prompts], width, 0).permute(1, 0, 2)
        digests: dict[int, bytes] = {}  # a group's rows hold one ImagePrompt: hashed once
        keys = (
            [(tuple(p.ids), digests.setdefault(id(p), image_digest(p.inputs))) for p in prompts]
            if share
            else list(range(len(prompts)))
        )
        first, inverse = distinct_prompts(keys)
        with_images = [prompts[r].inputs for r in first if prompts[r].inputs]
        inputs = {k: torch.cat([x[k] for x in with_images]).to(device) for k in (with_images[0] if with_images else {})}
        return cls(inputs, rows.to(device), torch.tensor(first, device=device), inverse.to(device))

    def prefill(self, model: Any, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[Any, Any, Any]:
        """KV cache, next-token logits [B, V] and mask: each distinct prompt once, whole (its images at their
        tokens), then each row takes its prompt's cache and logits."""
        first = self.first
        step = model(
            input_ids=input_ids[first], attention_mask=mask[first], position_ids=self.positions[:, first],
            use_cache=True, logits_to_keep=1, **self.inputs,
        )  # fmt: skip
        cache, logits = output_cache(step), step.logits[:, -1]
        if len(first) < input_ids.shape[0]:
            cache.batch_select_indices(self.inverse)
            logits = logits[self.inverse]
        return cache, logits, mask

    def next_positions(self) -> torch.Tensor:
        """Each row's next M-RoPE position (its largest + 1: text after the prompt moves all channels alike)."""
        return self.positions.amax(dim=(0, 2)) + 1
