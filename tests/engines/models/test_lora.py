"""LoRA on the actor (peft): only the adapter trains, the frozen base is the reference (no second copy),
rollouts get merged weights equal to peft's own merge, checkpoints hold the adapter and continue exactly,
export writes a merged HF model and the adapter. Tiny model, CPU."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.models import load_causal_lm, lora
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.training import state_io
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams

PARAMS = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ("q_proj", "v_proj", "down_proj")}


@pytest.fixture(scope="module")
def batch(tiny_model_dir: Path):
    rollout = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    prompts = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
    b = rollout.generate(prompts, SamplingParams(n=4, max_new_tokens=8), seed=0)
    scores = (torch.arange(16) % 3 == 0).float()
    token = A.outcome_to_token_rewards(scores, b[T.RESPONSE_MASK])
    b[T.ADVANTAGES], b[T.RETURNS] = A.compute_advantages("grpo", token, b[T.RESPONSE_MASK], T.get_rows(b, "uid"))
    return b


def actor(path: Path, role: str = "actor", lora_params: dict | None = None, **options) -> PPOTrainer:
    options.setdefault("micro_batch_size", 4)
    train = TorchTrainingConfig(optim=OptimConfig(lr=1e-2, total_steps=10), **options)
    return PPOTrainer(TrainerSettings(str(path), role=role, train=train, lora=lora_params))  # type: ignore[arg-type]


def test_wrap_freezes_the_base_and_merged_weights_match_peft(tiny_model_dir: Path) -> None:
    base = load_causal_lm(tiny_model_dir)
    names = [k for k, _ in lora.named_weights(base)]
    model = lora.wrap_lora(base, PARAMS)
    trainable = lora.trainable_parameters(model)
    assert trainable and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert sum(p.numel() for p in trainable) < 0.1 * sum(p.numel() for p in model.parameters())
    untouched = {k: v.clone() for k, v in lora.named_weights(model)}
    assert list(untouched) == names  # HF names, as the rollout engines expect
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    merged = dict(lora.named_weights(model))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    changed = 0
    for name in names:
        torch.testing.assert_close(merged[name], reference[name], rtol=0, atol=1e-6)
        changed += not torch.equal(merged[name], untouched[name])
    assert changed == 3 * 2  # q_proj, v_proj, down_proj in each of the 2 layers
    with pytest.raises(ValueError, match=r"model.lora.target_modules \['nope'\] are not linear layers"):
        lora.wrap_lora(load_causal_lm(tiny_model_dir), {**PARAMS, "target_modules": ("nope",)})


def test_lora_actor_trains_the_adapter_and_its_base_is_the_reference(tiny_model_dir: Path, batch) -> None:
    engine = actor(tiny_model_dir, lora_params=PARAMS)
    plain = actor(tiny_model_dir, role="reference")
    before = dict(engine.named_weights())
    engine.train_step(batch)
    engine.train_step(batch)
    after = dict(engine.named_weights())
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved and all(any(t in k for t in PARAMS["target_modules"]) for k in moved)
    ref = engine.logprobs(batch, base=True)["logprobs"]
    torch.testing.assert_close(ref, plain.logprobs(batch)["logprobs"], rtol=0, atol=1e-6)
    assert (engine.logprobs(batch)["logprobs"] - ref).abs().max() > 1e-4  # the adapter changed the policy
    weight_ids = {id(p) for p in engine.backend.model.parameters()}
    assert len(weight_ids) == len(list(engine.backend.model.parameters()))  # one copy of each weight
    # the merged weights are the trained policy: a plain model loaded with them gives the same log-probs
    plain.backend.model.load_state_dict(after, strict=False)
    torch.testing.assert_close(plain.logprobs(batch)["logprobs"], engine.logprobs(batch)["logprobs"], atol=1e-5, rtol=0)


def test_lora_with_the_shared_prompt_forward_gives_the_same_update(tiny_model_dir: Path, batch) -> None:
    """The demo's settings (one forward per distinct prompt, eager attention) under LoRA: the same log-probs,
    the same reference (base) log-probs and the same adapter gradients as the plain forward."""
    shared = actor(tiny_model_dir, lora_params=PARAMS, share_prompt_forward=True, attention="eager", micro_batch_size=8)
    plain = actor(tiny_model_dir, lora_params=PARAMS, micro_batch_size=8)
    for base in (False, True):
        torch.testing.assert_close(
            shared.logprobs(batch, base=base)["logprobs"],
            plain.logprobs(batch, base=base)["logprobs"],
            atol=1e-5,
            rtol=0,
        )
    assert shared.train_step(batch)["grad_norm"] == pytest.approx(plain.train_step(batch)["grad_norm"], rel=1e-4)
    opt_shared, opt_plain = shared.backend.optimizer, plain.backend.optimizer
    assert opt_shared is not None and opt_plain is not None
    pairs = zip(opt_shared.param_groups[0]["params"], opt_plain.param_groups[0]["params"], strict=True)
    for p_shared, p_plain in pairs:  # the adapters' first moments: (1 - beta1) x the gradient
        torch.testing.assert_close(
            opt_shared.state[p_shared]["exp_avg"], opt_plain.state[p_plain]["exp_avg"], atol=1e-7, rtol=1e-4
        )


def test_checkpoint_holds_the_adapter_and_continues_exactly(tiny_model_dir: Path, batch, tmp_path: Path) -> None:
    engine = actor(tiny_model_dir, lora_params=PARAMS)
    engine.train_step(batch)
    engine.save(tmp_path / "ckpt")
    saved = load_file(str(tmp_path / "ckpt" / state_io.MODEL_FILE))
    assert saved and all("lora_" in k for k in saved)
    engine.train_step(batch)
    expected = dict(engine.named_weights())
    restored = actor(tiny_model_dir, lora_params=PARAMS)
    restored.load(tmp_path / "ckpt")
    restored.train_step(batch)
    for k, v in restored.named_weights():
        assert torch.equal(v, expected[k]), k


def test_export_writes_merged_model_and_adapter(tiny_model_dir: Path, batch, tmp_path: Path) -> None:
    from peft import PeftModel

    engine = actor(tiny_model_dir, lora_params=PARAMS)
    engine.train_step(batch)
    engine.save_pretrained(tmp_path / "out", tokenizer_from=tiny_model_dir)
    merged = load_causal_lm(tmp_path / "out")
    ids = batch[T.PROMPT_IDS][:2]
    with torch.no_grad():
        want = engine.backend.model(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        adapted = PeftModel.from_pretrained(load_causal_lm(tiny_model_dir), str(tmp_path / "out" / lora.ADAPTER_DIR))
        torch.testing.assert_close(adapted(input_ids=ids).logits, want, atol=1e-5, rtol=0)
    assert (tmp_path / "out" / "tokenizer.json").is_file()
