"""Megatron-Core TP=1 on CUDA (`cpu:gloo,cuda:nccl`): every parameter on the GPU (the local spec's RMSNorm
included), log-probs equal to the torch backend's, and one GRPO step. Marked `gpu`; needs megatron-core."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from gpu_helpers import masked_max, snapshot

from rlstages.engines import types as T
from rlstages.engines.training.core import PPOTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]


def test_tp1_logprobs_equal_torch_and_one_grpo_step(tiny_model_dir: Path, batch, settings) -> None:
    engine = PPOTrainer(settings(tiny_model_dir, "megatron"))  # first: its env is set before CUDA starts
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    torch_engine = PPOTrainer(settings(tiny_model_dir))
    params = [p for chunk in engine.backend.chunks for p in chunk.parameters()]
    assert params and all(p.device == torch.device("cuda", 0) for p in params)
    mask = batch[T.RESPONSE_MASK]
    assert masked_max(engine.logprobs(batch)["logprobs"], torch_engine.logprobs(batch)["logprobs"], mask) <= 1e-4
    before = snapshot(engine.named_weights())
    metrics = engine.train_step(batch)
    assert torch.isfinite(torch.tensor([metrics["pg_loss"], metrics["grad_norm"]])).all()
    after = snapshot(engine.named_weights())
    assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2
