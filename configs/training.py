"""Training engines (actor, critic, reference), one typed options class per backend, chosen by `backend`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlstages.configs.base import StrictModel
from rlstages.configs.megatron_training import MegatronTrainingConfig
from rlstages.configs.training_base import OptimConfig as OptimConfig  # where most callers look for it
from rlstages.configs.training_base import TrainingCommon


class _HFModelTraining(TrainingCommon):
    """Options of the backends that train the transformers model itself (torch, deepspeed)."""

    fuse_elementwise: bool = Field(
        default=True,
        description="On a GPU: the trained model's RMSNorm, SwiGLU and rotary embedding (Llama/Qwen-family code) "
        "run through torch.compile'd kernels in the update's forward and backward (engines/models/fused_layers.py); "
        "on the CPU its RMSNorm and SwiGLU run eager autograd functions that keep less for the backward "
        "(engines/models/lean_layers.py: the same outputs, ~0.24 GB less on a 1,024-token demo micro-batch); "
        "generation keeps transformers' kernels. false: transformers' code everywhere.",
    )


class TorchTrainingConfig(_HFModelTraining):
    """Plain torch (one process, or DDP over gloo/NCCL): the embedded default."""

    backend: Literal["torch"] = "torch"
    attention: Literal["sdpa", "eager"] = Field(
        default="sdpa",
        description="transformers attention of the trained model. eager: plain matmuls, faster for short CPU "
        "sequences (the demo's update: 10.8-13.1 s vs 14.1-14.6 s); sdpa for long sequences (no [L, L] scores kept).",
    )
    share_prompt_forward: bool = Field(
        default=False,
        description="Forward each distinct prompt of a train step once (their common prefix once) and reuse its "
        "KV cache for the rows sharing it in every micro-batch (GRPO's n samples per prompt); the prompts' "
        "gradient is taken through their forward once. Same loss and gradients, fewer tokens through the model.",
    )
    fp32_matmul: bool | Literal["auto"] = Field(
        default="auto",
        description="Where the model computes in bf16 on CPU: run each linear layer's matmuls, and the eager or "
        "sdpa attention's, on the fp32 kernel (operands upcast, result cast back: the same products and fp32 sums, "
        "bf16 weights and activations). Faster on some CPUs "
        "without AMX, 4x slower on others; auto = timed once at start-up (a 512 x 1024 GEMM each way), the fp32 "
        "kernel where it is 1.25x faster or more, never with AMX.",
    )
    gradient_accumulation_fusion: bool = Field(
        default=True,
        description="Add each linear layer's weight gradient into its .grad by the GEMM itself (beta = 1) and an "
        "embedding's rows into their rows, instead of a fresh gradient per micro-batch that autograd then adds "
        "(Megatron-Core's option of the same name; engines/training/grad_accumulation.py). Not under LoRA.",
    )
    bf16_stochastic_round: bool = Field(
        default=False,
        description="With model.dtype bfloat16: AdamW in fp32 math with bf16 moments (engines/training/sr_adamw.py) "
        "rounds each updated weight to bf16 stochastically, so updates far below bf16's resolution still add up in "
        "expectation. No fp32 master copy: weights, gradients and moments take 4 bytes per parameter of the 16 "
        "of fp32 AdamW.",
    )

    @model_validator(mode="after")
    def _shared_prompt_needs_cache(self) -> TorchTrainingConfig:
        if self.share_prompt_forward and self.gradient_checkpointing:
            raise ValueError(
                "share_prompt_forward needs the KV cache, which gradient_checkpointing turns off in transformers; "
                "set one of them to false"
            )
        return self


class DeepSpeedTrainingConfig(_HFModelTraining):
    """DeepSpeed ZeRO 1/2/3 with optional optimizer and parameter offload to CPU."""

    backend: Literal["deepspeed"] = "deepspeed"
    zero_stage: Literal[0, 1, 2, 3] = 2
    offload_optimizer: bool = False
    offload_param: bool = False

    @model_validator(mode="after")
    def _param_offload_needs_zero3(self) -> DeepSpeedTrainingConfig:
        if self.offload_param and self.zero_stage != 3:
            raise ValueError(
                "deepspeed offload_param needs zero_stage 3 (ZeRO only partitions parameters at stage 3); "
                "set zero_stage: 3 or offload_param: false"
            )
        return self


TrainingConfig = Annotated[
    TorchTrainingConfig | DeepSpeedTrainingConfig | MegatronTrainingConfig, Field(discriminator="backend")
]


class ReferenceConfig(StrictModel):
    """The frozen initial policy that only computes log-probs for KL terms."""

    enabled: bool | None = Field(default=None, description="None = on exactly when a KL term is used.")
    backend: Literal["torch", "deepspeed", "megatron"] = "torch"
    micro_batch_size: int = Field(default=16, ge=1)
    num_workers: int = Field(default=1, ge=1)
