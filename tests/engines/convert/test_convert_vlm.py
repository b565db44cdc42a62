"""The qwen2_vl and qwen2_5_vl templates: HF -> Megatron-Core -> HF bit-exact at TP 1/2 x PP 1/2, the vision tower
renamed (`visual.{}` -> `vision_model.{}`) and placed on the first pipeline stage only, whole on every TP rank; the
language part's config read from `text_config` with M-RoPE; the in-memory names convert like the on-disk ones.

Run: .venv/bin/pytest tests/engines/convert/test_convert_vlm.py -q   (CPU only, a few seconds, no megatron-core)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from convert_fixtures import hf_tensors
from safetensors.torch import load_file, save_file

from rlstages.engines.convert import ConversionSpec, convert_hf_to_mcore, mcore_to_hf
from rlstages.engines.convert.hf_to_mcore import rank_file
from rlstages.engines.models.vision import module_name

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


@pytest.fixture(scope="module")
def vlm_dirs(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rlstages.engines.models import build_tiny_model

    out = tmp_path_factory.mktemp("vlm") / "qwen2_5_vl"
    return {"qwen2_vl": tiny_vlm_dir, "qwen2_5_vl": build_tiny_model(out, model_type="qwen2_5_vl")}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_round_trip_and_placement(vlm_dirs: dict[str, Path], tmp_path: Path, model_type: str) -> None:
    hf = hf_tensors(vlm_dirs[model_type])
    visual = {k: v for k, v in hf.items() if k.startswith("visual.")}
    assert visual and any(k.startswith("visual.merger.") for k in visual)
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        out = convert_hf_to_mcore(vlm_dirs[model_type], tmp_path / f"tp{tp}pp{pp}", tp=tp, pp=pp)
        assert_same(hf, dict(mcore_to_hf(out)))
        for t in range(tp):
            for p in range(pp):
                rank = load_file(out / rank_file(t, p, pp))
                vision = {k[len("vision_model.") :]: v for k, v in rank.items() if k.startswith("vision_model.")}
                if p == 0:  # the first stage holds the whole tower and projector on every TP rank
                    assert_same(vision, {k[len("visual.") :]: v for k, v in visual.items()})
                else:
                    assert not vision
    spec = ConversionSpec.load(tmp_path / "tp2pp2")
    assert spec.mcore["position_embedding_type"] == "mrope" and spec.mcore["mrope_section"] == [2, 3, 3]
    assert spec.mcore["num_layers"] == 2 and spec.mcore["hidden_size"] == 64 and spec.mcore["add_qkv_bias"]
    assert spec.template.mcore_model_cls == "rlstages.engines.megatron.vlm_model:QwenVLModel"


def test_in_memory_names_convert_like_on_disk_names(vlm_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = vlm_dirs["qwen2_vl"]
    memory = tmp_path / "memory"
    shutil.copytree(src, memory)
    tensors = load_file(memory / "model.safetensors")
    renamed = {module_name(k): v for k, v in tensors.items()}
    assert any(k.startswith("model.language_model.layers.") for k in renamed)
    assert any(k.startswith("model.visual.") for k in renamed)
    save_file(renamed, memory / "model.safetensors", metadata={"format": "pt"})
    a = convert_hf_to_mcore(src, tmp_path / "a", tp=2, pp=2)
    b = convert_hf_to_mcore(memory, tmp_path / "b", tp=2, pp=2)
    for t, p in [(0, 0), (1, 0), (0, 1), (1, 1)]:
        assert_same(load_file(a / rank_file(t, p, 2)), load_file(b / rank_file(t, p, 2)))
    assert_same(tensors, dict(mcore_to_hf(b)))  # exports use the checkpoint's names


def test_flat_text_keys_and_a_missing_mrope_section(vlm_dirs: dict[str, Path]) -> None:
    config = json.loads((vlm_dirs["qwen2_vl"] / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **config, "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    spec = ConversionSpec.from_hf_config(flat)  # an older checkpoint: the text keys at the top level
    assert spec.mcore["num_layers"] == 2 and spec.mcore["mrope_section"] == [2, 3, 3]
    with pytest.raises(ValueError, match="mrope_section must list 3 sections"):
        ConversionSpec.from_hf_config({**flat, "rope_scaling": {"type": "mrope", "mrope_section": [8, 8]}})
