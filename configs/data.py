"""Prompt sources: the synthetic addition task of the demo, JSONL files of prompt/answer rows, or any
Hugging Face `datasets` source (parquet / JSON / arrow files, a saved dataset dir, a cached hub dataset),
with verl's RL parquet schema as the default column layout."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from rlstages.configs.base import StrictModel


class AdditionTaskConfig(StrictModel):
    """Seeded synthetic prompts "What is a + b? Reply with only the number." with a, b in [1, max_operand].

    `terms` > 2 makes a multi-step sum ("What is a + b + c?"); `min_operand` lifts the operands (two-digit
    addition is `min_operand: 10, max_operand: 99`)."""

    kind: Literal["addition"] = "addition"
    max_operand: int = Field(default=20, ge=1)
    min_operand: int = Field(default=1, ge=0)
    terms: int = Field(default=2, ge=2, le=8)
    num_train: int = Field(default=4000, ge=1)
    num_eval: int = Field(default=64, ge=1)
    seed: int = 0
    template: str = Field(
        default="What is {a} + {b}? Reply with only the number.",
        description="`{a}`, `{b}` (two terms), or `{expr}` (the terms joined by ' + ', any number of terms).",
    )


class ColorsTaskConfig(StrictModel):
    """Seeded synthetic image prompts drawn with PIL (docs/vlm.md): `colour` asks "Name the colour of this square:
    <image>" (red, green, blue or yellow) of a square of that colour (size, place and shade drawn at
    random) on a grey `image_size` canvas; `count` asks how many squares (1-4) it holds. For a vision-language model."""

    kind: Literal["colors"] = "colors"
    task: Literal["colour", "count"] = "colour"
    num_train: int = Field(default=2000, ge=1)
    num_eval: int = Field(default=64, ge=1)
    image_size: int = Field(default=56, ge=28)
    seed: int = 0


class JsonlDataConfig(StrictModel):
    """Prompt/answer rows from JSONL files (one JSON object per line)."""

    kind: Literal["jsonl"] = "jsonl"
    train_path: Path
    eval_path: Path | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"


class DatasetsDataConfig(StrictModel):
    """Rows read with the Hugging Face `datasets` library; the default columns are verl's RL parquet schema.

    `path` is a local file or glob (.parquet, .json, .jsonl, .arrow, .csv), a directory written by
    `Dataset.save_to_disk`, or a hub dataset name (read from the local HF cache when HF_DATASETS_OFFLINE=1 or
    HF_HUB_OFFLINE=1). A dotted key reads inside a struct column (`reward_model.ground_truth`).
    """

    kind: Literal["datasets"] = "datasets"
    path: str
    eval_path: str | None = Field(default=None, description="Held-out rows; default: `path` at `eval_split`.")
    name: str | None = Field(default=None, description="A hub dataset's config name (subset).")
    revision: str | None = None
    train_split: str = "train"
    eval_split: str = Field(default="test", description="Used when `path` holds splits (hub or save_to_disk).")
    prompt_key: str = Field(default="prompt", description="A string, or a list of chat messages {role, content}.")
    answer_key: str = "reward_model.ground_truth"
    data_source_key: str | None = "data_source"
    extra_info_key: str | None = "extra_info"
    default_data_source: str = Field(default="", description="For rows without a data_source column.")
    image_key: str | None = Field(
        default="images",
        description="A list of images per row (bytes, file paths, or {bytes, path} dicts); read when the column "
        "exists. Their `<image>` placeholders in the prompt mark where each goes (docs/vlm.md).",
    )


DataSource = Annotated[
    AdditionTaskConfig | ColorsTaskConfig | JsonlDataConfig | DatasetsDataConfig, Field(discriminator="kind")
]


class DataConfig(StrictModel):
    """Which prompts, how many per step, and how they are framed for the model."""

    source: DataSource
    prompts_per_step: int = Field(ge=1, description="Prompts per training step (verl's train_batch_size).")
    eval_prompts: int = Field(default=64, ge=1)
    apply_chat_template: bool = True
    chat_template: str | None = Field(
        default=None, description="A Jinja chat template that replaces the tokenizer's own."
    )
    system_prompt: str | None = None
    shuffle: bool = True
    max_prompt_length: int | None = Field(
        default=None,
        ge=1,
        description="Prompt tokens (after the chat template) allowed; longer ones are handled as "
        "`overlong_prompts` says. Prompts that do not fit the model's context minus the response's budget "
        "(rollout.max_new_tokens, or rollout.multi_turn.max_response_tokens) are "
        "handled the same way, whatever this is.",
    )
    image_min_pixels: int | None = Field(
        default=None, ge=1, description="Images smaller than this are scaled up (the image processor's min_pixels)."
    )
    image_max_pixels: int | None = Field(
        default=None, ge=1, description="Images larger than this are scaled down (the image processor's max_pixels)."
    )
    max_images_per_prompt: int = Field(default=4, ge=1, description="Rows with more images are refused.")
    overlong_prompts: Literal["error", "drop", "truncate"] = Field(
        default="error",
        description="error: refuse the run before it starts, naming the row; drop: skip them and count them "
        "(data/dropped_prompts); truncate: keep each such prompt's last tokens (context limit only; a multi-turn "
        "run keeps the prompt whole and its trajectory stops at the context).",
    )
