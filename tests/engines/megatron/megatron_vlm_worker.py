"""A gloo worker for `test_megatron_vlm.py`: the Megatron trainer on an image batch at several 2-rank layouts.

Not a test file. Run by `rlstages.engines.megatron.gloo_world` in fresh processes (the test puts this folder on
PYTHONPATH); each layout builds a `PPOTrainer` on the megatron backend in the same 2-process world (the groups
rebuilt between layouts), takes one GRPO step on the batch file and writes the HF weights after it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def train_step_worker(
    rank: int, world_size: int, port: int, model: str, batch: str, out: str, lr: float, layouts: list[dict[str, Any]]
) -> list[dict[str, float]]:
    """Per layout (MegatronTrainingConfig fields): one GRPO step's metrics; the weights after it in
    `out/<i>.safetensors` (written by the weight source)."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from rlstages.configs.training import MegatronTrainingConfig, OptimConfig
    from rlstages.engines import types as T
    from rlstages.engines.megatron import gpt
    from rlstages.engines.models.vision import module_name
    from rlstages.engines.training.core import PPOTrainer
    from rlstages.engines.training.settings import TrainerSettings

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    data = T.load_batch(batch)
    results = []
    try:
        for i, layout in enumerate(layouts):
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()  # the same world, the next layout's groups
            train = MegatronTrainingConfig(
                optim=OptimConfig(lr=lr, total_steps=10), micro_batch_size=2, num_workers=world_size, **layout
            )
            engine = PPOTrainer(TrainerSettings(model, train=train))
            metrics = engine.train_step(data)
            weights = {module_name(k): v.detach().clone() for k, v in engine.named_weights()}  # a collective
            if engine.backend.is_weight_source:
                save_file(weights, str(Path(out) / f"{i}.safetensors"))
            results.append({k: float(v) for k, v in metrics.items()})
        return results
    finally:
        gpt.destroy_model_parallel()
