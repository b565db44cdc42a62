"""HF -> Megatron-Core -> HF is bit-exact for every template and layout; the rank files have Megatron's layout.

Run: .venv/bin/pytest tests/engines/convert/test_convert_roundtrip.py -q   (CPU only, ~10 s, no megatron-core)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from convert_fixtures import TEMPLATES, hf_tensors, make_hf_model
from safetensors.torch import load_file

from rlstages.engines.convert import (
    ConversionSpec,
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    mcore_to_hf,
    read_manifest,
    verify_manifest,
)
from rlstages.engines.convert.hf_to_mcore import rank_file


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    """One tiny HF directory per (template, variant), built once for the module."""
    root = tmp_path_factory.mktemp("hf")
    cache: dict[tuple, Path] = {}

    def get(model_type: str, **kw) -> Path:
        key = (model_type, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_hf_model(root / f"m{len(cache)}", model_type, **kw)
        return cache[key]

    return get


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("model_type", TEMPLATES)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_bit_exact(models, tmp_path: Path, model_type: str, tp: int, pp: int, tie: bool) -> None:
    hf = models(model_type, tie=tie)
    out = convert_hf_to_mcore(hf, tmp_path / "mcore", tp=tp, pp=pp)
    assert_same(hf_tensors(hf), dict(mcore_to_hf(out)))
    verify_manifest(out)
    manifest = read_manifest(out)
    ranks = [f for f in manifest["files"] if f.endswith("model.safetensors")]
    assert len(ranks) == tp * pp
    last = load_file(out / rank_file(0, pp - 1, pp))
    # tied: no output layer with PP=1; a copy of the embedding on the last stage with PP>1 (reference C.2)
    assert ("output_layer.weight" in last) == (not tie or pp > 1)


@pytest.mark.parametrize(
    "model_type,variant",
    [
        ("llama", {"heads": 4, "kv_heads": 4}),  # MHA
        ("llama", {"attention_bias": True, "mlp_bias": True}),  # every linear has a bias
        ("qwen2", {"heads": 8, "kv_heads": 2, "hidden": 64}),  # r = 4 query heads per group
        ("qwen3", {"dtype": torch.bfloat16}),
        ("mistral", {"layers": 4, "max_shard_size": "20KB"}),  # many input shards
    ],
)
def test_round_trip_variants(models, tmp_path: Path, model_type: str, variant: dict) -> None:
    hf = models(model_type, **variant)
    for tp, pp in [(2, 1), (2, 2)]:
        out = convert_hf_to_mcore(hf, tmp_path / f"tp{tp}pp{pp}", tp=tp, pp=pp)
        assert_same(hf_tensors(hf), dict(mcore_to_hf(out)))


def test_export_directory_loads_in_transformers(models, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = models("qwen2", tie=True)
    mcore = convert_hf_to_mcore(hf, tmp_path / "mcore", tp=2, pp=2)
    back = convert_mcore_to_hf(mcore, tmp_path / "hf", max_shard_bytes=40_000)
    assert (back / "model.safetensors.index.json").is_file()  # sharded output, with its index
    assert_same(hf_tensors(hf), hf_tensors(back))
    original = AutoModelForCausalLM.from_pretrained(hf)
    exported = AutoModelForCausalLM.from_pretrained(back)
    ids = torch.tensor([[1, 5, 7, 42]])
    assert torch.equal(original(ids).logits, exported(ids).logits)


def test_qkv_and_fc1_layout_on_ranks(models, tmp_path: Path) -> None:
    """The rank files hold Megatron's exact layouts (C.2, C.4), not merely something invertible."""
    hf_dir = models("qwen2", heads=8, kv_heads=2, hidden=64)
    hf = hf_tensors(hf_dir)
    out = convert_hf_to_mcore(hf_dir, tmp_path / "m", tp=2)
    d, r = 8, 4  # head_dim, query heads per group
    layer = "model.layers.1."
    q, k, v = (hf[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv")
    gate, up = hf[f"{layer}mlp.gate_proj.weight"], hf[f"{layer}mlp.up_proj.weight"]
    for tp_rank in range(2):
        shard = load_file(out / rank_file(tp_rank, 0, 1))
        qkv = shard["decoder.layers.1.self_attention.linear_qkv.weight"]
        group = tp_rank  # 2 groups over 2 ranks: one group per rank
        expected = torch.cat(
            [q[group * r * d : (group + 1) * r * d], k[group * d : (group + 1) * d], v[group * d : (group + 1) * d]]
        )
        assert torch.equal(qkv, expected)
        half = gate.shape[0] // 2
        fc1 = shard["decoder.layers.1.mlp.linear_fc1.weight"]
        assert torch.equal(
            fc1, torch.cat([gate[tp_rank * half : (tp_rank + 1) * half], up[tp_rank * half : (tp_rank + 1) * half]])
        )
        proj = shard["decoder.layers.1.self_attention.linear_proj.weight"]
        assert torch.equal(proj, hf[f"{layer}self_attn.o_proj.weight"].chunk(2, dim=1)[tp_rank])
        emb = shard["embedding.word_embeddings.weight"]
        assert emb.shape[0] == 50  # vocab 99 padded to 100, split in two
    padded_last = load_file(out / rank_file(1, 0, 1))["embedding.word_embeddings.weight"]
    assert torch.equal(padded_last[-1], torch.zeros_like(padded_last[-1]))


def test_virtual_pipeline_layer_map(models, tmp_path: Path) -> None:
    hf_dir = models("llama", layers=4)
    hf = hf_tensors(hf_dir)
    out = convert_hf_to_mcore(hf_dir, tmp_path / "m", tp=1, pp=2, vpp=2)
    assert_same(hf, dict(mcore_to_hf(out)))
    stage1 = load_file(out / rank_file(0, 1, 2))
    # chunk c = v * pp + p owns layer c: stage 1 holds global layer 1 (model0) and 3 (model1)
    assert torch.equal(
        stage1["model0.decoder.layers.0.mlp.linear_fc2.weight"], hf["model.layers.1.mlp.down_proj.weight"]
    )
    assert torch.equal(
        stage1["model1.decoder.layers.0.mlp.linear_fc2.weight"], hf["model.layers.3.mlp.down_proj.weight"]
    )
    assert "model1.output_layer.weight" in stage1 and "model0.embedding.word_embeddings.weight" not in stage1


def test_transformer_engine_names(models, tmp_path: Path) -> None:
    hf_dir = models("qwen3")
    out = convert_hf_to_mcore(hf_dir, tmp_path / "te", transformer_impl="transformer_engine", tp=2)
    names = set(load_file(out / rank_file(0, 0, 1)))
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)
    assert_same(hf_tensors(hf_dir), dict(mcore_to_hf(out)))


def test_vocab_divisible_by_and_in_memory_ranks(models, tmp_path: Path) -> None:
    hf_dir = models("mistral")
    out = convert_hf_to_mcore(hf_dir, tmp_path / "m", tp=2, vocab_divisible_by=64)
    spec = ConversionSpec.load(out)
    assert spec.mcore["padded_vocab_size"] == 128 and spec.hf_vocab_size == 99
    ranks = {(t, 0): load_file(out / rank_file(t, 0, 1)) for t in range(2)}
    assert_same(hf_tensors(hf_dir), dict(mcore_to_hf(ranks, spec)))


def test_tied_checkpoint_with_lm_head_and_old_rotary_buffers(models, tmp_path: Path) -> None:
    from convert_fixtures import rewrite_tensors

    hf_dir = models("llama", tie=True, seed=3)
    rewrite_tensors(
        hf_dir,
        lambda t: {
            **t,
            "lm_head.weight": t["model.embed_tokens.weight"].clone(),
            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),
        },
    )
    out = convert_hf_to_mcore(hf_dir, tmp_path / "m")
    back = dict(mcore_to_hf(out))
    assert "lm_head.weight" not in back and "model.layers.0.self_attn.rotary_emb.inv_freq" not in back
    assert torch.equal(back["model.embed_tokens.weight"], hf_tensors(hf_dir)["model.embed_tokens.weight"])


