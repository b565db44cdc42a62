"""Images in prompt rows (verl's and ROLL's schema): the `images` column read into encoded image bytes, and the
pre-flight's image checks, each a one-line error naming the row.

A cell of `images` is a list whose items are bytes, a file path, or a `{bytes, path}` dict as `datasets`
stores an `Image` feature. Refused before anything starts: an image that does not open, a count of `<image>`
placeholders that differs from the images given, more images than `data.max_images_per_prompt`, a prompt whose
tokens with its image tokens exceed the length limit (image tokens are never cut), a model without an image
processor or that is not a vision-language model, a backend that does not run images yet.

Non-goal: turning images into tensors (`engines.rollout.vision_inputs`).
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

from rlstages.configs import RunConfig
from rlstages.engines.imports import import_object
from rlstages.engines.models.vision import IMAGE_PLACEHOLDER, VISION_MODEL_TYPES
from rlstages.engines.registry import ROLLOUT_BACKENDS, TRAINING_BACKENDS, rollout_backend, training_backend


def row_images(value: Any, where: str, key: str, base: Path | None = None) -> tuple[bytes, ...]:
    """The encoded images of one `images` cell (None: no images); a path is read relative to the working
    directory, else to the data file's directory `base`. A wrong item is a one-line ValueError."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        value = [value]
    out = []
    for i, item in enumerate(value):
        if isinstance(item, dict):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, bytes | bytearray):
            out.append(_image_bytes(bytes(item), f"{where}: column {key!r}: image {i} (bytes in the cell)"))
        elif isinstance(item, str) and item:
            cell = f"{where}: column {key!r}: image {i}"
            out.append(_image_bytes(_read_path(item, cell, base), f"{cell} ({item})"))
        else:
            raise ValueError(
                f"{where}: column {key!r}: image {i} is {type(item).__name__}; expected bytes, a file path or "
                "{bytes, path}"
            )
    return tuple(out)


def _image_bytes(data: bytes, where: str) -> bytes:
    """`data` when its header is one of an image format PIL reads (the whole image is verified by the pre-flight),
    else a one-line ValueError naming the cell or path."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)):
            return data
    except UnidentifiedImageError:
        raise ValueError(f"{where} does not open as an image (not in an image format PIL reads)") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ValueError(f"{where} does not open as an image ({type(exc).__name__}: {_plain(exc)})") from None


def _plain(exc: BaseException) -> str:
    """An exception's text without the in-memory file objects PIL names (`<_io.BytesIO object at 0x...>`)."""
    return re.sub(r"<_io\.BytesIO object at 0x[0-9a-f]+>", "its bytes", str(exc))


def _read_path(path: str, where: str, base: Path | None) -> bytes:
    if not os.path.isabs(path) and os.path.normpath(path).split(os.sep)[0] == "..":
        raise ValueError(
            f"{where}: {path} climbs out of the data directory (a relative path with '..'); give a path inside it, "
            "or an absolute one"
        )
    for candidate in (Path(path), *((base / path,) if base is not None else ())):
        if candidate.is_file():
            return candidate.read_bytes()
    raise ValueError(f"{where}: {path} does not exist (expected an image file)")


COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (235, 210, 40)}
# the image last, nearest the answer; the choices go in the run's system prompt (configs/vlm_colors.yaml): at the
# image vectors' start (zero) SmolLM2-135M then names a colour 2 times in 3, every colour among them (docs/vlm.md)
COLOUR_PROMPT = "Name the colour of this square: <image>"
COUNT_PROMPT = "<image>How many squares are in the picture? Answer with one number: 1, 2, 3 or 4."


