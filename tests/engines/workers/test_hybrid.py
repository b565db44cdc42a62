"""The hybrid engine (trainer + rollout in one process): where the trainer's weights are in the rollout's dtype
the rollout holds the trainer's own tensors (one copy, a sync that copies nothing, generation that follows
every update); otherwise it keeps its own copy and a sync casts into it. CPU only."""

from __future__ import annotations

from pathlib import Path

import torch

from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines import types as T
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.engines.workers.hybrid import HybridEngine

PROMPTS = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(2)]
SAMPLING = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)


def hybrid(path: Path, trainer_dtype: str, rollout_dtype: str, lora: dict | None = None) -> HybridEngine:
    options = TorchTrainingConfig(optim=OptimConfig(lr=1e-2), micro_batch_size=4)
    return HybridEngine(
        "rlstages.engines.training.core:PPOTrainer",
        {"settings": TrainerSettings(str(path), train=options, dtype=trainer_dtype, lora=lora)},
        "rlstages.engines.rollout.hf_rollout:HFRolloutEngine",
        {"model_path": str(path), "dtype": rollout_dtype, "apply_chat_template": False},
    )


def shared(engine: HybridEngine) -> int:
    """How many rollout parameters live in the trainer's memory."""
    trainer = {p.untyped_storage().data_ptr() for p in engine.trainer.backend.model.parameters()}
    return sum(p.untyped_storage().data_ptr() in trainer for p in engine.rollout.model.parameters())


def train_once(engine: HybridEngine) -> None:
    batch = engine.generate(PROMPTS, SAMPLING, seed=0)
    batch[T.ADVANTAGES] = torch.linspace(-1, 1, 8)[:, None] * batch[T.RESPONSE_MASK]
    engine.sleep()
    metrics = engine.train_step(batch)
    assert metrics["grad_norm"] > 0


def rollout_matches_trainer(engine: HybridEngine) -> float:
    """Largest |rollout log-prob - trainer log-prob| over the sampled tokens of a fresh batch."""
    batch = engine.generate(PROMPTS, SAMPLING, seed=1)
    mask = batch[T.RESPONSE_MASK].bool()
    diff = (engine.logprobs(batch)["logprobs"] - batch[T.ROLLOUT_LOGPROBS]).abs()
    return float(diff[mask].max())


def test_same_dtype_shares_the_trainers_weights_and_sync_copies_nothing(tiny_model_dir: Path) -> None:
    engine = hybrid(tiny_model_dir, "float32", "float32")
    n = len(list(engine.rollout.model.parameters()))
    assert engine.shares_weights and shared(engine) == n  # the rollout's own copy is gone from the start
    before = {k: v.clone() for k, v in engine.rollout.model.state_dict().items()}
    train_once(engine)
    metrics = engine.sync_local()
    assert metrics["sync/copied_tensors"] == 0 and metrics["sync/tensors"] > 0
    assert shared(engine) == n
    after = engine.rollout.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the update is what the rollout samples with
    assert rollout_matches_trainer(engine) < 1e-4
    engine.sleep()  # frees nothing (the weights are the trainer's); wake takes them again
    engine.wake()
    assert shared(engine) == n and rollout_matches_trainer(engine) < 1e-4


def test_another_dtype_keeps_its_own_copy_and_sync_casts_into_it(tiny_model_dir: Path) -> None:
    engine = hybrid(tiny_model_dir, "float32", "bfloat16")
    assert not engine.shares_weights and shared(engine) == 0  # bf16 rollout: a cast copy of fp32 weights
    train_once(engine)  # the rollout sleeps through it: its weights are freed
    assert all(p.numel() == 0 for p in engine.rollout.model.parameters())
    metrics = engine.sync_local()
    assert metrics["sync/copied_tensors"] == metrics["sync/tensors"] > 0
    trainer = dict(engine.trainer.backend.model.named_parameters())
    for name, param in engine.rollout.model.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, trainer[name].to(torch.bfloat16))


def test_lora_keeps_a_rollout_copy(tiny_model_dir: Path) -> None:
    """Under LoRA the trainer's HF weights are merged copies made per sync: the rollout keeps (and sleeps) its own."""
    from rlstages.configs.model import LoraSettings

    engine = hybrid(tiny_model_dir, "float32", "float32", lora=LoraSettings().model_dump(mode="json"))
    assert not engine.shares_weights
    train_once(engine)
    assert engine.sync_local()["sync/copied_tensors"] > 0 and rollout_matches_trainer(engine) < 1e-4


def test_the_cuda_cache_is_released_only_for_another_process(tiny_model_dir: Path, monkeypatch) -> None:
    """`empty_cache` (here recorded on the CPU) only where another process needs the blocks: sharing the trainer's
    weights, rollout and trainer share one allocator and keep their cache; with its own copy of the weights the
    rollout's memory is its own (vLLM's in the GPU case), so the trainer hands its blocks back."""
    from rlstages.engines.rollout import hf_rollout
    from rlstages.engines.runtime import device as D

    released: list[str] = []
    monkeypatch.setattr(hf_rollout, "free_cached", lambda device: released.append("rollout"))
    monkeypatch.setattr(D, "free_cached", lambda device: released.append("trainer"))
    one = hybrid(tiny_model_dir, "float32", "float32")
    assert one.shares_weights and not one.trainer.shares_device and not one.rollout.shares_device
    train_once(one)
    assert released == []
    own = hybrid(tiny_model_dir, "float32", "bfloat16")
    assert not own.shares_weights and own.trainer.shares_device and own.rollout.shares_device
    train_once(own)
    assert released == ["rollout", "trainer"]  # after generating, after the update
