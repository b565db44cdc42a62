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


def test_tiny_spec_builds_every_moe_type(tmp_path: Path) -> None:
    # `model.tiny` names each MoE type the converter has a template for; the planned config (the pre-flight's view
    # before the model exists) and the built one agree, experts saved one tensor per expert
    import pytest
    from pydantic import ValidationError
    from transformers import AutoConfig

    from rlstages.configs.model import TinyModelSpec
    from rlstages.engines.models import build_tiny_model
    from rlstages.engines.models.providers import planned_config

    # the HF config key of the routed experts per type (mixtral's on-disk experts are w1 / w2 / w3)
    experts_key = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}
    for model_type, key in experts_key.items():
        spec = TinyModelSpec(model_type=model_type, hidden_size=32, num_hidden_layers=2, num_experts=4)
        path = build_tiny_model(tmp_path / model_type, **spec.model_dump())
        built = AutoConfig.from_pretrained(path)
        planned = planned_config(tmp_path / "absent", "tiny-random", spec.model_dump())
        assert built.model_type == planned.model_type == model_type and getattr(built, key) == 4
        assert getattr(planned, key) == 4
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            assert any(k.endswith((".experts.3.down_proj.weight", ".experts.3.w2.weight")) for k in f.keys()), (
                model_type
            )
        rollout = HFRolloutEngine(path, dtype="float32", apply_chat_template=False)
        batch = rollout.generate([Prompt("u", "1+1=", "2")], SamplingParams(n=2, max_new_tokens=4), seed=0)
        assert batch[T.RESPONSE_MASK].sum() > 0
    assert AutoConfig.from_pretrained(tmp_path / "deepseek_v3").first_k_dense_replace == 1
    for bad in ({"model_type": "mixtral"}, {"model_type": "qwen2", "num_experts": 4}):
        with pytest.raises(ValidationError, match="num_experts > 0 goes with model_type"):
            TinyModelSpec(**bad)
