"""Vision-language models on the embedded default: a tiny random Qwen2-VL through the registry, HF rollout with
images (greedy tokens equal `model.generate`'s), torch training on image batches (trainer and rollout log-probs
agree, one GRPO step moves the weights, freezing and per-part learning rates), on-disk weight names."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.models import load_causal_lm
from rlstages.engines.models.vision import (
    component,
    dummy_vision_pass,
    has_images,
    module_name,
    vision_token_ids,
    zero_image_output,
)
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.rollout.vision_inputs import encode_image_prompts
from rlstages.engines.training import ppo_step as P
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams


def png(colour: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    """A PNG of a square of `colour` on grey."""
    img = Image.new("RGB", size, (128, 128, 128))
    img.paste(colour, (8, 8, size[0] - 8, size[1] - 8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# different image sizes (4 and 12 image tokens) and text lengths: rows of different lengths, left padding
PROMPTS = [
    Prompt("u0", "<image>What colour?", "red", images=(png((255, 0, 0), (56, 56)),)),
    Prompt(
        "u1",
        "Look: <image> and <image>. Which?",
        "blue",
        images=(png((0, 0, 255), (112, 84)), png((0, 255, 0), (56, 56))),
    ),
    Prompt("u2", "<image>What colour?", "green", images=(png((0, 255, 0), (56, 56)),)),
]


@pytest.fixture(scope="module")
def rollout(tiny_vlm_dir: Path) -> HFRolloutEngine:
    return HFRolloutEngine(tiny_vlm_dir, dtype="float32", apply_chat_template=False, batch_size=8)


@pytest.fixture(scope="module")
def batch(rollout: HFRolloutEngine):
    b = rollout.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6), seed=0)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    token = A.outcome_to_token_rewards(scores, b[T.RESPONSE_MASK])
    b[T.ADVANTAGES], b[T.RETURNS] = A.compute_advantages("grpo", token, b[T.RESPONSE_MASK], T.get_rows(b, "uid"))
    return b


def trainer(path: Path, **train) -> PPOTrainer:
    optim = train.pop("optim", OptimConfig(lr=1e-2, total_steps=10))
    options = TorchTrainingConfig(optim=optim, micro_batch_size=2, **train)
    return PPOTrainer(TrainerSettings(str(path), train=options))


def test_greedy_tokens_equal_generate(rollout: HFRolloutEngine) -> None:
    out = rollout.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=8), seed=0)
    model = rollout.model
    for i, p in enumerate(PROMPTS):  # each prompt alone, transformers' own positions (get_rope_index, rope_deltas)
        enc = encode_image_prompts(model, rollout.tokenizer, rollout.image_processor, [p], False, None)[0]
        ids = torch.tensor([enc.ids])
        kinds = (ids == model.config.image_token_id).int()
        ref = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=kinds,
            **enc.inputs, max_new_tokens=8, do_sample=False, eos_token_id=sorted(rollout.eos_ids),
            suppress_tokens=vision_token_ids(model.config),
        )[0, ids.shape[1]:].tolist()  # fmt: skip
        n = int(out[T.RESPONSE_MASK][i].sum())
        assert out[T.RESPONSE_IDS][i, :n].tolist() == ref[:n] and n == len(ref)
    assert int((out[T.PROMPT_IDS][1] == model.config.image_token_id).sum()) == 12 + 4  # every image token kept


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_image_prompts_share_their_prefill(rollout: HFRolloutEngine, temperature: float) -> None:
    """The n samples of an image prompt share its prefill, keyed by its tokens and its images (prompts 0 and 2 have
    the same tokens, different images: two prefills): the same tokens (greedy, and sampled from one seed) and
    log-probs as prefilling every row whole."""
    from rlstages.engines.rollout.decode import decode
    from rlstages.engines.rollout.vision_inputs import ImageBatch

    model = rollout.model
    prompts = encode_image_prompts(model, rollout.tokenizer, rollout.image_processor, PROMPTS, False, None)
    assert prompts[0].ids == prompts[2].ids
    rows = [p for p in prompts for _ in range(3)]
    enc = rollout.tokenizer.pad({"input_ids": [p.ids for p in rows]}, padding=True, return_tensors="pt")
    pick = rollout._picker(SamplingParams(temperature=temperature))
    outs = []
    for share in (True, False):
        images = ImageBatch.of(rows, enc["input_ids"].shape[1], torch.device("cpu"), share)
        patches = images.inputs["pixel_values"].shape[0]
        assert patches == sum(p.inputs["pixel_values"].shape[0] for p in (prompts if share else rows))
        torch.manual_seed(0)
        outs.append(decode(model, enc["input_ids"], enc["attention_mask"], 8, rollout.eos_ids, pick, images=images))
    shared, whole = outs
    assert shared.ids == whole.ids
    for a, b in zip(shared.logprobs, whole.logprobs, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert shared.logprobs[0] != shared.logprobs[6]  # same tokens, other image: not shared


def test_batch_carries_image_inputs_and_positions(batch) -> None:
    mm = T.get_multi_modal(batch)
    assert [tuple(m["image_grid_thw"].shape) for m in mm] == [(1, 3)] * 2 + [(2, 3)] * 2 + [(1, 3)] * 2
    rope = batch[T.ROPE_POSITION_IDS]
    width = batch[T.PROMPT_IDS].shape[1]
    assert rope.shape == (6, 3, batch[T.ATTENTION_MASK].shape[1])
    # image tokens take 2-D positions (height and width differ), the response continues every channel by one
    assert bool((rope[2, 1, :width] != rope[2, 2, :width]).any())
    assert torch.equal(rope[:, 0, width + 1 :] - rope[:, 0, width:-1], torch.ones(6, rope.shape[2] - width - 1).long())


def test_pixel_values_travel_between_actors_without_copies(ray_session, batch) -> None:
    """Through Ray's object store (what an actor's return value and a large argument become): each prompt group's
    image inputs are one object read back as read-only views of the store's shared memory, not pickled copies."""
    sent = T.get_multi_modal(batch)
    assert sent[0] is sent[1] and sent[2] is sent[3] and sent[0] is not sent[2]  # one object per prompt group
    ref = ray_session.put(batch)
    back, twice = (T.get_multi_modal(ray_session.get(ref)) for _ in range(2))
    assert back[0] is back[1] and back[2] is back[3] and back[0] is not back[2]
    pixels = back[2]["pixel_values"]
    assert pixels.shape == (64, 1176) and back[2].shared  # read-only buffers of the object store
    assert twice[2]["pixel_values"].data_ptr() == pixels.data_ptr()  # two reads, one memory: no copy
    assert all(torch.equal(a[k], b[k]) for a, b in zip(sent, back, strict=True) for k in a)
    again = T.get_multi_modal(pickle.loads(pickle.dumps(batch)))  # plain pickle: in-band bytes, own memory
    assert not again[2].shared and torch.equal(again[2]["pixel_values"], pixels)


