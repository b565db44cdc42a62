"""What every training backend's options share: the optimizer and its LR schedule, ranks and batch sizes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlstages.configs.base import StrictModel

ModelPart = Literal["vision_tower", "projector", "language_model"]


class OptimConfig(StrictModel):
    """AdamW and its learning-rate schedule (warm-up, then constant or a cosine decay; with `decay_steps` the decay
    takes only the last steps and the LR holds its peak until then: warm-up, stable, decay)."""

    lr: float = Field(default=1e-6, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = Field(default=0.0, ge=0.0)
    grad_clip: float = Field(default=1.0, gt=0.0)
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    total_steps: int | None = Field(default=None, description="Cosine horizon; None = trainer.total_steps.")
    decay_steps: int | None = Field(
        default=None,
        ge=1,
        description="With schedule cosine: the decay takes the last `decay_steps` optimizer steps of the horizon "
        "and the LR holds its peak before them (warm-up, stable, decay); None = every step after the warm-up.",
    )
    group_lr: dict[ModelPart, float] = Field(
        default_factory=dict,
        description="A vision-language model's learning rate per part (vision_tower, projector, language_model); "
        "parts not named take `lr` (torch, deepspeed and megatron backends).",
    )

    @model_validator(mode="after")
    def _decay_needs_cosine(self) -> OptimConfig:
        # set to other than their defaults (a run's resolved config writes every field out, defaults included)
        unused = [f for f in ("decay_steps", "min_lr_ratio") if getattr(self, f) not in (None, 0.0)]
        if self.schedule == "constant" and unused:
            raise ValueError(
                f"{', '.join(unused)} shape only the cosine schedule, and schedule is constant: "
                "set schedule: cosine or drop them"
            )
        return self


class TrainingCommon(StrictModel):
    """What every training backend takes: the optimizer, ranks, batch sizes, frozen parts."""

    optim: OptimConfig = OptimConfig()
    num_workers: int = Field(default=1, ge=1, description="Ranks of this role (TP x PP x CP x DP).")
    ppo_epochs: int = Field(default=1, ge=1)
    mini_batch_size: int | None = Field(
        default=None, ge=1, description="Prompts per optimizer step; None = all prompts of the step."
    )
    micro_batch_size: int = Field(default=8, ge=1, description="Sequences per forward/backward.")
    dynamic_batching: bool = False
    max_tokens_per_micro_batch: int = Field(
        default=4096,
        ge=1,
        description="With dynamic_batching: padded tokens a micro-batch puts through the model, rows x their "
        "longest; with share_prompt_forward a row counts its response alone (the prompts go through once a step).",
    )
    bf16_autocast: bool = False
    gradient_checkpointing: bool = False
    freeze: tuple[ModelPart, ...] = Field(
        default=(),
        description="Parts of a vision-language model left untrained: vision_tower, projector, language_model "
        "(torch, deepspeed and megatron backends).",
    )

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks of one model replica (1: no model parallelism)."""
        return 1

    @property
    def pp_size(self) -> int:
        """Pipeline stages of one model replica."""
        return 1

    @property
    def cp_size(self) -> int:
        """Context-parallel ranks one sequence is split over."""
        return 1

    @property
    def grad_average_ranks(self) -> int:
        """Ranks the gradients are averaged over (the token-sum loss's scale): every rank without model parallelism."""
        return self.num_workers

    def check_model_layout(self, role: str, sizes: dict[str, int]) -> None:
        """Refuse a parallel layout the model's sizes (`num_attention_heads`, `num_hidden_layers`, ...) do not split
        into (a one-line ValueError naming `role`'s field); nothing to check without model parallelism."""
