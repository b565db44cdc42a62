"""DeepSpeed ZeRO-2 and ZeRO-3 on one CUDA rank (nccl): the model on the GPU, log-probs equal to the torch
backend's, one GRPO step that moves the weights. Marked `gpu`; needs deepspeed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from gpu_helpers import masked_max, snapshot

from rlstages.engines import types as T
from rlstages.engines.training.core import PPOTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"),
]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stage_on_one_cuda_rank(tiny_model_dir: Path, batch, settings, stage: int) -> None:
    torch_engine = PPOTrainer(settings(tiny_model_dir))
    engine = PPOTrainer(settings(tiny_model_dir, "deepspeed", zero_stage=stage))
    assert torch.distributed.get_backend() == "nccl"
    assert all(p.is_cuda for p in engine.backend.module.parameters())
    mask = batch[T.RESPONSE_MASK]
    assert masked_max(engine.logprobs(batch)["logprobs"], torch_engine.logprobs(batch)["logprobs"], mask) <= 1e-5
    before = snapshot(engine.named_weights())
    metrics = engine.train_step(batch)
    assert torch.isfinite(torch.tensor(metrics["pg_loss"])) and metrics["perf/max_memory_allocated_gb"] > 0
    after = snapshot(engine.named_weights())
    assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2
