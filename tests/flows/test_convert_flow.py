"""The convert/export flows under real Prefect (no server): cached conversion, verify step, CLI commands.

Run: .venv/bin/python -m pytest tests/flows/test_convert_flow.py -q
Hardware: CPU; ~30 s; the verify test needs megatron-core (skipped otherwise) and starts one gloo worker.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import rlstages.tasks.convert as convert_tasks
from rlstages.flows.cli.convert import convert_command, export_command
from rlstages.flows.convert import convert_flow, convert_hf_to_mcore, convert_mcore_to_hf

pytestmark = pytest.mark.usefixtures("prefect_harness")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100)  # fmt: skip
    out = tmp_path_factory.mktemp("flow") / "hf"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


@pytest.fixture
def count_conversions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every real conversion the task performs."""
    calls: list[str] = []
    real = convert_tasks.convert_hf_to_mcore

    def counting(hf, out, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(str(out))
        return real(hf, out, *args, **kwargs)

    monkeypatch.setattr(convert_tasks, "convert_hf_to_mcore", counting)
    return calls


def test_second_run_is_a_cache_hit(hf_dir: Path, tmp_path: Path, count_conversions: list[str]) -> None:
    out = tmp_path / "mcore"
    first = convert_flow(str(hf_dir), str(out), tp=2, pp=1)
    assert first["out_dir"] == str(out) and len(count_conversions) == 1
    stamp = (out / "manifest.json").stat().st_mtime_ns
    second = convert_flow(str(hf_dir), str(out), tp=2, pp=1)  # a new flow run, same inputs
    assert second["out_dir"] == str(out)
    assert len(count_conversions) == 1, "cache hit must do no work"
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    convert_flow(str(hf_dir), str(out), tp=1, pp=1, overwrite=True)  # another layout is another key
    assert len(count_conversions) == 2


def test_cache_never_returns_a_missing_output(hf_dir: Path, tmp_path: Path, count_conversions: list[str]) -> None:
    out = tmp_path / "mcore"
    convert_hf_to_mcore(hf_dir, out, tp=1, pp=2)
    shutil.rmtree(out)
    assert convert_hf_to_mcore(hf_dir, out, tp=1, pp=2) == str(out)
    assert len(count_conversions) == 2 and (out / "manifest.json").is_file()
    assert convert_hf_to_mcore(hf_dir, out, tp=1, pp=2) == str(out)
    assert len(count_conversions) == 2


def test_changed_input_is_converted_again(hf_dir: Path, tmp_path: Path, count_conversions: list[str]) -> None:
    hf = Path(shutil.copytree(hf_dir, tmp_path / "hf"))
    out = tmp_path / "mcore"
    convert_hf_to_mcore(hf, out)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    convert_hf_to_mcore(hf, out, overwrite=True)
    assert len(count_conversions) == 2
    assert json.loads((out / "mcore_config.json").read_text())["mcore"]["layernorm_epsilon"] == 1e-5


def test_python_api_round_trip(hf_dir: Path, tmp_path: Path) -> None:
    mcore = convert_hf_to_mcore(hf_dir, tmp_path / "mcore", tp=2, pp=2)
    back = Path(convert_mcore_to_hf(mcore, tmp_path / "hf"))
    a, b = load_file(hf_dir / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_verify_step(hf_dir: Path, tmp_path: Path) -> None:
    result = convert_flow(str(hf_dir), str(tmp_path / "mcore"), tp=1, pp=1, verify=True)
    assert result["parity"]["passed"] and result["parity"]["max_abs_diff"] <= 1e-5


def _app():
    import typer

    app = typer.Typer()
    app.command("convert")(convert_command)
    app.command("export")(export_command)
    return app


def test_cli_convert_and_export(hf_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(_app(), ["convert", str(hf_dir), str(tmp_path / "m"), "--tp", "2", "--pp", "2"])
    assert done.exit_code == 0, done.output
    assert "converted" in done.output and (tmp_path / "m" / "mp_rank_01_001" / "model.safetensors").is_file()
    done = runner.invoke(_app(), ["export", str(tmp_path / "m"), str(tmp_path / "back")])
    assert done.exit_code == 0, done.output
    assert sorted(load_file(tmp_path / "back" / "model.safetensors")) == sorted(load_file(hf_dir / "model.safetensors"))


def test_cli_bad_input_is_one_line(hf_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    bad = runner.invoke(_app(), ["convert", str(hf_dir), str(tmp_path / "m"), "--tp", "3"])
    assert bad.exit_code == 2
    assert "error: num_attention_heads=4 is not divisible by tensor parallel size tp=3" in bad.output
    missing = runner.invoke(_app(), ["convert", str(tmp_path / "nope"), str(tmp_path / "m")])
    assert missing.exit_code == 2 and "HF model directory not found" in missing.output
    assert not (tmp_path / "m").exists()
    not_converted = runner.invoke(_app(), ["export", str(hf_dir), str(tmp_path / "back")])
    assert not_converted.exit_code == 2 and "manifest.json: missing" in not_converted.output
    for result in (bad, missing, not_converted):
        assert len(result.output.strip().splitlines()) == 1, result.output  # no traceback, no Prefect noise


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_convert_replaces_only_our_conversion_and_only_when_asked(hf_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    checkpoint = tmp_path / "runs" / "r" / "checkpoints" / "step_000002"  # a run's checkpoint has a manifest.json
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text(json.dumps({"step": 2, "files": {}}))
    (checkpoint / "driver_state.json").write_text("{}")
    before = _tree(checkpoint)
    refused = runner.invoke(_app(), ["convert", str(hf_dir), str(checkpoint), "--overwrite"])
    assert refused.exit_code == 2 and "is not an rlstages conversion output" in refused.output
    assert _tree(checkpoint) == before
    out = tmp_path / "m"
    assert runner.invoke(_app(), ["convert", str(hf_dir), str(out), "--tp", "2"]).exit_code == 0
    ours = _tree(out)
    again = runner.invoke(_app(), ["convert", str(hf_dir), str(out), "--tp", "2"])  # the same conversion: a no-op
    assert again.exit_code == 0 and _tree(out) == ours
    other = runner.invoke(_app(), ["convert", str(hf_dir), str(out), "--tp", "1"])
    assert other.exit_code == 2 and "holds another conversion; pass --overwrite" in other.output
    assert _tree(out) == ours
    replaced = runner.invoke(_app(), ["convert", str(hf_dir), str(out), "--tp", "1", "--overwrite"])
    assert replaced.exit_code == 0 and json.loads((out / "mcore_config.json").read_text())["tp"] == 1


def test_export_never_imports_a_template_module_from_metadata(hf_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from rlstages.engines.convert.manifest import write_manifest

    marker = tmp_path / "imported"
    (tmp_path / "evil_template.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mcore = tmp_path / "mcore"
    assert CliRunner().invoke(_app(), ["convert", str(hf_dir), str(mcore)]).exit_code == 0
    spec = json.loads((mcore / "mcore_config.json").read_text())
    evil = {**spec, "template": "evil", "template_module": "evil_template"}
    (mcore / "mcore_config.json").write_text(json.dumps(evil))
    tampered = CliRunner().invoke(_app(), ["export", str(mcore), str(tmp_path / "back")])
    assert tampered.exit_code == 2 and "mcore_config.json" in tampered.output  # checksums fail first
    manifest = json.loads((mcore / "manifest.json").read_text())
    write_manifest(mcore, {k: v for k, v in manifest.items() if k not in {"files", "format", "checksum"}}, {}, "sha256")
    unregistered = CliRunner().invoke(_app(), ["export", str(mcore), str(tmp_path / "back")])
    assert unregistered.exit_code == 2 and "no conversion template for model_type 'evil'" in unregistered.output
    assert not marker.exists() and not (tmp_path / "back").exists()


def test_cli_convert_moe_with_expert_parallelism(hf_dir: Path, tmp_path: Path, count_conversions: list[str]) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "engines" / "convert"))
    from moe_fixtures import make_moe_model

    from rlstages.engines.convert import ConversionSpec, read_manifest

    moe = make_moe_model(tmp_path / "moe", "qwen3_moe", layers=3)
    runner = CliRunner()
    argv = ["convert", str(moe), str(tmp_path / "m"), "--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1"]
    argv += ["--first-stage-layers", "1"]  # uneven: 1 + 2 layers, as the Python API and training runs record it
    done = runner.invoke(_app(), argv)
    assert done.exit_code == 0, done.output
    first = load_file(tmp_path / "m" / "mp_rank_01_000_001" / "model.safetensors")  # TP rank 1, stage 0, EP rank 1
    assert {n.split(".")[2] for n in first if n.startswith("decoder.layers.")} == {"0"}
    assert first["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"].shape == (32, 16)  # expert TP 1
    spec = ConversionSpec.load(tmp_path / "m")
    assert (spec.stage_split, spec.expert_tp) == ((1, None), 1)
    manifest = read_manifest(tmp_path / "m")
    assert (manifest["stage_layers"], manifest["etp"]) == ([1, 2], 1)
    again = runner.invoke(_app(), argv)  # the same options: the same cache key, nothing converted again
    assert again.exit_code == 0 and count_conversions == [str(tmp_path / "m")]
    default = ["convert", str(moe), str(tmp_path / "m2"), "--tp", "2", "--ep", "2"]
    assert runner.invoke(_app(), [*default, "--etp", "2"]).exit_code == 0
    assert runner.invoke(_app(), default).exit_code == 0  # expert TP = TP is the default: the same conversion
    assert count_conversions == [str(tmp_path / "m"), str(tmp_path / "m2")]
    done = runner.invoke(_app(), ["export", str(tmp_path / "m"), str(tmp_path / "back")])
    assert done.exit_code == 0, done.output
    back, original = load_file(tmp_path / "back" / "model.safetensors"), load_file(moe / "model.safetensors")
    assert sorted(back) == sorted(original) and all(torch.equal(back[k], original[k]) for k in original)
    dense = runner.invoke(_app(), ["convert", str(hf_dir), str(tmp_path / "d"), "--ep", "2"])
    assert dense.exit_code == 2 and "expert parallelism needs a Mixture-of-Experts model" in dense.output
    assert len(dense.output.strip().splitlines()) == 1 and not (tmp_path / "d").exists()
    even = runner.invoke(_app(), ["convert", str(moe), str(tmp_path / "e"), "--last-stage-layers", "2"])
    assert even.exit_code == 2 and "--last-stage-layers need --pp > 1" in even.output and not (tmp_path / "e").exists()
