"""Weight ops are invertible, the registry dispatches by model_type, and a user template works end to end.

Run: .venv/bin/pytest tests/engines/convert/test_convert_templates.py -q   (CPU only, ~5 s, no megatron-core)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from convert_fixtures import hf_tensors, make_hf_model, rewrite_tensors
from safetensors.torch import load_file

from rlstages.engines.convert import (
    QKV,
    AttentionDims,
    Concat,
    ConversionSpec,
    Drop,
    QKVBias,
    Rename,
    Stack,
    StackedParts,
    convert_hf_to_mcore,
    get_template,
    materialize,
    mcore_to_hf,
    register_template,
    registered_templates,
    transformer_config_kwargs,
)
from rlstages.engines.convert.template import _TEMPLATES

DIMS = AttentionDims(heads=8, groups=2, head_dim=4)


@pytest.fixture
def scratch_templates():
    """Templates registered by a test are removed afterwards."""
    before = dict(_TEMPLATES)
    yield
    _TEMPLATES.clear()
    _TEMPLATES.update(before)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_qkv_grouped_layout_and_inverse(device: str) -> None:
    q, k, v = torch.randn(32, 16), torch.randn(8, 16), torch.randn(8, 16)
    op = QKV(["q", "k", "v"], "qkv")
    fused = materialize(op.to_mcore([t.to(device) for t in (q, k, v)], DIMS)[0])
    assert fused.shape == (48, 16)
    if device == "meta":
        return
    # group g = [4 q heads (16 rows), k head g (4 rows), v head g (4 rows)]
    assert torch.equal(fused[:16], q[:16]) and torch.equal(fused[16:20], k[:4]) and torch.equal(fused[20:24], v[:4])
    assert torch.equal(fused[24:40], q[16:]) and torch.equal(fused[40:44], k[4:]) and torch.equal(fused[44:], v[4:])
    for a, b in zip(op.to_hf([fused], DIMS), (q, k, v), strict=True):
        assert torch.equal(a, b)
    bias = QKVBias(["q", "k", "v"], "qkv")
    qb, kb, vb = torch.randn(32), torch.randn(8), torch.randn(8)
    fused_b = materialize(bias.to_mcore([qb, kb, vb], DIMS)[0])
    assert torch.equal(fused_b[16:20], kb[:4])
    assert all(torch.equal(a, b) for a, b in zip(bias.to_hf([fused_b], DIMS), (qb, kb, vb), strict=True))


def test_stack_concat_rename_drop_are_invertible() -> None:
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    (stacked,) = Stack(["g", "u"], "fc1").to_mcore([gate, up], DIMS)
    assert isinstance(stacked, StackedParts) and stacked.shape == (12, 4)
    back = Stack(["g", "u"], "fc1").to_hf([stacked.merged()], DIMS)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)
    (cat,) = Concat(["a", "b"], "ab", dim=1).to_mcore([gate, up], DIMS)
    assert cat.shape == (6, 8)
    assert torch.equal(Concat(["a", "b"], "ab", dim=1).to_hf([cat], DIMS)[1], up)
    assert torch.equal(Rename("a", "b").to_hf([gate], DIMS)[0], gate)
    assert Drop(".x.inv_freq").to_mcore([gate], DIMS) == []


def test_wildcards_carry_values() -> None:
    op = Rename("visual.{}", "vision_model.{}")
    assert op.match("hf", "visual.blocks.3.attn.weight") == (0, ("blocks.3.attn.weight",))
    assert op.match("hf", "model.norm.weight") is None
    layer_op = Stack([".experts.{}.w1", ".experts.{}.w3"], ".mlp.experts.local_experts.{}.linear_fc1.weight")
    assert layer_op.match("hf", ".experts.7.w3") == (1, ("7",)) and layer_op.is_layer_op


def test_op_definition_errors() -> None:
    with pytest.raises(ValueError, match="mix layer suffixes"):
        Rename(".a.weight", "b.weight")
    with pytest.raises(ValueError, match="same number of"):
        Rename("a.{}", "b")
    with pytest.raises(ValueError, match="exactly 3 hf_names"):
        QKV(["q", "k"], "qkv")


def test_registry_errors(scratch_templates) -> None:
    assert {"llama", "qwen2", "qwen3", "mistral"} <= set(registered_templates())
    with pytest.raises(ValueError, match="already registered; pass replace=True"):
        register_template("llama", {}, [], "model.layers.")
    with pytest.raises(ValueError, match="tp_rules values must be one of"):
        register_template("x1", {}, [], "model.layers.", tp_rules={".w": "diagonal"})
    with pytest.raises(ValueError, match="must end with '.'"):
        register_template("x2", {}, [], "model.layers")
    with pytest.raises(KeyError, match=r"'nope'; registered: \["):
        get_template("nope")


def test_transformer_config_kwargs() -> None:
    qwen2 = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5}  # fmt: skip
    kw = transformer_config_kwargs(qwen2, tp=2)
    assert kw["num_query_groups"] == 2 and kw["kv_channels"] == 8 and kw["ffn_hidden_size"] == 96
    assert kw["add_qkv_bias"] is True and kw["add_bias_linear"] is False and kw["normalization"] == "RMSNorm"
    assert kw["activation_func"] is torch.nn.functional.silu and kw["layernorm_epsilon"] == 1e-5
    assert "padded_vocab_size" not in kw and "rotary_base" not in kw  # GPTModel arguments, not TransformerConfig
    qwen3 = ConversionSpec.from_hf_config({**qwen2, "model_type": "qwen3", "head_dim": 16})
    assert qwen3.mcore["qk_layernorm"] is True and qwen3.mcore["kv_channels"] == 16
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    llama = ConversionSpec.from_hf_config({**qwen2, "model_type": "llama", "rope_parameters": rope})
    assert llama.gpt_model_kwargs()["rope_scaling"] is True and llama.gpt_model_kwargs()["rotary_base"] == 5e5
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        ConversionSpec.from_hf_config({**qwen2, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


# --- a user template, as in docs/new-model.md ------------------------------------------------------------

TOY_NAMES = {  # HF Llama name -> the toy model's own name
    "model.embed_tokens.weight": "backbone.wte.weight",
    "model.norm.weight": "backbone.ln_f.weight",
    "lm_head.weight": "head.weight",
}
TOY_SUFFIXES = {
    ".input_layernorm.weight": ".ln_1.weight",
    ".self_attn.q_proj.weight": ".attn.wq.weight",
    ".self_attn.k_proj.weight": ".attn.wk.weight",
    ".self_attn.v_proj.weight": ".attn.wv.weight",
    ".self_attn.o_proj.weight": ".attn.wo.weight",
    ".post_attention_layernorm.weight": ".ln_2.weight",
    ".mlp.gate_proj.weight": ".ffn.w1.weight",
    ".mlp.up_proj.weight": ".ffn.w3.weight",
    ".mlp.down_proj.weight": ".ffn.w2.weight",
}


def _toy_name(name: str) -> str:
    if name in TOY_NAMES:
        return TOY_NAMES[name]
    layer, suffix = name[len("model.layers.") :].split(".", 1)
    return f"backbone.blocks.{layer}{TOY_SUFFIXES['.' + suffix]}"


def register_toy() -> None:
    register_template(
        "toy_gpt",
        {"n_layer": "num_layers", "d_model": "hidden_size", "n_head": "num_attention_heads",
         "n_kv_head": "num_query_groups", "d_ff": "ffn_hidden_size", "vocab": "padded_vocab_size",
         "eps": "layernorm_epsilon", "rope_base": "rotary_base", "tied": "share_embeddings_and_output_weights",
         "max_len": "max_sequence_length"},  # fmt: skip
        [
            Rename("backbone.wte.weight", "embedding.word_embeddings.weight"),
            Rename("backbone.ln_f.weight", "decoder.final_layernorm.weight"),
            Rename("head.weight", "output_layer.weight"),
            Rename(".ln_1.weight", ".input_layernorm.weight"),
            QKV([".attn.wq.weight", ".attn.wk.weight", ".attn.wv.weight"], ".self_attention.linear_qkv.weight"),
            Rename(".attn.wo.weight", ".self_attention.linear_proj.weight"),
            Rename(".ln_2.weight", ".pre_mlp_layernorm.weight"),
            Stack([".ffn.w1.weight", ".ffn.w3.weight"], ".mlp.linear_fc1.weight"),
            Rename(".ffn.w2.weight", ".mlp.linear_fc2.weight"),
        ],
        "backbone.blocks.",
        {"normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False, "add_qkv_bias": False,
         "activation_func": "silu", "position_embedding_type": "rope", "rotary_percent": 1.0, "hidden_dropout": 0.0},
        mcore_model_cls="my_models.toy:ToyGPTModel",
    )  # fmt: skip


def test_user_template_matches_builtin_llama(scratch_templates, tmp_path: Path) -> None:
    """A renamed Llama under a user template converts to exactly the Megatron tensors of the llama template."""
    llama = make_hf_model(tmp_path / "llama", "llama", vocab=100)
    toy = tmp_path / "toy"
    toy.mkdir()
    cfg = json.loads((llama / "config.json").read_text())
    toy_cfg = {"model_type": "toy_gpt", "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 64,
               "vocab": 100, "eps": cfg["rms_norm_eps"], "rope_base": 10000.0, "tied": False,
               "max_len": 128}  # fmt: skip
    (toy / "config.json").write_text(json.dumps(toy_cfg))
    (toy / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    rewrite_tensors(toy, lambda t: {_toy_name(k): v for k, v in t.items()})
    register_toy()
    ours = convert_hf_to_mcore(toy, tmp_path / "toy_mcore", tp=2)
    ref = convert_hf_to_mcore(llama, tmp_path / "llama_mcore", tp=2)
    for rank in ("mp_rank_00", "mp_rank_01"):
        a, b = load_file(ours / rank / "model.safetensors"), load_file(ref / rank / "model.safetensors")
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    spec = ConversionSpec.load(ours)
    assert spec.template.mcore_model_cls == "my_models.toy:ToyGPTModel"
    assert spec.transformer_kwargs()["num_layers"] == 2
    back = dict(mcore_to_hf(ours))
    expected = hf_tensors(toy)
    assert sorted(back) == sorted(expected) and all(torch.equal(back[k], expected[k]) for k in back)


def test_user_template_missing_config_field(scratch_templates, tmp_path: Path) -> None:
    register_toy()
    hf = tmp_path / "toy"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "toy_gpt", "n_layer": 2, "n_head": 4}))
    with pytest.raises(ValueError, match=r"missing 'd_model' \(Megatron hidden_size\), 'd_ff'"):
        convert_hf_to_mcore(hf, tmp_path / "out")
