"""Vision-language models (Qwen2-VL, Qwen2.5-VL): their classes for the registry, their weight names, their
parts (vision tower, projector, language model) for freezing and per-group learning rates, and a tiny random
one (model, tokenizer with the vision tokens, image processor) built offline for tests.

transformers' own `Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration` are the models. A
checkpoint on disk names the vision tower `visual.*` and the text tower `model.layers.*`; in memory they are
`model.visual.*` and `model.language_model.*`: `module_name` maps the first onto the second.

`checkpoint_name` maps the second back onto the first (the names vLLM and SGLang load).

Non-goals: images to tensors (`rollout.vision_inputs`), Megatron (docs/vlm.md: left for later).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
COMPONENTS = ("vision_tower", "projector", "language_model")
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"  # in every Qwen2-VL tokenizer; vLLM's Qwen2-VL processor looks it up
IMAGE_PLACEHOLDER = "<image>"  # verl's and ROLL's placeholder in a prompt's text


def vision_model_class(model_type: str) -> type | None:
    """The transformers conditional-generation class of a vision-language `model_type` (None for other types)."""
    if model_type == "qwen2_vl":
        from transformers import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration
    if model_type == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration
    return None


def is_vision_model(model: Any) -> bool:
    """True for a model (or config) of a vision-language type this project runs."""
    config = getattr(model, "config", model)
    return getattr(config, "model_type", "") in VISION_MODEL_TYPES


_DISK_TO_MEMORY = (
    ("visual.", "model.visual."),
    ("model.layers.", "model.language_model.layers."),
    ("model.embed_tokens.", "model.language_model.embed_tokens."),
    ("model.norm.", "model.language_model.norm."),
)


def module_name(name: str) -> str:
    """The in-memory name of a checkpoint tensor (`visual.x` -> `model.visual.x`, `model.layers.x` ->
    `model.language_model.layers.x`); in-memory names and `lm_head.*` are returned as they are."""
    for disk, memory in _DISK_TO_MEMORY:
        if name.startswith(disk):
            return memory + name[len(disk) :]
    return name


def checkpoint_name(name: str) -> str:
    """The on-disk name of an in-memory one (`model.visual.x` -> `visual.x`, `model.language_model.layers.x` ->
    `model.layers.x`): what inference engines load at start-up (vLLM, SGLang); others are returned as they are."""
    for disk, memory in _DISK_TO_MEMORY:
        if name.startswith(memory):
            return disk + name[len(memory) :]
    return name


def component(name: str) -> str:
    """The part a parameter (in-memory or on-disk name) belongs to: vision_tower, projector or language_model."""
    name = module_name(name)
    if name.startswith("model.visual.merger."):
        return "projector"
    if name.startswith("model.visual."):
        return "vision_tower"
    return "language_model"


def param_groups(
    model: Any, params: list[torch.nn.Parameter], freeze: Sequence[str], group_lr: Mapping[str, float], lr: float
) -> list[dict[str, Any]]:
    """Optimizer groups of `params` by part: the frozen parts' parameters stop requiring grad and are left out;
    each remaining part gets its own learning rate (`group_lr`, else `lr`). A text model is all language_model."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups: dict[str, list[torch.nn.Parameter]] = {}
    for p in params:
        part = component(names.get(id(p), ""))
        if part in freeze:
            p.requires_grad_(False)
        else:
            groups.setdefault(part, []).append(p)
    return [{"params": ps, "lr": group_lr.get(part, lr), "name": part} for part, ps in groups.items()]


def vision_token_ids(config: Any) -> list[int]:
    """The ids of the vision tokens (start, end, image and video pads): never sampled in a response (no image
    stands behind them there), so the rollout and the trainer both take them out of the distribution."""
    keys = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return sorted({int(v) for k in keys if isinstance(v := getattr(config, k, None), int)})


