"""Qwen2-VL / Qwen2.5-VL on the Megatron-Core backend (`engines/megatron/vlm_model.py`: the vision tower on the first
pipeline stage, image embeddings written into the image-token rows, megatron-core's M-RoPE) against HF and the torch
backend on the same weights and image batch (tiny random models: text hidden 64, 2 layers; one vision block of
width 32).

In this process at TP=1: trainer log-probs equal the torch backend's, the conversion is exact, one GRPO step gives the
same metrics and moved weights (vision tower and projector included), freezing and a per-part learning rate act as
on torch, and a megatron-core dist checkpoint (model + optimizer) loads back and continues bit for bit. Two 2-rank
gloo worlds: (1) HF-converted Qwen2-VL and Qwen2.5-VL at TP=2, at PP=2 and at TP=2 with sequence parallelism, and
that dist checkpoint (saved at TP=1) resharded to each: logits on image prompts equal HF's, and the vision tower's
gradient too; (2) the trainer itself at TP=2 with sequence parallelism and at PP=2: the torch backend's GRPO step.

Run: .venv/bin/python -m pytest tests/engines/megatron/test_megatron_vlm.py -q
Hardware: CPU only (megatron-core local spec, gloo, the cuda_shim); two 2-process worlds; ~35 s on 2 cores.
Skipped without megatron-core.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlstages.configs.training import MegatronTrainingConfig, OptimConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.models import load_causal_lm
from rlstages.engines.models.vision import forward_kwargs, module_name
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.training.core import PPOTrainer, without_perf
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams
from tests.engines.compare import masked_max, max_diff
from tests.engines.models.test_vlm import png

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")

LR = 1e-4
STEP_ATOL = 5e-2 * LR  # as test_megatron_trainer.py: a wrong-signed gradient moves an element by 2 lr


TWO_IMAGES = (png((0, 0, 255), (112, 84)), png((0, 255, 0), (56, 56)))
PROMPTS = [  # 4 and 12 + 4 image tokens, rows of different lengths (left padding)
    Prompt("u0", "<image>What colour?", "red", images=(png((255, 0, 0), (56, 56)),)),
    Prompt("u1", "Look: <image> and <image>. Which?", "blue", images=TWO_IMAGES),
]


def settings(path: Path, backend: str, group_lr: dict | None = None, **options) -> TrainerSettings:
    config = MegatronTrainingConfig if backend == "megatron" else TorchTrainingConfig
    optim = OptimConfig(lr=LR, total_steps=10, group_lr=group_lr or {})
    train = config(optim=optim, micro_batch_size=2, **options)  # 2 micro-batches of image rows
    return TrainerSettings(str(path), train=train)  # type: ignore[arg-type]


def weights(engine: PPOTrainer) -> dict[str, torch.Tensor]:
    """HF tensors in the in-memory naming (megatron exports the checkpoint's names, `visual.*`, `model.layers.*`)."""
    return {module_name(k): v.detach().clone() for k, v in engine.named_weights()}


@pytest.fixture(scope="module")
def batch(tiny_vlm_dir: Path):
    rollout = HFRolloutEngine(tiny_vlm_dir, dtype="float32", apply_chat_template=False, batch_size=8)
    b = rollout.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6), seed=0)
    # transformers gives the pad id's embedding row no gradient (padding_idx), megatron's embedding has one
    assert not (b[T.RESPONSE_IDS][b[T.RESPONSE_MASK].bool()] == rollout.pad_id).any()
    token = A.outcome_to_token_rewards(torch.tensor([1.0, 0.0, 0.0, 1.0]), b[T.RESPONSE_MASK])
    b[T.ADVANTAGES], b[T.RETURNS] = A.compute_advantages("grpo", token, b[T.RESPONSE_MASK], T.get_rows(b, "uid"))
    return b


