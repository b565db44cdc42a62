"""Backend tables: name -> "module:Class", imported only on use.

A CPU machine without vLLM, SGLang, DeepSpeed or Megatron-Core imports everything and runs the defaults;
choosing a backend whose package is missing fails when its worker builds the engine.
"""

from __future__ import annotations

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


def engine_path(table: dict[str, str], backend: str) -> str:
    """The "module:Class" of a backend, or a one-line error listing the known ones."""
    if backend not in table:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(sorted(table))}")
    return table[backend]
