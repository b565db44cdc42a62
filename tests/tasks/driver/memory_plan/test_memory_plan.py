"""The memory plan against reality: a torch-backend train step on the tiny Qwen2 (weights, gradients and AdamW
states exactly; saved activations within the stated tolerance), the seed presets' sizes against their published
parameter counts, and the fit check with its advice. CPU only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlstages.configs import load_config
from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines import types as T
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.training import ppo_step as P
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.microbatch import by_length, micro_batches
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.tasks.driver.memory_plan import load_dims, micro_batch_tokens, plan

ROOT = Path(__file__).resolve().parents[4]
# Saved activations: the plan counts what fused kernels keep (Megatron / Transformer Engine); transformers' RoPE is
# unfused and keeps a few more tensors per layer, while the CPU trainer's RMSNorm and SwiGLU (`lean_layers`) keep
# less than the plan's SwiGLU (3 intermediate-wide tensors to its 4): an HF forward measures 0.9-1.3 of the plan.
ACTIVATION_TOLERANCE = (0.9, 1.3)
PUBLISHED_BILLIONS = {"qwen2_7b": 7.62, "qwen3_235b": 235.1, "deepseek_v3_671b": 671.0}  # the models' cards


def _storage_bytes(tensors) -> int:  # type: ignore[no-untyped-def]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_plan_matches_a_torch_train_step(tiny_model_dir: Path) -> None:
    rollout = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    prompts = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
    batch = rollout.generate(prompts, SamplingParams(n=1, max_new_tokens=8), seed=0)
    batch[T.ADVANTAGES] = torch.ones_like(batch[T.RESPONSE_MASK], dtype=torch.float32)
    prompt_len, response_len = batch[T.PROMPT_IDS].shape[1], batch[T.RESPONSE_IDS].shape[1]
    options = TorchTrainingConfig(optim=OptimConfig(lr=1e-3), micro_batch_size=4)
    engine = PPOTrainer(TrainerSettings(str(tiny_model_dir), role="actor", train=options))
    engine.train_step(batch)
    model, optimizer = engine.backend.model, engine.backend.optimizer
    assert optimizer is not None

    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"data.max_prompt_length={prompt_len}",
            f"rollout.max_new_tokens={response_len}",
            "actor.micro_batch_size=4",
        ],
    )
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    rank = plan(cfg, hf).fullest
    assert rank.role == "actor" and rank.params == sum(p.numel() for p in model.parameters())
    assert rank.gpu["weights"] == _storage_bytes(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert rank.gpu["optimizer"] == pytest.approx(_storage_bytes(states), rel=1e-6)

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, _ = P.causal_lm_forward(model, batch, 1.0, False)
    (logprobs * batch[T.RESPONSE_MASK]).sum().backward()
    measured = sum(n for ptr, n in saved.items() if ptr not in weights)
    planned = rank.gpu["activations"] + rank.gpu["logits"]
    low, high = ACTIVATION_TOLERANCE
    print(f"saved activations {measured} B, planned {planned:.0f} B, ratio {measured / planned:.3f}")
    assert low * planned <= measured <= high * planned, (measured, planned)
    assert rank.gpu["grads"] == _storage_bytes(p.grad for p in model.parameters())


def test_with_shared_prompts_the_plan_bounds_what_a_micro_batch_puts_through(tiny_model_dir: Path) -> None:
    """Under share_prompt_forward the budget counts responses (the trainer's `prompt_once`) and the step's prompts
    stay in flight until its backward: the plan's tokens cover the largest micro-batch the trainer forms plus
    those prompts, and its logits the responses alone."""
    rollout = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    prompts = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
    batch = rollout.generate(prompts, SamplingParams(n=4, max_new_tokens=8), seed=0)
    prompt_len, response_len = batch[T.PROMPT_IDS].shape[1], batch[T.RESPONSE_IDS].shape[1]
    budget = 2 * response_len
    overrides = [
        f"model.path={tiny_model_dir}",
        f"data.max_prompt_length={prompt_len}",
        f"rollout.max_new_tokens={response_len}",
        "rollout.n=4",
        "data.prompts_per_step=4",
        "actor.dynamic_batching=true",
        f"actor.max_tokens_per_micro_batch={budget}",
    ]
    shared = load_config(ROOT / "configs" / "tiny.yaml", [*overrides, "actor.share_prompt_forward=true"])
    rows_whole = load_config(ROOT / "configs" / "tiny.yaml", [*overrides, "actor.share_prompt_forward=false"])

    ordered, _ = by_length(batch, prompt_once=True)
    mbs = micro_batches(ordered, 16, True, budget, prompt_once=True)
    responses = max(mb[T.RESPONSE_IDS].shape[1] * mb.batch_size[0] for mb in mbs)
    step_prompts = len(prompts) * prompt_len  # every prompt once, kept for the step's backward
    assert len(mbs) > 1 and micro_batch_tokens(shared, shared.actor) >= responses + step_prompts
    assert micro_batch_tokens(rows_whole, rows_whole.actor) == budget  # a row's prompt counted in the budget
    assert micro_batch_tokens(shared, shared.actor, "critic") == budget  # a critic reads every row whole

    hf = json.loads((tiny_model_dir / "config.json").read_text())
    dims, _ = load_dims(shared, hf)
    actor = plan(shared, hf).fullest
    assert actor.role == "actor"
    assert actor.gpu["logits"] == budget * dims.vocab * 4  # fp32 log-softmax of the responses only
    assert actor.gpu["activations"] > plan(rows_whole, hf).fullest.gpu["activations"]


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_preset_sizes_match_their_published_models(name: str) -> None:
    cfg = load_config(ROOT / "configs" / f"{name}_grpo_megatron.yaml", [])
    dims, source = load_dims(cfg, None)
    arch = cfg.model.architecture
    assert source == "published_models.json" and arch is not None
    assert (dims.layers, dims.heads, dims.kv_heads, dims.vocab) == (
        arch.num_hidden_layers,
        arch.num_attention_heads,
        arch.num_key_value_heads,
        arch.vocab_size,
    )
    assert dims.experts == (arch.num_experts or 0)
    assert dims.total_params() / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], rel=0.01)


def test_presets_on_h20_and_the_advice_when_not_fitting() -> None:
    preset = ROOT / "configs" / "qwen3_235b_grpo_megatron.yaml"
    fixed = plan(load_config(preset, []), None, "H20")  # as verl runs it: full recompute (its 96 GB script)
    assert fixed.fits is True
    tight = plan(load_config(preset, ["actor.gradient_checkpointing=false"]), None, "H20")
    assert tight.fits is False and any("gradient_checkpointing=true" in tip for tip in tight.advice)
    # the advice is what the preset does: full recompute brings the fullest stage under the H20's 96 GB
    assert fixed.fullest.peak < tight.fullest.peak
    # the layout: uneven stages (11 / 12 x 6 / 11 layers), experts split over EP, the fullest a middle stage
    assert [r.layers for r in tight.ranks if r.role == "actor"] == [11, 12, 12, 12, 12, 12, 12, 11]
    deepseek = plan(load_config(ROOT / "configs" / "deepseek_v3_671b_grpo_megatron.yaml", []), None, "H20")
    assert deepseek.fits is True and deepseek.nodes == 12
    assert 1000 < deepseek.node_cpu / 1e9 < 2000  # host memory per node (GB) near verl's 1,500 GB row


def test_unknown_model_and_gpu_are_named() -> None:
    cfg = load_config(ROOT / "configs" / "qwen2_7b_grpo_megatron.yaml", ["model.path=/models/Unknown-9B"])
    with pytest.raises(ValueError, match="Unknown-9B"):
        plan(cfg, None, "H20")
    with pytest.raises(ValueError, match="--gpu B300"):
        plan(load_config(ROOT / "configs" / "qwen2_7b_grpo_megatron.yaml", []), None, "B300")


def test_plan_command_prints_each_stage_and_exits_3_when_it_does_not_fit() -> None:
    from typer.testing import CliRunner

    from rlstages.flows.cli.main import app

    runner = CliRunner()
    fits = runner.invoke(app, ["plan", str(ROOT / "configs" / "deepseek_v3_671b_grpo_megatron.yaml"), "--gpu", "H20"])
    assert fits.exit_code == 0, fits.output
    assert "fits: True" in fits.output and "cpu_per_node_gib" in fits.output
    assert "actor   1-10" not in fits.output and " 11 " in fits.output  # stages differ: one line each
    qwen3 = str(ROOT / "configs" / "qwen3_235b_grpo_megatron.yaml")
    tight = runner.invoke(app, ["plan", qwen3, "--gpu", "H20", "actor.gradient_checkpointing=false"])
    assert tight.exit_code == 3 and "advice: actor.gradient_checkpointing=true" in tight.output
    shown = runner.invoke(
        app, ["config", "show", "--schema-only", str(ROOT / "configs" / "qwen2_7b_grpo_megatron.yaml")]
    )
    assert shown.exit_code == 0 and "#   gpu_peak_gib:" in shown.output


def test_a_vision_language_models_sizes_come_from_its_text_config(tiny_vlm_dir: Path) -> None:
    """transformers >= 5 keeps a Qwen2-VL's language sizes under `text_config` (`config show` read them at the top
    level and failed); the plan counts the language model, not the small vision tower."""
    from transformers import AutoModelForImageTextToText

    from rlstages.engines.memory_models.model import ModelDims

    hf = json.loads((tiny_vlm_dir / "config.json").read_text())
    dims = ModelDims.from_hf(hf)
    assert (dims.model_type, dims.hidden, dims.layers, dims.heads, dims.kv_heads, dims.vocab) == (
        "qwen2_vl",
        64,
        2,
        4,
        2,
        512,
    )
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    text = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.visual."))
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"model.path={tiny_vlm_dir}"])
    assert plan(cfg, hf).fullest.params == text


def test_without_a_prompt_length_the_plan_measures_the_datas_longest_prompt(tiny_model_dir: Path) -> None:
    """data.max_prompt_length unset: `rlstages plan` plans the data's longest prompt as the rollout engine tokenizes
    it (not 512 tokens); a set field is used as given, and a plan that does not measure says it assumed."""
    from rlstages.tasks.driver.data.loading import load_rows
    from rlstages.tasks.driver.memory_plan.rank import DEFAULT_PROMPT_TOKENS

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"model.path={tiny_model_dir}"])
    assert cfg.data.max_prompt_length is None
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    rows = [*load_rows(cfg.data, "train"), *load_rows(cfg.data, "eval")]
    rollout = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=cfg.data.apply_chat_template)
    prompts = [r.prompt(f"u{i}") for i, r in enumerate(rows)]
    batch = rollout.generate(prompts, SamplingParams(n=1, max_new_tokens=1), seed=0)  # left-padded to the longest
    measured, assumed = plan(cfg, hf, measure_prompts=True), plan(cfg, hf)
    assert measured.prompt_tokens == batch[T.PROMPT_IDS].shape[1]
    assert measured.prompt_tokens < DEFAULT_PROMPT_TOKENS and "measured" in measured.summary()["prompt_tokens"]
    assert assumed.prompt_tokens == DEFAULT_PROMPT_TOKENS and "assumed" in assumed.summary()["prompt_tokens"]
    assert measured.fullest.gpu["activations"] < assumed.fullest.gpu["activations"]
    given = load_config(ROOT / "configs" / "tiny.yaml", [f"model.path={tiny_model_dir}", "data.max_prompt_length=40"])
    assert plan(given, hf, measure_prompts=True).prompt_tokens == 40
