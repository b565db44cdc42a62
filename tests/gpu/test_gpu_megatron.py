"""Megatron-Core TP=1 on CUDA (`cpu:gloo,cuda:nccl`): every parameter on the GPU (the local spec's RMSNorm
included), log-probs equal to the torch backend's, and one GRPO step; the same for a tiny Qwen3-MoE at EP=1
through megatron-core's alltoall token dispatcher on CUDA (no CPU shim), with the router's `moe/*` metrics.
Marked `gpu`; needs megatron-core."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from gpu_helpers import masked_max, sample_grpo_batch, snapshot

from rlstages.configs.megatron_training import MoERouterConfig
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


def test_moe_ep1_logprobs_equal_torch_and_one_grpo_step(tiny_moe_dir: Path, settings) -> None:
    batch = sample_grpo_batch(tiny_moe_dir)
    moe = MoERouterConfig(aux_loss_coeff=0.01)
    engine = PPOTrainer(settings(tiny_moe_dir, "megatron", moe=moe))
    torch_engine = PPOTrainer(settings(tiny_moe_dir))
    config = engine.backend.chunks[0].config
    assert config.moe_token_dispatcher_type == "alltoall" and config.num_moe_experts == 4
    params = [p for chunk in engine.backend.chunks for p in chunk.parameters()]
    assert params and all(p.device == torch.device("cuda", 0) for p in params)
    mask = batch[T.RESPONSE_MASK]
    assert masked_max(engine.logprobs(batch)["logprobs"], torch_engine.logprobs(batch)["logprobs"], mask) <= 1e-4
    before = snapshot(engine.named_weights())
    metrics = engine.train_step(batch)
    assert torch.isfinite(torch.tensor([metrics["pg_loss"], metrics["grad_norm"]])).all()
    assert 0.5 < metrics["moe/aux_loss"] < 4.0 and metrics["moe/tokens_per_expert_imbalance"] >= 1.0
    after = snapshot(engine.named_weights())
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert any(".experts." in k for k in moved) and any(".gate." in k for k in moved), moved
