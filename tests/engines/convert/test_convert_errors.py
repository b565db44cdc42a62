"""Completeness and bad input: clear one-line errors naming the tensor/field, and no half-written output.

Run: .venv/bin/pytest tests/engines/convert/test_convert_errors.py -q   (CPU only, ~5 s, no megatron-core)
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from convert_fixtures import edit_config, make_hf_model, rewrite_tensors

from rlstages.engines.convert import ConversionError, convert_hf_to_mcore, mcore_to_hf
from rlstages.engines.convert.safetensors_io import PlannedWriter


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("base") / "qwen2", "qwen2")


@pytest.fixture
def hf(base: Path, tmp_path: Path) -> Path:
    """A private copy of the base model that a test may damage."""
    return Path(shutil.copytree(base, tmp_path / "hf"))


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temporary dir left behind"


def test_leftover_tensor_is_named(hf: Path, tmp_path: Path) -> None:
    rewrite_tensors(hf, lambda t: {**t, "model.layers.1.self_attn.extra.weight": torch.ones(2)})
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=re.escape("model.layers.1.self_attn.extra.weight")):
        convert_hf_to_mcore(hf, out)
    assert_nothing_written(out)


def test_missing_input_of_an_op_is_named(hf: Path, tmp_path: Path) -> None:
    rewrite_tensors(hf, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.self_attn.k_proj.weight"})
    with pytest.raises(ConversionError, match=r"missing hf tensor.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        convert_hf_to_mcore(hf, tmp_path / "out")


def test_missing_output_is_named(hf: Path, tmp_path: Path) -> None:
    rewrite_tensors(hf, lambda t: {k: v for k, v in t.items() if k != "model.layers.0.mlp.down_proj.weight"})
    with pytest.raises(ConversionError, match=r"never produced.*decoder\.layers\.0\.mlp\.linear_fc2\.weight"):
        convert_hf_to_mcore(hf, tmp_path / "out")


def test_bias_present_but_disabled_by_config(tmp_path: Path) -> None:
    hf = make_hf_model(tmp_path / "llama", "llama", attention_bias=True)  # o_proj.bias: no Megatron home
    with pytest.raises(ConversionError, match=r"o_proj\.bias"):
        convert_hf_to_mcore(hf, tmp_path / "out")


def test_wrong_shape_is_named(hf: Path, tmp_path: Path) -> None:
    rewrite_tensors(hf, lambda t: {**t, "model.layers.0.self_attn.q_proj.weight": torch.zeros(16, 32)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: expected 32 rows"):
        convert_hf_to_mcore(hf, tmp_path / "out")


@pytest.mark.parametrize(
    "tp,pp,message",
    [
        (3, 1, r"num_attention_heads=4 is not divisible by tensor parallel size tp=3"),
        (4, 1, r"num_key_value_heads=2 is not divisible by tensor parallel size tp=4"),
        (1, 3, r"num_layers=2 is not divisible by pipeline stages"),
        (0, 1, r"tp must be an integer >= 1"),
    ],
)
def test_layout_errors(base: Path, tmp_path: Path, tp: int, pp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        convert_hf_to_mcore(base, tmp_path / "out", tp=tp, pp=pp)
    assert_nothing_written(tmp_path / "out")


def test_unknown_model_type_lists_registered(hf: Path, tmp_path: Path) -> None:
    edit_config(hf, model_type="no_such_model")
    with pytest.raises(KeyError, match=r"no_such_model.*registered: \[.*'llama', .*'qwen2'.*'qwen3_moe'"):
        convert_hf_to_mcore(hf, tmp_path / "out")


def test_missing_config_and_bin_only_weights(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json: not found"):
        convert_hf_to_mcore(empty, tmp_path / "out")
    (empty / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 32}')
    (empty / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights \(found \['pytorch_model\.bin'\]"):
        convert_hf_to_mcore(empty, tmp_path / "out")


def test_existing_output_is_not_overwritten(base: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists"):
        convert_hf_to_mcore(base, out)
    assert (out / "keep.txt").read_text() == "mine"
    convert_hf_to_mcore(base, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "manifest.json").is_file()


def test_failure_while_writing_leaves_nothing(base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = PlannedWriter.write

    def flaky(self, name, tensor):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full (simulated)")
        return real(self, name, tensor)

    monkeypatch.setattr(PlannedWriter, "write", flaky)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        convert_hf_to_mcore(base, out, tp=2)
    assert_nothing_written(out)


def test_damaged_rank_file_fails_export(base: Path, tmp_path: Path) -> None:
    from rlstages.engines.convert import verify_manifest

    out = convert_hf_to_mcore(base, tmp_path / "m", tp=2)
    rank = out / "mp_rank_01" / "model.safetensors"
    data = bytearray(rank.read_bytes())
    data[-1] ^= 0xFF
    rank.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"mp_rank_01/model\.safetensors: size or xxh3_128 differs"):
        verify_manifest(out)
    (out / "mp_rank_01" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        list(mcore_to_hf(out))