@pytest.fixture(scope="module")
def megatron_step(tiny_vlm_dir: Path, batch, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The torch backend's and the megatron backend's (TP=1, converted in memory) log-probs, weights and one GRPO
    step; the megatron engine's dist checkpoint and HF export after it; a second engine loaded from the checkpoint."""
    root = tmp_path_factory.mktemp("mvlm")
    ref = PPOTrainer(settings(tiny_vlm_dir, "torch"))
    out = {"ref_logprobs": ref.logprobs(batch), "ref_before": weights(ref)}
    out["ref_metrics"], out["ref_after"] = ref.train_step(batch), weights(ref)
    engine = PPOTrainer(settings(tiny_vlm_dir, "megatron"))
    out["logprobs"], out["before"] = engine.logprobs(batch), weights(engine)
    out["metrics"], out["after"] = engine.train_step(batch), weights(engine)
    engine.save(root / "ckpt")
    engine.save_pretrained(root / "hf", tokenizer_from=tiny_vlm_dir)
    out["next"], out["next_weights"] = engine.train_step(batch), weights(engine)
    restored = PPOTrainer(settings(tiny_vlm_dir, "megatron"))
    restored.load(root / "ckpt")
    out["restored_after"] = weights(restored)
    out["restored_next"], out["restored_next_weights"] = restored.train_step(batch), weights(restored)
    out["ckpt"], out["hf"] = root / "ckpt" / "mcore", root / "hf"
    return out


def test_grpo_step_equals_the_torch_backend(megatron_step: dict, batch) -> None:
    run, mask = megatron_step, batch[T.RESPONSE_MASK]
    assert masked_max(run["logprobs"]["logprobs"], run["ref_logprobs"]["logprobs"], mask) <= 1e-5
    assert masked_max(run["logprobs"]["entropy"], run["ref_logprobs"]["entropy"], mask) <= 1e-5
    assert max_diff(run["before"], run["ref_before"]) == 0.0  # exact conversion, vision tower included
    metrics, ref = run["metrics"], run["ref_metrics"]
    assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert metrics["pg_loss"] == pytest.approx(ref["pg_loss"], abs=1e-6)
    assert metrics["entropy"] == pytest.approx(ref["entropy"], rel=1e-6)
    assert metrics["logprob_diff"] < 1e-5
    assert max_diff(run["after"], run["ref_after"]) <= STEP_ATOL
    for part in ("model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.mlp.2.weight"):  # tower, projector
        assert not torch.equal(run["after"][part], run["before"][part]), part


def test_dist_checkpoint_loads_back_and_continues_bitwise(megatron_step: dict) -> None:
    run = megatron_step
    assert (run["ckpt"] / "metadata.json").is_file()
    assert max_diff(run["restored_after"], run["after"]) == 0.0
    assert without_perf(run["restored_next"]) == without_perf(run["next"])
    assert max_diff(run["restored_next_weights"], run["next_weights"]) == 0.0


def test_freezing_and_a_projector_learning_rate_equal_the_torch_backend(tiny_vlm_dir: Path, batch) -> None:
    parts = {"freeze": ("vision_tower",), "group_lr": {"projector": 2 * LR}}
    ref = PPOTrainer(settings(tiny_vlm_dir, "torch", **parts))
    engine = PPOTrainer(settings(tiny_vlm_dir, "megatron", **parts))
    before = weights(engine)
    ref_metrics, metrics = ref.train_step(batch), engine.train_step(batch)
    after, ref_after = weights(engine), weights(ref)
    assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)  # over the trained parts only
    projector = [k for k in after if k.startswith("model.visual.merger.")]
    tower = [k for k in after if k.startswith("model.visual.") and k not in projector]
    assert tower and all(torch.equal(after[k], before[k]) for k in tower)  # frozen
    assert max_diff({k: after[k] for k in projector}, {k: ref_after[k] for k in projector}) <= 2 * STEP_ATOL
    assert max(float((after[k] - before[k]).abs().max()) for k in projector) > 1.5 * LR  # Adam's step: ~ its lr
    rest = [k for k in after if k not in projector]
    assert max_diff({k: after[k] for k in rest}, {k: ref_after[k] for k in rest}) <= STEP_ATOL


