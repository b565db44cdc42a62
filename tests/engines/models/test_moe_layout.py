"""MoE expert layouts: a transformers >= 5 model's fused experts leave `named_weights` in the on-disk layout (one
tensor per expert, what `save_pretrained` writes and vLLM loads), and the HF rollout engine takes that layout back
into its fused parameters (update and adopt).

Run: .venv/bin/python -m pytest tests/engines/models/test_moe_layout.py -q   (CPU, tiny models, ~10 s)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlstages.engines.models.moe_layout import ExpertSlots, disk_named_weights, fused_expert_names
from rlstages.engines.models.tiny_tokenizer import build_char_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "convert"))
from moe_fixtures import make_moe_model  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for model_type in ("qwen3_moe", "mixtral", "deepseek_v3"):
        for seed in (0, 1):
            path = make_moe_model(root / f"{model_type}-{seed}", model_type, vocab=128, seed=seed)
            build_char_tokenizer(128).save_pretrained(path)
            out[f"{model_type}-{seed}"] = path
    return out


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_named_weights_in_disk_layout_and_back(dirs: dict[str, Path], model_type: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dirs[f"{model_type}-0"])
    assert fused_expert_names(model)  # transformers holds the experts fused in memory
    disk = dict(disk_named_weights(model, model.state_dict().items()))
    on_file = load_file(dirs[f"{model_type}-0"] / "model.safetensors")
    assert sorted(disk) == sorted(on_file) and all(torch.equal(disk[k], on_file[k]) for k in on_file)
    fresh = AutoModelForCausalLM.from_pretrained(dirs[f"{model_type}-1"])
    slots, params = ExpertSlots(fresh), fresh.state_dict()
    with torch.no_grad():
        for name, tensor in disk.items():
            target, index = slots.target(name) or (name, ())
            params[target][index].copy_(tensor)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), params.values(), strict=True))


def test_dense_models_pass_through(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    items = list(model.state_dict().items())
    assert list(disk_named_weights(model, iter(items))) == items and not ExpertSlots(model).slots


def test_hf_rollout_takes_the_disk_layout(dirs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    from rlstages.engines.rollout.hf_rollout import HFRolloutEngine

    engine = HFRolloutEngine(dirs["mixtral-0"], dtype="float32", apply_chat_template=False)
    source = AutoModelForCausalLM.from_pretrained(dirs["mixtral-1"])
    named = list(disk_named_weights(source, source.state_dict().items()))
    assert any(".block_sparse_moe.experts.3.w2.weight" in n for n, _ in named)
    rest = engine.adopt_weights(iter(named))
    assert rest and all(".block_sparse_moe." in n for n, _ in rest)  # experts and router: copied, not adopted
    engine.update_weights(iter(rest))
    expected = source.state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in engine.model.state_dict().items())
