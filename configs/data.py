"""Prompt sources: the synthetic addition task of the demo, or JSONL files of prompt/answer rows."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from rlstages.configs.base import StrictModel


class AdditionTaskConfig(StrictModel):
    """Seeded synthetic prompts "What is a + b? Reply with only the number." with a, b in [1, max_operand]."""

    kind: Literal["addition"] = "addition"
    max_operand: int = Field(default=20, ge=1)
    num_train: int = Field(default=4000, ge=1)
    num_eval: int = Field(default=64, ge=1)
    seed: int = 0
    template: str = "What is {a} + {b}? Reply with only the number."


class JsonlDataConfig(StrictModel):
    """Prompt/answer rows from JSONL files (one JSON object per line)."""

    kind: Literal["jsonl"] = "jsonl"
    train_path: Path
    eval_path: Path | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"


DataSource = Annotated[AdditionTaskConfig | JsonlDataConfig, Field(discriminator="kind")]


class DataConfig(StrictModel):
    """Which prompts, how many per step, and how they are framed for the model."""

    source: DataSource
    prompts_per_step: int = Field(ge=1, description="Prompts per training step (verl's train_batch_size).")
    eval_prompts: int = Field(default=64, ge=1)
    apply_chat_template: bool = True
    system_prompt: str | None = None
    shuffle: bool = True
    overlong_prompts: Literal["error", "truncate"] = Field(
        default="error",
        description="Prompts longer than the model's context minus rollout.max_new_tokens: error refuses the run "
        "before it starts (naming the row); truncate keeps each such prompt's last tokens.",
    )