def test_logprobs_agree_through_a_batch_file(tiny_vlm_dir: Path, batch, tmp_path: Path) -> None:
    loaded = T.load_batch(T.save_batch(batch, tmp_path / "b.safetensors"))
    assert all(
        torch.equal(a["pixel_values"], b["pixel_values"])
        for a, b in zip(T.get_multi_modal(batch), T.get_multi_modal(loaded), strict=True)
    )
    out = trainer(tiny_vlm_dir, dynamic_batching=True, max_tokens_per_micro_batch=64).logprobs(loaded)
    diff = (out["logprobs"] - batch[T.ROLLOUT_LOGPROBS]).abs() * batch[T.RESPONSE_MASK]
    assert diff.max() < 1e-4


def test_shared_prompt_forward_on_image_batches(tiny_vlm_dir: Path, batch) -> None:
    """`actor.share_prompt_forward` on an image batch: each prompt (its tokens and images) forwarded once for its
    rows, the same log-probs and the same update (Adam's first moments, the vision tower's included) as
    forwarding every row whole."""
    shared = trainer(tiny_vlm_dir, share_prompt_forward=True)  # 3 micro-batches of 2 rows
    plain = trainer(tiny_vlm_dir)
    with torch.no_grad():
        assert len(P.SharedPrompts(plain.backend.model, [batch], False).index) == 3  # prompts 0, 2: other images
    mask = batch[T.RESPONSE_MASK]
    lp_shared, lp_plain = shared.logprobs(batch), plain.logprobs(batch)
    assert ((lp_shared["logprobs"] - lp_plain["logprobs"]).abs() * mask).max() < 1e-5
    m_shared, m_plain = shared.train_step(batch), plain.train_step(batch)
    assert m_shared["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=1e-4)
    opt_shared, opt_plain = shared.backend.optimizer, plain.backend.optimizer
    named = dict(plain.backend.model.named_parameters())
    for name, p_shared in shared.backend.model.named_parameters():
        grad_shared = opt_shared.state[p_shared]["exp_avg"]  # (1 - beta1) x the accumulated gradient
        assert torch.allclose(grad_shared, opt_plain.state[named[name]]["exp_avg"], atol=1e-7, rtol=1e-4), name
        assert grad_shared.any() or component(name) == "language_model", name  # the vision parts' gradients


def test_grpo_step_trains_the_vision_tower(tiny_vlm_dir: Path, batch) -> None:
    engine = trainer(tiny_vlm_dir)
    before = {k: v.clone() for k, v in engine.named_weights()}
    metrics = engine.train_step(batch)
    moved = {component(k) for k, v in engine.named_weights() if not torch.equal(before[k], v)}
    assert moved == {"vision_tower", "projector", "language_model"}
    assert metrics["grad_norm"] > 0 and metrics["logprob_diff"] < 1e-4


def test_freeze_and_per_part_learning_rates(tiny_vlm_dir: Path, batch) -> None:
    optim = OptimConfig(lr=1e-2, total_steps=10, group_lr={"projector": 0.5})
    engine = trainer(tiny_vlm_dir, freeze=("vision_tower",), optim=optim)
    before = {k: v.clone() for k, v in engine.named_weights()}
    engine.train_step(batch)
    moved = {component(k) for k, v in engine.named_weights() if not torch.equal(before[k], v)}
    assert moved == {"projector", "language_model"}
    lrs = {g["name"]: g["lr"] for g in engine.backend.optimizer.param_groups}
    assert lrs == {"projector": 0.5, "language_model": 1e-2}


def test_text_only_micro_batch_runs_a_zero_dummy_vision_pass(tiny_vlm_dir: Path, rollout: HFRolloutEngine) -> None:
    """A micro-batch without images (text prompts of a vision-language model) puts the vision tower and projector
    in the graph with weight 0 (`dummy_vision_pass`, what keeps ZeRO-3 / FSDP ranks in step): the same logits, the
    same language-model gradients, and zero (not missing) gradients on every vision parameter."""
    text = rollout.generate([Prompt("t0", "2+2=", "4"), Prompt("t1", "Say hi.", "hi")], SamplingParams(n=2), seed=0)
    assert not has_images(text)
    model = load_causal_lm(tiny_vlm_dir)
    runs = []
    for needed in (False, True):
        model.zero_grad(set_to_none=True)
        with dummy_vision_pass(model, needed):
            logits = P.response_logits(model, text, torch.device("cpu"))
        (logits.log_softmax(-1)[..., 0] * text[T.RESPONSE_MASK]).sum().backward()
        runs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (dummy, dummy_grads) = runs
    assert torch.equal(plain, dummy)
    vision = [n for n in plain_grads if component(n) != "language_model"]
    assert vision and all(plain_grads[n] is None for n in vision)
    assert all(dummy_grads[n] is not None and not dummy_grads[n].any() for n in vision)
    assert all(torch.equal(plain_grads[n], dummy_grads[n]) for n in plain_grads if n not in vision)
    model.zero_grad(set_to_none=True)  # the trainer's forward runs the dummy pass itself
    logp, _ = P.causal_lm_forward(model, text, 1.0, False)
    (logp * text[T.RESPONSE_MASK]).sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n in vision)