def colour_task(task: str, count: int, size: int, seed: int, split: str) -> list[tuple[str, str, bytes, str]]:
    """`count` seeded synthetic image prompts (text, answer, PNG bytes, extra_info JSON): one square of a random
    colour, size, place and shade on grey (`colour`), or 1-4 squares of one colour in distinct cells (`count`)."""
    import json
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(f"{seed}:{split}:{task}")
    names = list(COLOURS)
    out = []
    for _ in range(count):
        name = rng.choice(names)
        shade = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in COLOURS[name])
        img = Image.new("RGB", (size, size), tuple([rng.randint(110, 150)] * 3))
        draw = ImageDraw.Draw(img)
        if task == "colour":
            side = rng.randint(size // 3, size * 3 // 4)
            x, y = rng.randint(0, size - side), rng.randint(0, size - side)
            draw.rectangle((x, y, x + side - 1, y + side - 1), fill=shade)
            answer, text, choices = name, COLOUR_PROMPT, names
        else:
            n = rng.randint(1, 4)
            cell = size // 2
            for k in rng.sample(range(4), n):
                side = rng.randint(cell // 2, cell - 4)
                x0, y0 = (
                    (k % 2) * cell + rng.randint(1, cell - side - 1),
                    (k // 2) * cell + rng.randint(1, cell - side - 1),
                )
                draw.rectangle((x0, y0, x0 + side - 1, y0 + side - 1), fill=shade)
            answer, text, choices = str(n), COUNT_PROMPT, ["1", "2", "3", "4"]
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append((text, answer, buf.getvalue(), json.dumps({"choices": choices})))
    return out


def placeholders(text: str, messages: tuple[dict[str, str], ...]) -> int:
    """`<image>` placeholders in a prompt (in every chat message when it has messages)."""
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages) if messages else text.count(IMAGE_PLACEHOLDER)


def check_image_rows(cfg: RunConfig, rows: list[Any]) -> None:
    """The pre-flight's image checks of the rows (`data.files.Row`) of both splits; a no-op without images."""
    image_rows = [r for r in rows if r.images or placeholders(r.text, r.messages)]
    if not image_rows:
        return
    _check_backends(cfg)
    for r in image_rows:
        where = r.where or "data"
        found = placeholders(r.text, r.messages)
        if found != len(r.images):
            raise ValueError(f"{where}: {found} {IMAGE_PLACEHOLDER} placeholder(s) but {len(r.images)} image(s)")
        if len(r.images) > cfg.data.max_images_per_prompt:
            raise ValueError(
                f"{where}: {len(r.images)} images > data.max_images_per_prompt={cfg.data.max_images_per_prompt}"
            )
        for i, data in enumerate(r.images):
            _check_opens(data, f"{where}: image {i}")
    processor = _model_processor(cfg)
    if processor is not None:
        from rlstages.engines.models import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.path)
        check = rollout_backend(cfg.rollout.backend).image_check  # what the backend's own image path needs
        if check is not None:
            import_object(check, "rollout.backend", expected="function")(cfg.model.path, tokenizer)
        _check_lengths(cfg, image_rows, processor, tokenizer)


def _check_backends(cfg: RunConfig) -> None:
    """The chosen backends run images (their registry entries' `images`), and nothing that is not built with
    images yet is asked for (context parallelism, multi-turn rollouts, a critic)."""
    if not rollout_backend(cfg.rollout.backend).images:
        able = ", ".join(name for name, entry in ROLLOUT_BACKENDS.items() if entry.images)
        raise ValueError(f"rollout.backend: {cfg.rollout.backend} does not run image prompts ({able} do; docs/vlm.md)")
    actor = cfg.actor
    if not training_backend(actor.backend).images:
        able = ", ".join(name for name, entry in TRAINING_BACKENDS.items() if entry.images)
        raise ValueError(f"actor.backend: {actor.backend} does not train on images yet ({able} do; docs/vlm.md)")
    if actor.cp_size > 1:
        raise ValueError(
            f"actor.context_parallel_size={actor.cp_size}: the {actor.backend} backend does not split an image "
            "batch's sequence over context-parallel ranks yet; use 1 (docs/vlm.md)"
        )
    if getattr(getattr(cfg.rollout, "multi_turn", None), "enabled", False):
        raise ValueError("rollout.multi_turn.enabled: multi-turn rollouts with images are not built yet (docs/vlm.md)")
    if cfg.critic is not None:
        raise ValueError("critic: a value model of a vision-language model is not built yet (docs/vlm.md)")


def _check_opens(data: bytes, where: str) -> None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
    except Exception as exc:  # noqa: BLE001 - PIL raises many kinds; all are "does not open"
        raise ValueError(f"{where} does not open as an image ({type(exc).__name__}: {_plain(exc)})") from None


def _model_processor(cfg: RunConfig) -> Any:
    """The model directory's image processor; None while a provider has not built the model yet. A model that
    is not a vision-language model, or has no image processor, is refused."""
    from rlstages.engines.rollout.vision_inputs import load_image_processor

    path = cfg.model.path
    config = path / "config.json"
    if not config.is_file() and cfg.model.provider == "local":
        raise ValueError(f"model.path: {path} has no config.json (expected a vision-language model directory)")
    kind = planned_model_type(cfg)
    if kind is None:
        return None  # a model of unknown type before it exists: its worker finds out
    if kind not in VISION_MODEL_TYPES:
        raise ValueError(
            f"model.path: {path} is a {kind} model, not a vision-language one ({', '.join(VISION_MODEL_TYPES)}), "
            "and the data has images"
        )
    if not config.is_file():
        return None  # a provider builds the vision-language model (and its image processor) on first use
    if not (path / "preprocessor_config.json").is_file():
        raise ValueError(f"model.path: {path} has no image processor (preprocessor_config.json), which images need")
    return load_image_processor(path, cfg.data.image_min_pixels, cfg.data.image_max_pixels)


def planned_model_type(cfg: RunConfig) -> str | None:
    """The model's `model_type`, known before it exists where a provider builds it (the tiny spec's, the
    provider's): config.json's, else the planned config's; None when not known before the start (a hub id)."""
    import json

    from rlstages.engines.models import planned_config

    config = cfg.model.path / "config.json"
    if config.is_file():
        try:
            kind = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):  # unreadable: the model checks say so
            return None
        return str(kind) if kind is not None else None
    if cfg.model.provider == "smollm2-vl":
        return "qwen2_vl"  # SmolLM2 as the text tower of a Qwen2-VL (engines/models/vision.py)
    tiny = cfg.model.tiny.model_dump() if cfg.model.tiny is not None else None
    try:
        planned = planned_config(cfg.model.path, cfg.model.provider, tiny)
    except Exception:  # noqa: BLE001 - a rehearsal that fails refuses nothing: the worker finds out
        return None
    return getattr(planned, "model_type", None) if planned is not None else None