@pytest.mark.parametrize("checksum", ["crc32", "sha256", "none"])
def test_other_checksums(models, tmp_path: Path, checksum: str) -> None:
    hf = models("qwen2")
    out = convert_hf_to_mcore(hf, tmp_path / "m", tp=2, checksum=checksum)
    manifest = verify_manifest(out)
    entry = manifest["files"]["mp_rank_01/model.safetensors"]
    assert manifest["checksum"] == checksum and (checksum in entry) == (checksum != "none")
    rank = out / "mp_rank_01" / "model.safetensors"
    data = bytearray(rank.read_bytes())
    data[-1] ^= 0xFF
    rank.write_bytes(bytes(data))
    if checksum != "none":
        with pytest.raises(ValueError, match=f"size or {checksum} differs"):
            verify_manifest(out)
    with pytest.raises(ValueError, match="checksum must be one of"):
        convert_hf_to_mcore(hf, tmp_path / "x", checksum="md5")


def test_outputs_record_configs(models, tmp_path: Path) -> None:
    hf_dir = models("qwen2")
    out = convert_hf_to_mcore(hf_dir, tmp_path / "m", tp=2, pp=2)
    saved = json.loads((out / "mcore_config.json").read_text())
    assert saved["tp"] == 2 and saved["pp"] == 2 and saved["template"] == "qwen2"
    assert saved["mcore"]["add_qkv_bias"] is True and saved["mcore"]["num_query_groups"] == 2
    assert json.loads((out / "hf" / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())


NO_MEGATRON = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ImportError("megatron-core is not installed (blocked by the test)")
sys.meta_path.insert(0, Block())
from rlstages.engines.convert import convert_hf_to_mcore, convert_mcore_to_hf
out = convert_hf_to_mcore(sys.argv[1], sys.argv[2], tp=2, pp=2)
convert_mcore_to_hf(out, sys.argv[3])
assert not any(m.startswith("megatron") for m in sys.modules)
print("ok")
"""


def test_pure_conversion_needs_no_megatron(models, tmp_path: Path) -> None:
    import subprocess
    import sys

    hf = models("qwen2")
    done = subprocess.run(
        [sys.executable, "-c", NO_MEGATRON, str(hf), str(tmp_path / "m"), str(tmp_path / "back")],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[3],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ok" in done.stdout
    assert_same(hf_tensors(hf), hf_tensors(tmp_path / "back"))
    assert not (tmp_path / "m-dist").exists()


@pytest.mark.parametrize("pp,vpp,first,last", [(2, None, 1, None), (3, None, 1, 2), (2, 2, 2, None)])
def test_uneven_pipeline_stages_round_trip(models, tmp_path: Path, pp: int, vpp, first, last) -> None:
    """megatron-core's num_layers_in_first/last_pipeline_stage: each stage's rank file holds the layers that
    megatron-core builds there (its own `get_transformer_layer_offset` / `get_num_layers_to_build` where
    installed), and the round trip is bit-exact."""
    layers = 6 if vpp else 5
    hf_dir = models("qwen2", layers=layers)
    hf = hf_tensors(hf_dir)
    out = convert_hf_to_mcore(hf_dir, tmp_path / "m", pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    assert_same(hf, dict(mcore_to_hf(out)))
    spec = ConversionSpec.load(out)
    assert (spec.first_stage_layers, spec.last_stage_layers) == (first, last)
    expected = megatron_chunk_layers(spec)
    assert spec.layer_map.chunk_layers() == expected
    for c, (p, v) in enumerate(spec.layer_map.chunks()):
        start, count = expected[c]
        prefix = f"model{v}." if vpp else ""
        names = load_file(out / rank_file(0, p, pp)).keys()
        local = {int(n[len(prefix) :].split(".")[2]) for n in names if n.startswith(prefix + "decoder.layers.")}
        assert local == set(range(count)), (p, v)
        fc2 = load_file(out / rank_file(0, p, pp))[f"{prefix}decoder.layers.{count - 1}.mlp.linear_fc2.weight"]
        assert torch.equal(fc2, hf[f"model.layers.{start + count - 1}.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match="do not split evenly"):
        convert_hf_to_mcore(hf_dir, tmp_path / "bad", pp=3, first_stage_layers=layers - 3)  # 3 left, 2 stages


def megatron_chunk_layers(spec: ConversionSpec) -> list[tuple[int, int]]:
    """(offset, layers) of each chunk in model order from megatron-core's own functions (the layer map's
    arithmetic when megatron-core is not installed)."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        return spec.layer_map.chunk_layers()
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vpp = spec.vpp if spec.vpp > 1 else None
    config = TransformerConfig(
        num_layers=spec.mcore["num_layers"], hidden_size=32, num_attention_heads=4, pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=spec.pp, virtual_pipeline_model_parallel_size=vpp, **spec.pipeline_config(),
    )  # fmt: skip
    out = []
    for p, v in spec.layer_map.chunks():
        stage = v if spec.vpp > 1 else None
        out.append((get_transformer_layer_offset(config, stage, p), get_num_layers_to_build(config, stage, p)))
    return out
