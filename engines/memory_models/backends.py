"""Each backend's memory model for the plan, named by its registry entry (`memory`): what a training backend keeps
per parameter, how it splits and offloads it, its layout and the changes that free memory; what a rollout engine
reserves on the GPU and whether it frees it while the trainers work. Each class reads only its own backend's
options, so the plan never asks which backend it is looking at."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlstages.configs.rollout import SGLangRolloutConfig, VLLMRolloutConfig
from rlstages.configs.training import DeepSpeedTrainingConfig, MegatronTrainingConfig
from rlstages.engines.imports import import_object
from rlstages.engines.memory_models.gpus import GIB
from rlstages.engines.memory_models.layout import Layout
from rlstages.engines.memory_models.model import DTYPE_BYTES, ModelDims
from rlstages.engines.memory_models.result import RankMemory
from rlstages.engines.registry import rollout_backend, training_backend

# DeepSpeed's default reduce_bucket_size (elements): ZeRO's contiguous-gradient bucket, allocated whole whatever
# the model's size (ZeRO-1/2: during backward; ZeRO-3: from start-up on), in the gradients' dtype.
ZERO_BUCKET_ELEMENTS = 500_000_000


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each training state and how they are split over DP."""

    weight: int
    grad: int
    optim: int
    shard_weight: bool = False
    shard_grad: bool = False
    shard_optim: bool = False


@dataclass(frozen=True)
class Offload:
    """What a training backend keeps in host memory: a fraction of the optimizer states, the gradients, the weights."""

    optimizer: float = 0.0
    grads: bool = False
    params: bool = False


class TorchMemory:
    """torch AdamW in one process: moments in the weights' dtype, nothing split or offloaded, every layer on one
    stage, the logits of the response tokens only (`logits_to_keep`)."""

    full_logits = False  # logits of every position (not only the response's)

    def state_bytes(self, train: Any, dtype: str) -> StateBytes:
        """Weights, gradients and optimizer states per parameter (the bf16 AdamW's bf16 moments likewise)."""
        w = DTYPE_BYTES[dtype]
        return StateBytes(w, w, 2 * w)

    def layout(self, train: Any, world: int, dims: ModelDims) -> Layout:
        """Every layer on one stage; the ranks are data-parallel."""
        return Layout(world=world, stages=(dims.layers,))

    def offload(self, train: Any) -> Offload:
        """Nothing leaves the GPU."""
        return Offload()

    def bucket_elements(self, train: Any) -> int:
        """Elements of a gradient bucket allocated whole (0: none)."""
        return 0

    def bucket_resident(self, train: Any) -> bool:
        """The bucket stays allocated from start-up on (not only during backward)."""
        return False

    def offload_advice(self, train: Any, full: RankMemory) -> list[str]:
        """Offload changes that free the fullest rank's memory, best first."""
        return []

    def parallel_advice(self, train: Any) -> list[str]:
        """Layout changes that spread the weights over more GPUs."""
        return []


class DeepSpeedMemory(TorchMemory):
    """DeepSpeed ZeRO (measured: tests/engines/plan_check.py): an fp32 copy of the weights and an fp32 gradient for
    the step even when they are fp32; stage >= 1 splits the optimizer, >= 2 the gradients, 3 the weights (and keeps
    the gradient partition in the weights' dtype)."""

    def state_bytes(self, train: DeepSpeedTrainingConfig, dtype: str) -> StateBytes:
        """fp32 master + moments (12 B) and fp32 gradients, split by the ZeRO stage."""
        w, stage = DTYPE_BYTES[dtype], train.zero_stage
        return StateBytes(w, 4 + (w if stage >= 3 else 0), 12, stage >= 3, stage >= 2, stage >= 1)

    def offload(self, train: DeepSpeedTrainingConfig) -> Offload:
        """`offload_optimizer` (all of it), `offload_param`."""
        return Offload(optimizer=1.0 if train.offload_optimizer else 0.0, params=train.offload_param)

    def bucket_elements(self, train: DeepSpeedTrainingConfig) -> int:
        """ZeRO's contiguous-gradient bucket (stage >= 1)."""
        return ZERO_BUCKET_ELEMENTS if train.zero_stage >= 1 else 0

    def bucket_resident(self, train: DeepSpeedTrainingConfig) -> bool:
        """ZeRO-3 keeps its gradient bucket from start-up on."""
        return train.zero_stage >= 3

    def offload_advice(self, train: DeepSpeedTrainingConfig, full: RankMemory) -> list[str]:
        """ZeRO's optimizer states to host memory."""
        tip = "actor.offload_optimizer=true (ZeRO's optimizer states to host memory)"
        return [] if train.offload_optimizer else [tip]


