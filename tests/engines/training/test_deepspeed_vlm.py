"""The PPO trainer on the DeepSpeed backend with image batches (a tiny Qwen2-VL widened so ZeRO-3 partitions its
vision tower): one process under ZeRO-2 with a frozen vision tower, and 2 ZeRO-3 ranks on Ray where one rank's rows
are text only (the dummy vision pass keeps the collectives matched).

CPU only, real DeepSpeed (skipped when it is not installed): `.venv/bin/python -m pytest -q
tests/engines/training/test_deepspeed_vlm.py` (the JIT-built ops as in test_deepspeed_trainer.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from deepspeed_support import (  # noqa: E402
    EXT_DIR,
    one_process_group,  # noqa: F401 (the module's autouse fixture)
    rank_weights,
    settings,
    ship_to_ray,
    snapshot,
    torch_engine,
)

from rlstages.configs.training import DeepSpeedTrainingConfig, OptimConfig  # noqa: E402
from rlstages.engines import algorithms as A  # noqa: E402
from rlstages.engines import types as T  # noqa: E402
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine  # noqa: E402
from rlstages.engines.training.core import PPOTrainer  # noqa: E402
from rlstages.engines.training.settings import TrainerSettings  # noqa: E402
from rlstages.engines.types import Prompt, SamplingParams  # noqa: E402
from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec  # noqa: E402


def setup_module() -> None:
    """Ship this module's helper functions to Ray workers by value (test files are not importable there)."""
    ship_to_ray(sys.modules[__name__])


# ---- image batches (a tiny Qwen2-VL) -------------------------------------------------------------------------------
def png(colour: tuple[int, int, int], size: int) -> bytes:
    """A PNG of a square of `colour` on grey."""
    import io

    from PIL import Image

    img = Image.new("RGB", (size, size), (128, 128, 128))
    img.paste(colour, (8, 8, size - 8, size - 8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def wide_vlm_dir(session_tmp: Path) -> Path:
    """The tiny Qwen2-VL with a vision tower of width 96, so ZeRO-3 really partitions its patch embedding (113k
    elements) and projector (147k), above DeepSpeed's 1e5 persistence threshold."""
    from rlstages.engines.models.vision import build_tiny_vlm

    path = session_tmp / "wide-qwen2-vl"
    if not (path / "config.json").is_file():
        build_tiny_vlm(path, vision_width=96)
    return path


@pytest.fixture(scope="module")
def vlm_batch(wide_vlm_dir: Path):
    """Two image prompts (4 and 16 image tokens), then two text prompts, 2 samples each: rows 0-3 hold images,
    rows 4-7 are text only (split over 2 ranks in order: rank 1's rows are all text)."""
    rollout = HFRolloutEngine(wide_vlm_dir, dtype="float32", apply_chat_template=False)
    prompts = [
        Prompt("i0", "<image>What colour?", "red", images=(png((255, 0, 0), 56),)),
        Prompt("i1", "Which <image>?", "blue", images=(png((0, 0, 255), 112),)),
        Prompt("t0", "2+2=", "4"),
        Prompt("t1", "3+3=", "6"),
    ]
    b = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=6), seed=0)
    token = A.outcome_to_token_rewards(torch.tensor([1.0, 0.0] * 4), b[T.RESPONSE_MASK])
    b[T.ADVANTAGES], b[T.RETURNS] = A.compute_advantages("grpo", token, b[T.RESPONSE_MASK], T.get_rows(b, "uid"))
    return b


def test_image_batch_step_with_frozen_vision_tower(wide_vlm_dir: Path, vlm_batch) -> None:
    """One process, ZeRO-2: pixel values concatenated per micro-batch and M-RoPE positions passed (trainer
    log-probs = rollout log-probs), `actor.freeze` and `optim.group_lr` as in the torch backend."""
    from rlstages.engines.models.vision import component

    optim = OptimConfig(lr=1e-2, total_steps=10, group_lr={"projector": 0.5})
    engine = PPOTrainer(
        TrainerSettings(
            str(wide_vlm_dir),
            train=DeepSpeedTrainingConfig(optim=optim, micro_batch_size=2, zero_stage=2, freeze=("vision_tower",)),
        )
    )
    before = snapshot(engine)
    metrics = engine.train_step(vlm_batch)
    assert metrics["logprob_diff"] < 1e-4 and metrics["grad_norm"] > 0
    moved = {component(k) for k, v in engine.named_weights() if not torch.equal(before[k], v)}
    assert moved == {"projector", "language_model"}
    assert {g["name"]: g["lr"] for g in engine.backend.optimizer.param_groups} == {
        "projector": 0.5,
        "language_model": 1e-2,
    }


def test_two_ranks_zero3_with_a_text_only_rank(ray_session, wide_vlm_dir: Path, vlm_batch) -> None:
    """ZeRO-3 over 2 ranks on Ray, rank 0's rows with images and rank 1's text only: each forward gathers the
    vision tower's partitioned weights and each backward reduces its gradients, so rank 1 runs the zero-weighted
    dummy vision pass; without it the ranks hang (the timeouts turn a hang into a failure). Log-probs equal the
    rollout's; after a step the vision tower and projector moved and are equal on both ranks."""
    from rlstages.engines.models.vision import component, has_images

    assert [has_images(r) for r in T.chunk_for_ranks(vlm_batch, 2)] == [True, False]
    spec = GroupSpec(
        name="ds-dp2-z3-vlm",
        engine="rlstages.engines.training.core:PPOTrainer",
        kwargs={"settings": settings(wide_vlm_dir, "deepspeed", micro_batch_size=2, zero_stage=3)},
        num_workers=2,
        env={"TORCH_EXTENSIONS_DIR": EXT_DIR, "DS_ACCELERATOR": "cpu"},
    )
    group = ActorGroup(spec, namespace="rlstages-tests")
    try:
        logp = group.dp(300).logprobs(vlm_batch)["logprobs"]
        diff = (logp - vlm_batch[T.ROLLOUT_LOGPROBS]).abs() * vlm_batch[T.RESPONSE_MASK]
        assert diff.max() < 1e-4
        per_rank = group.dp(120).train_step(vlm_batch)
        assert per_rank[0]["grad_norm"] == per_rank[1]["grad_norm"] > 0
        w0, w1 = group.all(120).__ray_call__(rank_weights)
        assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
        start = dict(torch_engine(wide_vlm_dir).named_weights())
        moved = {component(k) for k in start if not torch.equal(w0[k], start[k])}
        assert moved == {"vision_tower", "projector", "language_model"}
    finally:
        group.kill()
