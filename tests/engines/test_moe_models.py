"""Tiny Mixture-of-Experts models as they are, through the model registry: a Qwen3-MoE built from a config
(one safetensors tensor per expert on disk, fused in memory by transformers 5) generates with the HF rollout
and trains a GRPO step on the torch backend; the rollout takes the trainer's weights in the on-disk
per-expert layout into its fused experts. CPU, in process."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.models import read_model_type
from rlstages.engines.models.moe_layout import disk_named_weights
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams


def test_tiny_qwen3_moe_generates_and_trains_on_torch(tiny_moe_dir: Path) -> None:
    assert read_model_type(tiny_moe_dir) == "qwen3_moe"
    with safe_open(str(tiny_moe_dir / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in f.keys()  # the on-disk layout
    rollout = HFRolloutEngine(tiny_moe_dir, dtype="float32", apply_chat_template=False)
    prompts = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(2)]
    batch = rollout.generate(prompts, SamplingParams(n=4, max_new_tokens=6), seed=0)
    assert batch[T.RESPONSE_MASK].sum() > 0
    token = A.outcome_to_token_rewards((torch.arange(8) % 2 == 0).float(), batch[T.RESPONSE_MASK])
    batch[T.ADVANTAGES], batch[T.RETURNS] = A.compute_advantages(
        "grpo", token, batch[T.RESPONSE_MASK], T.get_rows(batch, "uid")
    )
    train = TorchTrainingConfig(optim=OptimConfig(lr=1e-3), micro_batch_size=4)
    engine = PPOTrainer(TrainerSettings(str(tiny_moe_dir), role="actor", train=train))
    before = {k: v.clone() for k, v in engine.named_weights()}
    metrics = engine.train_step(batch)
    after = {k: v.clone() for k, v in engine.named_weights()}  # the on-disk layout: one tensor per expert
    assert metrics["grad_norm"] > 0 and abs(metrics["logprob_diff"]) < 1e-4  # rollout and trainer agree
    expert = "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert expert in after and not torch.equal(after[expert], before[expert])
    rollout.update_weights(after.items())  # per-expert names into the rollout's fused experts
    state = rollout.model.state_dict()
    synced = dict(disk_named_weights(rollout.model, state.items()))
    assert sorted(synced) == sorted(after) and all(torch.equal(synced[k], after[k]) for k in after)
