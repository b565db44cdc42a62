"""Where the policy comes from: a local HF directory (built on first use when a provider says how) or a hub id."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlstages.configs.base import StrictModel

TINY_MOE_TYPES = ("qwen3_moe", "mixtral", "deepseek_v3")


class TinyModelSpec(StrictModel):
    """A random-init model built from a config (tests, smoke runs): a few layers, hidden 32–64."""

    model_type: Literal[
        "llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "deepseek_v3", "qwen2_vl", "qwen2_5_vl"
    ] = "qwen2"
    vocab_size: int = Field(default=512, ge=16)
    hidden_size: int = Field(default=64, ge=8)
    intermediate_size: int = Field(default=128, ge=8)
    num_hidden_layers: int = Field(default=2, ge=1)
    num_attention_heads: int = Field(default=4, ge=1)
    num_key_value_heads: int = Field(default=2, ge=1)
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    num_experts: int = Field(
        default=0, ge=0, description="Routed experts per layer (MoE types: qwen3_moe, mixtral, deepseek_v3); 0 = dense."
    )
    num_experts_per_tok: int = Field(default=2, ge=1, description="Top-k experts per token (MoE types).")
    moe_intermediate_size: int = Field(
        default=32, ge=8, description="Each routed expert's MLP width (MoE types; deepseek_v3's shared expert too)."
    )
    seed: int = 0

    @model_validator(mode="after")
    def _experts_match_type(self) -> TinyModelSpec:
        if (self.model_type in TINY_MOE_TYPES) != (self.num_experts > 0):
            raise ValueError(
                f"model.tiny: num_experts > 0 goes with model_type {' / '.join(TINY_MOE_TYPES)} (and only with them)"
            )
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"model.tiny.num_experts_per_tok={self.num_experts_per_tok} > num_experts")
        return self


class ModelArchitecture(StrictModel):
    """Sizes the parallel layout is checked against when the model directory is not on this machine."""

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_experts: int | None = Field(default=None, ge=0, description="Routed experts per MoE layer (0 = dense).")


class LoraSettings(StrictModel):
    """LoRA adapters (the `peft` library) on the actor, torch backend: the base stays frozen and is also the
    reference policy (adapter disabled); rollouts get merged weights; checkpoints hold the adapter."""

    rank: int = Field(default=16, ge=1)
    alpha: float = Field(default=32.0, gt=0.0, description="Scale = alpha / rank.")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: tuple[str, ...] = Field(
        default=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), min_length=1
    )


class ModelConfig(StrictModel):
    """The policy model. `path` is a local HF directory (`provider` builds it there on first use) or a hub id
    `org/name`, resolved through the Hugging Face cache (HF_HOME, HF_HUB_OFFLINE) at `revision`."""

    path: Path = Field(description="A local HF model directory, or a hub id such as Qwen/Qwen2.5-0.5B-Instruct.")
    revision: str | None = Field(default=None, description="Hub branch, tag or commit of a hub id (default main).")
    provider: Literal["local", "smollm2-gguf", "smollm2-vl", "tiny-random"] = "local"
    tiny: TinyModelSpec | None = None
    architecture: ModelArchitecture | None = None
    model_type: str | None = Field(
        default=None, description="Model-registry key; defaults to config.json's model_type."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraSettings | None = Field(default=None, description="Train LoRA adapters instead of all weights.")
    plugins: tuple[str, ...] = Field(
        default=(), description="Modules every worker imports first, e.g. one that calls register_model(...)."
    )