def _check_lengths(cfg: RunConfig, rows: list[Any], processor: Any, tokenizer: Any) -> None:
    """Text tokens + image tokens of each image prompt within data.max_prompt_length and the model's context
    minus the response's budget (`rollout.response_budget`): image tokens are never truncated, so a longer prompt
    is refused."""
    from transformers import AutoConfig

    from rlstages.engines.rollout.batching import prompt_text
    from rlstages.engines.rollout.vision_inputs import expand_images, image_inputs, image_token_counts

    model = AutoConfig.from_pretrained(str(cfg.model.path), local_files_only=True)
    context = getattr(model.get_text_config(), "max_position_embeddings", None)
    limits = [n for n in (cfg.data.max_prompt_length, context and context - cfg.rollout.response_budget) if n]
    if not limits:
        return
    limit = min(limits)
    if cfg.data.chat_template:
        tokenizer.chat_template = cfg.data.chat_template
    merge = model.vision_config.spatial_merge_size
    for row in rows:
        counts = image_token_counts(image_inputs(processor, row.images)["image_grid_thw"], merge)
        text, special = prompt_text(tokenizer, row.prompt("len"), cfg.data.apply_chat_template, cfg.data.system_prompt)
        total = len(tokenizer(expand_images(text, counts), add_special_tokens=special)["input_ids"])
        if total > limit:
            raise ValueError(
                f"{row.where or 'data'}: prompt of {total} tokens ({sum(counts)} of them image tokens) > the limit "
                f"of {limit} (data.max_prompt_length, or the context minus {cfg.rollout.response_budget_key}); "
                "image tokens are never cut: shorten the text or lower data.image_max_pixels"
            )
