"""Mixture-of-Experts conversion: qwen3_moe, mixtral, deepseek_v3 round trip bit-exact at EP 1/2 x TP 1/2 x PP 1/2
(and TP2 x PP2 x EP2 with expert TP 1: experts whole in every TP rank's file),
the rank files hold Megatron's expert-parallel layout, completeness errors name the tensor, the config maps
routing and the dense/MoE layer pattern, and the weight-sync export gathers experts over the EP group.

Run: .venv/bin/python -m pytest tests/engines/convert/test_convert_moe.py -q
Hardware: CPU; no megatron-core; one test starts 4 local gloo processes (TP2 x EP2); ~30 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from convert_fixtures import hf_tensors, rewrite_tensors
from moe_fixtures import MOE_TYPES, make_moe_model
from safetensors.torch import load_file

from rlstages.engines.convert import (
    ConversionError,
    ConversionSpec,
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    mcore_to_hf,
    transformer_config_kwargs,
    verify_manifest,
)
from rlstages.engines.convert.hf_to_mcore import spec_rank_file
from rlstages.engines.megatron.gloo_world import run_world

# (tp, pp, ep, expert tp): every TP x PP x EP with expert TP = TP, and the presets' expert TP 1 under TP 2
LAYOUTS = [(tp, pp, ep, None) for ep in (1, 2) for tp in (1, 2) for pp in (1, 2)] + [(2, 2, 2, 1)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-hf")
    return {t: make_moe_model(root / t, t) for t in MOE_TYPES}


MOE_BLOCK = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe", "deepseek_v3": "mlp"}
MOE_GATE = {"qwen3_moe": "gate_proj", "mixtral": "w1", "deepseek_v3": "gate_proj"}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_every_layout_round_trips_bit_exact(models: dict[str, Path], tmp_path: Path) -> None:
    for model_type, hf in models.items():
        original = hf_tensors(hf)
        assert any(".experts.3." in n for n in original)  # the on-disk layout: one tensor per expert
        for tp, pp, ep, etp in LAYOUTS:
            out = convert_hf_to_mcore(hf, tmp_path / f"{model_type}-{tp}{pp}{ep}{etp}", tp=tp, pp=pp, ep=ep, etp=etp)
            assert_same(original, dict(mcore_to_hf(out)))
            manifest = verify_manifest(out)
            assert manifest["ep"] == ep and manifest.get("etp") == etp
            assert len([f for f in manifest["files"] if f.endswith("model.safetensors")]) == tp * pp * ep
            if etp is None:
                continue
            spec = ConversionSpec.load(out)
            assert spec.expert_tp == etp and spec.with_layout(tp, pp, ep=ep, etp=etp) == spec
            last = load_file(out / spec_rank_file(spec, 1, 1, 1))  # TP rank 1, last stage, EP rank 1
            fc1 = last["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]  # global expert 3
            gate = original[f"model.layers.1.{MOE_BLOCK[model_type]}.experts.3.{MOE_GATE[model_type]}.weight"]
            assert fc1.shape[0] == 2 * gate.shape[0]  # whole (gate and up), not split over the TP ranks
            assert last["decoder.layers.0.self_attention.linear_proj.weight"].shape[1] * 2 == gate.shape[1]


def test_expert_parallel_rank_files(models: dict[str, Path], tmp_path: Path) -> None:
    hf = hf_tensors(models["qwen3_moe"])
    out = convert_hf_to_mcore(models["qwen3_moe"], tmp_path / "m", tp=2, ep=2)
    spec = ConversionSpec.load(out)
    assert (spec.ep, spec.experts_per_rank) == (2, 2)
    assert spec_rank_file(spec, 1, 0, 1) == "mp_rank_01_001/model.safetensors"  # Megatron-LM's _EEE suffix
    layer = "model.layers.1.mlp."
    for tp_rank in range(2):
        ranks = [load_file(out / spec_rank_file(spec, tp_rank, 0, e)) for e in range(2)]
        for ep_rank, shard in enumerate(ranks):
            names = [n for n in shard if ".experts." in n]
            assert {re.search(r"local_experts\.(\d+)\.", n)[1] for n in names} == {"0", "1"}  # renumbered
            for local in range(2):
                e = ep_rank * 2 + local  # contiguous: EP rank 1 holds experts 2 and 3
                fc1 = shard[f"decoder.layers.1.mlp.experts.local_experts.{local}.linear_fc1.weight"]
                gate, up = hf[f"{layer}experts.{e}.gate_proj.weight"], hf[f"{layer}experts.{e}.up_proj.weight"]
                assert torch.equal(fc1, torch.cat([gate.chunk(2)[tp_rank], up.chunk(2)[tp_rank]]))  # per-half TP
                fc2 = shard[f"decoder.layers.1.mlp.experts.local_experts.{local}.linear_fc2.weight"]
                assert torch.equal(fc2, hf[f"{layer}experts.{e}.down_proj.weight"].chunk(2, dim=1)[tp_rank])
        router = [r["decoder.layers.1.mlp.router.weight"] for r in ranks]
        assert torch.equal(router[0], hf[f"{layer}gate.weight"]) and torch.equal(router[1], router[0])  # replicated
    # in-memory rank state dicts keyed (tp, pp, ep) give the same HF tensors
    dicts = {(t, 0, e): load_file(out / spec_rank_file(spec, t, 0, e)) for t in range(2) for e in range(2)}
    assert_same(hf, dict(mcore_to_hf(dicts, spec)))


def test_deepseek_layers_mla_and_router_bias(models: dict[str, Path], tmp_path: Path) -> None:
    hf = hf_tensors(models["deepseek_v3"])
    out = convert_hf_to_mcore(models["deepseek_v3"], tmp_path / "m", pp=2, ep=2)
    spec = ConversionSpec.load(out)
    assert spec.mcore["moe_layer_freq"] == [0, 1] and spec.mcore["multi_latent_attention"] is True
    first, last = load_file(out / spec_rank_file(spec, 0, 0, 1)), load_file(out / spec_rank_file(spec, 0, 1, 1))
    assert "decoder.layers.0.mlp.linear_fc1.weight" in first and not any(".experts." in n for n in first)
    att = "decoder.layers.0.self_attention."
    assert torch.equal(
        first[f"{att}linear_kv_down_proj.weight"], hf["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    )
    assert torch.equal(first[f"{att}q_layernorm.weight"], hf["model.layers.0.self_attn.q_a_layernorm.weight"])
    bias = hf["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(last["decoder.layers.0.mlp.router.expert_bias"], bias)  # global layer 1, local 0
    shared = torch.cat([hf[f"model.layers.1.mlp.shared_experts.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(last["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"], shared)
    assert torch.equal(
        last["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"],
        hf["model.layers.1.mlp.experts.3.down_proj.weight"],
    )


def test_export_directory_loads_in_transformers(models: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = models["mixtral"]
    back = convert_mcore_to_hf(convert_hf_to_mcore(hf, tmp_path / "m", tp=2, ep=2), tmp_path / "hf")
    assert_same(hf_tensors(hf), hf_tensors(back))
    ids = torch.tensor([[1, 5, 7, 42, 9]])
    original, exported = AutoModelForCausalLM.from_pretrained(hf), AutoModelForCausalLM.from_pretrained(back)
    assert torch.equal(original(ids).logits, exported(ids).logits)


def test_config_maps_routing_and_layer_pattern(tmp_path: Path) -> None:
    hf = make_moe_model(tmp_path / "q", "qwen3_moe", layers=4, norm_topk_prob=False, mlp_only_layers=[0, 2])
    kw = transformer_config_kwargs(json.loads((hf / "config.json").read_text()), tp=2, ep=2)
    assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 16
    assert kw["moe_router_pre_softmax"] is True  # softmax over all experts, top-k not renormalised
    assert kw["moe_layer_freq"] == [0, 1, 0, 1] and kw["qk_layernorm"] is True
    out = convert_hf_to_mcore(hf, tmp_path / "m", pp=2, ep=2)  # dense and MoE layers mixed, round trip
    assert_same(hf_tensors(hf), dict(mcore_to_hf(out)))
    deepseek = json.loads((make_moe_model(tmp_path / "d", "deepseek_v3") / "config.json").read_text())
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}  # fmt: skip
    kw = transformer_config_kwargs({**deepseek, "rope_parameters": yarn, "n_group": 2, "topk_group": 1})
    assert (kw["rope_type"], kw["rotary_scaling_factor"], kw["mscale_all_dim"]) == ("yarn", 40.0, 1.0)
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"]) == (2, 1)
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"] is True
    with pytest.raises(ValueError, match="topk_group"):
        transformer_config_kwargs({**deepseek, "n_group": 2, "topk_group": 2})


def test_completeness_and_layout_errors(models: dict[str, Path], tmp_path: Path) -> None:
    hf = Path(shutil.copytree(models["qwen3_moe"], tmp_path / "hf"))
    gone = "model.layers.1.mlp.experts.3.down_proj.weight"
    rewrite_tensors(hf, lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(ConversionError, match=r"never produced.*decoder\.layers\.1\.mlp\.experts\.local_experts\.3"):
        convert_hf_to_mcore(hf, tmp_path / "a", ep=2)
    stray = "model.layers.0.mlp.gate_proj.weight"  # a dense MLP tensor in an MoE layer: no Megatron home
    rewrite_tensors(hf, lambda t: {**t, gone: torch.zeros(32, 16), stray: torch.zeros(64, 32)})
    with pytest.raises(ConversionError, match=re.escape(stray)):
        convert_hf_to_mcore(hf, tmp_path / "b")
    with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by expert parallel size ep=3"):
        convert_hf_to_mcore(models["mixtral"], tmp_path / "c", ep=3)
    with pytest.raises(ValueError, match=r"etp=2: the expert tensor parallel size must divide tp=1"):
        convert_hf_to_mcore(models["mixtral"], tmp_path / "c", ep=2, etp=2)
    from convert_fixtures import make_hf_model

    dense = make_hf_model(tmp_path / "dense", "qwen3")
    with pytest.raises(ValueError, match="expert parallelism needs a Mixture-of-Experts model"):
        convert_hf_to_mcore(dense, tmp_path / "d", ep=2)
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_rank_export_gathers_experts_over_ep(models: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    hf = models["qwen3_moe"]
    out = convert_hf_to_mcore(hf, tmp_path / "m", tp=2, ep=2)
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    names = run_world(
        "moe_fixtures:ep_export_worker", 4, {"mcore_dir": str(out), "out_dir": str(tmp_path), "tp": 2, "ep": 2}
    )
    assert all(n == names[0] for n in names)  # every rank yields every expert
    expected = hf_tensors(hf)
    for rank in range(4):
        assert_same(expected, load_file(tmp_path / f"rank{rank}.safetensors"))


def test_transformer_engine_names(models: dict[str, Path], tmp_path: Path) -> None:
    for model_type in ("qwen3_moe", "deepseek_v3"):
        hf = models[model_type]
        out = convert_hf_to_mcore(hf, tmp_path / model_type, transformer_impl="transformer_engine", tp=2, ep=2)
        spec = ConversionSpec.load(out)
        names = set(load_file(out / spec_rank_file(spec, 0, 0, 1)))
        assert spec.mcore["moe_grouped_gemm"] is True
        assert {
            "decoder.layers.1.mlp.experts.linear_fc1.weight0",
            "decoder.layers.1.mlp.experts.linear_fc2.weight1",
        } <= names
        assert not any("local_experts" in n for n in names)
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in names  # an MoE layer's norm stays separate in TE
        assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in names or model_type == "deepseek_v3"
        assert_same(hf_tensors(hf), dict(mcore_to_hf(out)))
    assert "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight" in names  # MLA: fused q norm
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names  # DeepSeek's dense first layer: fused


def test_expert_tp_between_one_and_tp(tmp_path: Path) -> None:
    # TP4 with expert TP 2: each expert split in two, TP rank t's file holding expert shard t % 2 (ranks 0 and 2 alike)
    for model_type in MOE_TYPES:
        hf = make_moe_model(tmp_path / model_type, model_type, num_key_value_heads=4)
        original = hf_tensors(hf)
        for ep in (1, 2):
            out = convert_hf_to_mcore(hf, tmp_path / f"m-{model_type}-{ep}", tp=4, ep=ep, etp=2)
            assert_same(original, dict(mcore_to_hf(out)))
            spec = ConversionSpec.load(out)
            assert (spec.tp, spec.expert_tp) == (4, 2)
            files = [load_file(out / spec_rank_file(spec, t, 0, 0)) for t in range(4)]
            name = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"  # an MoE layer in every type
            gate = original[f"model.layers.1.{MOE_BLOCK[model_type]}.experts.0.{MOE_GATE[model_type]}.weight"]
            assert files[0][name].shape[1] * 2 == gate.shape[0]  # fc2 split over the expert TP ranks (input dim)
            assert torch.equal(files[0][name], files[2][name]) and torch.equal(files[1][name], files[3][name])
            assert not torch.equal(files[0][name], files[1][name])
