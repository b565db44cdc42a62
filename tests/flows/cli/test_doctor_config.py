"""`rlstages doctor --config`: the config's memory plan and verl's troubleshooting checks (CUDA_DEVICE_MAX_CONNECTIONS
of the Megatron workers, NCCL settings, the Megatron-Core / vLLM pair against the tested ones). In-process, no
probes: `config_checks` alone, and the command's refusal of a bad config. CPU only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlstages.configs import load_config
from rlstages.flows.cli import doctor_config
from rlstages.flows.cli.main import app

ROOT = Path(__file__).resolve().parents[3]
PRESET = ROOT / "configs" / "qwen3_235b_grpo_megatron.yaml"


def _rows(checks: list[doctor_config.Check]) -> dict[str, doctor_config.Check]:
    return {c.name: c for c in checks}


def test_config_checks_of_the_235b_preset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    versions = {"megatron-core": "0.16.1", "vllm": "0.32.0"}
    monkeypatch.setattr(doctor_config, "_version", versions.get)
    no_recompute = load_config(PRESET, ["actor.gradient_checkpointing=false"])  # the preset without verl's recompute
    checks = doctor_config.config_checks(no_recompute, "H20", Path(sys.executable))
    rows = _rows(checks)
    assert rows["fullest rank"].ok is False and "actor stage 1" in rows["fullest rank"].detail
    assert any(c.name == "change" and "gradient_checkpointing=true" in c.detail for c in checks)
    assert rows["CUDA_DEVICE_MAX_CONNECTIONS"].ok is True
    assert "NCCL_DEBUG=WARN" in rows["NCCL"].detail and "nccl_cumem_enable" in rows["NCCL"].detail
    assert rows["megatron-core / vllm"].ok is True and "this project's CI" in rows["megatron-core / vllm"].detail
    versions["vllm"] = "0.9.2"
    cfg = load_config(PRESET, ["cluster.cuda_device_max_connections=8", "actor.gradient_checkpointing=true"])
    rows = _rows(doctor_config.config_checks(cfg, "H20", Path(sys.executable)))
    assert rows["megatron-core / vllm"].ok is False and "untested pair" in rows["megatron-core / vllm"].detail
    assert rows["CUDA_DEVICE_MAX_CONNECTIONS"].ok is False and rows["fullest rank"].ok is True


def test_doctor_refuses_a_bad_config() -> None:
    result = CliRunner().invoke(app, ["doctor", "--config", str(PRESET.with_name("nope.yaml"))])
    assert result.exit_code == 2 and "nope.yaml" in result.output