def hf_forward(path: Path, inputs: dict[str, torch.Tensor], images: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF model's logits, and its vision tower's flattened gradient of sum(logits * W) over the valid tokens (W
    = `parity.logit_weights`, as the megatron worker takes it)."""
    from rlstages.engines.megatron.parity import logit_weights

    model = load_causal_lm(path, "float32").eval()
    extra = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]} if images else {}
    logits = model(
        input_ids=inputs["input_ids"], attention_mask=inputs["valid"], position_ids=inputs["position_ids"], **extra
    ).logits
    weights = logit_weights(*logits.shape[:2], model.config.text_config.vocab_size)[..., : logits.shape[-1]]
    if images:
        (logits * weights * inputs["valid"][..., None]).sum().backward()
        grad = torch.cat([p.grad.flatten() for p in model.model.visual.parameters()])
    return logits.detach(), grad if images else torch.zeros(0)


def test_image_logits_equal_hf_at_tp2_pp2_and_sequence_parallel(
    tiny_vlm_dir: Path, batch, megatron_step: dict, tmp_path: Path
) -> None:
    from rlstages.engines.convert import convert_hf_to_mcore
    from rlstages.engines.megatron.parity import image_logits_many
    from rlstages.engines.models import build_tiny_model

    qwen25 = build_tiny_model(tmp_path / "qwen2_5_vl", model_type="qwen2_5_vl")  # same tokenizer and processor
    images = forward_kwargs(batch, torch.device("cpu"))
    inputs = {
        "input_ids": torch.cat([batch[T.PROMPT_IDS], batch[T.RESPONSE_IDS]], dim=1),
        "position_ids": images["position_ids"].contiguous(),
        "valid": batch[T.ATTENTION_MASK].long(),
        "pixel_values": images["pixel_values"],
        "image_grid_thw": images["image_grid_thw"],
    }
    assert inputs["input_ids"].shape[1] % 2  # an odd length: sequence parallelism pads it for its 2 slices
    save_file(inputs, tmp_path / "inputs.safetensors")
    layouts = [(2, 1, False), (1, 2, False), (2, 1, True)]  # TP2, PP2, TP2 with sequence parallelism
    cases = [
        [
            (convert_hf_to_mcore(tiny_vlm_dir, tmp_path / f"vl-{tp}-{pp}", tp=tp, pp=pp, overwrite=True), "ranks"),
            (convert_hf_to_mcore(qwen25, tmp_path / f"vl25-{tp}-{pp}", tp=tp, pp=pp, overwrite=True), "ranks"),
            (megatron_step["ckpt"], "dist_ckpt"),  # saved at TP=1 after a step, resharded
        ]
        for tp, pp, _ in layouts
    ]
    got = image_logits_many(cases, tmp_path / "inputs.safetensors", layouts)
    refs = [hf_forward(tiny_vlm_dir, inputs), hf_forward(qwen25, inputs), hf_forward(megatron_step["hf"], inputs)]
    valid = inputs["valid"].bool()
    for layout, outputs in zip(layouts, got, strict=True):
        for case, (mine, (ref, ref_grad)) in enumerate(zip(outputs, refs, strict=True)):
            diff = float((mine["logits"][..., : ref.shape[-1]][valid] - ref[valid]).abs().max())
            assert diff <= 1e-5, (layout, case, diff)
            if "vision_grad" in mine:  # TP layouts, rank-file cases: the vision tower's gradient is HF's
                assert float((mine["vision_grad"] - ref_grad).abs().max()) <= 1e-5 * float(ref_grad.abs().max())
    assert all("vision_grad" in got[i][c] for i in (0, 2) for c in (0, 1))
    without_images, _ = hf_forward(tiny_vlm_dir, inputs, images=False)  # the images change the logits: they are used
    mine = got[0][0]["logits"][..., : without_images.shape[-1]]
    assert float((mine[valid] - without_images[valid]).abs().max()) > 1e-3


def test_grpo_step_at_tp2_with_sequence_parallelism_and_at_pp2(
    tiny_vlm_dir: Path, batch, megatron_step: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer itself in one 2-process gloo world: TP=2 with sequence parallelism (each rank fills its slice's
    image tokens, the vision tower's gradients summed over TP) and PP=2 (1F1B over two image micro-batches) take
    the torch backend's GRPO step."""
    import os

    from safetensors.torch import load_file

    from rlstages.engines.megatron.gloo_world import run_world

    T.save_batch(batch, tmp_path / "batch.safetensors")
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    layouts = [
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},
        {"pipeline_model_parallel_size": 2},
    ]
    kwargs = {"model": str(tiny_vlm_dir), "batch": str(tmp_path / "batch.safetensors"), "out": str(tmp_path)}
    by_rank = run_world("megatron_vlm_worker:train_step_worker", 2, {**kwargs, "lr": LR, "layouts": layouts})
    ref, ref_after = megatron_step["ref_metrics"], megatron_step["ref_after"]
    for i, layout in enumerate(layouts):
        metrics = by_rank[-1][i]  # rank 1: the last pipeline stage at PP=2 (where the loss is), a TP rank at TP=2
        assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), layout
        assert metrics["pg_loss"] == pytest.approx(ref["pg_loss"], abs=1e-6), layout
        assert max_diff(load_file(tmp_path / f"{i}.safetensors"), ref_after) <= STEP_ATOL, layout
