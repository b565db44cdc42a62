"""The torch trainer with each policy loss and rollout IS weights in the batch: gradient accumulation stays exact
(micro-batches of 2 = one of 16) for the losses whose per-token value does not depend on the micro-batch, the
weights change the update, and every loss moves the parameters. CPU only, in-process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams

PROMPTS = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def batch(tiny_model_dir: Path):
    """16 rollouts with GRPO advantages; old log-probs = rollout's + noise (an off-policy pi_old) and TIS weights."""
    rollout = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    b = rollout.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=8), seed=0)
    mask = b[T.RESPONSE_MASK]
    scores = (torch.arange(16) % 3 == 0).float()
    adv, ret = A.compute_advantages("grpo", A.outcome_to_token_rewards(scores, mask), mask, T.get_rows(b, "uid"))
    b[T.ADVANTAGES], b[T.RETURNS] = adv, ret
    noise = 0.2 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    b[T.OLD_LOGPROBS] = b[T.ROLLOUT_LOGPROBS] + noise * mask
    b[T.ROLLOUT_IS_WEIGHTS] = A.rollout_is_weights(b[T.OLD_LOGPROBS], b[T.ROLLOUT_LOGPROBS], mask, "token")[0]
    return b


def step(path: Path, batch, micro: int, **loss) -> tuple[dict[str, float], list[torch.Tensor]]:
    options = TorchTrainingConfig(optim=OptimConfig(lr=1e-2, total_steps=10), micro_batch_size=micro)
    engine = PPOTrainer(TrainerSettings(str(path), train=options, loss=A.PolicyLossParams(**loss)))
    metrics = engine.train_step(batch)
    backend = engine.backend
    assert backend.optimizer is not None
    return metrics, [backend.optimizer.state[p]["exp_avg"].clone() for p in backend.model.parameters()]


@pytest.mark.parametrize(
    "loss",
    [
        {"name": "vanilla", "loss_agg_mode": "token-sum"},
        {"name": "gspo", "loss_agg_mode": "seq-mean-token-mean"},
        {"name": "cispo"},
    ],
    ids=lambda d: d["name"],
)
def test_accumulation_is_exact_with_is_weights(tiny_model_dir: Path, batch, loss: dict) -> None:
    m_small, g_small = step(tiny_model_dir, batch, 2, **loss)
    m_big, g_big = step(tiny_model_dir, batch, 16, **loss)
    assert m_small["grad_norm"] == pytest.approx(m_big["grad_norm"], rel=1e-4) and m_big["grad_norm"] > 0
    assert m_small["pg_loss"] == pytest.approx(m_big["pg_loss"], abs=1e-5)
    assert all(torch.allclose(a, b, atol=1e-7, rtol=1e-4) for a, b in zip(g_small, g_big, strict=True))


@pytest.mark.parametrize("name", A.POLICY_LOSSES)
def test_every_loss_trains_and_the_weights_matter(tiny_model_dir: Path, batch, name: str) -> None:
    weighted, _ = step(tiny_model_dir, batch, 16, name=name, clip_cov_ratio=0.5)
    unweighted, _ = step(tiny_model_dir, batch.exclude(T.ROLLOUT_IS_WEIGHTS), 16, name=name, clip_cov_ratio=0.5)
    assert math.isfinite(weighted["pg_loss"]) and weighted["grad_norm"] > 0
    if name != "clip_cov":  # clip_cov draws its detached tokens at random: the two runs differ anyway
        assert weighted["pg_loss"] != pytest.approx(unweighted["pg_loss"], abs=1e-7)


def test_the_gpu_fused_log_prob_pass_trains_as_the_eager_chunks(monkeypatch, tiny_model_dir: Path, batch) -> None:
    """Two GRPO steps with an entropy bonus at T=0.7 through the fused log-prob kernels (what a GPU compiles;
    traced here with aot_eager) leave the weights the eager chunks the CPU runs leave, and those moved."""
    from rlstages.engines.algorithms import fused_logits as F
    from rlstages.engines.algorithms import logits as L

    def train(fused: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        monkeypatch.setattr(L, "_use_fused", lambda logits: fused)
        options = TorchTrainingConfig(optim=OptimConfig(lr=1e-2, total_steps=10), micro_batch_size=8)
        params = A.PolicyLossParams(entropy_coeff=0.01)
        engine = PPOTrainer(TrainerSettings(str(tiny_model_dir), train=options, loss=params, temperature=0.7))
        start = [p.detach().clone() for p in engine.backend.model.parameters()]
        for _ in range(2):
            engine.train_step(batch)
        return start, [p.detach().clone() for p in engine.backend.model.parameters()]

    torch._dynamo.reset()  # a fresh compile cache: earlier tests' traces do not count toward the recompile limit
    monkeypatch.setattr(F.KERNELS, "compiled", {})
    monkeypatch.setattr(F.KERNELS, "failed", set())
    monkeypatch.setattr(F.KERNELS, "backend", "aot_eager")
    start, fused = train(True)
    _, eager = train(False)
    assert not F.KERNELS.failed
    # Adam divides each gradient by its own running scale, so where a gradient is near zero the two paths' rounding
    # (a different summation order; on an AVX-512/AMX Xeon 1 of 4,096 weights differed by 1.3e-5) shows in the step
    for a, b in zip(fused, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)
    assert max((a - b).abs().max().item() for a, b in zip(eager, start, strict=True)) > 1e-3  # >> the tolerance


def test_the_gpu_fused_decoder_kernels_train_as_transformers(monkeypatch, tiny_model_dir: Path, batch) -> None:
    """Two GRPO steps with the decoder's RMSNorm, SwiGLU and rotary embedding routed to the compiled functions
    (what a GPU's trainer does, `fused_elementwise`; traced here with aot_eager) leave the weights transformers'
    own kernels leave, and the trainer did route and compile them."""
    from rlstages.engines.models import fused_layers as FL

    def train(fuse: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        options = TorchTrainingConfig(optim=OptimConfig(lr=1e-2, total_steps=10), micro_batch_size=8)
        options = options.model_copy(update={"fuse_elementwise": fuse})
        engine = PPOTrainer(TrainerSettings(str(tiny_model_dir), train=options, loss=A.PolicyLossParams()))
        start = [p.detach().clone() for p in engine.backend.model.parameters()]
        for _ in range(2):
            engine.train_step(batch)
        return start, [p.detach().clone() for p in engine.backend.model.parameters()]

    torch._dynamo.reset()
    monkeypatch.setattr(FL.KERNELS, "devices", ("cpu",))
    monkeypatch.setattr(FL.KERNELS, "backend", "aot_eager")
    monkeypatch.setattr(FL.KERNELS, "compiled", {})
    monkeypatch.setattr(FL.KERNELS, "failed", set())
    start, fused = train(True)
    assert sorted(FL.KERNELS.compiled) == ["rms_norm", "rotary", "swiglu"] and not FL.KERNELS.failed
    monkeypatch.setattr(FL.KERNELS, "enabled", False)  # the rotary function stays routed in this process: turn it off
    _, eager = train(False)
    for a, b in zip(fused, eager, strict=True):  # Adam's first steps scale tiny gradient differences up to ~1e-5
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    assert max((a - b).abs().max().item() for a, b in zip(eager, start, strict=True)) > 1e-2