def test_preflight_lets_deepspeed_and_megatron_train_on_images() -> None:
    from rlstages.configs.loader import load_config
    from rlstages.tasks.driver.data.vision import _check_backends

    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
    _check_backends(load_config(tiny, ["actor.backend=deepspeed", "actor.zero_stage=3"]))  # no refusal
    _check_backends(load_config(tiny, ["actor.backend=megatron"]))
    cp = ["actor.backend=megatron", "actor.num_workers=2", "actor.context_parallel_size=2"]
    with pytest.raises(ValueError, match="actor.context_parallel_size=2: the megatron backend does not split"):
        _check_backends(load_config(tiny, cp))


def test_on_disk_names_map_onto_the_model(tiny_vlm_dir: Path, rollout: HFRolloutEngine) -> None:
    disk = load_file(str(tiny_vlm_dir / "model.safetensors"))
    assert any(k.startswith("visual.") for k in disk) and any(k.startswith("model.layers.") for k in disk)
    model = load_causal_lm(tiny_vlm_dir)  # through the registry: transformers' own class
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    params = dict(model.named_parameters())
    assert {module_name(k) for k in disk} == set(params)
    rollout.update_weights([(k, torch.zeros_like(v)) for k, v in disk.items() if k.startswith("visual.")])
    assert all(
        float(p.detach().abs().sum()) == 0 for n, p in rollout.model.named_parameters() if n.startswith("model.visual.")
    )
    rollout.update_weights(disk.items())  # back, by on-disk names


