"""The hybrid engine on CUDA: trainer and HF rollout share one copy of the weights on the GPU, and
update -> generate -> update keeps GPU memory flat (after five steps within a small bound of after the first).
Marked `gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_helpers import LR, PROMPTS

from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import SamplingParams
from rlstages.engines.workers.hybrid import HybridEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
LEAK_BOUND = 16 * 2**20  # bytes: allocator rounding and cuBLAS workspaces, far below a model copy or KV cache


def test_update_generate_update_shares_weights_and_does_not_leak(tiny_model_dir: Path) -> None:
    train = TorchTrainingConfig(micro_batch_size=8, optim=OptimConfig(lr=LR, total_steps=10))
    settings = TrainerSettings(str(tiny_model_dir), train=train, dtype="bfloat16")
    engine = HybridEngine(
        "rlstages.engines.training.core:PPOTrainer",
        {"settings": settings},
        "rlstages.engines.rollout.hf_rollout:HFRolloutEngine",
        {"model_path": str(tiny_model_dir), "dtype": "bfloat16", "apply_chat_template": False, "attention": "sdpa"},
    )
    assert engine.shares_weights
    trainer_ptrs = {p.data_ptr() for p in engine.trainer.backend.model.parameters()}
    assert {p.data_ptr() for p in engine.rollout.model.parameters()} <= trainer_ptrs
    assert all(p.is_cuda for p in engine.rollout.model.parameters())
    allocated = []
    for step in range(5):
        engine.sleep()
        batch = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=16), seed=step)
        token = A.outcome_to_token_rewards((torch.arange(16) % 3 == step % 3).float(), batch[T.RESPONSE_MASK])
        adv, ret = A.compute_advantages("grpo", token, batch[T.RESPONSE_MASK], T.get_rows(batch, "uid"))
        batch[T.ADVANTAGES], batch[T.RETURNS] = adv, ret
        metrics = engine.train_step(batch)
        assert torch.isfinite(torch.tensor(metrics["pg_loss"]))
        engine.wake()  # shared weights: the sync copies nothing
        assert engine.sync_local()["sync/copied_tensors"] == 0
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[-1] - allocated[0] <= LEAK_BOUND, allocated
