"""bf16 weights trained with stochastic rounding (`actor.bf16_stochastic_round`, engines/training/sr_adamw.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.training.core import PPOTrainer, without_perf
from rlstages.engines.training.optim import adamw
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams


def test_stochastic_rounding_keeps_updates_below_bf16_resolution() -> None:
    """AdamW's first steps move each weight by ~lr. At 1.0 bf16's spacing is 2^-7, so lr 1e-4 rounds to
    nothing to nearest, while stochastic rounding moves the mean by lr per step, as fp32 would."""
    lr, steps = 1e-4, 8
    weights = {sr: torch.nn.Parameter(torch.ones(256, 256, dtype=torch.bfloat16)) for sr in (False, True)}
    torch.manual_seed(0)
    for sr, w in weights.items():
        optimizer = adamw([w], OptimConfig(lr=lr), bf16_stochastic_round=sr)
        for _ in range(steps):
            w.grad = torch.ones_like(w)
            optimizer.step()
        assert w.dtype == torch.bfloat16
    assert torch.equal(weights[False], torch.ones(256, 256, dtype=torch.bfloat16))  # every update lost
    drift = 1.0 - weights[True].float().mean().item()
    assert drift == pytest.approx(steps * lr, rel=0.1)  # unbiased in expectation (65k weights)
    # a few weights moved down by whole bf16 steps (2^-8 below 1.0), at most steps*lr/2^-8 of them
    moved = weights[True] != 1.0
    assert (weights[True][moved] < 1.0).all()
    assert 0.5 * steps * lr / 2**-8 < moved.float().mean().item() <= steps * lr / 2**-8


@pytest.fixture(scope="module")
def batch(tiny_model_dir: Path):
    rollout = HFRolloutEngine(tiny_model_dir, dtype="bfloat16", apply_chat_template=False)
    prompts = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
    b = rollout.generate(prompts, SamplingParams(n=4, max_new_tokens=8), seed=0)
    token = A.outcome_to_token_rewards((torch.arange(16) % 3 == 0).float(), b[T.RESPONSE_MASK])
    b[T.ADVANTAGES], _ = A.compute_advantages("grpo", token, b[T.RESPONSE_MASK], T.get_rows(b, "uid"))
    return b


def bf16_trainer(path: Path) -> PPOTrainer:
    train = TorchTrainingConfig(optim=OptimConfig(lr=1e-3), micro_batch_size=8, bf16_stochastic_round=True)
    return PPOTrainer(TrainerSettings(str(path), train=train, dtype="bfloat16"))


def test_bf16_trainer_steps_in_bf16_and_resumes_bitwise(tiny_model_dir: Path, batch, tmp_path: Path) -> None:
    engine = bf16_trainer(tiny_model_dir)
    before = {k: v.clone() for k, v in engine.named_weights()}
    engine.train_step(batch)
    after = dict(engine.named_weights())
    assert all(v.dtype == torch.bfloat16 for v in after.values())
    assert sum(not torch.equal(before[k], after[k]) for k in before) == len(before)
    optimizer = engine.backend.optimizer
    assert optimizer is not None
    moments = [s["exp_avg"] for s in optimizer.state.values()]
    assert moments and all(m.dtype == torch.bfloat16 for m in moments)  # 2 bytes each, not fp32's 4

    engine.save(tmp_path / "ckpt")
    m1 = engine.train_step(batch)
    w1 = {k: v.clone() for k, v in engine.named_weights()}
    restored = bf16_trainer(tiny_model_dir)
    restored.load(tmp_path / "ckpt")
    m2 = restored.train_step(batch)
    assert without_perf(m1) == without_perf(
        m2
    )  # moments, the step counts (the rounding's bits are keyed by them) restored
    assert all(torch.equal(w1[k], v) for k, v in restored.named_weights())