def test_smollm2_as_the_text_tower_keeps_its_text_logits() -> None:
    from rlstages.engines.models import ensure_model
    from rlstages.engines.models.vision import smollm2_vl

    text_dir = ensure_model(
        Path(__file__).resolve().parents[3] / ".cache" / "models" / "smollm2-135m-instruct", "smollm2-gguf"
    )
    vlm, tok = smollm2_vl(text_dir)
    text = load_causal_lm(text_dir)
    ids = tok("What colour is the square? Answer with one word.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = text(input_ids=ids).logits
        got = vlm(input_ids=ids).logits
    assert got.shape[-1] == want.shape[-1] + 4  # the four vision tokens (the video pad: vLLM's processor needs it)
    assert vlm.config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>") != vlm.config.image_token_id
    assert torch.allclose(got[..., : want.shape[-1]], want, atol=1e-4, rtol=1e-4)
    assert vlm.model.visual.blocks[0].attn.qkv.weight.requires_grad  # the vision tower: random, trained by RL
    out = vlm.model.visual.merger.mlp[-1]  # every image starts as SmolLM2's mean token embedding, not as zero
    mean = vlm.get_input_embeddings().weight[: want.shape[-1]].mean(0)
    assert not out.weight.any() and torch.allclose(out.bias, mean) and float(mean.norm()) > 1.0


def test_choice_reward_names_one_choice() -> None:
    from rlstages.engines.rewards.functions import choice

    info = {"choices": ["red", "green", "blue", "yellow"]}
    assert choice("", "Red.", "red", extra_info=info) == 1.0
    assert choice("", "The square is red", "red", extra_info=info) == 1.0
    assert choice("", "red or blue", "red", extra_info=info) == 0.0
    assert choice("", "green", "red", extra_info=info) == 0.0


def test_qwen2_5_vl_rollout_and_trainer_agree(tmp_path: Path) -> None:
    from rlstages.engines.models import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny-qwen2.5-vl", model_type="qwen2_5_vl")  # model.tiny.model_type
    engine = HFRolloutEngine(path, dtype="float32", apply_chat_template=False)
    assert type(engine.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    greedy = engine.generate(PROMPTS[:2], SamplingParams(n=1, temperature=0.0, max_new_tokens=5), seed=0)
    enc = encode_image_prompts(engine.model, engine.tokenizer, engine.image_processor, PROMPTS[1:2], False, None)[0]
    ids = torch.tensor([enc.ids])
    kinds = (ids == engine.model.config.image_token_id).int()
    ref = engine.model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=kinds,
        **enc.inputs, max_new_tokens=5, do_sample=False, eos_token_id=sorted(engine.eos_ids),
        suppress_tokens=vision_token_ids(engine.model.config),
    )[0, ids.shape[1] :].tolist()  # fmt: skip
    n = int(greedy[T.RESPONSE_MASK][1].sum())
    assert greedy[T.RESPONSE_IDS][1, :n].tolist() == ref[:n]
    assert (
        float(zero_image_output(engine.model.model.visual).detach()) == 0.0
    )  # its window attention takes the dummy image
    sampled = engine.generate(PROMPTS[:2], SamplingParams(n=2, max_new_tokens=5), seed=0)
    out = trainer(path).logprobs(sampled)
    assert ((out["logprobs"] - sampled[T.ROLLOUT_LOGPROBS]).abs() * sampled[T.RESPONSE_MASK]).max() < 1e-4