def suppress(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """`logits` with the `ids` columns at -1e9 (probability 0, entropy terms stay finite), out of place."""
    if not ids:
        return logits
    return logits.index_fill(-1, torch.tensor(ids, device=logits.device), -1e9)


def unwrap(model: Any) -> Any:
    """The transformers model inside a training wrapper (DeepSpeed's engine, a PEFT model), else `model`."""
    inner = getattr(model, "module", None)  # DeepSpeedEngine (its own `config` is the DeepSpeed JSON)
    model = inner if isinstance(inner, torch.nn.Module) else model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def has_images(batch: Any) -> bool:
    """True when some row of a batch carries pixel values."""
    from rlstages.engines import types as T

    return any("pixel_values" in mm for mm in T.get_multi_modal(batch))


def zero_image_output(visual: Any) -> torch.Tensor:
    """0 x the vision tower's and projector's output on a tiny blank image (one merged patch): a scalar zero whose
    graph holds every vision parameter."""
    cfg = visual.config
    merge = cfg.spatial_merge_size
    param = next(visual.parameters())
    pixels = torch.zeros(
        merge * merge, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2, dtype=param.dtype,
        device=param.device,
    )  # fmt: skip
    grid = torch.tensor([[1, merge, merge]], device=param.device)
    out = visual(pixels, grid_thw=grid)
    return getattr(out, "pooler_output", out).sum() * 0.0


@contextlib.contextmanager
def dummy_vision_pass(model: Any, needed: bool = True) -> Iterator[None]:
    """While alive, a forward of a vision-language model (`needed`: its batch has no image) runs
    `zero_image_output` right after the token embedding, where an image batch runs its vision tower, and adds it
    to the embeddings: the loss is unchanged and the vision parameters get zero gradients, so every rank gathers
    (ZeRO-3) and reduces (ZeRO / FSDP) the same parameters in the same order, whatever its images; a rank with a
    text-only micro-batch would otherwise skip the vision tower's collectives and the ranks hang. A no-op for
    text models."""
    inner = getattr(unwrap(model), "model", None)
    visual = getattr(inner, "visual", None)
    if not needed or visual is None or inner is None:
        yield
        return

    def add(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output + zero_image_output(visual).to(output.dtype)

    handle = inner.get_input_embeddings().register_forward_hook(add)
    try:
        yield
    finally:
        handle.remove()


def forward_kwargs(batch: Any, device: torch.device) -> dict[str, Any]:
    """The image inputs of a training micro-batch for the model's forward: pixel values and grids concatenated in
    row order, and the M-RoPE position ids [3, B, L] (the batch's [B, 3, L]); {} for a batch without images."""
    from rlstages.engines import types as T

    if T.ROPE_POSITION_IDS not in batch.keys():
        return {}
    out: dict[str, Any] = {"position_ids": batch[T.ROPE_POSITION_IDS].permute(1, 0, 2).to(device)}
    out.update(concat_images(T.get_multi_modal(batch), device))
    return out


def concat_images(inputs: Sequence[Mapping[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """Rows' pixel values and grids concatenated in row order (the order the model fills image tokens in); {}
    when no row has an image."""
    rows = [mm for mm in inputs if "pixel_values" in mm]
    if not rows:
        return {}
    return {k: torch.cat([mm[k] for mm in rows]).to(device) for k in ("pixel_values", "image_grid_thw")}


def build_tiny_vlm(
    out: Path,
    model_type: str = "qwen2_vl",
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    vision_width: int = 32,
    **_: Any,
) -> Path:
    """A random-init Qwen2-VL / Qwen2.5-VL (text tower as given, a one-block vision tower of width `vision_width`
    with patch 14 and merge 2), the character tokenizer plus the four vision tokens (video's too), and its image
    processor (images resized into 56x56..112x112 pixels: 4 to 16 image tokens each), built offline into `out`."""
    from transformers import AutoConfig

    from rlstages.engines.models.tiny_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(vocab_size - 4)
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD]})
    start, pad, end, video = tok.convert_tokens_to_ids([VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD])
    head_dim = hidden_size // num_attention_heads
    half = head_dim // 2
    hw = half * 3 // 8  # M-RoPE sections (temporal, height, width) in Qwen2-VL's proportions 16:24:24
    text = {
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers, "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads, "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * hw, hw, hw]},
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        "tie_word_embeddings": tie_word_embeddings,
    }  # fmt: skip
    vision: dict[str, Any] = {"depth": 1, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2}
    vision.update(temporal_patch_size=2, in_channels=3)
    if model_type == "qwen2_vl":
        vision.update(embed_dim=vision_width, hidden_size=hidden_size, mlp_ratio=2)
    else:
        vision.update(hidden_size=vision_width, out_hidden_size=hidden_size, intermediate_size=2 * vision_width)
        vision.update(fullatt_block_indexes=[0])
        vision.update(window_size=56)
    cfg = AutoConfig.for_model(
        model_type, text_config=text, vision_config=vision, vision_start_token_id=start, image_token_id=pad,
        vision_end_token_id=end, video_token_id=video, tie_word_embeddings=tie_word_embeddings,
    )  # fmt: skip
    save_vlm(out, _random_model(cfg, seed), tok, 56 * 56, 112 * 112)
    return out


def _random_model(cfg: Any, seed: int) -> Any:
    model_cls = vision_model_class(cfg.model_type)
    assert model_cls is not None
    torch.manual_seed(seed)
    return model_cls(cfg).to(torch.float32)


