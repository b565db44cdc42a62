"""The Megatron-Core training backend's options: 5-D parallelism, offload, MoE routing (`backend: megatron`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlstages.configs.base import StrictModel
from rlstages.configs.training_base import TrainingCommon


class MoERouterConfig(StrictModel):
    """Mixture-of-Experts router and dispatcher options of the Megatron backend (megatron-core's `moe_*` fields;
    verl sets them through `override_transformer_config`). Dense models ignore them."""

    router_topk: int | None = Field(
        default=None, ge=1, description="Experts per token; None = the model's (num_experts_per_tok)."
    )
    aux_loss_coeff: float = Field(
        default=0.0,
        ge=0.0,
        description="Load-balancing auxiliary loss coefficient (moe_aux_loss_coeff); 0 = the HF forward's loss "
        "(transformers adds router_aux_loss_coef only with output_router_logits).",
    )
    load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = Field(
        default="aux_loss", description="How the auxiliary loss is computed (moe_router_load_balancing_type)."
    )
    z_loss_coeff: float | None = Field(
        default=None, ge=0.0, description="Router z-loss coefficient (moe_z_loss_coeff); None = off."
    )
    expert_capacity_factor: float | None = Field(
        default=None,
        gt=0.0,
        description="Tokens an expert takes, as a multiple of its even share; tokens over capacity are dropped. "
        "None = dropless (every routed token is computed, the HF forward).",
    )
    token_dispatcher: Literal["alltoall", "allgather"] = Field(
        default="alltoall",
        description="How tokens reach experts on other EP ranks. alltoall: NCCL on GPU, gloo on CPU (megatron's "
        "CUDA-stream bookkeeping mapped to the CPU); the only one with pipeline parallelism (variable lengths).",
    )


UNEVEN_VPP_NEEDS_MIDDLE = (
    "megatron num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage with virtual pipeline "
    "stages need a middle stage (megatron-core 0.16 divides by their count): use pipeline_model_parallel_size > 2 "
    "or set one of them"
)


class MegatronTrainingConfig(TrainingCommon):
    """Megatron-Core GPTModel from our converted checkpoint, with 5-D parallelism and offload (verl's knobs)."""

    backend: Literal["megatron"] = "megatron"
    tensor_model_parallel_size: int = Field(default=1, ge=1)
    pipeline_model_parallel_size: int = Field(default=1, ge=1)
    virtual_pipeline_model_parallel_size: int | None = Field(default=None, ge=1)
    context_parallel_size: int = Field(
        default=1, ge=1, description="Sequence split over CP ranks; > 1 needs Transformer Engine's attention."
    )
    expert_model_parallel_size: int = Field(
        default=1, ge=1, description="EP: each MoE layer's experts split over this many ranks (within DP x CP x TP)."
    )
    expert_tensor_parallel_size: int | None = Field(
        default=None,
        ge=1,
        description="TP inside each expert, a divisor of tensor_model_parallel_size (the seeds' MoE presets: 1); "
        "None = tensor_model_parallel_size (megatron's default).",
    )
    num_layers_in_first_pipeline_stage: int | None = Field(
        default=None, ge=1, description="Uneven pipeline: layers of the first stage (the others share the rest)."
    )
    num_layers_in_last_pipeline_stage: int | None = Field(
        default=None, ge=1, description="Uneven pipeline: layers of the last stage (the others share the rest)."
    )
    moe: MoERouterConfig = MoERouterConfig()
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    offload_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    transformer_impl: Literal["local", "transformer_engine"] = "local"

    @model_validator(mode="after")
    def _layout(self) -> MegatronTrainingConfig:
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "megatron sequence_parallel needs tensor_model_parallel_size > 1 (it splits the sequence "
                "across TP ranks); turn it off or raise TP"
            )
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        model_parallel *= self.context_parallel_size
        if self.num_workers % model_parallel:
            raise ValueError(
                f"megatron num_workers={self.num_workers} is not a multiple of TP x PP x CP = {model_parallel}; "
                "data-parallel size must be a whole number"
            )
        if self.tensor_model_parallel_size % self.expert_tp:
            raise ValueError(
                f"megatron expert_tensor_parallel_size={self.expert_tp} must divide tensor_model_parallel_size="
                f"{self.tensor_model_parallel_size} (expert TP larger than TP is not supported)"
            )
        expert_group = self.expert_model_parallel_size * self.expert_tp * self.pipeline_model_parallel_size
        if self.num_workers % expert_group:
            raise ValueError(
                f"megatron num_workers={self.num_workers} is not a multiple of expert_model_parallel_size x "
                f"expert_tensor_parallel_size x pipeline_model_parallel_size = {expert_group} (megatron-core's "
                "expert groups); lower expert_model_parallel_size or set expert_tensor_parallel_size: 1"
            )
        uneven = (self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage)
        if any(n is not None for n in uneven) and self.pipeline_model_parallel_size == 1:
            raise ValueError("megatron num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1")
        if all(uneven) and self.virtual_pipeline_model_parallel_size and self.pipeline_model_parallel_size == 2:
            raise ValueError(UNEVEN_VPP_NEEDS_MIDDLE)
        return self

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (megatron-core's default: the dense TP size)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage (x virtual chunks counted together): even, or the first / last stage as set
        and the rest shared evenly by the middle stages; raises when they do not add up."""
        pp = self.pipeline_model_parallel_size
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        fixed = [n for n in (first, last) if n is not None]
        middle = pp - len(fixed)
        rest = num_layers - sum(fixed)
        if rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
            raise ValueError(
                f"pipeline stages: {num_layers} layers minus first={first} / last={last} do not split evenly over "
                f"the other {middle} of pipeline_model_parallel_size={pp} stages"
            )
        share = rest // middle if middle else 0
        stages = [share] * pp
        if first is not None:
            stages[0] = first
        if last is not None:
            stages[-1] = last
        return stages

    @property
    def data_parallel_size(self) -> int:
        """DP = world / (TP x PP x CP)."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        return self.num_workers // (tp * pp * self.context_parallel_size)

    @property
    def tp_size(self) -> int:
        """`tensor_model_parallel_size`."""
        return self.tensor_model_parallel_size

    @property
    def pp_size(self) -> int:
        """`pipeline_model_parallel_size`."""
        return self.pipeline_model_parallel_size

    @property
    def cp_size(self) -> int:
        """`context_parallel_size`."""
        return self.context_parallel_size

    @property
    def grad_average_ranks(self) -> int:
        """DP x CP: the ranks a gradient is averaged over."""
        return self.data_parallel_size * self.context_parallel_size

    def check_model_layout(self, role: str, sizes: dict[str, int]) -> None:
        """TP divides the attention heads and KV groups, PP (x virtual) the layers (or the uneven stages add up),
        EP the routed experts; the router's top-k is at most the routed experts."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        heads, groups = sizes["num_attention_heads"], sizes["num_key_value_heads"]
        if heads % tp or groups % tp:
            raise ValueError(
                f"{role}.tensor_model_parallel_size={tp} must divide the model's attention heads ({heads}) and "
                f"KV groups ({groups}): Megatron splits whole query groups across TP ranks"
            )
        layers = sizes["num_hidden_layers"]
        vpp = self.virtual_pipeline_model_parallel_size or 1
        self._check_experts(role, sizes.get("num_experts"))
        if self.num_layers_in_first_pipeline_stage or self.num_layers_in_last_pipeline_stage:
            try:
                self.stage_layers(layers)
            except ValueError as exc:
                raise ValueError(f"{role}.{exc}") from None
        elif layers % (pp * vpp):
            raise ValueError(
                f"{role}.pipeline_model_parallel_size={pp} (x virtual {vpp}) must divide the model's {layers} layers"
            )

    def _check_experts(self, role: str, experts: int | None) -> None:
        """Expert parallelism needs an MoE model whose routed experts split evenly over the EP ranks; the router's
        top-k is at most the routed experts (megatron's router would fail at the first step)."""
        if experts is None:
            return
        topk = self.moe.router_topk
        if experts and topk is not None and topk > experts:
            raise ValueError(
                f"{role}.moe.router_topk={topk} is larger than the model's {experts} routed experts; use at most "
                f"{experts} (or leave it unset: the model's num_experts_per_tok)"
            )
        ep = self.expert_model_parallel_size
        if ep == 1:
            return
        if not experts:
            raise ValueError(f"{role}.expert_model_parallel_size={ep}: the model is dense (no routed experts); use 1")
        if experts % ep:
            raise ValueError(f"{role}.expert_model_parallel_size={ep} must divide the model's {experts} routed experts")


# Options only the megatron backend reads -> what they are, for the error when another backend is given one.
MEGATRON_ONLY: dict[str, str] = {
    "tensor_model_parallel_size": "tensor parallelism",
    "pipeline_model_parallel_size": "pipeline parallelism",
    "virtual_pipeline_model_parallel_size": "virtual pipeline parallelism",
    "context_parallel_size": "context parallelism",
    "expert_model_parallel_size": "expert parallelism",
    "expert_tensor_parallel_size": "expert parallelism",
    "num_layers_in_first_pipeline_stage": "an uneven pipeline",
    "num_layers_in_last_pipeline_stage": "an uneven pipeline",
    "moe": "MoE routing (moe.*)",
    "sequence_parallel": "sequence parallelism",
}