class MegatronMemory(TorchMemory):
    """Megatron-Core: fp32 main gradients, fp32 master + Adam moments (split by the distributed optimizer), its
    5-D layout with layers per stage as the engine places them, every position's logits, verl's offload knobs."""

    full_logits = True

    def state_bytes(self, train: MegatronTrainingConfig, dtype: str) -> StateBytes:
        """fp32 main grads; fp32 master + moments (8 B with fp32 weights)."""
        w = DTYPE_BYTES[dtype]
        return StateBytes(w, 4, 12 if w < 4 else 8, shard_optim=train.use_distributed_optimizer)

    def layout(self, train: MegatronTrainingConfig, world: int, dims: ModelDims) -> Layout:
        """TP / PP / CP / EP / ETP, sequence parallelism (forced for MoE under TP) and the layers of each stage."""
        sp = train.sequence_parallel or (dims.experts > 0 and train.tensor_model_parallel_size > 1)
        return Layout(
            world=world,
            tp=train.tensor_model_parallel_size,
            pp=train.pipeline_model_parallel_size,
            cp=train.context_parallel_size,
            ep=train.expert_model_parallel_size,
            etp=train.expert_tp,
            sequence_parallel=sp,
            stages=tuple(train.stage_layers(dims.layers)),
        )

    def offload(self, train: MegatronTrainingConfig) -> Offload:
        """`optimizer_offload` (`offload_fraction` of it), `grad_offload`, `param_offload`."""
        fraction = train.offload_fraction if train.optimizer_offload else 0.0
        return Offload(optimizer=fraction, grads=train.grad_offload, params=train.param_offload)

    def offload_advice(self, train: MegatronTrainingConfig, full: RankMemory) -> list[str]:
        """Verl's troubleshooting row: offload the optimizer fully, split it, offload weights and gradients."""
        tips = []
        if not train.optimizer_offload or train.offload_fraction < 1.0:
            freed = full.gpu.get("optimizer", 0.0) / GIB
            tips.append(f"actor.optimizer_offload=true actor.offload_fraction=1.0 (frees {freed:.1f} GiB)")
        if not train.use_distributed_optimizer:
            tips.append("actor.use_distributed_optimizer=true (optimizer states split over data-parallel ranks)")
        if full.peak_phase == "rollout" and not (train.param_offload and train.grad_offload):
            tips.append(
                "actor.param_offload=true actor.grad_offload=true (weights and gradients leave the GPU during rollout)"
            )
        return tips

    def parallel_advice(self, train: MegatronTrainingConfig) -> list[str]:
        """More model parallelism."""
        return [
            "raise actor.tensor_model_parallel_size, pipeline_model_parallel_size or expert_model_parallel_size "
            "(more GPUs share the weights)"
        ]


class GeneratedKV:
    """A rollout engine that holds its weights and the KV cache of one generate call (the HF engine), and keeps
    them while the trainers work."""

    def reserved(self, rollout: Any) -> float | None:
        """The fraction of the GPU it reserves up front (None: weights + KV cache as computed)."""
        return None

    def sleeps(self, rollout: Any) -> bool:
        """It frees its memory while the trainers work (colocated)."""
        return False

    def advice(self, rollout: Any) -> list[str]:
        """Changes that shrink it when a rollout or sync phase is the peak."""
        return []


class VLLMMemory(GeneratedKV):
    """vLLM: `gpu_memory_utilization` of the GPU, freed in sleep mode."""

    def reserved(self, rollout: VLLMRolloutConfig) -> float | None:
        """`gpu_memory_utilization`."""
        return rollout.gpu_memory_utilization

    def sleeps(self, rollout: VLLMRolloutConfig) -> bool:
        """`enable_sleep_mode`."""
        return rollout.enable_sleep_mode

    def advice(self, rollout: VLLMRolloutConfig) -> list[str]:
        """A smaller KV cache."""
        return [f"rollout.gpu_memory_utilization={rollout.gpu_memory_utilization - 0.1:.2f} (a smaller KV cache)"]


class SGLangMemory(GeneratedKV):
    """SGLang: `mem_fraction_static` of the GPU, freed by its memory saver."""

    def reserved(self, rollout: SGLangRolloutConfig) -> float | None:
        """`mem_fraction_static`."""
        return rollout.mem_fraction_static

    def sleeps(self, rollout: SGLangRolloutConfig) -> bool:
        """`enable_memory_saver`."""
        return rollout.enable_memory_saver


def training_memory(train: Any) -> TorchMemory:
    """The memory model of the training backend whose options `train` are (its registry entry's `memory`)."""
    model: TorchMemory = import_object(training_backend(train.backend).memory, f"{train.backend} memory model")()
    return model


def layout_of(train: Any, world: int, dims: ModelDims) -> Layout:
    """The layout of a role trained with `train` on `world` ranks, as its backend's memory model places it."""
    return training_memory(train).layout(train, world, dims)


def rollout_memory(rollout: Any) -> GeneratedKV:
    """The memory model of the rollout backend whose options `rollout` are."""
    model: GeneratedKV = import_object(rollout_backend(rollout.backend).memory, f"{rollout.backend} memory model")()
    return model