def save_vlm(out: Path, model: Any, tokenizer: Any, min_pixels: int, max_pixels: int) -> None:
    """Save a vision-language model with its tokenizer and image processor (`preprocessor_config.json`)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    vision = model.config.vision_config
    processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size, temporal_patch_size=vision.temporal_patch_size,
    )  # fmt: skip
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    processor.save_pretrained(str(out))


def build_smollm2_vl(out: Path, text_dir: Path, seed: int = 0) -> Path:
    """`smollm2_vl` saved into `out` with its tokenizer and image processor (56x56..112x112 pixels)."""
    model, tok = smollm2_vl(text_dir, seed)
    save_vlm(out, model, tok, 56 * 56, 112 * 112)
    return out


def smollm2_vl(text_dir: Path, seed: int = 0) -> tuple[Any, Any]:
    """The demo's vision-language model and tokenizer: SmolLM2-135M-Instruct (the HF directory `text_dir`) as the
    text tower of a Qwen2-VL (zero q/k/v biases, tied embeddings, M-RoPE sections 8/12/12 of its 64-dim heads:
    on text the same logits as SmolLM2), the four vision tokens added (zero embeddings; the video pad only because
    vLLM's Qwen2-VL processor looks it up), and a small vision tower (2 blocks of width 128, patch 14, merge 2) and
    projector initialised at random (the projector's output layer: weight zero, bias the mean token embedding), to
    be trained by RL."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    text = AutoModelForCausalLM.from_pretrained(str(text_dir), dtype=torch.float32, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(text_dir), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD]})
    vocab = tok.get_vocab()
    start, pad, end, video = (vocab[t] for t in (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD))
    src = text.config
    head_dim = src.hidden_size // src.num_attention_heads
    half = head_dim // 2
    hw = half * 3 // 8
    theta = (getattr(src, "rope_parameters", None) or {}).get("rope_theta", getattr(src, "rope_theta", 10000.0))
    text_config = {
        "vocab_size": len(tok), "hidden_size": src.hidden_size, "intermediate_size": src.intermediate_size,
        "num_hidden_layers": src.num_hidden_layers, "num_attention_heads": src.num_attention_heads,
        "num_key_value_heads": src.num_key_value_heads, "max_position_embeddings": src.max_position_embeddings,
        "rms_norm_eps": src.rms_norm_eps, "hidden_act": src.hidden_act, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta, "mrope_section": [half - 2 * hw, hw, hw]},
        "bos_token_id": src.bos_token_id, "eos_token_id": src.eos_token_id, "pad_token_id": tok.pad_token_id,
    }  # fmt: skip
    vision = {"depth": 2, "embed_dim": 128, "hidden_size": src.hidden_size, "num_heads": 4, "mlp_ratio": 2}
    vision.update(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    cfg = AutoConfig.for_model(
        "qwen2_vl", text_config=text_config, vision_config=vision, vision_start_token_id=start, image_token_id=pad,
        vision_end_token_id=end, video_token_id=video, tie_word_embeddings=True,
    )  # fmt: skip
    model = _random_model(cfg, seed)
    weights = {module_name(k): v for k, v in text.state_dict().items() if k != "lm_head.weight"}
    embed = weights.pop("model.language_model.embed_tokens.weight")
    with torch.no_grad():
        table = model.get_input_embeddings().weight
        table.zero_()
        table[: embed.shape[0]] = embed  # the vision tokens' rows stay zero
        for name, p in model.named_parameters():
            if name.startswith("model.language_model.") and name.endswith(
                ("q_proj.bias", "k_proj.bias", "v_proj.bias")
            ):
                p.zero_()
        # The projector's output starts as one typical vector for every image: weight zero, bias SmolLM2's mean
        # token embedding. Not random vectors far from its embeddings (SmolLM2 babbled), and not zero: the first
        # RMSNorm divides by the vector's own size, so near zero only its direction counts and the gradient grows
        # as 1/size (a step of norm 0.03 flipped the answers; docs/vlm.md, the demo).
        last = model.model.visual.merger.mlp[-1]
        last.weight.zero_()
        last.bias.copy_(embed.mean(0))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    left = [
        k
        for k in missing
        if k.startswith("model.language_model.") and not k.endswith(("_proj.bias", "embed_tokens.weight"))
    ]
    if unexpected or left:
        raise RuntimeError(f"SmolLM2 -> Qwen2-VL: unexpected {unexpected[:3]}, missing {left[:3]}")
    model.generation_config.bos_token_id = src.bos_token_id
    return model, tok
